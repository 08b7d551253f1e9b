"""The ``jaxrl-eval`` command's pieces: what to evaluate, on what, and the figures with their intervals.

``launch/evaluate.py`` is the command-line wrapper; everything it does is here,
callable from Python (:func:`evaluate`, one :class:`EvalRequest`).

**Sources** (:func:`detect_source`), each loaded by the code training uses:

* a run folder (``config.json`` + ``checkpoints/``): the run's job
  (``jobs.JOBS[config.job](config)``: ``RLJob``, or a preference-optimisation job) with
  ``config.run_dir`` at the folder restores its newest verified checkpoint, as a
  resumed run would (a corrupt newest one is quarantined and the previous used);
  the config is the folder's ``config.json`` unless one is given;
* a checkpoint step folder (``<run>/checkpoints/<step>``): the same job, restored at
  that step (verified, no fallback); the config is the one saved in the step folder;
* a Hugging Face folder (``config.json`` + ``*.safetensors`` + tokenizer): the job
  built with ``init.hf_checkpoint`` at it (:mod:`jaxrl_llm.bridge.hf_import`) in a
  temporary run folder; an ``hf_export/`` inside a run takes the run's config (task,
  sampling settings), any other folder the given config or the defaults.

**Examples**: the run's task and its held-out split exactly as training evaluates it
(``build_eval_set(task, task.eval_size, seed=seed)``), another registered task's
held-out split, or a file of prompts and answers (JSONL, parquet, JSON or a
``datasets`` folder read as :class:`~jaxrl_llm.tasks.JsonlTask` rows, all of them, in
file order, scored by its verifier); ``limit`` keeps the first ones.

**Figures**: :class:`~jaxrl_llm.jobs.evaluation.PolicyEvaluator` (the training loop's
evaluator) answers each example greedily and with ``n`` samples; greedy accuracy with
its Wilson interval, the unbiased pass@k (Chen et al. 2021, arXiv:2107.03374) and the
sample accuracy with normal-approximation intervals over examples
(:mod:`jaxrl_llm.diagnostics.estimates`, docs/evaluation.md). The default batch is
``task.eval_size`` examples and the samples' key is the checkpoint's step, so with
``n = k = eval.pass_k`` a run's checkpoint gives exactly the run's ``eval/accuracy``,
``eval/pass@k`` and ``eval/sample_accuracy`` of that step.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

import ml_collections
import numpy as np

from jaxrl_llm import configuration
from jaxrl_llm.diagnostics import estimates, writers
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.jobs import JOBS, Job, resume
from jaxrl_llm.jobs.base import Progress, place_on_mesh
from jaxrl_llm.jobs.episodes import EpisodeEvaluator, build_episode_runner
from jaxrl_llm.jobs.evaluation import PolicyEvaluator, Scores, eval_metrics
from jaxrl_llm.jobs.score import reward_runner
from jaxrl_llm.learner import checkpoint, multihost
from jaxrl_llm.tasks import JsonlTask, build_eval_set, get_task

__all__ = ["EXPECTED", "EvalRequest", "Source", "config_from_record", "detect_source", "evaluate", "open_job",
           "source_config", "summarize", "write_examples"]

EXPECTED = ("a run folder (config.json and checkpoints/<step>/), a checkpoint step folder (<run>/checkpoints/<step>) "
            "or a Hugging Face folder (config.json, *.safetensors and the tokenizer)")
CI_METHOD = ("95%: Wilson score interval for the greedy accuracy; normal approximation over examples "
             "(mean +- 1.96 s/sqrt(N)) for pass@k and the sample accuracy")


@dataclasses.dataclass(frozen=True)
class Source:
  """What ``--source`` points to.

  Attributes:
    kind: "run", "checkpoint" or "hf".
    path: the folder (absolute).
    run_dir: the run folder it belongs to (None: an HF folder outside a run).
    step: the checkpoint step of a step folder (None otherwise).
  """

  kind: str
  path: str
  run_dir: Optional[str] = None
  step: Optional[int] = None


@dataclasses.dataclass
class EvalRequest:
  """One ``jaxrl-eval`` call (the command's flags).

  Attributes:
    source: run folder, checkpoint step folder or HF folder.
    config: the run config (None: the source's own ``config.json``).
    task: "" the config's task; else a registered task's held-out split (default arguments).
    data: a file or ``datasets`` folder of prompts and answers (instead of a task); ``fields``: its
      :class:`~jaxrl_llm.tasks.JsonlTask` arguments (prompt_field, answer_field, prompt_template, verifier).
    limit: the first ``limit`` examples (0: all).
    ks: the k of pass@k; samples: n samples per example (0: max(ks); >= max(ks)).
    batch_size: examples per batch (0: ``task.eval_size``, the training loop's batch).
    step_key: the global step whose key the samples use (None: the checkpoint's step; 0 for an HF folder).
    output: the per-example JSONL ("": ``<run>/eval/<name>.jsonl``).
    progress: show a progress bar over batches.
  """

  source: str
  config: Optional[ml_collections.ConfigDict] = None
  task: str = ""
  data: str = ""
  fields: dict = dataclasses.field(default_factory=dict)
  limit: int = 0
  ks: Sequence[int] = (1, 4, 8)
  samples: int = 0
  batch_size: int = 0
  step_key: Optional[int] = None
  output: str = ""
  progress: bool = True


# ------------------------------------------------------------------ the source and its config

def _is_hf(path: str) -> bool:
  names = os.listdir(path)
  return "config.json" in names and any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json")
                                        for n in names)


def _steps(folder: str) -> list[int]:
  if not os.path.isdir(folder):
    return []
  return sorted(int(n) for n in os.listdir(folder) if n.isdigit() and os.path.isdir(os.path.join(folder, n)))


def detect_source(path: str) -> Source:
  """Which kind of folder ``path`` is; a :class:`ConfigError` naming it and :data:`EXPECTED` when none."""
  full = os.path.abspath(path)
  if not os.path.exists(full):
    raise ConfigError(f"--source={path}: no such file or folder. Expected {EXPECTED}.")
  if not os.path.isdir(full):
    raise ConfigError(f"--source={path}: a file, not a folder. Expected {EXPECTED}.")
  parent = os.path.dirname(full)
  if os.path.basename(full).isdigit() and os.path.basename(parent) == "checkpoints":
    return Source("checkpoint", full, os.path.dirname(parent), int(os.path.basename(full)))
  if _is_hf(full):
    run = parent if os.path.isfile(os.path.join(parent, "config.json")) and _steps(
        os.path.join(parent, "checkpoints")) else None
    return Source("hf", full, run)
  if os.path.isdir(os.path.join(full, "checkpoints")):
    if not _steps(os.path.join(full, "checkpoints")):
      raise ConfigError(f"--source={path}: a run folder without a checkpoint (checkpoints/ holds no step folder). "
                        f"Expected {EXPECTED}.")
    return Source("run", full, full)
  found = ", ".join(sorted(os.listdir(full))[:8]) or "nothing"
  raise ConfigError(f"--source={path}: not a run, checkpoint or Hugging Face folder (it holds: {found}). "
                    f"Expected {EXPECTED}.")


def config_from_record(record: dict, where: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a saved config record (a run's ``config.json``) on today's defaults.

  A field the schema no longer has is an error naming ``where`` and the field.
  """
  c = configuration.base_config()
  for path, value in resume.flatten(record).items():
    if path == "run_dir" or (isinstance(value, dict) and not value):
      continue
    try:
      current = configuration.get_field(c, path)
    except ConfigError:
      current = None
    if isinstance(current, tuple) and isinstance(value, list):
      value = tuple(value)
    try:
      configuration.override(c, path, value)
    except (ConfigError, TypeError, ValueError, KeyError, AttributeError) as e:
      raise ConfigError(f"{where}: config field {path!r} = {value!r} does not fit this version's config ({e}); "
                        "pass the run's config file with --config") from None
  return c


def _read_record(*paths: str) -> Optional[tuple[dict, str]]:
  for p in paths:
    if os.path.isfile(p):
      with open(p) as f:
        return json.load(f), p
  return None


def source_config(source: Source, config: Optional[ml_collections.ConfigDict] = None) -> ml_collections.ConfigDict:
  """The config to build the job with: ``config`` if given, else the source's saved one (an HF folder outside a
  run: the defaults), with ``run_dir`` at the source's run and no progress bar of the job's own."""
  if config is None:
    candidates = []
    if source.kind == "checkpoint":
      candidates.append(os.path.join(source.path, checkpoint.CONFIG))
    if source.run_dir:
      candidates.append(os.path.join(source.run_dir, "config.json"))
      steps = _steps(os.path.join(source.run_dir, "checkpoints"))
      candidates += [os.path.join(source.run_dir, "checkpoints", str(s), checkpoint.CONFIG) for s in reversed(steps)]
    found = _read_record(*candidates)
    if found is None and source.kind != "hf":
      raise ConfigError(f"--source={source.path}: no config.json in the run folder or its checkpoints; "
                        "pass the run's config file with --config")
    config = config_from_record(*found) if found else configuration.base_config()
  else:
    config = copy.deepcopy(config)  # the caller's stays as it is
  config.log.progress = False
  if source.run_dir and source.kind != "hf":
    config.run_dir = source.run_dir
  return config


def open_job(source: Source, config: ml_collections.ConfigDict) -> tuple[Job, int, Callable[[], None]]:
  """The job holding the source's policy: ``(job, global step of its weights, cleanup)``."""
  cleanup = lambda: None  # noqa: E731
  if source.kind == "hf":
    tmp = tempfile.mkdtemp(prefix="jaxrl_eval_")
    config.run_dir = tmp
    config.init.hf_checkpoint = source.path
    config.checkpoint.resume = False
    cleanup = lambda: shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731
  else:  # a run: its newest verified checkpoint, as a resumed run; a step folder: restored below at that step
    config.checkpoint.resume = source.kind == "run"
  configuration.validate(config)
  kind = JOBS.get(config.job)
  try:
    if kind is None:
      raise ConfigError(f"--source={source.path}: job={config.job!r}: expected one of {tuple(JOBS)}")
    job = kind(config)
  except Exception:
    cleanup()
    raise
  if not all(hasattr(job, a) for a in ("evaluator", "eval_set", "sampler", "publish_local")):
    job.close()
    cleanup()
    raise ConfigError(f"--source={source.path}: a {config.job!r} run holds no policy to evaluate (jaxrl-eval "
                      "evaluates the policy of an RL or preference-optimisation run, or a Hugging Face folder)")
  if source.kind == "checkpoint":
    try:
      state, extra, _ = job.checkpointer.restore(job.restorable_like(job.state), step=source.step)
    except checkpoint.CheckpointError as e:
      job.close()
      cleanup()
      raise ConfigError(f"--source={source.path}: {e}") from None
    job.state = place_on_mesh(state, job.mesh)
    job.progress = Progress(**extra["progress"])
    job.sampler.update_weights(multihost.local_copy(job.params), int(job.train_state.policy_version))
  step = job.progress.sft_step + job.progress.step if source.kind != "hf" else 0
  return job, step, cleanup


# ------------------------------------------------------------------ the examples

def _data_task(path: str, fields: dict) -> JsonlTask:
  try:
    return JsonlTask(path=path, eval_fraction=0.0, **{k: v for k, v in fields.items() if v is not None})
  except (ValueError, OSError) as e:
    raise ConfigError(f"--data={path}: {e}") from None


def examples_and_evaluator(job: Job, request: EvalRequest, n: int) -> tuple[str, list, PolicyEvaluator]:
  """``(what is evaluated, examples, evaluator)``: the job's own evaluator for its task's held-out split."""
  c = job.config
  if request.data:
    task = _data_task(request.data, request.fields)
    examples, what = list(task.examples()[0]), request.data
  elif request.task and request.task != job.task.name:
    try:
      task = get_task(request.task)
    except (KeyError, ValueError) as e:
      raise ConfigError(f"--task={request.task}: {e}") from None
    examples, what = list(build_eval_set(task, c.task.eval_size, seed=c.seed).examples), f"task {task.name}"
  else:
    examples, what = list(job.eval_set.examples), f"task {job.task.name}"
    return what, examples[:request.limit or None], job.evaluator
  for e in examples[:request.limit or None]:
    try:
      job.encode_prompt(e.prompt)
    except (ValueError, KeyError) as err:
      where = f"{e.meta['source']}:{e.meta['line']}" if "line" in e.meta else repr(e.prompt[:60])
      raise ConfigError(f"{where}: the model's tokenizer cannot encode this prompt ({err})") from None
  runner = reward_runner(task.reward, job.settings.reward, name="eval")
  job.on_close(runner.close)
  if getattr(job, "episodes", None) is not None:  # a multi-turn run: the other examples are played as episodes
    episodes = build_episode_runner(job.settings.env, task, job.tokenizer, job.encode_prompt)
    return what, examples[:request.limit or None], EpisodeEvaluator(job.sampler, episodes, runner, seed=c.seed,
                                                                    pass_k=n)
  evaluator = PolicyEvaluator(job.sampler, runner, job.encode_prompt, job.decode_response, seed=c.seed, pass_k=n)
  return what, examples[:request.limit or None], evaluator


# ------------------------------------------------------------------ figures and outputs

def summarize(scores: Scores, ks: Sequence[int]) -> dict[str, Any]:
  """Every figure with its 95 % interval: ``accuracy``, ``pass@k``, ``sample_accuracy`` (+ ``*_ci95``)."""
  metrics = eval_metrics(scores, ks, prefix="")
  correct = np.asarray(scores.greedy_correct, bool)
  out: dict[str, Any] = {"accuracy": metrics["accuracy"],
                         "accuracy_ci95": list(estimates.wilson_interval(int(correct.sum()), int(correct.size)))}
  if scores.hits.size:
    for k in ks:
      out[f"pass@{k}"] = metrics[f"pass@{k}"]
      out[f"pass@{k}_ci95"] = list(estimates.mean_interval(estimates.pass_at_k_per_problem(scores.hits, k)))
    out["sample_accuracy"] = metrics["sample_accuracy"]
    out["sample_accuracy_ci95"] = list(estimates.mean_interval(scores.hits.mean(1)))
  return out


def write_examples(path: str, examples: Sequence[Any], scores: Scores, ks: Sequence[int]) -> None:
  """One JSON line per example: prompt, answer, greedy response and correctness, samples, per-example pass@k."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  per_k = {k: estimates.pass_at_k_per_problem(scores.hits, k) for k in ks} if scores.hits.size else {}
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    for i, e in enumerate(examples):
      row = {"index": i, "prompt": e.prompt, "answer": e.answer, "greedy": scores.greedy[i],
             "correct": bool(scores.greedy_correct[i]), "samples": scores.samples[i],
             "samples_correct": [bool(h) for h in scores.hits[i]],
             "pass@k": {str(k): float(v[i]) for k, v in per_k.items()}}
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


def _default_output(source: Source, what: str, step: int) -> str:
  folder = source.run_dir or source.path
  stem = os.path.splitext(os.path.basename(what.rstrip("/")))[0] if not what.startswith("task ") else what[5:]
  tag = "hf" if source.kind == "hf" else f"step{step}"
  return os.path.join(folder, "eval", f"{stem}_{tag}.jsonl")


def evaluate(request: EvalRequest) -> dict[str, Any]:
  """Runs one evaluation; returns every figure (the command prints it as its last line)."""
  ks = tuple(int(k) for k in request.ks)
  if any(k < 1 for k in ks):
    raise ConfigError(f"--k={','.join(map(str, ks))}: every k must be >= 1")
  n = request.samples or (max(ks) if ks else 0)
  if ks and n < max(ks):
    raise ConfigError(f"--samples={n}: pass@{max(ks)} needs at least {max(ks)} samples per example (n >= max k): "
                      "raise --samples or lower --k")
  if request.data and request.task:
    raise ConfigError("--task and --data: give one of them")
  if request.limit < 0 or request.batch_size < 0:
    raise ConfigError(f"--limit={request.limit}, --batch_size={request.batch_size}: expected >= 0")
  source = detect_source(request.source)
  config = source_config(source, request.config)
  start = time.perf_counter()
  job, step, cleanup = open_job(source, config)
  try:
    what, examples, evaluator = examples_and_evaluator(job, request, n)
    if not examples:
      raise ConfigError(f"{what}: no examples to evaluate")
    key_step = step if request.step_key is None else request.step_key
    size = request.batch_size or job.config.task.eval_size
    bar = writers.ProgressBar(-(-len(examples) // size), f"jaxrl-eval {what}", enabled=request.progress)
    done = {"batches": 0, "correct": 0, "seen": 0}

    def on_batch(seen: int, part: Scores) -> None:
      done["batches"] += 1
      done["correct"] += int(part.greedy_correct.sum())
      bar.update(done["batches"], {"eval/accuracy": done["correct"] / max(seen, 1)})

    job.publish_local()
    try:
      scores = evaluator.score(examples, key_step, n, batch_size=size, on_batch=on_batch)
    finally:
      bar.close()
    output = request.output or _default_output(source, what, step)
    write_examples(output, examples, scores, ks)
    figures = {"source": source.path, "kind": source.kind, "checkpoint_step": step if source.kind != "hf" else None,
               "evaluated": what, "examples": len(examples), "samples_per_example": n, "sampling_step": key_step,
               **summarize(scores, ks), "ci": CI_METHOD, "output": os.path.abspath(output),
               "seconds": time.perf_counter() - start}
  finally:
    job.close()
    cleanup()
  return figures

