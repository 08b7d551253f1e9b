"""The first script a GPU machine runs: a vLLM engine check, then PipelineRL training on the GPUs; one JSON line.

  python -m launch.gpu_check                                   # both parts on a tiny random Qwen2
  python -m launch.gpu_check --parts=engine --transports=object_store,ipc
  python -m launch.gpu_check --parts=pipeline --pipeline_transports=object_store,ipc --pipeline_steps=4
  python -m launch.gpu_check --hf_checkpoint=/ckpt/Qwen2.5-0.5B-Instruct --vllm_dtype=bfloat16
  python -m launch.gpu_check --parts=pipeline --sampler_kind=jax   # test: JAX sampler actors, no GPU

Both parts use one checkpoint: ``--hf_checkpoint``, or a tiny random Qwen2 (2 layers, hidden
256, vocabulary 128) built with transformers, with a char tokenizer that has a token for each
of the 128 ids (so whatever the random model samples decodes) and covers the addition task's
characters, in ``--workdir`` (a temp dir by default; the pipeline runs go to
``<workdir>/pipeline/<layout name>``). The learner runs JAX on the CPU unless
``--jax_platforms`` says otherwise.

Part ``pipeline`` (run first; each of its runs is a process of its own, so nothing of it is
left on a GPU when the engine part starts):

  1. the GPUs sampler actors may use: this machine's GPUs the learner's JAX does not use
     (``rollout.local_gpus='auto'``), or ``--num_gpus``;
  2. the layouts (:func:`launch.gpu_layouts.pipeline_layouts`), one per tensor-parallel size P in (1, 2) and
     weight transport of ``--pipeline_transports``; an actor holds P GPUs, P + 1 with
     ``nccl``. Two actors; at P = 1 with one GPU both share it (``rollout.actor_gpus=0.5``,
     ``sampler.vllm.gpu_memory_utilization`` <= 0.4 each); one actor when only one fits;
     a layout no actor fits is reported ``"skipped: needs N GPUs, M visible"``;
  3. each layout that fits: the RL job (``jaxrl_llm.jobs.RLJob``, ``gpu_layouts.run_overrides``) with
     ``rollout.mode='pipeline'``, ``sampler.kind='vllm'``, ``rollout.max_lag=1``, started from
     the checkpoint (``init.hf_checkpoint``) on the task ``addition`` (with partial credit),
     ``--pipeline_sft_steps`` SFT steps (so rewards differ within a group and every RL update
     moves the weights), then ``--pipeline_steps`` RL steps, in a spawned process (killed
     after ``--pipeline_timeout_s``) with its own local Ray cluster on loopback. A probe hook
     (``gpu_pipeline.ActorProbe``) records each actor's placement (``SamplerPool.describe()``: GPU
     ids, ``CUDA_VISIBLE_DEVICES``, the exact ``vllm.LLM`` arguments) and, after every step,
     the last weight load of each actor's engine (``VllmSampler.last_publish``, read in the
     actor by ``SamplerWorker.weight_report``; nothing in the job records the actor side),
     written to metrics.jsonl as ``gpu_check/actor_load_s`` and ``gpu_check/actor_load_mb``.
     After the last step each actor must hold the learner's final version and its weights
     (per-parameter checksums);
  4. the run's metrics.jsonl is summarised (``gpu_layouts.summarise_run``): reward mean and step
     seconds per step, the learner-side weight put (``pool/publish_s``, ``pool/publish_mb``)
     and the actor-side load, each per MB, the sampler-vs-learner mismatch measured by the
     job's consistency check (``consistency/abs_log_ratio_mean``, ``kl_k3``,
     ``out_of_bounds``, ``ess_rate``), the pool's lost, restarted, rejected and failed work.
     A run passes when its ``checks`` hold: every step ran, no work was lost, rejected or
     failed, the mismatch was measured and is within ``--max_mean_abs_delta``, the actors
     sit where the layout put them, the learner's weights changed during RL, and every
     actor ended on the learner's final version and weights.

Part ``engine`` (one in-process ``VllmSampler``):

  1. the learner's side with jaxrl_llm: params, tokenizer, ModelConfig, fingerprint;
  2. ``VllmSampler`` (fingerprint check, engine with processed log-probabilities
     and the weight-sync worker extension); sample ``num_samples`` responses per prompt;
  3. learner log-probabilities of those tokens (``models.sequence_logprobs`` at
     the sampling temperature): mismatch ``delta = log pi_learner - log mu_vllm``;
  4. one GRPO update with jaxrl_llm's RL step; publish the new weights
     (``update_weights``, then each extra transport of ``--transports``); the workers'
     parameter checksums must equal the learner's;
  5. sample again; mismatch against the new params (and against the old ones,
     which must be larger: the update reached the engine); greedy agreement of
     vLLM with the built-in JAX sampler before and after;
  6. multi-turn episodes through vLLM (``sampling.session.ReplaySession``: each turn
     re-submits the history, with an observation appended between turns): the behaviour
     log-probabilities of the model's tokens, after observations too, against the
     learner's over the whole rows (``multi_turn_episodes``).

Output: one JSON line on stdout (also written to ``--output_json`` when set); everything
else goes to stderr. Keys: ``ok`` (every selected part passed) and ``parts``; the engine
part's ``checks``, ``gpu``, ``vllm_version``, ``checkpoint``, ``engine_dtype``,
``learner_dtype``, ``jax_backend``, ``engine_start_s``, ``sampling``, ``mismatch_before``,
``mismatch_after``, ``mismatch_after_vs_old_params``, ``weight_sync``,
``weights_checksum_max_rel_err``, ``update_param_abs_change``, ``update_metrics``,
``greedy_agreement_before``, ``greedy_agreement_after``, ``multi_turn_episodes``; the pipeline part's
``pipeline_ok``, ``pipeline_error`` (only when every layout was skipped), ``pipeline_gpus``
(``ids``, ``count``), ``pipeline_settings`` and ``pipeline``: one entry per layout with
``name``, ``sampler_kind``, ``transport``, ``tensor_parallel_size``, ``num_samplers``,
``actor_gpus``, ``shared_gpu``, ``gpus_needed``, ``gpu_memory_utilization``, ``overrides``,
``skipped`` (the reason, or null), ``ok`` (null when skipped), ``error`` (the traceback of
a failed run), ``seconds``, ``run_dir``, ``checks``, ``steps_done``, ``steps`` (per step:
``step``, ``reward_mean``, ``step_s``, ``publish_s``, ``sample_s``, ``lag_max``,
``mismatch``, ``actor_load_s``), ``reward_mean`` and ``step_s`` (lists), ``weight_sync``
(``publish_mb``, ``learner_put_s``, ``learner_put_s_per_mb``,
``learner_publish_stage_s_mean``, ``actor_load_s``, ``actor_load_mb``,
``actor_load_s_per_mb``, ``actor_load_source``), ``mismatch`` (``steps_measured``,
``abs_log_ratio_mean_mean``, ``abs_log_ratio_mean_max``, ``kl_k3_max``,
``out_of_bounds_max``, ``ess_rate_min``, ``tokens``), ``pool``, ``placement`` (each
actor's ``describe()``), ``placement_problems`` (when there are), ``actor_weights`` (each
actor's final version, last publish and checksum error), ``learner_version``,
``learner_params_changed`` and ``probe_errors``. Non-finite figures are null.

Exit status 0 when every check passed, 1 when one failed (a pipeline run that failed or
every layout skipped included), 2 when there is no GPU or no vLLM (with a message saying
which; not with ``--sampler_kind=jax``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from typing import Any, Mapping

import numpy as np
from absl import app, flags

from launch.gpu_engine import build_tiny_checkpoint, episode_mismatch, greedy_agreement, learner_mismatch, rl_update
from launch.gpu_layouts import TRANSPORTS, pipeline_layouts
from launch.gpu_pipeline import run_pipeline, run_pipeline_isolated, sampler_gpu_ids

_PARTS = flags.DEFINE_list("parts", ["engine", "pipeline"], "Parts to run: engine, pipeline (see the docstring).")
_CKPT = flags.DEFINE_string("hf_checkpoint", None, "HF folder to run (default: build a tiny random Qwen2).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the tiny checkpoint and the pipeline runs are written "
                               "(default: a temp dir).")
_VLLM_DTYPE = flags.DEFINE_enum("vllm_dtype", "bfloat16", ["bfloat16", "float16", "float32"],
                                "Engine dtype of the engine part.")
_TRANSPORTS = flags.DEFINE_list("transports", ["object_store"],
                                "Engine part: weight transports to time; the first one is the sampler's own.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Engine part: prompts per generate call.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 4, "Engine part: samples per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Engine part: response length limit.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Engine part: sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Engine part: top-k (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Engine part: top-p (1 = off).")
_LR = flags.DEFINE_float("lr", 3e-3, "Learning rate of the learner updates (both parts).")
_GPU_MEM = flags.DEFINE_float("gpu_memory_utilization", 0.3, "Engine part: vLLM's share of GPU memory.")
_EAGER = flags.DEFINE_bool("enforce_eager", True, "No CUDA graphs (faster start; both parts).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the checkpoint, prompts and sampling.")
_JAX_PLATFORMS = flags.DEFINE_string("jax_platforms", "cpu", "JAX_PLATFORMS for the learner ('' = JAX's choice).")
_MAX_MEAN_ABS = flags.DEFINE_float("max_mean_abs_delta", 0.05,
                                   "Fail when mean |delta| after the update exceeds this (bf16 engines need ~1e-2); "
                                   "the pipeline part's bound on consistency/abs_log_ratio_mean too.")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON line here.")
_P_TRANSPORTS = flags.DEFINE_list("pipeline_transports", ["object_store", "ipc", "nccl"],
                                  "Pipeline part: rollout.weight_transport values to run.")
_P_TP = flags.DEFINE_list("pipeline_tp", ["1", "2"], "Pipeline part: sampler.vllm.tensor_parallel_size values.")
_P_STEPS = flags.DEFINE_integer("pipeline_steps", 3, "Pipeline part: RL steps per run.")
_P_PROMPTS = flags.DEFINE_integer("pipeline_prompts_per_step", 4, "Pipeline part: rl.prompts_per_step.")
_P_SAMPLES = flags.DEFINE_integer("pipeline_samples_per_prompt", 4, "Pipeline part: rl.samples_per_prompt.")
_P_SFT = flags.DEFINE_integer("pipeline_sft_steps", 4, "Pipeline part: sft.steps before RL (so that rewards differ "
                               "within groups and every update moves the weights the samplers must receive).")
_P_MAX_LAG = flags.DEFINE_integer("pipeline_max_lag", 1, "Pipeline part: rollout.max_lag.")
_P_DTYPE = flags.DEFINE_enum("pipeline_vllm_dtype", "auto", ["auto", "bfloat16", "float16", "float32"],
                             "Pipeline part: sampler.vllm.dtype ('auto': the learner's float32).")
_P_GPU_MEM = flags.DEFINE_float("pipeline_gpu_memory_utilization", 0.4,
                                "Pipeline part: sampler.vllm.gpu_memory_utilization (at most 0.4 when two engines "
                                "share a GPU).")
_P_TIMEOUT = flags.DEFINE_integer("pipeline_timeout_s", 600, "Pipeline part: a run's process is killed after this.")
_P_ISOLATE = flags.DEFINE_bool("pipeline_isolate", True, "Pipeline part: each run in a spawned process of its own.")
_NUM_GPUS = flags.DEFINE_integer("num_gpus", -1, "Pipeline part: GPUs to plan for (-1: the sampler GPUs found).")
_SAMPLER_KIND = flags.DEFINE_enum("sampler_kind", "vllm", ["vllm", "jax"],
                                  "Pipeline part's sampler; 'jax' (testing, no GPU): JAX sampler actors on the CPU "
                                  "(needs --parts=pipeline).")

PARTS = ("engine", "pipeline")


def _preflight() -> None:
  """Exits with status 2 and a message when there is no GPU or no vLLM (creates no CUDA context)."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    _fail("torch is not installed; install the [vllm] extra on a CUDA machine: pip install 'jaxrl_llm[vllm]'")
  if not torch.cuda.is_available():
    _fail("no CUDA GPU is visible (torch.cuda.is_available() is False); run this on a GPU machine")
  try:
    import vllm  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError as e:
    _fail(f"vLLM is not importable ({e}); install the [vllm] extra: pip install 'jaxrl_llm[vllm]'")


def _fail(message: str) -> None:
  print(f"gpu_check: {message}", file=sys.stderr)
  sys.exit(2)


def run_pipeline_part(checkpoint: str, workdir: str) -> dict[str, Any]:
  """The pipeline part from the flags: the layouts for the GPUs found, each run (see the module docstring)."""
  kind = _SAMPLER_KIND.value
  ids = sampler_gpu_ids() if kind == "vllm" else []
  count = _NUM_GPUS.value if _NUM_GPUS.value >= 0 else len(ids)
  try:
    tps = [int(p) for p in _P_TP.value]
  except ValueError as e:
    raise app.UsageError(f"--pipeline_tp={_P_TP.value}: expected integers ({e})") from None
  layouts = pipeline_layouts(count, _P_TRANSPORTS.value, sampler_kind=kind, tensor_parallel_sizes=tps,
                             gpu_memory_utilization=_P_GPU_MEM.value)
  settings = dict(checkpoint=checkpoint, workdir=os.path.join(workdir, "pipeline"), steps=_P_STEPS.value,
                  prompts_per_step=_P_PROMPTS.value, samples_per_prompt=_P_SAMPLES.value, max_lag=_P_MAX_LAG.value,
                  lr=_LR.value, sft_steps=_P_SFT.value, vllm_dtype=_P_DTYPE.value, enforce_eager=_EAGER.value,
                  seed=_SEED.value, max_mean_abs=_MAX_MEAN_ABS.value)
  entries = []
  for layout in layouts:
    print(f"gpu_check: pipeline run {layout['name']}: {layout['skipped'] or 'starting'}", file=sys.stderr,
          flush=True)
    if _P_ISOLATE.value:
      entry = run_pipeline_isolated(layout, _P_TIMEOUT.value, **settings)
    else:
      entry = run_pipeline(layout, **settings)
    if entry["ok"] is not None:
      print(f"gpu_check: pipeline run {layout['name']}: {'ok' if entry['ok'] else 'FAILED'} in "
            f"{entry.get('seconds', 0):.0f} s", file=sys.stderr, flush=True)
    entries.append(entry)
  ran = [e for e in entries if e["ok"] is not None]
  out = {"pipeline": entries, "pipeline_gpus": {"ids": ids, "count": count},
         "pipeline_settings": {k: v for k, v in settings.items() if k != "checkpoint"},
         "pipeline_ok": bool(ran) and all(e["ok"] for e in ran)}
  if not ran:
    out["pipeline_error"] = f"every layout was skipped ({count} GPUs for sampler actors)"
  return out


def run_check(folder: str) -> dict[str, Any]:
  """Runs the engine part (see the module docstring) on the HF checkpoint ``folder`` and returns its report."""
  import jax  # pylint: disable=import-outside-toplevel
  import vllm  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.bridge import weight_transport as wt  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling import JaxSampler, SamplerConfig  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling.vllm_sampler import VllmEngineConfig, VllmSampler  # pylint: disable=import-outside-toplevel

  tokenizer = bridge.Tokenizer.from_folder(folder)
  model_config = bridge.config_from_hf(folder, pad_token_id=tokenizer.pad_id, param_dtype="float32",
                                       dtype="float32")
  params = bridge.load_hf_params(folder, model_config)
  fingerprint = bridge.make_fingerprint(tokenizer, model_config)
  sampling = SamplerConfig(max_new_tokens=_MAX_NEW.value, temperature=_TEMPERATURE.value, top_k=_TOP_K.value,
                           top_p=_TOP_P.value, num_samples=_NUM_SAMPLES.value, seed=_SEED.value,
                           max_length=min(model_config.max_position_embeddings, 64 + _MAX_NEW.value))
  transports = list(_TRANSPORTS.value)
  engine = VllmEngineConfig(dtype=_VLLM_DTYPE.value, gpu_memory_utilization=_GPU_MEM.value,
                            enforce_eager=_EAGER.value, skip_tokenizer_init=True, seed=_SEED.value,
                            transport=transports[0])
  t0 = time.perf_counter()
  sampler = VllmSampler(model_config, folder, fingerprint, sampling, engine=engine)
  engine_start_s = time.perf_counter() - t0
  import torch  # pylint: disable=import-outside-toplevel
  gpu = torch.cuda.get_device_name(0)  # after the engine started: no CUDA context before vLLM forks
  rng = np.random.default_rng(_SEED.value)
  low = 3 if tokenizer.vocab_size > 3 else 0
  prompts = [rng.integers(low, tokenizer.vocab_size, size=int(rng.integers(4, 17))).tolist()
             for _ in range(_NUM_PROMPTS.value)]
  reference = JaxSampler(model_config, params, sampling)

  before = sampler.generate(prompts)
  greedy_before = greedy_agreement(sampler.generate(prompts, greedy=True, num_samples=1).response_tokens,
                                   reference.generate(prompts, greedy=True, num_samples=1).response_tokens)
  mismatch_before = learner_mismatch(params, model_config, before, sampling.temperature)

  new_params, update_metrics = rl_update(params, model_config, before, sampling.temperature,
                                          sampling.num_samples, _LR.value, _SEED.value)
  change = float(sum(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum()
                     for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params))))
  version = 1
  sampler.update_weights(new_params, version)
  sync = {transports[0]: sampler.last_publish.to_dict()}
  for kind in transports[1:]:
    extra = VllmEngineConfig(dtype=_VLLM_DTYPE.value, transport=kind).make_transport(model_config)
    if kind == "nccl":
      extra.connect(sampler.collective_rpc, engine.tensor_parallel_size)
    sync[kind] = extra.publish(new_params, model_config, sampler.collective_rpc).to_dict()
    extra.close()
    version += 1
    sampler.commit_weights(version)

  reports = sampler.collective_rpc("report_weight_checksum")
  expected = wt.expected_checksums(new_params, model_config, engine.tensor_parallel_size, dtype=_VLLM_DTYPE.value)
  checksum_err = 0.0
  for report in reports:
    for name, value in expected[report["rank"]].items():
      got = report["sums"].get(name)
      err = float("inf") if got is None else abs(got - value) / max(abs(value), 1.0)
      checksum_err = max(checksum_err, err)

  after = sampler.generate(prompts)
  mismatch_after = learner_mismatch(new_params, model_config, after, sampling.temperature)
  mismatch_stale = learner_mismatch(params, model_config, after, sampling.temperature)
  reference.update_weights(new_params, version)
  greedy_after = greedy_agreement(sampler.generate(prompts, greedy=True, num_samples=1).response_tokens,
                                  reference.generate(prompts, greedy=True, num_samples=1).response_tokens)
  episodes = episode_mismatch(sampler, new_params, model_config, tokenizer, prompts[:8], sampling.temperature,
                              seed=_SEED.value)
  checks = {
      "episodes_observations_appended": episodes["observation_tokens"] > 0,
      "episodes_mean_abs_delta_within_bound": episodes["mismatch"]["mean_abs"] <= _MAX_MEAN_ABS.value,
      "weights_reached_engine": checksum_err < 1e-4,
      "update_changed_params": change > 0,
      "after_closer_to_new_than_old_params": mismatch_after["mean_abs"] < mismatch_stale["mean_abs"],
      "mean_abs_delta_within_bound": mismatch_after["mean_abs"] <= _MAX_MEAN_ABS.value,
      "policy_version": sampler.policy_version == version and after.policy_version == version,
  }
  sampler.close()
  return {
      "ok": all(checks.values()), "checks": checks, "gpu": gpu, "vllm_version": vllm.__version__,
      "checkpoint": folder, "engine_dtype": _VLLM_DTYPE.value, "learner_dtype": model_config.param_dtype,
      "jax_backend": jax.default_backend(), "engine_start_s": engine_start_s,
      "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                   "num_prompts": len(prompts), "num_samples": sampling.num_samples,
                   "max_new_tokens": sampling.max_new_tokens},
      "mismatch_before": mismatch_before, "mismatch_after": mismatch_after,
      "mismatch_after_vs_old_params": mismatch_stale, "weight_sync": sync,
      "weights_checksum_max_rel_err": checksum_err, "update_param_abs_change": change,
      "update_metrics": update_metrics, "greedy_agreement_before": greedy_before,
      "greedy_agreement_after": greedy_after, "multi_turn_episodes": episodes,
  }


def run_all() -> dict[str, Any]:
  """Runs the parts the flags select (see the module docstring) and returns the report."""
  parts = list(dict.fromkeys(_PARTS.value))
  if not parts or any(p not in PARTS for p in parts):
    raise app.UsageError(f"--parts={_PARTS.value}: expected a non-empty list of {', '.join(PARTS)}")
  for name, value in (("transports", _TRANSPORTS.value), ("pipeline_transports", _P_TRANSPORTS.value)):
    if not value or any(t not in TRANSPORTS for t in value):
      raise app.UsageError(f"--{name}={value}: expected a non-empty list of {', '.join(TRANSPORTS)}")
  if _SAMPLER_KIND.value == "jax" and "engine" in parts:
    raise app.UsageError("--sampler_kind=jax runs the pipeline part only (the engine part is vLLM's): pass "
                         "--parts=pipeline")
  if _P_STEPS.value < 1:
    raise app.UsageError(f"--pipeline_steps={_P_STEPS.value}: expected >= 1")
  if _JAX_PLATFORMS.value:
    os.environ["JAX_PLATFORMS"] = _JAX_PLATFORMS.value
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to vLLM if JAX sees it
  if "engine" in parts or _SAMPLER_KIND.value == "vllm":
    _preflight()
  workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="gpu_check_")
  folder = _CKPT.value or build_tiny_checkpoint(os.path.join(workdir, "tiny_qwen2"), _SEED.value)
  report: dict[str, Any] = {"parts": parts}
  oks = []
  if "pipeline" in parts:  # first: its runs are processes that are gone when the engine part starts
    report.update(run_pipeline_part(folder, workdir))
    oks.append(report["pipeline_ok"])
  if "engine" in parts:
    report.update(run_check(folder))
    oks.append(report["ok"])
  report["ok"] = all(oks)
  return report


def failures(report: Mapping[str, Any]) -> list[str]:
  """What failed in a report: the engine part's failed checks, the pipeline runs that failed."""
  out = [k for k, v in (report.get("checks") or {}).items() if not v]
  for entry in report.get("pipeline") or []:
    if entry.get("ok") is False:
      failed = [k for k, v in (entry.get("checks") or {}).items() if not v]
      out.append(f"pipeline {entry['name']}" + (f" ({', '.join(failed)})" if failed else " (error)"))
  if report.get("pipeline_error"):
    out.append(report["pipeline_error"])
  return out


def main(argv):
  del argv
  report = run_all()
  line = json.dumps(_json_safe(report), sort_keys=True)
  print(line, flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  if not report["ok"]:
    print(f"gpu_check: FAILED {failures(report)}", file=sys.stderr)
    sys.exit(1)


def _json_safe(value: Any) -> Any:
  """``value`` with non-finite floats as None (the line stays strict JSON) and numpy scalars as Python ones."""
  if isinstance(value, Mapping):
    return {str(k): _json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_json_safe(v) for v in value]
  if isinstance(value, (np.floating, float)):
    return float(value) if math.isfinite(value) else None
  if isinstance(value, np.integer):
    return int(value)
  if isinstance(value, np.bool_):
    return bool(value)
  return value


if __name__ == "__main__":
  app.run(main)
