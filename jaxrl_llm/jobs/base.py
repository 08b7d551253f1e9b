"""What every job shares: the run folder, checkpoints with progress, the warm start, hooks, the summary.

A job is a run with phases: an optional supervised warm start (``sft.steps``),
an evaluation of the warm start, then its main phase of ``main_steps()``
steps, a final evaluation and the outputs. :class:`Job` owns the scaffolding;
a subclass supplies only what differs (the shape of flax's
``train_and_evaluate`` or Tunix's ``RLLearner``, with explicit methods instead
of attribute probing):

===========================  ================================================
subclass supplies            meaning
===========================  ================================================
``build()``                  models, optimizers, data; sets ``self.state``,
                             ``self.model_config`` and ``self.sft_step``
``after_restore()``          work that needs the final state (e.g. samplers)
``train_state`` / setter     the :class:`~jaxrl_llm.learner.state.TrainState`
                             inside ``self.state`` (the warm start trains it)
``main_steps()``             length of the main phase
``step()``                   one main-phase step; returns its metrics
``evaluate()``               held-out metrics (``eval/*``)
``end_warm_start(writer)``   what happens between the phases
``summary(final)``           the job's own summary fields
===========================  ================================================

One run, in order: validate the config; check that the run folder is
writable (before any compute); ``build()``; resume from the newest usable
checkpoint when there is one (verified, its config compared with this one;
arrays, progress and every registered component's state: see
:mod:`jaxrl_llm.jobs.resume`); ``after_restore()``; warm start;
``end_warm_start``; main phase, each step followed by the due hooks
(:mod:`jaxrl_llm.jobs.hooks`), a metrics record and a checkpoint when due
(never of a non-finite state); final evaluation; ``metrics.jsonl``,
TensorBoard events, ``curves.png``, ``summary.json`` and the model as a
Hugging Face folder in ``hf_export/`` (only from a finite state). A finished
run rerun with the same steps does nothing; with more steps it trains them.

State that lives on the host (prompt streams, controllers, counters) is saved
as JSON with the checkpoint: a component registered with
:meth:`Job.register_state` (``get_state()``/``set_state(dict)``) is saved on
every checkpoint and restored on resume, under its name.
"""

from __future__ import annotations

import abc
import dataclasses
import os
import time
from typing import Any, Callable, Optional

import jax
import ml_collections

from jaxrl_llm import bridge, configuration
from jaxrl_llm.bridge import peft_export
from jaxrl_llm.diagnostics import wandb_sink, writers
from jaxrl_llm.jobs import resume
from jaxrl_llm.jobs.evaluation import PolicyEvaluator
from jaxrl_llm.jobs.resume import NonFiniteError
from jaxrl_llm.learner import builders, checkpoint, mesh as mesh_lib, multihost, sft
from jaxrl_llm.models import lora
from jaxrl_llm.reward_model.encoding import encode_prompt
from jaxrl_llm.sampling import JaxSampler, SamplerConfig
from jaxrl_llm.tasks import get_task

__all__ = ["Hook", "Job", "NonFiniteError", "Progress", "place_on_mesh"]


@dataclasses.dataclass
class Progress:
  """Host-side position of a run (saved as JSON next to the arrays of every checkpoint).

  Attributes:
    phase: "sft", the job's main phase (``Job.main_phase``) or "done".
    sft_step: warm-start steps done.
    step: main-phase steps done.
    sft_stream: the warm start's example stream state.
    warm_start: the evaluation taken when the warm start ended.
    nonfinite_in_a_row: consecutive updates skipped for a non-finite loss or gradient.
    skipped_updates: all such updates.
    components: name -> state of every registered component (:meth:`Job.register_state`).
    metrics_lines: records in ``metrics.jsonl`` at the checkpoint (a resume cuts the file back to them).
  """

  phase: str = "sft"
  sft_step: int = 0
  step: int = 0
  sft_stream: Optional[dict] = None
  warm_start: Optional[dict] = None
  nonfinite_in_a_row: int = 0
  skipped_updates: int = 0
  components: dict = dataclasses.field(default_factory=dict)
  metrics_lines: Optional[int] = None


class Hook(abc.ABC):
  """A periodic action of a job, run after a main-phase step when :meth:`due`.

  Subclasses set ``name`` and implement ``__call__(job, step, metrics) -> metrics``
  (``metrics``: the step's metrics so far, read-only by convention); a
  hook with host state also implements ``get_state``/``set_state`` (it is
  then saved with every checkpoint under its name).
  """

  name = "hook"

  def due(self, step: int) -> bool:
    """Whether to run after main-phase step ``step`` (1-based count of steps done)."""
    del step
    return True

  @abc.abstractmethod
  def __call__(self, job: "Job", step: int, metrics: dict) -> dict:
    """Runs the hook after main-phase step ``step``; returns metrics for that step's record."""


class Job(abc.ABC):
  """The shared scaffolding of a run; see the module docstring for what a subclass supplies."""

  main_phase = "main"
  plot_keys: tuple[str, ...] = ()

  def __init__(self, config: ml_collections.ConfigDict):
    configuration.validate(config)
    self.config = config
    self.settings = configuration.settings(config)  # typed, checked sections
    self.run_dir = os.path.abspath(configuration.run_dir(config))
    checkpoint.check_writable(self.run_dir, "run folder (run_dir)")
    # Process 0 writes the run's files; the others write theirs under process_<i>/.
    self.out_dir = (self.run_dir if multihost.is_main_process()
                    else os.path.join(self.run_dir, f"process_{jax.process_index()}"))
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.run_dir, "checkpoints"), keep=config.checkpoint.keep,
                                                save_every=config.checkpoint.every, verify=config.checkpoint.verify)
    self.task = get_task(config.task.name, **dict(config.task.kwargs))
    self.tokenizer = builders.build_tokenizer(config, self.task)
    self.mesh = mesh_lib.make_mesh(dict(config.learner.mesh))
    self.progress = Progress(phase="sft")
    self.hooks: list[Hook] = []
    self.state: Any = None
    self.model_config: Any = None
    self.sft_step: Optional[Callable] = None  # the warm start's jitted step (set by build)
    self._components: dict[str, Any] = {}
    self._metrics: Optional[writers.MetricsWriter] = None  # while training: its line count goes into checkpoints
    self.resume_point = resume.ResumePoint()
    self._closers: list[Callable[[], None]] = [self.checkpointer.close]
    self.build()
    self.restore()
    self.after_restore()

  # ------------------------------------------------------------------ supplied by subclasses

  @abc.abstractmethod
  def build(self) -> None:
    """Builds models, optimizers and data; sets ``state``, ``model_config`` and ``sft_step``."""

  def after_restore(self) -> None:
    pass

  @property
  @abc.abstractmethod
  def train_state(self) -> Any:
    """The TrainState inside ``state`` that the warm start trains."""

  @abc.abstractmethod
  def set_train_state(self, train: Any) -> None:
    """Puts ``train`` back into ``state``."""

  @abc.abstractmethod
  def main_steps(self) -> int:
    """Steps of the main phase."""

  @abc.abstractmethod
  def step(self) -> dict:
    """One main-phase step; returns its metrics."""

  @abc.abstractmethod
  def evaluate(self) -> dict:
    """Held-out metrics (``eval/*``) of the current model."""

  def end_warm_start(self, writer: writers.MetricsWriter) -> None:
    pass

  def summary(self, final: dict) -> dict:
    return {}

  # ------------------------------------------------------------------ components, hooks, checkpoints

  def register_state(self, name: str, component: Any) -> None:
    """Saves ``component.get_state()`` with every checkpoint and restores it on resume."""
    if name in self._components:
      raise ValueError(f"component {name!r} is registered twice")
    self._components[name] = component

  def add_hook(self, hook: Hook) -> None:
    """Runs ``hook`` after every main-phase step it is due at (in the order added)."""
    self.hooks.append(hook)
    if callable(getattr(hook, "get_state", None)):
      self.register_state(hook.name, hook)

  def on_close(self, fn: Callable[[], None]) -> None:
    """Calls ``fn`` when the run ends (even on an error): reward workers, sampler actors."""
    self._closers.append(fn)

  def restore(self) -> bool:
    """Loads the newest usable checkpoint (arrays, progress, components); False when there is none."""
    found = resume.load(self)
    if found is None:
      return False
    state, extra, step = found
    self.state = place_on_mesh(state, self.mesh)
    self.progress = Progress(**extra["progress"])
    for name, component in self._components.items():
      if self.progress.components.get(name) is not None:
        component.set_state(self.progress.components[name])
    resume.continue_from(self, step)
    return True

  def restorable_like(self, state: Any) -> Any:
    """The structure a checkpoint of this job holds (a subclass may add optional parts)."""
    return state

  def save(self, force: bool = False) -> None:
    """Checkpoints arrays + progress + components + config when due (every ``checkpoint.every`` steps) or forced."""
    step = self.progress.sft_step + self.progress.step
    if force or self.checkpointer.should_save(step):
      self.progress.components = {name: c.get_state() for name, c in self._components.items()}
      self.progress.metrics_lines = self._metrics.lines if self._metrics is not None else None
      resume.save(self, step, force)

  def track_nonfinite(self, metrics: dict) -> None:
    """Counts updates skipped for non-finite values; raises :class:`NonFiniteError` after too many in a row."""
    resume.track_nonfinite(self, metrics)

  # ------------------------------------------------------------------ shared pieces

  def encode_prompt(self, prompt: Any) -> list[int]:
    """Prompt ids (the tokenizer's chat template when ``task.use_chat_template``)."""
    return encode_prompt(self.tokenizer, prompt, self.config.task.use_chat_template)

  def decode_response(self, ids: list[int]) -> str:
    """The text of a sampled response. Ids past the tokenizer's vocabulary (a model's padded
    embedding rows, e.g. Qwen2.5's 151,936 rows for 151,665 tokens) have no text and decode to
    nothing, as Hugging Face tokenizers decode them, instead of stopping the run."""
    known = self.tokenizer.vocab_size
    return self.tokenizer.decode([i for i in ids if 0 <= int(i) < known], skip_special_tokens=True)

  def encode_segments(self, segments: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """A demonstration's ``[(text, trained)]`` pieces -> ``(ids, context_only flags)``."""
    ids, flags = [], []
    for text, trained in segments:
      piece = self.tokenizer.encode(text, add_special_tokens=False)
      ids += piece
      flags += [not trained] * len(piece)
    return ids, flags

  def make_sft_step(self, optimizer: Any, grad_atoms: int = 0) -> Callable:
    """The jitted supervised step of this job's model (``learner.micro_batches``)."""
    return sft.make_sft_step(self.model_config, optimizer, self.config.learner.micro_batches,
                             grad_atoms=grad_atoms, mesh=self.mesh)

  def run_warm_start(self, writer: writers.MetricsWriter, step_fn: Callable) -> None:
    """``sft.steps`` supervised steps on the task's gold responses (resumable mid-way)."""
    c = self.config
    stream = self.task.train_prompts(seed=c.seed + 1000)
    if self.progress.sft_stream:
      stream.set_state(self.progress.sft_stream)
    while self.progress.sft_step < c.sft.steps:
      examples = [next(stream) for _ in range(c.sft.batch_size)]
      targets = [self.encode_segments(self.task.sft_segments(e)) for e in examples]
      batch = sft.collate([self.encode_prompt(e.prompt) for e in examples], [ids for ids, _ in targets],
                          self.tokenizer.eos_id, self.tokenizer.pad_id, self.model_config.max_position_embeddings,
                          context_only=[flags for _, flags in targets])
      train, m = step_fn(self.train_state, batch)
      self.set_train_state(train)
      self.progress.sft_step += 1
      self.progress.sft_stream = stream.get_state()
      self.track_nonfinite(m)
      if self.progress.sft_step % c.log.every == 0:
        writer.write(self.progress.sft_step - c.sft.steps, m)
      self.save()

  # ------------------------------------------------------------------ the run

  def train(self) -> dict:
    """Runs the job from wherever its progress stands; returns the summary (also summary.json)."""
    c = self.config
    start = time.time()
    if (done := resume.completed_summary(self)) is not None:
      self.close()
      return done
    purge_step = resume.start(self)
    sinks = (wandb_sink.WandbWriter(self.out_dir, project=c.log.wandb_project, entity=c.log.wandb_entity,
                                    name=c.name, config=c.to_dict()),) if c.log.wandb else ()
    writer = self._metrics = writers.MetricsWriter(self.out_dir, c.sft.steps + self.main_steps(), description=c.name,
                                                   progress=c.log.progress, tensorboard=c.log.tensorboard,
                                                   purge_step=purge_step, extra_sinks=sinks)
    try:
      if self.progress.phase == "sft":
        if c.sft.steps:
          self.run_warm_start(writer, self.sft_step)
        self.end_warm_start(writer)
        self.progress.phase = self.main_phase
        self.save(force=True)
      if self.progress.phase == self.main_phase:
        while self.progress.step < self.main_steps():
          metrics = self.step()
          self.progress.step += 1
          for hook in self.hooks:
            if hook.due(self.progress.step):
              metrics.update(hook(self, self.progress.step, metrics))
          if self.progress.step % c.log.every == 0 or any(k.startswith("eval/") for k in metrics):
            writer.write(self.progress.step, metrics)
          self.save()
        self.progress.phase = "done"
        self.save(force=True)
      final = self.evaluate()
    finally:
      self._metrics = None
      writer.close()
      self.close()
    return self.finish(final, time.time() - start, writer)

  def close(self) -> None:
    for fn in reversed(self._closers):
      fn()
    self._closers = []

  def finish(self, final: dict, seconds: float, writer: writers.MetricsWriter) -> dict:
    """Plot, HF export, ``summary.json`` and the printed summary line."""
    c = self.config
    resume.check_final(self)
    records = [r for r in writers.read_jsonl(writer.jsonl_path) if r["step"] >= 0]
    plot = writers.plot_curves(records, os.path.join(self.out_dir, "curves.png"), list(self.plot_keys), title=c.name)
    export_dir = None
    if c.export.hf:
      params = multihost.to_host(self.train_state.params)  # every process gathers; process 0 writes
      if multihost.is_main_process():
        export_dir = bridge.export_hf_checkpoint(params, self.model_config, os.path.join(self.run_dir, "hf_export"),
                                                 tokenizer=self.tokenizer)
        if self.model_config.lora_rank:
          self.export_adapter(params)
    summary = {"name": c.name, "job": c.job, **self.summary(final), "steps": self.progress.step,
               "sft_steps": self.progress.sft_step, "skipped_updates": self.progress.skipped_updates,
               "wall_clock_s": seconds, "run_dir": self.run_dir,
               "outputs": {"metrics": writer.jsonl_path, "tensorboard": writer.tb_dir, "plot": plot,
                           "hf_export": export_dir, "checkpoints": self.checkpointer.directory}}
    resume.write_json(os.path.join(self.out_dir, "summary.json"), summary)  # last: it marks the run complete
    print(f"\n{c.name}: {self.headline(summary)} ({seconds:.0f} s).\nOutputs in {self.run_dir}: metrics.jsonl, "
          "tensorboard/, curves.png, summary.json" + (", hf_export/" if export_dir else ""))
    return summary

  def export_adapter(self, params: Any) -> str:
    """LoRA runs: the adapters as a PEFT folder (``peft_adapter/``) next to the merged ``hf_export/``.

    Its base is ``init.hf_checkpoint``; a run without one (a random base) also writes that
    base, ``peft_base/``, so ``peft`` can rebuild the trained model from the two folders.
    """
    base = self.config.init.hf_checkpoint
    if not base:
      base = bridge.export_hf_checkpoint(lora.without_adapters(params), self.model_config.replace(
          lora_rank=0, lora_targets=()), os.path.join(self.run_dir, "peft_base"), tokenizer=self.tokenizer)
    return peft_export.export_peft_adapter(params, self.model_config, os.path.join(self.run_dir, "peft_adapter"),
                                           base_model=os.path.abspath(base))

  def headline(self, summary: dict) -> str:
    """The one-line result printed at the end."""
    return "done"


class PolicyJob(Job):
  """A job that trains a policy: its run state keeps the policy's TrainState in ``state.train``
  (next to whatever else the job holds: a reference, objective state), and it evaluates the policy
  on held-out problems with the in-process JAX sampler (RLJob, PreferenceOptimizationJob)."""

  @property
  def train_state(self) -> Any:
    return self.state.train

  def set_train_state(self, train: Any) -> None:
    self.state = self.state.replace(train=train)

  @property
  def params(self) -> Any:
    return self.state.train.params

  def make_sampler_config(self, num_samples: int) -> SamplerConfig:
    """The run's sampling settings (``rl.*``) with ``num_samples`` responses per prompt."""
    c = self.config
    return SamplerConfig(max_new_tokens=c.rl.max_new_tokens, temperature=c.rl.temperature, top_k=c.rl.top_k,
                         top_p=c.rl.top_p, num_samples=num_samples, seed=c.seed,
                         max_length=c.model.max_position_embeddings if not c.init.hf_checkpoint else None)

  def start_local_sampler(self, sampler_config: SamplerConfig, rewards: Any) -> None:
    """The in-process sampler at the current weights, and the held-out evaluator scoring with ``rewards``."""
    c = self.config
    self.sampler = JaxSampler(self.model_config, multihost.local_copy(self.params), sampler_config)
    self.publish_local()
    self.evaluator = self.make_evaluator(rewards)

  def make_evaluator(self, rewards: Any) -> PolicyEvaluator:
    """The held-out evaluator of the in-process sampler, scoring with ``rewards``."""
    return PolicyEvaluator(self.sampler, rewards, self.encode_prompt, self.decode_response, seed=self.config.seed,
                           pass_k=self.config.eval.pass_k)

  def publish_local(self) -> None:
    """Brings the in-process sampler (evaluation, synchronous sampling) to the current weights."""
    version = int(self.state.train.policy_version)
    if self.sampler.policy_version != version:
      # one local device holds a whole copy (same bits on any mesh / process count)
      self.sampler.update_weights(multihost.local_copy(self.params), version)


def place_on_mesh(tree: Any, mesh: Any) -> Any:
  """Commits every leaf to ``mesh``: sharded leaves keep their sharding, the rest (step counters,
  RNG, optimizer counts, objective state) are replicated, so a state restored from a checkpoint
  lands on the same devices as a fresh one."""
  replicated = mesh_lib.replicated_sharding(mesh)

  def place(x):
    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) and x.sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, tree)
