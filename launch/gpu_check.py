"""vLLM smoke test on a GPU: generate, update from the learner, regenerate, report one JSON line.

  python -m launch.gpu_check                                   # tiny random Qwen2, object store
  python -m launch.gpu_check --transports=object_store,ipc     # also time CUDA IPC
  python -m launch.gpu_check --hf_checkpoint=/ckpt/Qwen2.5-0.5B-Instruct --vllm_dtype=bfloat16

Steps:
  1. a checkpoint: ``--hf_checkpoint``, or a tiny random Qwen2 built with
     transformers (plus a char tokenizer) in ``--workdir``;
  2. the learner's side with jaxrl_llm (JAX on the CPU unless
     ``--jax_platforms`` says otherwise): params, tokenizer, ModelConfig, fingerprint;
  3. ``VllmSampler`` (fingerprint check, engine with processed log-probabilities
     and the weight-sync worker extension); sample ``num_samples`` responses per prompt;
  4. learner log-probabilities of those tokens (``models.sequence_logprobs`` at
     the sampling temperature): mismatch ``delta = log pi_learner - log mu_vllm``;
  5. one GRPO update with jaxrl_llm's RL step; publish the new weights
     (``update_weights``, then each extra transport); the workers' parameter
     checksums must equal the learner's;
  6. sample again; mismatch against the new params (and against the old ones,
     which must be larger: the update reached the engine); greedy agreement of
     vLLM with the built-in JAX sampler before and after.

Output: one JSON line on stdout (also written to ``--output_json`` when set).
Exit status 0 when every check passed, 1 when one failed, 2 when there is no
GPU or no vLLM (with a message saying which).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Sequence

import numpy as np
from absl import app, flags

_CKPT = flags.DEFINE_string("hf_checkpoint", None, "HF folder to run (default: build a tiny random Qwen2).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Where the tiny checkpoint is written (default: a temp dir).")
_VLLM_DTYPE = flags.DEFINE_enum("vllm_dtype", "bfloat16", ["bfloat16", "float16", "float32"], "Engine dtype.")
_TRANSPORTS = flags.DEFINE_list("transports", ["object_store"],
                                "Weight transports to time; the first one is the sampler's own.")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "Prompts per generate call.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 4, "Samples per prompt.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "Response length limit.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Sampling temperature.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Top-k (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Top-p (1 = off).")
_LR = flags.DEFINE_float("lr", 3e-3, "Learning rate of the one learner update.")
_GPU_MEM = flags.DEFINE_float("gpu_memory_utilization", 0.3, "vLLM's share of GPU memory.")
_EAGER = flags.DEFINE_bool("enforce_eager", True, "No CUDA graphs (faster start).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the checkpoint, prompts and sampling.")
_JAX_PLATFORMS = flags.DEFINE_string("jax_platforms", "cpu", "JAX_PLATFORMS for the learner ('' = JAX's choice).")
_MAX_MEAN_ABS = flags.DEFINE_float("max_mean_abs_delta", 0.05,
                                   "Fail when mean |delta| after the update exceeds this (bf16 engines need ~1e-2).")
_OUTPUT = flags.DEFINE_string("output_json", None, "Also write the JSON line here.")

RATIO_BOUNDS = (0.8, 1.25)


# ------------------------------------------------------------------ the maths
def logprob_mismatch(learner_logp_bt: np.ndarray, behaviour_logp_bt: np.ndarray, mask_bt: np.ndarray,
                     bounds: tuple[float, float] = RATIO_BOUNDS) -> dict[str, float]:
  """Sampler-vs-learner disagreement on the sampled tokens.

  ``delta = log pi_learner(y_t) - log mu_sampler(y_t)`` over ``mask_bt``;
  the importance ratio is ``exp(delta)``.

  Args:
    learner_logp_bt: float [B, T] learner log-probabilities.
    behaviour_logp_bt: float [B, T] the sampler's recorded log-probabilities.
    mask_bt: bool [B, T] sampled tokens.
    bounds: ratio interval counted as "inside" (PipelineRL / ScaleRL use [0.8, 1.25]).

  Returns:
    ``{"tokens", "mean_abs", "max_abs", "mean", "outside_share"}``.
  """
  mask = np.asarray(mask_bt, bool)
  if mask.shape != np.shape(learner_logp_bt) or mask.shape != np.shape(behaviour_logp_bt):
    raise ValueError(f"logprob_mismatch: shapes {np.shape(learner_logp_bt)}, {np.shape(behaviour_logp_bt)} and "
                     f"mask {mask.shape} differ")
  if not mask.any():
    raise ValueError("logprob_mismatch: the mask selects no token")
  delta = (np.asarray(learner_logp_bt, np.float64) - np.asarray(behaviour_logp_bt, np.float64))[mask]
  ratio = np.exp(delta)
  outside = (ratio < bounds[0]) | (ratio > bounds[1])
  return {"tokens": int(mask.sum()), "mean_abs": float(np.abs(delta).mean()), "max_abs": float(np.abs(delta).max()),
          "mean": float(delta.mean()), "outside_share": float(outside.mean())}


def greedy_agreement(rows_a: Sequence[Sequence[int]], rows_b: Sequence[Sequence[int]]) -> dict[str, float]:
  """How far two greedy decoders agree, row by row.

  Returns:
    ``{"rows_identical": share of rows with equal responses,
    "prefix_share": mean over rows of (common prefix length / longer length)}``.
  """
  if len(rows_a) != len(rows_b) or not rows_a:
    raise ValueError(f"greedy_agreement: {len(rows_a)} vs {len(rows_b)} rows")
  identical, prefix = [], []
  for a, b in zip(rows_a, rows_b):
    a, b = list(a), list(b)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
      common += 1
    identical.append(a == b)
    prefix.append(common / max(len(a), len(b), 1))
  return {"rows_identical": float(np.mean(identical)), "prefix_share": float(np.mean(prefix))}


# --------------------------------------------------------------------- steps
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


def build_tiny_checkpoint(folder: str, seed: int) -> str:
  """A random Qwen2 (2 layers, hidden 256, head_dim 64) + char tokenizer, saved with transformers."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  tokenizer = bridge.build_char_tokenizer("0123456789+-*= abcdefghijklmnopqrstuvwxyz")
  config = transformers.Qwen2Config(
      vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
      initializer_range=0.1, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
      pad_token_id=tokenizer.pad_id)
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config).float().eval()
  model.save_pretrained(folder)
  tokenizer.save(folder)
  return folder


def _learner_logp(params, model_config, result, temperature):
  from jaxrl_llm import models  # pylint: disable=import-outside-toplevel
  traj = result.trajectory
  mask = np.asarray(traj.prompt_mask_bt) | np.asarray(traj.response_mask_bt)
  return np.asarray(models.sequence_logprobs(params, model_config, traj.tokens_bt, mask, temperature))


def _mismatch(params, model_config, result, temperature) -> dict[str, float]:
  traj = result.trajectory
  return logprob_mismatch(_learner_logp(params, model_config, result, temperature), traj.behaviour_logp_bt,
                          traj.response_mask_bt)


def _rl_update(params, model_config, result, temperature, num_samples, lr, seed):
  """One GRPO step of jaxrl_llm's learner on ``result`` (reward: share of even token ids)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import advantages as A, objectives as O  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.learner import optim, rl_step, state as state_lib  # pylint: disable=import-outside-toplevel
  traj = result.trajectory
  rewards = np.array([np.mean([t % 2 == 0 for t in r]) for r in result.response_tokens], np.float32)
  response = jnp.asarray(traj.response_mask_bt)
  adv = A.sequence_to_tokens(A.grpo_advantages(rewards, num_samples).advantages_b, response)
  zeros = jnp.zeros(response.shape, jnp.float32)
  batch = rl_step.RLBatch(tokens_bt=jnp.asarray(traj.tokens_bt),
                          seq_mask_bt=jnp.asarray(traj.prompt_mask_bt) | response, response_mask_bt=response,
                          behaviour_logp_bt=jnp.asarray(traj.behaviour_logp_bt), advantages_bt=adv,
                          ref_logp_bt=zeros, lag_bt=jnp.zeros(response.shape, jnp.int32), old_values_bt=zeros,
                          returns_bt=zeros)
  objective = O.recipe("grpo", kl_coef=0.0)
  optimizer = optim.make_optimizer(lr)
  step = rl_step.make_rl_step(rl_step.RLStepSpec(model=model_config, temperature=temperature,
                                                 group_size=num_samples), objective, optimizer)
  train = state_lib.create_train_state(params, optimizer, seed)
  train, _, metrics = step(train, objective.init(None), batch)
  return train.params, {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


def run_check() -> dict[str, Any]:
  """Runs the whole check (see the module docstring) and returns the report."""
  if _JAX_PLATFORMS.value:
    os.environ["JAX_PLATFORMS"] = _JAX_PLATFORMS.value
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave the GPU to vLLM if JAX sees it
  unknown = [t for t in _TRANSPORTS.value if t not in ("object_store", "nccl", "ipc")]
  if unknown or not _TRANSPORTS.value:
    raise app.UsageError(f"--transports={_TRANSPORTS.value}: expected a non-empty list of object_store, nccl, ipc")
  _preflight()
  import jax  # pylint: disable=import-outside-toplevel
  import vllm  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.bridge import weight_transport as wt  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling import JaxSampler, SamplerConfig  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling.vllm_sampler import VllmEngineConfig, VllmSampler  # pylint: disable=import-outside-toplevel

  folder = _CKPT.value or build_tiny_checkpoint(_WORKDIR.value or tempfile.mkdtemp(prefix="gpu_check_"),
                                                _SEED.value)
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
  mismatch_before = _mismatch(params, model_config, before, sampling.temperature)

  new_params, update_metrics = _rl_update(params, model_config, before, sampling.temperature,
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
  mismatch_after = _mismatch(new_params, model_config, after, sampling.temperature)
  mismatch_stale = _mismatch(params, model_config, after, sampling.temperature)
  reference.update_weights(new_params, version)
  greedy_after = greedy_agreement(sampler.generate(prompts, greedy=True, num_samples=1).response_tokens,
                                  reference.generate(prompts, greedy=True, num_samples=1).response_tokens)
  checks = {
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
      "greedy_agreement_after": greedy_after,
  }


def main(argv):
  del argv
  report = run_check()
  line = json.dumps(report, sort_keys=True)
  print(line, flush=True)
  if _OUTPUT.value:
    with open(_OUTPUT.value, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  if not report["ok"]:
    failed = [k for k, v in report["checks"].items() if not v]
    print(f"gpu_check: FAILED {failed}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
