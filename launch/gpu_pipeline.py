"""The pipeline part of ``launch.gpu_check``: PipelineRL training with sampler actors on the GPUs.

:func:`run_pipeline` trains one layout's RL job (:mod:`launch.gpu_layouts`) in this process
with an :class:`ActorProbe` hook that reads each actor's placement, weight loads and final
weights (:meth:`jaxrl_llm.rollout.SamplerWorker.weight_report`);
:func:`run_pipeline_isolated` runs it in a spawned process, so GPU memory, Ray and NCCL
state end with it. ``launch/gpu_check.py``'s docstring says what a run checks and which JSON
keys it reports.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import time
import traceback
from typing import Any, Mapping, Optional

import numpy as np

from jaxrl_llm.rollout.actor import tree_sums
from launch.gpu_layouts import (CHECKSUM_RTOL, build_run_config, placement_problems, run_overrides, summarise_run,
                                tokenizer_gaps)


def _checksum_error(got: Mapping[str, float], want: Mapping[str, float]) -> float:
  """Largest relative difference of two ``{name: sum}`` maps (inf for a missing name)."""
  err = 0.0
  for name, value in want.items():
    mine = got.get(name)
    err = max(err, float("inf") if mine is None else abs(mine - value) / max(abs(value), 1.0))
  return err


class ActorProbe:
  """A job hook (:class:`jaxrl_llm.jobs.base.Hook` protocol) that watches the pipeline's sampler actors.

  After every RL step: the actors' placement (``SamplerPool.describe()``, once) and the last
  weight load of each actor's sampler (``last_publish``: vLLM's :class:`PublishStats`; the JAX
  sampler has none, via :meth:`~jaxrl_llm.rollout.SamplerWorker.weight_report`), returned as
  ``gpu_check/actor_load_s`` / ``gpu_check/actor_load_mb``
  (means over the actors that loaded a new version since the last look). After the last step:
  each actor waits for the learner's final version, and its weights' checksums are compared
  with the learner's (``final``).

  Args:
    last_step: ``rl.steps``.
    timeout_s: how long one look may wait for the actors.
  """

  name = "gpu_check_probe"

  def __init__(self, last_step: int, timeout_s: float = 300.0):
    self.last_step = int(last_step)
    self.timeout_s = float(timeout_s)
    self.placement: Optional[list[dict[str, Any]]] = None
    self.final: Optional[list[dict[str, Any]]] = None
    self.learner_version: Optional[int] = None
    self.errors: list[str] = []
    self.rl_start_sums: Optional[dict[str, float]] = None
    self._seen: dict[str, int] = {}

  def attach(self, job: Any) -> None:
    """Adds this hook to ``job``, and notes the learner's weights when its RL phase starts (after the SFT
    warm start): :func:`run_pipeline` compares them with the final ones."""
    job.add_hook(self)
    start = job.start_source

    def start_source():
      if job.source is None:
        self.rl_start_sums = tree_sums(job.params)
      return start()

    job.start_source = start_source

  def due(self, step: int) -> bool:
    del step
    return True

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    """Looks at the actors after RL step ``step``; a failure is noted in ``errors``, never raised (the run goes on).

    Returns:
      ``gpu_check/actor_load_s`` / ``_mb`` when an actor loaded a new version since the last look, else {}.
    """
    del metrics
    pool = getattr(job.source, "pool", None)
    if pool is None:
      return {}
    import ray  # pylint: disable=import-outside-toplevel
    try:
      if self.placement is None:
        self.placement = pool.describe(self.timeout_s)
      final = step >= self.last_step
      version = int(job.state.train.policy_version) if final else -1
      answers = ray.get([a.weight_report.remote(version, self.timeout_s, final) for a in pool.actors()],
                        timeout=self.timeout_s + 60)
      if final:
        self.final, self.learner_version = answers, version
        self._compare(job, answers)
    except Exception as e:  # pylint: disable=broad-except
      self.errors.append(f"RL step {step}: {type(e).__name__}: {e}")
      return {}
    fresh = [a for a in answers if a["last_publish"] and a["policy_version"] > self._seen.get(a["sampler_id"], -1)]
    for a in fresh:
      self._seen[a["sampler_id"]] = a["policy_version"]
    if not fresh:
      return {}
    return {"gpu_check/actor_load_s": float(np.mean([a["last_publish"]["seconds"] for a in fresh])),
            "gpu_check/actor_load_mb": float(np.mean([a["last_publish"]["bytes"] for a in fresh])) / 2**20}

  def _compare(self, job: Any, answers: list[dict[str, Any]]) -> None:
    """Adds ``checksum_max_rel_err`` to each final answer (the learner's weights against the actor's)."""
    kinds = {a.get("checksums", {}).get("kind") for a in answers}
    expected_vllm = None
    if "vllm" in kinds:
      from jaxrl_llm.bridge import weight_transport as wt  # pylint: disable=import-outside-toplevel
      from jaxrl_llm.jobs.collect import vllm_engine_config  # pylint: disable=import-outside-toplevel
      import jax  # pylint: disable=import-outside-toplevel
      engine = vllm_engine_config(job.config)
      expected_vllm = wt.expected_checksums(jax.device_get(job.params), job.model_config,
                                            engine.tensor_parallel_size, dtype=engine.engine_dtype(job.model_config))
    expected_jax = tree_sums(job.params) if "jax" in kinds else None
    for a in answers:
      sums = a.pop("checksums", None) or {}
      if sums.get("kind") == "vllm":
        errs = [_checksum_error(r["sums"], expected_vllm[r["rank"]]) for r in sums["ranks"]]
        a["checksum_max_rel_err"] = max(errs) if errs else float("inf")
      elif sums.get("kind") == "jax":
        a["checksum_max_rel_err"] = _checksum_error(sums["sums"], expected_jax)


def _layout_entry(layout: Mapping[str, Any]) -> dict[str, Any]:
  entry = {k: layout[k] for k in ("name", "sampler_kind", "transport", "tensor_parallel_size", "num_samplers",
                                   "actor_gpus", "shared_gpu", "gpus_needed", "gpu_memory_utilization", "overrides",
                                   "skipped")}
  entry.update(ok=None if layout.get("skipped") else False, error=None)
  return entry


def run_pipeline(layout: Mapping[str, Any], *, checkpoint: str, workdir: str, steps: int = 3,
                 prompts_per_step: int = 4, samples_per_prompt: int = 4, max_lag: int = 1, lr: float = 3e-3,
                 sft_steps: int = 4, vllm_dtype: str = "auto", enforce_eager: bool = True, seed: int = 0,
                 max_mean_abs: float = 0.05, probe_timeout_s: float = 300.0) -> dict[str, Any]:
  """Trains the RL job of one layout in this process and returns its report entry (never raises).

  The job (:func:`run_overrides`, :func:`build_run_config`) runs in ``<workdir>/<name>`` with
  an :class:`ActorProbe`; its local Ray cluster is shut down afterwards unless Ray was already
  connected. The JAX layouts (``sampler_kind="jax"``) run the same code with CPU actors.

  Args:
    layout: one of :func:`pipeline_layouts`; a skipped one is returned as it is (``ok`` None).
    checkpoint: HF folder (``init.hf_checkpoint``; its tokenizer must cover the task's characters).
    workdir: parent of the run folder (which must not hold an earlier run of the same name).
    steps, prompts_per_step, samples_per_prompt, max_lag, lr, sft_steps, vllm_dtype, enforce_eager, seed:
      see :func:`run_overrides`.
    max_mean_abs: bound on every step's ``consistency/abs_log_ratio_mean``.
    probe_timeout_s: how long the probe waits for the actors.

  Returns:
    The layout's fields plus ``ok``, ``error`` (a traceback), ``checks``, ``seconds``,
    ``run_dir`` and, once the run finished, :func:`summarise_run`'s figures, ``placement``,
    ``actor_weights`` and ``learner_params_changed``.
  """
  entry = _layout_entry(layout)
  if layout.get("skipped"):
    return entry
  t0 = time.perf_counter()
  run_dir = os.path.join(os.path.abspath(workdir), layout["name"])
  entry["run_dir"] = run_dir
  owns_ray, probe = False, None
  try:
    import ray  # pylint: disable=import-outside-toplevel
    owns_ray = not ray.is_initialized()
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
      raise FileExistsError(f"{run_dir} already holds a run; pass another --workdir")
    config = build_run_config(run_overrides(
        layout, checkpoint=checkpoint, run_dir=run_dir, steps=steps, prompts_per_step=prompts_per_step,
        samples_per_prompt=samples_per_prompt, max_lag=max_lag, lr=lr, sft_steps=sft_steps, vllm_dtype=vllm_dtype,
        enforce_eager=enforce_eager, seed=seed))
    gaps = tokenizer_gaps(checkpoint, config.task.name, dict(config.task.kwargs))
    if gaps:
      raise ValueError(f"the tokenizer of {checkpoint} has no token for {gaps}, which task {config.task.name!r} "
                       "writes; pass a checkpoint whose tokenizer covers them")
    from jaxrl_llm import jobs  # pylint: disable=import-outside-toplevel
    probe = ActorProbe(steps, probe_timeout_s)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the report line
      job = jobs.RLJob(config)
      probe.attach(job)
      job.train()
    entry.update(summarise_run(run_dir))
    entry["placement"] = probe.placement
    entry["actor_weights"] = probe.final
    entry["learner_version"] = probe.learner_version
    entry["probe_errors"] = probe.errors
    entry["learner_params_changed"] = (probe.rl_start_sums is not None
                                       and _checksum_error(tree_sums(job.params), probe.rl_start_sums) > 0)
    entry["checks"] = _run_checks(layout, entry, probe, steps, max_mean_abs)
    entry["ok"] = all(entry["checks"].values())
  except Exception:  # pylint: disable=broad-except
    entry["ok"] = False
    entry["error"] = traceback.format_exc()
    if probe is not None:  # what the failed run got to, for the diagnosis
      entry.update(placement=probe.placement, probe_errors=probe.errors)
    with contextlib.suppress(Exception):
      entry.update({k: v for k, v in summarise_run(run_dir).items() if k not in entry})
  finally:
    if owns_ray:
      with contextlib.suppress(Exception):
        import ray  # pylint: disable=import-outside-toplevel,reimported
        ray.shutdown()
    entry["seconds"] = time.perf_counter() - t0
  return entry


def _run_checks(layout: Mapping[str, Any], entry: Mapping[str, Any], probe: ActorProbe, steps: int,
                max_mean_abs: float) -> dict[str, bool]:
  pool = entry["pool"]
  worst = entry["mismatch"]["abs_log_ratio_mean_max"]
  final = probe.final or []
  problems = placement_problems(layout, probe.placement or [])
  if problems:
    entry["placement_problems"] = problems
  return {
      "all_steps_ran": entry["steps_done"] == steps,
      "no_lost_rejected_or_failed_work": all((pool.get(k) or 0) == 0 for k in ("lost_items", "rejected", "failures")),
      "mismatch_measured": worst is not None,
      "mismatch_within_bound": worst is not None and worst <= max_mean_abs,
      "placement_as_planned": probe.placement is not None and not problems,
      "actors_hold_final_version": bool(final) and all(a["policy_version"] == probe.learner_version and
                                                       not a["error"] for a in final),
      "learner_params_changed": bool(entry["learner_params_changed"]),
      "actor_weights_match_learner": bool(final) and all(a.get("checksum_max_rel_err", float("inf")) < CHECKSUM_RTOL
                                                         for a in final),
  }


def _pipeline_child(conn: Any, layout: Mapping[str, Any], kwargs: Mapping[str, Any]) -> None:
  """A spawned run's body: :func:`run_pipeline`, its entry sent back through ``conn``."""
  os.dup2(2, 1)  # the parent's stdout carries only the report line
  sys.stdout = sys.stderr
  try:
    entry = run_pipeline(layout, **kwargs)
  except BaseException:  # pylint: disable=broad-except
    entry = {**_layout_entry(layout), "error": traceback.format_exc()}
  conn.send(entry)
  conn.close()


def run_pipeline_isolated(layout: Mapping[str, Any], timeout_s: float, **kwargs: Any) -> dict[str, Any]:
  """:func:`run_pipeline` in a spawned process (GPU memory, Ray and NCCL state end with it), killed after
  ``timeout_s`` seconds; a run that dies or times out is reported with ``ok`` False and why."""
  if layout.get("skipped"):
    return _layout_entry(layout)
  t0 = time.perf_counter()
  ctx = multiprocessing.get_context("spawn")
  receive, send = ctx.Pipe(duplex=False)
  proc = ctx.Process(target=_pipeline_child, args=(send, dict(layout), dict(kwargs)),
                     name=f"gpu_check-{layout['name']}")
  proc.start()
  send.close()
  try:
    if receive.poll(timeout_s):
      entry = receive.recv()
      proc.join(60)  # it shuts its Ray cluster down, then exits
    else:
      entry = {**_layout_entry(layout), "error": f"timed out after {timeout_s:.0f} s (--pipeline_timeout_s); its "
                                                 "process was killed; see stderr for how far it got"}
  except EOFError:
    proc.join(10)
    entry = {**_layout_entry(layout), "error": f"the run's process died (exit code {proc.exitcode}) before "
                                               "reporting; see stderr"}
  finally:
    if proc.is_alive():  # its Ray cluster's reaper ends what it started
      proc.kill()
      proc.join(10)
  entry.setdefault("seconds", time.perf_counter() - t0)
  return entry


def sampler_gpu_ids() -> list[str]:
  """The GPUs a local Ray cluster would offer the sampler actors (``rollout.local_gpus='auto'``)."""
  from jaxrl_llm.rollout import placement  # pylint: disable=import-outside-toplevel
  return placement.local_sampler_gpus("auto", placement.learner_gpu_ids(), placement.machine_gpu_ids())


