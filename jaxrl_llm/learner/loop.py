"""The training loop behind ``jaxrl-train``: SFT warm start, then RL (synchronous, or
PipelineRL with Ray sampler actors when ``rollout.mode="pipeline"``; see :class:`Pipeline`).

One run, in order:

1. set-up: validate the config, check that the run and checkpoint folders are
   writable (before any compute), build task, tokenizer, mesh, model, sampler,
   objective and optimizers; resume from the latest checkpoint when one exists;
2. SFT warm start (``sft.steps``) on the task's gold responses;
3. evaluation of the warm start (greedy accuracy, pass@k on held-out prompts);
4. RL: each step samples ``rl.prompts_per_step`` prompts x
   ``rl.samples_per_prompt`` responses, scores them with the task's reward
   (guarded: timeouts and exceptions score 0 and are counted), computes
   advantages, takes ``rl.updates_per_batch`` jitted updates and publishes the
   new weights to the sampler(s); periodic evaluation and checkpoints. In
   pipeline mode the samples of step t come from sampler actors that run up to
   ``rollout.max_lag`` steps ahead (``jaxrl_llm.rollout``);
5. outputs in the run folder: ``metrics.jsonl``, TensorBoard events,
   ``curves.png``, ``summary.json``, the policy as a Hugging Face folder in
   ``hf_export/``, and a printed summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct

from jaxrl_llm import advantages as A, bridge, configuration, models
from jaxrl_llm.diagnostics import writers
from jaxrl_llm.learner import builders, checkpoint, mesh as mesh_lib, rl_step, sft
from jaxrl_llm.learner.state import TrainState, create_train_state
from jaxrl_llm.sampling import JaxSampler, SamplerConfig
from jaxrl_llm.tasks import PromptSource, RewardRunner, build_eval_set, get_task

log = logging.getLogger("jaxrl_llm")


class NonFiniteError(RuntimeError):
  """Raised after ``learner.max_nonfinite_in_a_row`` consecutive skipped updates."""


@struct.dataclass
class RunState:
  """Everything saved in a checkpoint's array item."""

  train: TrainState
  objective: Any
  ref_params: Any = None


@dataclasses.dataclass
class Progress:
  """Host-side position of the run (saved as JSON next to the arrays)."""

  phase: str = "sft"  # "sft" | "rl" | "done"
  sft_step: int = 0
  rl_step: int = 0
  sft_stream: Optional[dict] = None
  prompt_stream: Optional[dict] = None
  warm_start: Optional[dict] = None
  nonfinite_in_a_row: int = 0
  skipped_updates: int = 0


class Run:
  """A configured run. ``Run(config).train()`` does everything; parts are reusable in tests."""

  def __init__(self, config: ml_collections.ConfigDict):
    configuration.validate(config)
    self.config = config
    self.run_dir = os.path.abspath(configuration.run_dir(config))
    checkpoint.check_writable(self.run_dir, "run folder (run_dir)")
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                keep=config.checkpoint.keep, save_every=config.checkpoint.every)
    self.task = get_task(config.task.name, **dict(config.task.kwargs))
    self.tokenizer = builders.build_tokenizer(config, self.task)
    self.mesh = mesh_lib.make_mesh(dict(config.learner.mesh))
    critic = config.critic.enabled
    self.model_config = builders.build_model_config(config, self.tokenizer)
    self.critic_config = self.model_config.replace(value_head=True) if critic else None
    total = config.sft.steps + config.rl.steps * config.rl.updates_per_batch
    self.optimizer = builders.build_optimizer(config, total)
    self.sft_optimizer = _sft_optimizer(config)
    self.critic_optimizer = (builders.optim.make_optimizer(config.critic.lr, max_grad_norm=config.optimizer.max_grad_norm)
                             if critic else None)
    self.objective = builders.build_objective(config, config.rl.max_new_tokens)
    self.uses_ref = builders.objective_uses_reference(config)
    self.rewarder = RewardRunner(self.task.reward, timeout_s=5.0, name="task")
    self.eval_set = build_eval_set(self.task, config.task.eval_size, seed=config.seed)
    self.sampler_config = SamplerConfig(
        max_new_tokens=config.rl.max_new_tokens, temperature=config.rl.temperature, top_k=config.rl.top_k,
        top_p=config.rl.top_p, num_samples=config.rl.samples_per_prompt, seed=config.seed,
        max_length=config.model.max_position_embeddings if not config.init.hf_checkpoint else None)
    self._state = self._initial_state()
    self.progress = Progress()
    self._restore()
    self.sampler = JaxSampler(self.model_config, self._state.train.params, self.sampler_config)
    self.publish()
    self._sft_step = sft.make_sft_step(self.model_config, self.sft_optimizer, config.learner.micro_batches)
    self._rl_steps: dict[bool, Any] = {}
    self._ref_logp = jax.jit(lambda p, t, m: models.sequence_logprobs(p, self.model_config, t, m,
                                                                       config.rl.temperature))
    self._values = (jax.jit(lambda p, t, m: rl_step.shifted_values(p, self.critic_config, t, m))
                    if critic else None)

  # ------------------------------------------------------------------ state

  def _initial_state(self) -> RunState:
    c = self.config
    params = builders.build_params(c, self.model_config, self.mesh, c.seed, c.init.hf_checkpoint or None)
    critic_params = None
    if self.critic_config is not None:
      critic_params = builders.build_params(c, self.critic_config, self.mesh, c.seed + 1,
                                            c.critic.init_from or c.init.hf_checkpoint or None)
    train = create_train_state(params, self.optimizer, c.seed, critic_params, self.critic_optimizer)
    return _place_on_mesh(RunState(train=train, objective=self.objective.init(None), ref_params=None), self.mesh)

  def _restore(self) -> None:
    if not (self.config.checkpoint.resume and self.checkpointer.latest_step() is not None):
      return
    like = self._state
    if self.uses_ref and like.ref_params is None:
      like = like.replace(ref_params=like.train.params)
    state, extra, step = self.checkpointer.restore(like)
    self._state = state
    self.progress = Progress(**extra["progress"])
    log.warning("resumed from checkpoint step %d (%s phase)", step, self.progress.phase)
    print(f"Resumed from {self.checkpointer.directory} at step {step} ({self.progress.phase} phase).")

  def _save(self, force: bool = False) -> None:
    step = self.progress.sft_step + self.progress.rl_step
    if force or self.checkpointer.should_save(step):
      self.checkpointer.save(step, self._state, {"progress": dataclasses.asdict(self.progress)})

  @property
  def params(self) -> Any:
    return self._state.train.params

  def publish(self) -> None:
    """Sends the current policy weights to the sampler if it has an older version."""
    version = int(self._state.train.policy_version)
    if self.sampler.policy_version != version:
      self.sampler.update_weights(self._state.train.params, version)

  # ------------------------------------------------------------------ data

  def encode_prompt(self, text: str) -> list[int]:
    if self.config.task.use_chat_template:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode_response(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  # ------------------------------------------------------------------ evaluation

  def evaluate(self, pass_k: Optional[int] = None) -> dict[str, float]:
    """Greedy accuracy and pass@k on the held-out set."""
    pass_k = pass_k or self.config.eval.pass_k
    self.publish()
    examples = list(self.eval_set.examples)
    prompts = [self.encode_prompt(e.prompt) for e in examples]
    rng = jax.random.fold_in(jax.random.PRNGKey(self.config.seed + 1), self.progress.sft_step + self.progress.rl_step)
    greedy = self.sampler.generate(prompts, greedy=True, num_samples=1, rng=rng)
    correct = np.array([self.task.reward(e, self.decode_response(r)) >= 1.0
                        for e, r in zip(examples, greedy.response_tokens)])
    sampled = self.sampler.generate(prompts, num_samples=pass_k, rng=jax.random.fold_in(rng, 1))
    hits = np.array([self.task.reward(examples[i // pass_k], self.decode_response(r)) >= 1.0
                     for i, r in enumerate(sampled.response_tokens)]).reshape(len(examples), pass_k)
    return {"eval/accuracy": float(correct.mean()), f"eval/pass@{pass_k}": float(hits.any(1).mean()),
            "eval/sample_accuracy": float(hits.mean())}

  # ------------------------------------------------------------------ SFT

  def run_sft(self, metrics_writer: writers.MetricsWriter) -> None:
    c = self.config
    stream = self.task.train_prompts(seed=c.seed + 1000)
    if self.progress.sft_stream:
      stream.set_state(self.progress.sft_stream)
    length = c.model.max_position_embeddings
    while self.progress.sft_step < c.sft.steps:
      examples = [next(stream) for _ in range(c.sft.batch_size)]
      batch = sft.collate([self.encode_prompt(e.prompt) for e in examples],
                          [self.tokenizer.encode(self.task.sft_target(e), add_special_tokens=False) for e in examples],
                          self.tokenizer.eos_id, self.tokenizer.pad_id, length)
      train, m = self._sft_step(self._state.train, batch)
      self._state = self._state.replace(train=train)
      self.progress.sft_step += 1
      self.progress.sft_stream = stream.get_state()
      self._track_nonfinite(m)
      if self.progress.sft_step % c.log.every == 0:
        metrics_writer.write(self.progress.sft_step - c.sft.steps, m)
      self._save()

  def _track_nonfinite(self, metrics: dict) -> None:
    skipped = float(metrics["update/skipped_nonfinite"]) > 0
    if skipped:
      self.progress.skipped_updates += 1
      self.progress.nonfinite_in_a_row += 1
      log.warning("non-finite loss or gradient: update skipped (%d in a row)", self.progress.nonfinite_in_a_row)
      if self.progress.nonfinite_in_a_row >= self.config.learner.max_nonfinite_in_a_row:
        raise NonFiniteError(
            f"{self.progress.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
            f"(limit learner.max_nonfinite_in_a_row={self.config.learner.max_nonfinite_in_a_row}); "
            f"stopping. The last good state is in {self.checkpointer.directory}.")
    else:
      self.progress.nonfinite_in_a_row = 0

  # ------------------------------------------------------------------ RL

  def _rl_step_fn(self, train_actor: bool):
    if train_actor not in self._rl_steps:
      c = self.config
      spec = rl_step.RLStepSpec(model=self.model_config, temperature=c.rl.temperature,
                                group_size=c.rl.samples_per_prompt, micro_batches=c.learner.micro_batches,
                                use_ref=self.uses_ref, use_entropy=bool(c.objective.entropy_coef),
                                critic=self.critic_config, train_actor=train_actor)
      self._rl_steps[train_actor] = rl_step.make_rl_step(spec, self.objective, self.optimizer, self.critic_optimizer)
    return self._rl_steps[train_actor]

  def sampling_key(self, rl_step_index: int) -> jax.Array:
    """The sampling key of RL step ``i``: a function of (seed, i) only, so a resumed
    run, and the pipeline with k = 0, sample what the uninterrupted synchronous run would."""
    return jax.random.fold_in(jax.random.PRNGKey(self.config.seed), rl_step_index)

  def collect(self, prompt_source: PromptSource) -> tuple[rl_step.RLBatch, dict]:
    """Samples (in this process), scores and turns one batch of prompts into an RLBatch."""
    pb = prompt_source.next_batch()
    t0 = time.perf_counter()
    result = self.sampler.generate([self.encode_prompt(e.prompt) for e in pb.examples],
                                   rng=self.sampling_key(self.progress.rl_step))
    return self.build_batch(pb.examples, result.trajectory, result.response_tokens, time.perf_counter() - t0)

  def build_batch(self, examples, trajectory, response_tokens, t_sample: float) -> tuple[rl_step.RLBatch, dict]:
    """Scores sampled responses and builds the RLBatch (advantages, reference, lags).

    Args:
      examples: the G prompts' task examples.
      trajectory: the B = G * n sampled rows (numpy Trajectory).
      response_tokens: per row, the sampled ids.
      t_sample: seconds spent sampling (for the metrics).
    """
    c = self.config
    n = c.rl.samples_per_prompt
    traj = trajectory.trimmed(multiple=8)
    pairs = [(examples[i // n], self.decode_response(r)) for i, r in enumerate(response_tokens)]
    rewards = np.asarray(self.rewarder.score(pairs), np.float32)
    if c.advantage.reward_clip:
      rewards = np.clip(rewards, -c.advantage.reward_clip, c.advantage.reward_clip)
    tokens = jnp.asarray(traj.tokens_bt)
    response = jnp.asarray(traj.response_mask_bt)
    seq = jnp.asarray(traj.prompt_mask_bt) | response
    behaviour = jnp.asarray(traj.behaviour_logp_bt)
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    old_values, returns = zeros, zeros
    metrics: dict[str, Any] = {}
    if c.advantage.estimator == "gae":
      old_values = self._values(self._state.train.critic_params, tokens, seq)
      rewards_bt = A.reward_at_eos(rewards, response)
      adv, returns = A.gae(rewards_bt, jnp.where(response, old_values, 0.0), response,
                           gamma=c.advantage.gamma, lam=c.advantage.lam)
    else:
      out = A.group_advantages(rewards, n, estimator=builders.GROUP_ESTIMATORS[c.advantage.estimator])
      adv = A.sequence_to_tokens(out.advantages_b, response)
      metrics["data/zero_variance_groups"] = jnp.mean(out.zero_variance_g.astype(jnp.float32))
      if c.rl.filter_zero_variance:
        response = response & ~out.zero_variance_b[:, None]
    if c.advantage.normalization != "none":
      norm = A.make_advantage_normalizer(c.advantage.normalization, group_size=n)
      adv = norm(adv, response)
    if c.rl.filter_zero_variance and c.advantage.estimator != "gae":
      rows = rl_step.informative_rows(np.asarray(out.zero_variance_b), n, self._row_granule())
      tokens, seq, response, behaviour, adv, zeros = (jnp.asarray(a)[rows] for a in
                                                      (tokens, seq, response, behaviour, adv, zeros))
      old_values, returns = zeros, zeros
      traj = traj.replace(policy_version_bt=np.asarray(traj.policy_version_bt)[rows])
      metrics["data/rows_trained"] = float(len(rows))
    ref = self._ref_logp(self._state.ref_params, tokens, seq) if self.uses_ref else zeros
    version = int(self._state.train.policy_version)
    lag = jnp.where(response, version - jnp.asarray(traj.policy_version_bt), 0)
    batch = rl_step.RLBatch(tokens_bt=tokens, seq_mask_bt=seq, response_mask_bt=response,
                            behaviour_logp_bt=behaviour, advantages_bt=adv, ref_logp_bt=ref, lag_bt=lag,
                            old_values_bt=old_values, returns_bt=returns)
    lag_np = np.asarray(lag)[np.asarray(response)]
    metrics["data/lag_max"] = float(lag_np.max()) if lag_np.size else 0.0
    metrics["data/lag_mean"] = float(lag_np.mean()) if lag_np.size else 0.0
    gen_tokens = int(np.asarray(traj.response_mask_bt).sum())
    lengths = np.asarray(traj.response_mask_bt).sum(1)
    metrics.update({
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "response/length_mean": float(lengths.mean()),
        "response/finished_share": float(np.asarray(traj.finished_b).mean()),
        "throughput/sample_tokens_per_s": gen_tokens / max(t_sample, 1e-9),
        "time/sample_s": t_sample,
    })
    metrics.update(self.rewarder.metrics)
    return batch, metrics

  def _row_granule(self) -> int:
    """Smallest learner batch: a multiple of the group size, micro-batches and data-parallel size."""
    c = self.config
    data = int(np.prod([self.mesh.shape[a] for a in self.mesh.axis_names if a in ("data", "fsdp")]))
    return int(np.lcm.reduce([c.rl.samples_per_prompt, c.learner.micro_batches, data]))

  def run_rl(self, metrics_writer: writers.MetricsWriter) -> None:
    c = self.config
    source = PromptSource(self.task, c.rl.prompts_per_step, seed=c.seed, samples_per_prompt=c.rl.samples_per_prompt)
    if self.progress.prompt_stream:
      source.set_state(self.progress.prompt_stream)
    pipeline = Pipeline(self, source) if c.rollout.mode == "pipeline" else None
    try:
      self._rl_loop(metrics_writer, source, pipeline)
    finally:
      if pipeline is not None:
        pipeline.close()

  def _rl_loop(self, metrics_writer: writers.MetricsWriter, source: PromptSource, pipeline: Optional["Pipeline"]):
    c = self.config
    while self.progress.rl_step < c.rl.steps:
      t0 = time.perf_counter()
      batch, metrics = pipeline.collect() if pipeline else self.collect(source)
      # the learner's idle time: sampling in the synchronous loop, waiting for chunks in the pipeline
      metrics.setdefault("time/wait_s", metrics["time/sample_s"])
      train_actor = self.progress.rl_step >= c.critic.warmup_steps or not c.critic.enabled
      step_fn = self._rl_step_fn(train_actor)
      t1 = time.perf_counter()
      for _ in range(c.rl.updates_per_batch):
        train, obj_state, m = step_fn(self._state.train, self._state.objective, batch)
        self._state = self._state.replace(train=train, objective=obj_state)
        self._track_nonfinite(m) if train_actor else None
      t_publish = time.perf_counter()
      if pipeline:
        pipeline.publish()
      else:
        self.publish()
      metrics["time/publish_s"] = time.perf_counter() - t_publish
      t2 = time.perf_counter()
      self.progress.rl_step += 1
      self.progress.prompt_stream = pipeline.stream_state() if pipeline else source.get_state()
      metrics.update(m)
      tokens = float(np.asarray(batch.response_mask_bt).sum())
      metrics.update({"time/learn_s": t2 - t1, "time/step_s": t2 - t0,
                      "throughput/tokens_per_s": tokens / max(t2 - t0, 1e-9),
                      "policy_version": float(self._state.train.policy_version)})
      if self.progress.rl_step % c.eval.every == 0 or self.progress.rl_step == c.rl.steps:
        metrics.update(self.evaluate())
      if self.progress.rl_step % c.log.every == 0 or "eval/accuracy" in metrics:
        metrics_writer.write(self.progress.rl_step, metrics)
      self._save()

  # ------------------------------------------------------------------ whole run

  def train(self) -> dict:
    c = self.config
    start = time.time()
    mw = writers.MetricsWriter(self.run_dir, c.sft.steps + c.rl.steps, description=c.name,
                               progress=c.log.progress, tensorboard=c.log.tensorboard)
    try:
      if self.progress.phase == "sft":
        if c.sft.steps:
          self.run_sft(mw)
        self.progress.warm_start = self.evaluate()
        mw.write(0, {k.replace("eval/", "warm_start/"): v for k, v in self.progress.warm_start.items()})
        mw.write(0, self.progress.warm_start)
        if self.uses_ref:
          self._state = self._state.replace(ref_params=jax.tree.map(jnp.copy, self._state.train.params))
        self.progress.phase = "rl"
        self._save(force=True)
      if self.progress.phase == "rl":
        self.run_rl(mw)
        self.progress.phase = "done"
        self._save(force=True)
      final = self.evaluate()
    finally:
      mw.close()
      self.rewarder.close()
      self.checkpointer.close()
    return self._finish(final, time.time() - start, mw)

  def _finish(self, final: dict, seconds: float, mw: writers.MetricsWriter) -> dict:
    c = self.config
    records = writers.read_jsonl(mw.jsonl_path)
    plot = writers.plot_curves([r for r in records if r["step"] >= 0], os.path.join(self.run_dir, "curves.png"),
                               ["reward/mean", "eval/accuracy"], title=c.name)
    export_dir = None
    if c.export.hf:
      export_dir = bridge.export_hf_checkpoint(self.params, self.model_config, os.path.join(self.run_dir, "hf_export"),
                                               tokenizer=self.tokenizer)
    warm = self.progress.warm_start or {}
    summary = {
        "name": c.name,
        "final_accuracy": final["eval/accuracy"],
        f"final_pass@{c.eval.pass_k}": final[f"eval/pass@{c.eval.pass_k}"],
        "warm_start_accuracy": warm.get("eval/accuracy"),
        "sft_steps": self.progress.sft_step,
        "rl_steps": self.progress.rl_step,
        "skipped_updates": self.progress.skipped_updates,
        "wall_clock_s": seconds,
        "run_dir": self.run_dir,
        "outputs": {"metrics": mw.jsonl_path, "tensorboard": mw.tb_dir, "plot": plot,
                    "hf_export": export_dir, "checkpoints": self.checkpointer.directory},
    }
    with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    print(f"\n{c.name}: held-out greedy accuracy {summary['warm_start_accuracy'] or 0:.3f} after the warm start "
          f"-> {summary['final_accuracy']:.3f} after {summary['rl_steps']} RL steps "
          f"({seconds:.0f} s).\nOutputs in {self.run_dir}: metrics.jsonl, tensorboard/, curves.png, summary.json"
          + (", hf_export/" if export_dir else ""))
    return summary


class Pipeline:
  """The RL data path of ``rollout.mode="pipeline"``: Ray sampler actors ahead of the learner.

  Wraps a :class:`~jaxrl_llm.rollout.SamplerPool` and a
  :class:`~jaxrl_llm.rollout.PipelineFeeder` (see there for the staleness
  rule). Prompts are drawn from the run's prompt stream in step order; the
  stream state saved with a checkpoint is the one right after the learner's
  last consumed step, so a resumed run re-samples the steps that were in
  flight.
  """

  def __init__(self, run: Run, source: PromptSource):
    from jaxrl_llm import rollout  # Ray is imported only when the pipeline is used

    c = run.config
    self.run = run
    self.source = source
    self.start_step = run.progress.rl_step
    self._examples: dict[int, tuple] = {}
    self._stream_after: dict[int, dict] = {}
    fingerprint = bridge.make_fingerprint(run.tokenizer, run.model_config)
    model_path = ""
    if c.sampler.kind == "vllm":  # vLLM starts from an HF folder of the current weights
      model_path = str(bridge.export_hf_checkpoint(run.params, run.model_config,
                                                   os.path.join(run.run_dir, "sampler_init"), tokenizer=run.tokenizer))
    spec = rollout.SamplerSpec(model_config=run.model_config, sampler_config=run.sampler_config,
                               fingerprint=fingerprint.to_dict(), kind=c.sampler.kind,
                               segment_tokens=c.rollout.segment_tokens, model_path=model_path)
    self.version = int(run._state.train.policy_version)
    vocab = run.model_config.vocab_size
    self.pool = rollout.SamplerPool(
        spec, run.params, self.version, num_samplers=c.rollout.num_samplers, address=c.rollout.address or None,
        actor_cpus=c.rollout.actor_cpus,
        validate=lambda chunk: rollout.validate_chunk(chunk, fingerprint=fingerprint, vocab_size=vocab,
                                                      latest_version=self.pool.published_version))
    self.feeder = rollout.PipelineFeeder(self.pool, self._step_prompts, num_samples=c.rl.samples_per_prompt,
                                         max_lag=c.rollout.max_lag, base_version=self.version,
                                         chunks_per_step=c.rollout.chunks_per_step or c.rollout.num_samplers)

  def _step_prompts(self, s: int):
    pb = self.source.next_batch()
    self._examples[s] = pb.examples
    self._stream_after[s] = self.source.get_state()
    prompts = [self.run.encode_prompt(e.prompt) for e in pb.examples]
    return prompts, np.asarray(self.run.sampling_key(self.start_step + s))

  def collect(self) -> tuple[rl_step.RLBatch, dict]:
    s = self.run.progress.rl_step - self.start_step
    t0 = time.perf_counter()
    from jaxrl_llm import rollout

    chunks = self.feeder.take(s)
    waited = time.perf_counter() - t0
    traj, responses = rollout.concat_chunks(chunks, self.run.model_config.pad_token_id)
    batch, metrics = self.run.build_batch(self._examples.pop(s), traj, responses,
                                          max(ch.sample_seconds for ch in chunks))
    metrics["time/wait_s"] = waited
    metrics.update(self.feeder.metrics())
    metrics["pipeline/sampler_busy_s"] = float(sum(ch.sample_seconds for ch in chunks))
    return batch, metrics

  def publish(self) -> float:
    """Publishes the learner's new weights to the actors (and the in-process eval sampler)."""
    version = int(self.run._state.train.policy_version)
    seconds = self.pool.publish(self.run.params, version) if version > self.pool.published_version else 0.0
    self.run.publish()
    return seconds

  def stream_state(self) -> dict:
    return self._stream_after.pop(self.run.progress.rl_step - 1 - self.start_step)

  def close(self) -> None:
    self.pool.shutdown()


def _place_on_mesh(tree: Any, mesh) -> Any:
  """Commits every leaf to ``mesh``: sharded leaves keep their sharding, the rest
  (step counters, RNG, optimizer counts, objective state) are replicated, so a
  state restored from a checkpoint lands on the same devices as a fresh one."""
  replicated = mesh_lib.replicated(mesh)

  def place(x):
    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) and x.sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


def _sft_optimizer(config: ml_collections.ConfigDict):
  o = config.optimizer
  return builders.optim.make_optimizer(config.sft.lr, config.sft.warmup_steps, max(1, config.sft.steps), "constant",
                                       weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, max_grad_norm=o.max_grad_norm)


def train(config: ml_collections.ConfigDict) -> dict:
  """Runs a whole job; returns the summary dict (also written to summary.json)."""
  return Run(config).train()
