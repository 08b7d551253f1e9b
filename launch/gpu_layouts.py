"""Which pipeline runs ``launch.gpu_check`` makes for the GPUs at hand, their RL jobs, and what a run reports.

Pure functions, tested on the CPU (tests/test_gpu_check.py): :func:`pipeline_layouts`
(which layouts of tensor-parallel size, weight transport and actors fit the GPUs),
:func:`run_overrides` / :func:`build_run_config` (a layout's short RL job),
:func:`tokenizer_gaps`, :func:`summarise_run` (the figures of a run folder's
metrics.jsonl) and :func:`placement_problems` (actors placed otherwise than planned).
"""

from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxrl_llm.diagnostics import writers
from jaxrl_llm.rollout import placement

TRANSPORTS = ("object_store", "ipc", "nccl")
SHARED_GPU_MEMORY = 0.8  # the share of one GPU's memory that engines sharing it take together
CHECKSUM_RTOL = 1e-4


# ----------------------------------------------------------- pipeline: plans
def pipeline_layouts(num_gpus: int, transports: Sequence[str] = TRANSPORTS, *, sampler_kind: str = "vllm",
                     num_samplers: int = 2, tensor_parallel_sizes: Sequence[int] = (1, 2),
                     gpu_memory_utilization: float = 0.4) -> list[dict[str, Any]]:
  """The pipeline runs to make on ``num_gpus`` sampler GPUs, one per (tensor-parallel size, transport).

  vLLM: an actor holds P GPUs (``sampler.vllm.tensor_parallel_size``), P + 1 with ``nccl``
  (:func:`jaxrl_llm.rollout.placement.gpus_per_actor`). A layout runs ``num_samplers``
  actors when they fit, each on GPUs of its own; else, at P = 1 without ``nccl`` on one GPU,
  all of them share it (``rollout.actor_gpus = 1 / num_samplers``, each engine within
  ``SHARED_GPU_MEMORY / num_samplers`` of its memory); else one actor when one fits; else it
  is skipped. JAX (``sampler_kind="jax"``, the CPU test of the same runner): one layout of
  ``num_samplers`` CPU actors (``rollout.actor_gpus=0``, ``sampler.platform='cpu'``) with
  ``object_store``, the only transport of the JAX sampler; the others are skipped.

  Args:
    num_gpus: GPUs the sampler actors may use (>= 0).
    transports: ``rollout.weight_transport`` values, each of ``TRANSPORTS``.
    sampler_kind: ``"vllm"`` or ``"jax"``.
    num_samplers: actors per layout when they fit (``rollout.num_samplers``, >= 1).
    tensor_parallel_sizes: P values (vLLM only).
    gpu_memory_utilization: ``sampler.vllm.gpu_memory_utilization`` of an engine on GPUs of its own.

  Returns:
    One dict per layout: ``name``, ``sampler_kind``, ``transport``, ``tensor_parallel_size``,
    ``num_samplers``, ``actor_gpus`` (GPUs per actor, a share when shared), ``shared_gpu``,
    ``gpus_needed`` (all actors together; a skipped layout: what one actor needs),
    ``gpu_memory_utilization``, ``overrides`` (the layout's config overrides, ``{dotted path:
    value}``; None when skipped) and ``skipped`` (None, or ``"skipped: needs N GPUs, M
    visible"`` / why the sampler cannot run it).

  Raises:
    ValueError: naming the argument that is out of range.
  """
  if num_gpus < 0:
    raise ValueError(f"pipeline_layouts: num_gpus={num_gpus}: expected >= 0")
  if num_samplers < 1:
    raise ValueError(f"pipeline_layouts: num_samplers={num_samplers}: expected >= 1")
  unknown = [t for t in transports if t not in TRANSPORTS]
  if unknown or not transports:
    raise ValueError(f"pipeline_layouts: transports={list(transports)}: expected a non-empty list of {TRANSPORTS}")
  if sampler_kind == "jax":
    return [_jax_layout(t, num_samplers) for t in transports]
  if sampler_kind != "vllm":
    raise ValueError(f"pipeline_layouts: sampler_kind={sampler_kind!r}: expected 'vllm' or 'jax'")
  bad = [p for p in tensor_parallel_sizes if int(p) < 1]
  if bad or not tensor_parallel_sizes:
    raise ValueError(f"pipeline_layouts: tensor_parallel_sizes={list(tensor_parallel_sizes)}: expected sizes >= 1")
  if not 0 < gpu_memory_utilization <= 1:
    raise ValueError(f"pipeline_layouts: gpu_memory_utilization={gpu_memory_utilization}: expected in (0, 1]")
  return [_vllm_layout(int(p), t, num_gpus, num_samplers, gpu_memory_utilization)
          for p in tensor_parallel_sizes for t in transports]


def _layout(name: str, kind: str, transport: str, tp: int, actors: int, actor_gpus: float, shared: bool,
            memory: Optional[float], overrides: Optional[dict], skipped: Optional[str],
            needed: Optional[float] = None) -> dict[str, Any]:
  if needed is None:
    needed = 1.0 if shared else actor_gpus * actors
  return {"name": name, "sampler_kind": kind, "transport": transport, "tensor_parallel_size": tp,
          "num_samplers": actors, "actor_gpus": actor_gpus, "shared_gpu": shared, "gpus_needed": needed,
          "gpu_memory_utilization": memory, "overrides": overrides, "skipped": skipped}


def _jax_layout(transport: str, num_samplers: int) -> dict[str, Any]:
  name = f"jax_cpu_x{num_samplers}_{transport}"
  if transport != "object_store":
    return _layout(name, "jax", transport, 1, num_samplers, 0.0, False, None, None,
                   "skipped: the JAX sampler takes the host weights it receives; rollout.weight_transport="
                   f"{transport!r} needs sampler.kind='vllm'")
  overrides = {"sampler.kind": "jax", "sampler.platform": "cpu", "rollout.weight_transport": transport,
               "rollout.num_samplers": num_samplers, "rollout.actor_gpus": 0.0}
  return _layout(name, "jax", transport, 1, num_samplers, 0.0, False, None, overrides, None)


def _vllm_layout(tp: int, transport: str, num_gpus: int, num_samplers: int, memory: float) -> dict[str, Any]:
  per_actor = int(placement.gpus_per_actor("vllm", tensor_parallel_size=tp, weight_transport=transport))
  name = f"vllm_tp{tp}_x{{actors}}_{transport}"
  if num_gpus >= per_actor * num_samplers:
    actors, share, shared = num_samplers, float(per_actor), False
  elif per_actor == 1 and num_gpus == 1:
    actors, share, shared = num_samplers, round(1.0 / num_samplers, 6), True
    memory = min(memory, round(SHARED_GPU_MEMORY / num_samplers, 6))
  elif num_gpus >= per_actor:
    actors, share, shared = 1, float(per_actor), False
  else:
    return _layout(name.format(actors=num_samplers), "vllm", transport, tp, num_samplers, float(per_actor), False,
                   None, None, f"skipped: needs {per_actor} GPUs, {num_gpus} visible", needed=float(per_actor))
  overrides = {"sampler.kind": "vllm", "rollout.weight_transport": transport, "rollout.num_samplers": actors,
               "rollout.actor_gpus": share if shared else -1.0, "sampler.vllm.tensor_parallel_size": tp,
               "sampler.vllm.gpu_memory_utilization": memory}
  return _layout(name.format(actors=actors) + ("_shared" if shared else ""), "vllm", transport, tp, actors, share,
                 shared, memory, overrides, None)


def run_overrides(layout: Mapping[str, Any], *, checkpoint: str, run_dir: str, steps: int = 3,
                  prompts_per_step: int = 4, samples_per_prompt: int = 4, max_lag: int = 1, lr: float = 3e-3,
                  sft_steps: int = 4, vllm_dtype: str = "auto", enforce_eager: bool = True,
                  seed: int = 0) -> dict[str, Any]:
  """The RLJob config overrides of one pipeline run: a short PipelineRL job plus the layout's own.

  Args:
    layout: one of :func:`pipeline_layouts` (not skipped).
    checkpoint: HF folder the learner starts from (``init.hf_checkpoint``; its tokenizer too).
    run_dir: the run folder (fresh: an existing checkpoint there would be resumed).
    steps: ``rl.steps``.
    prompts_per_step, samples_per_prompt: ``rl.prompts_per_step``, ``rl.samples_per_prompt``.
    max_lag: ``rollout.max_lag``.
    lr: ``optimizer.lr`` and ``sft.lr`` (large enough that each update visibly moves the weights).
    sft_steps: ``sft.steps`` of 16 examples before RL: a random checkpoint then writes digits, so the
      rewards (with partial credit) differ within a group, the advantages are not all zero and every
      RL update changes the weights the samplers must receive (0: RL only).
    vllm_dtype: ``sampler.vllm.dtype`` (vLLM layouts).
    enforce_eager: ``sampler.vllm.enforce_eager`` (vLLM layouts).
    seed: the run's seed.

  Returns:
    ``{dotted config path: value}`` for :func:`build_run_config`.

  Raises:
    ValueError: when the layout is skipped.
  """
  if layout.get("skipped") or not layout.get("overrides"):
    raise ValueError(f"run_overrides: layout {layout.get('name')!r} is {layout.get('skipped') or 'empty'}")
  out = {
      "name": layout["name"], "run_dir": str(run_dir), "seed": int(seed), "init.hf_checkpoint": str(checkpoint),
      "task.name": "addition", "task.kwargs.partial_credit": 0.5, "task.kwargs.format_reward": 0.25,
      "task.eval_size": 8, "eval.pass_k": 2, "eval.every": 1_000_000,
      "sft.steps": int(sft_steps), "sft.batch_size": 16, "sft.lr": float(lr), "sft.warmup_steps": 0,
      "rl.steps": int(steps), "rl.prompts_per_step": int(prompts_per_step),
      "rl.samples_per_prompt": int(samples_per_prompt), "optimizer.lr": float(lr),
      "objective.kwargs.kl_coef": 0.0,  # no reference policy: one forward less per step
      "learner.mesh.data": 1, "rollout.mode": "pipeline", "rollout.max_lag": int(max_lag),
      "checkpoint.every": 1_000_000, "export.hf": False, "log.progress": False, "log.tensorboard": False,
  }
  if layout["sampler_kind"] == "vllm":
    out.update({"sampler.vllm.dtype": vllm_dtype, "sampler.vllm.enforce_eager": bool(enforce_eager)})
  out.update(layout["overrides"])
  return out


def build_run_config(overrides: Mapping[str, Any]):
  """``base_config()`` with ``overrides`` applied, validated (what :func:`run_pipeline` trains).

  Raises:
    jaxrl_llm.errors.ConfigError: listing every field that fails.
  """
  from jaxrl_llm import configuration  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.experiments import apply_overrides  # pylint: disable=import-outside-toplevel
  return configuration.validate(apply_overrides(configuration.base_config(), overrides))


def tokenizer_gaps(folder: str, task_name: str = "addition", task_kwargs: Optional[Mapping[str, Any]] = None
                   ) -> list[str]:
  """The characters of the task's prompts and answers that the tokenizer in ``folder`` has no token for."""
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.tasks import get_task  # pylint: disable=import-outside-toplevel
  tokenizer = bridge.Tokenizer.from_folder(folder)
  alphabet = get_task(task_name, **dict(task_kwargs or {})).alphabet
  if not tokenizer.is_char_level:
    return [ch for ch in alphabet if not tokenizer.encode(ch, add_special_tokens=False)]
  return [ch for ch in alphabet if tokenizer.token_to_id(ch) is None]


# ----------------------------------------------------------- pipeline: reading a run
def _finite(value: Any) -> Optional[float]:
  """A float, or None for a missing / non-finite value (metrics.jsonl writes NaN as "nan")."""
  try:
    out = float(value)
  except (TypeError, ValueError):
    return None
  return out if math.isfinite(out) else None


def _values(records: Sequence[Mapping[str, Any]], key: str) -> list[float]:
  return [v for v in (_finite(r.get(key)) for r in records) if v is not None]


def _mean(values: Sequence[float]) -> Optional[float]:
  return float(np.mean(values)) if values else None


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
  return num / den if num is not None and den else None


MISMATCH_KEYS = ("abs_log_ratio_mean", "kl_k3", "out_of_bounds", "ess_rate", "ratio_max", "tokens", "source")
POOL_KEYS = ("dispatched", "delivered", "lost_items", "restarts", "duplicates", "rejected", "rejected_rows",
             "failures")


def summarise_run(run_dir: str) -> dict[str, Any]:
  """The report figures of one RL run, from its ``metrics.jsonl``.

  RL step records are those with ``time/step_s``. Weight sync: ``pool/publish_s`` and
  ``pool/publish_mb`` are the learner-side put of :class:`~jaxrl_llm.rollout.SamplerPool`
  (host copy, ``ray.put``, the ``update_weights`` calls sent; it does not wait for the
  actors), averaged over the publishes before the record's step (the last record's are
  taken); ``time/publish_s`` is the job's whole publish stage per step. The actor-side
  load (``gpu_check/actor_load_s`` / ``_mb``) is only there when gpu_check's probe wrote it.
  Mismatch: the job's consistency check (``consistency/*``: learner log pi against the
  sampler's log mu on fresh tokens, or on stale rows re-scored by their own version).

  Args:
    run_dir: the run folder.

  Returns:
    ``{"steps_done", "steps": [per step], "reward_mean": [...], "step_s": [...],
    "weight_sync": {...}, "mismatch": {...}, "pool": {...}}``; figures that were not
    measured are None.

  Raises:
    FileNotFoundError: when the run folder has no metrics.jsonl.
  """
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"summarise_run: {path} does not exist (the run wrote no metrics)")
  records = writers.read_jsonl(path)
  rl = sorted((r for r in records if "time/step_s" in r), key=lambda r: r.get("step", 0))
  steps = [{"step": int(r.get("step", i + 1)), "reward_mean": _finite(r.get("reward/mean")),
            "step_s": _finite(r.get("time/step_s")), "publish_s": _finite(r.get("time/publish_s")),
            "sample_s": _finite(r.get("time/sample_s")), "lag_max": _finite(r.get("data/lag_max")),
            "mismatch": {k: _finite(r.get(f"consistency/{k}")) for k in MISMATCH_KEYS},
            "actor_load_s": _finite(r.get("gpu_check/actor_load_s"))} for i, r in enumerate(rl)]
  last = rl[-1] if rl else {}
  publish_mb = _finite(last.get("pool/publish_mb")) or None  # 0: no publish counted yet
  put_s = _finite(last.get("pool/publish_s")) if publish_mb else None
  load_s, load_mb = _mean(_values(rl, "gpu_check/actor_load_s")), _mean(_values(rl, "gpu_check/actor_load_mb"))
  weight_sync = {
      "publish_mb": publish_mb, "learner_put_s": put_s, "learner_put_s_per_mb": _ratio(put_s, publish_mb),
      "learner_publish_stage_s_mean": _mean(_values(rl, "time/publish_s")),
      "actor_load_s": load_s, "actor_load_mb": load_mb, "actor_load_s_per_mb": _ratio(load_s, load_mb),
      "actor_load_source": ("gpu_check's probe: VllmSampler.last_publish.seconds in each actor (transport send + "
                            "engine load); the job itself records no actor-side load time" if load_s is not None
                            else "not measured: nothing in metrics.jsonl records the actor-side load (pool/publish_s "
                            "is the learner-side put only), and this sampler reports no publish statistics"),
  }
  abs_mean = _values(rl, "consistency/abs_log_ratio_mean")
  mismatch = {"steps_measured": len(abs_mean), "abs_log_ratio_mean_mean": _mean(abs_mean),
              "abs_log_ratio_mean_max": max(abs_mean) if abs_mean else None,
              "kl_k3_max": max(_values(rl, "consistency/kl_k3"), default=None),
              "out_of_bounds_max": max(_values(rl, "consistency/out_of_bounds"), default=None),
              "ess_rate_min": min(_values(rl, "consistency/ess_rate"), default=None),
              "tokens": float(sum(_values(rl, "consistency/tokens")))}
  pool = {k: (max(v) if (v := _values(rl, f"pool/{k}")) else None) for k in POOL_KEYS}
  return {"steps_done": len(rl), "steps": steps, "reward_mean": [s["reward_mean"] for s in steps],
          "step_s": [s["step_s"] for s in steps], "weight_sync": weight_sync, "mismatch": mismatch, "pool": pool}


def placement_problems(layout: Mapping[str, Any], placement: Sequence[Mapping[str, Any]]) -> list[str]:
  """Where the actors' placement (``describe()`` of each) differs from the layout's plan; [] when it does not."""
  problems = []
  if len(placement) != layout["num_samplers"]:
    problems.append(f"{len(placement)} actors described, the layout has {layout['num_samplers']}")
  want_ids = 0 if layout["sampler_kind"] == "jax" else max(1, int(math.ceil(layout["actor_gpus"])))
  taken: dict[str, str] = {}
  for actor in placement:
    who, ids = actor.get("sampler_id"), [str(g) for g in actor.get("gpu_ids") or []]
    visible = [g for g in (actor.get("cuda_visible_devices") or "").split(",") if g.strip()]
    if len(ids) != want_ids:
      problems.append(f"{who}: GPUs {ids}, the layout gives each actor {want_ids}")
    if sorted(visible) != sorted(ids):
      problems.append(f"{who}: CUDA_VISIBLE_DEVICES={actor.get('cuda_visible_devices')!r}, Ray assigned {ids}")
    if layout["sampler_kind"] == "vllm":
      kwargs = actor.get("engine_kwargs") or {}
      if kwargs.get("tensor_parallel_size") != layout["tensor_parallel_size"]:
        problems.append(f"{who}: engine tensor_parallel_size={kwargs.get('tensor_parallel_size')}, the layout has "
                        f"{layout['tensor_parallel_size']}")
      if actor.get("weight_transport") != layout["transport"]:
        problems.append(f"{who}: weight transport {actor.get('weight_transport')!r}, the layout has "
                        f"{layout['transport']!r}")
    if not layout["shared_gpu"]:
      for g in ids:
        if g in taken:
          problems.append(f"{who} and {taken[g]} both hold GPU {g}")
        taken[g] = who
  return problems
