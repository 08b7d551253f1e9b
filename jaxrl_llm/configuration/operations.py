"""Settings of the operational sections: sampler, rollout, data, diagnostics, reward
functions, reward model, evaluation, checkpoints, logging and export.

The curation fields of ``config.data`` are declared by
:class:`jaxrl_llm.tasks.curation.CurationConfig`, the consistency limits of
``config.diagnostics`` by :class:`jaxrl_llm.diagnostics.ConsistencyThresholds`,
``config.control`` by :class:`jaxrl_llm.diagnostics.control.ControlSettings` and
``config.guard`` by :class:`jaxrl_llm.diagnostics.guard.GuardSettings`; this module
declares the rest of those sections.
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm import objectives
from jaxrl_llm.diagnostics import offpolicy
from jaxrl_llm.settings import (BOOL, NONEMPTY_STRING, NONNEG, NONNEG_INT, NUMBER, POSITIVE, POSITIVE_INT, STRING,
                                UNIT, Check, check, in_range, require, setting)

SAMPLER_KINDS = ("jax", "vllm")  # the sampler a rollout actor builds (jaxrl_llm.rollout.actor.SamplerSpec.kind)
SAMPLER_PLATFORMS = ("cpu", "gpu")  # where a JAX sampler actor runs (jaxrl_llm.rollout.placement.PLATFORMS)
VLLM_DTYPES = ("auto", "bfloat16", "float16", "float32")  # vLLM engine dtype; auto: the model's param_dtype
WEIGHT_TRANSPORTS = ("object_store", "nccl", "ipc")  # jaxrl_llm.bridge.weight_transport.TRANSPORTS
ROLLOUT_MODES = ("sync", "pipeline")  # where samples come from (the learner's process, or Ray sampler actors)
CONSISTENCY_ACTIONS = ("warn", "skip")  # what a failed sampler/learner consistency check does
RM_NORMALIZATIONS = ("none", "running")  # processing of reward-model scores (jaxrl_llm.reward_model.scorer)
RM_BASELINES = ("none", "greedy", "answer")  # reference-response baselines of reward-model scores
REWARD_MODES = ("process", "inline")  # where reward functions run (jaxrl_llm.tasks.reward_runner.MODES)
LONG_PROMPT_ACTIONS = ("error", "skip", "truncate")  # a task row too long for the context (jaxrl_llm.jobs.prompt_check)


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
  """``config.sampler``."""

  kind: str = setting("jax", "the sampler: the built-in JAX sampler, or vLLM engines in Ray actors (needs "
                      "rollout.mode='pipeline' and a GPU)", choices=SAMPLER_KINDS)
  platform: str = setting("cpu", "'pipeline' with sampler.kind='jax': where each sampler actor runs JAX; 'gpu' "
                          "asks Ray for one GPU per actor (never one of the learner's)", choices=SAMPLER_PLATFORMS)

  def __post_init__(self):
    check(self, "sampler")


@dataclasses.dataclass(frozen=True)
class VllmSettings:
  """``config.sampler.vllm``: the engine of each vLLM sampler actor (``vllm.LLM`` arguments).

  They reach :class:`jaxrl_llm.sampling.vllm_engine.VllmEngineConfig` through the job; the
  actor asks Ray for ``tensor_parallel_size`` GPUs (one more with
  ``rollout.weight_transport='nccl'``).
  """

  tensor_parallel_size: int = setting(1, "GPUs per engine (vLLM tensor parallelism); Ray places them on one node",
                                      POSITIVE_INT)
  gpu_memory_utilization: float = setting(0.85, "share of each of its GPUs' memory the engine may take (weights, "
                                          "activations and KV cache)", in_range(0.0, 1.0, low_open=True))
  dtype: str = setting("auto", "engine dtype; 'auto': the model's param_dtype (published weights are cast to it)",
                       choices=VLLM_DTYPES)
  max_model_len: int = setting(0, "longest prompt + response the engine serves; 0: the model's context (the "
                               "learner's prompt bucket + rl.max_new_tokens)", NONNEG_INT)
  enable_prefix_caching: bool = setting(True, "reuse the KV cache of shared prefixes (a prompt's n samples); "
                                        "reset after every weight update", BOOL)
  enforce_eager: bool = setting(False, "no CUDA graphs: faster start, slower decode", BOOL)
  seed: int = setting(-1, "engine seed; -1: the run's seed (every request has its own seed anyway)",
                      in_range(-1, 2**31 - 1, integer=True))

  def __post_init__(self):
    check(self, "sampler.vllm")


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """``config.rollout``: synchronous sampling, or PipelineRL with Ray sampler actors ahead of the learner."""

  mode: str = setting("sync", "'sync': sample in the learner's process between updates; 'pipeline': "
                      "rollout.num_samplers Ray actors at most rollout.max_lag versions behind", choices=ROLLOUT_MODES)
  num_samplers: int = setting(2, "'pipeline': Ray sampler actors", POSITIVE_INT)
  max_lag: int = setting(4, "'pipeline': most policy versions a sample may lag behind the learner (0: on-policy)",
                         NONNEG_INT)
  chunks_per_step: int = setting(0, "'pipeline': work items per RL step; 0: one per sampler", NONNEG_INT)
  segment_tokens: int = setting(0, "'pipeline': > 0: new weights may reach a sampler every this many tokens of a "
                                "response", NONNEG_INT)
  address: str = setting("", "Ray cluster address; empty: start a local cluster on 127.0.0.1", STRING)
  actor_cpus: float = setting(1.0, "CPUs reserved by each Ray sampler actor", POSITIVE)
  weight_transport: str = setting("object_store", "how each vLLM sampler actor moves the weights it receives "
                                  "(through Ray's object store, once per node) into its engine: 'object_store' "
                                  "(vLLM's RPC), 'ipc' (CUDA buffers shared with the engine's workers) or 'nccl' "
                                  "(a broadcast from one extra GPU of the actor); the JAX sampler takes them "
                                  "directly and needs 'object_store'", choices=WEIGHT_TRANSPORTS)
  weight_bucket_mb: int = setting(256, "about this many MiB of weights per transfer into a vLLM engine",
                                  POSITIVE_INT)
  actor_gpus: float = setting(-1.0, "GPUs each sampler actor reserves; -1: what its sampler needs "
                              "(sampler.vllm.tensor_parallel_size for vLLM, + 1 with rollout.weight_transport='nccl'; "
                              "1 for a JAX sampler on sampler.platform='gpu'; else 0); otherwise a JAX sampler "
                              "actor's own count, or a one-GPU vLLM engine's share of a GPU (0.5: two engines per "
                              "GPU, each within sampler.vllm.gpu_memory_utilization)", in_range(-1, 1024))
  local_gpus: str = setting("auto", "GPUs the local Ray cluster (no rollout.address) offers to sampler actors: "
                            "'auto' (every GPU of this machine the learner's JAX does not use), 'none', or ids "
                            "such as '4,5,6,7' (never the learner's)", STRING)
  exact_versions: bool = setting(False, "'pipeline': sample RL step s with exactly the policy version k steps older "
                                 "(base + max(0, s - k)), never a newer one: a fixed lag, so the run does not depend "
                                 "on timing (each actor keeps k + 1 weight versions)", BOOL)
  simulated_lag: int = setting(0, "experimental, 'sync' only: sample step t with the policy k versions old (a ring of "
                               "k+1 parameter sets), for deterministic staleness studies without Ray; 0: off",
                               NONNEG_INT)

  def __post_init__(self):
    check(self, "rollout")
    require(self, "rollout", not self.exact_versions or self.mode == "pipeline", "exact_versions",
            f"rollout.mode='pipeline', got {self.mode!r} (exact versions schedule the pipeline's Ray sampler "
            "actors)")
    require(self, "rollout", not self.exact_versions or self.segment_tokens == 0, "exact_versions",
            f"rollout.segment_tokens=0, got {self.segment_tokens} (an exact-version response is sampled whole "
            "by one version)")


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """``config.data`` beyond prompt curation: whether to curate, dynamic sampling and RFT."""

  curate: bool = setting(False, "draw prompts from a curated source (the data.* curation fields) instead of the "
                         "plain task stream", BOOL)
  dynamic_sampling: bool = setting(False, "DAPO: resample until the batch holds rl.prompts_per_step groups with "
                                   "non-zero reward variance", BOOL)
  max_rounds: int = setting(4, "dynamic sampling: most sampling rounds per step (then zero-variance groups pad the "
                            "batch)", POSITIVE_INT)
  rft_every: int = setting(0, "> 0: every this many RL steps, an SFT step on the best sample of each prompt (RFT)",
                           NONNEG_INT)
  rft_min_reward: float = setting(1.0, "RFT: a best sample needs at least this reward", NUMBER)
  sft_mix: str = setting("", "demonstrations mixed into every RL batch with an SFT loss (InstructGPT's PPO-ptx): "
                         "'task' (the task's reference answers) or a JSONL file of prompt/response objects; empty: off",
                         STRING)
  sft_mix_rows: int = setting(8, "demonstration rows per RL step (a multiple of rl.samples_per_prompt)", POSITIVE_INT)
  sft_mix_coef: float = setting(0.1, "coefficient of the SFT loss on the demonstration tokens", NONNEG)
  long_prompts: str = setting("error", "a task row whose prompt does not fit the context with rl.max_new_tokens "
                              "(or, with a warm start, whose prompt + reference answer does not), found when every row "
                              "of a dataset task is tokenised at start-up: 'error' (stop, naming file:line), 'skip' "
                              "(drop such rows) or 'truncate' (keep the prompt's last tokens); skipped and truncated "
                              "rows are counted in the log and summary.json. Generated tasks are checked on a sample "
                              "and always stop", choices=LONG_PROMPT_ACTIONS)

  def __post_init__(self):
    check(self, "data")


@dataclasses.dataclass(frozen=True)
class DiagnosticsSettings:
  """``config.diagnostics`` beyond the consistency limits: drift measurement, the check's action, data alerts."""

  drift_every: int = setting(1, "measure the update drift U_k (a post-update forward) every this many steps; "
                             "0: never", NONNEG_INT)
  consistency_action: str = setting("warn", "on a consistency alert: 'warn' (log it) or 'skip' (discard the "
                                    "update)", choices=CONSISTENCY_ACTIONS)
  max_abs_advantage: float = setting(offpolicy.DEFAULT_MAX_ABS_ADVANTAGE, "data alert above this largest |advantage|",
                                     POSITIVE)
  stale_check_rows: int = setting(8, "steps without a lag-0 token: check this many stale rows against the learner's "
                                  "parameters of their own version (kept for the lag window); 0: off", NONNEG_INT)
  max_unchecked_steps: int = setting(5, "alert when the consistency check could not be computed this many steps in "
                                     "a row", POSITIVE_INT)

  def __post_init__(self):
    check(self, "diagnostics")


@dataclasses.dataclass(frozen=True)
class RewardSettings:
  """``config.reward``: how the task's reward function runs (training and evaluation alike;
  :class:`jaxrl_llm.tasks.RewardRunner`)."""

  mode: str = setting("process", "'process': in a pool of worker processes killed and replaced on a timeout, crash "
                      "or memory error; 'inline': in the learner's thread (trusted rewards only: a call that never "
                      "returns hangs the run)", choices=REWARD_MODES)
  timeout_s: float = setting(5.0, "per-call time limit in seconds; a call over it scores 0 (counted)", POSITIVE)
  workers: int = setting(2, "'process': reward worker processes (a batch is spread over them)", POSITIVE_INT)
  memory_mb: int = setting(2048, "'process': address-space limit of each worker in MiB (RLIMIT_AS; a worker "
                           "with a built-in task's reward uses ~250 MiB); 0: none", NONNEG_INT)
  cpu_seconds: float = setting(60.0, "'process': CPU-time limit of one call in seconds (RLIMIT_CPU); 0: none",
                               NONNEG)
  max_failure_share: float = setting(0.5, "stop the run when more than this share of a step's reward calls fail "
                                     "(raise, time out, crash, run out of memory, return NaN/inf) for "
                                     "reward.failure_steps steps in a row; 1: never stop", UNIT)
  failure_steps: int = setting(3, "consecutive failing steps (see max_failure_share) that stop the run; evaluation "
                               "failures count as wrong answers and never stop it", POSITIVE_INT)
  functions: tuple = setting((), "the RL reward as weighted components, e.g. \"(('my_pkg.rewards:fmt', 0.2), "
                             "('task', 1.0))\": 'task' (the task's reward), any importable fn(example, "
                             "response_text) -> float, or a reward server's http(s):// URL (batched JSON, "
                             "jaxrl_llm.tasks.remote_reward); each runs under these limits and is logged as "
                             "reward/<name>/mean; empty: the task's reward alone (jaxrl_llm.tasks.reward_plugins)",
                             Check(lambda v: isinstance(v, tuple), "a tuple of (name, weight) pairs"))
  remote_retries: int = setting(2, "a reward server's request that fails (cannot connect, times out after "
                                "reward.timeout_s, HTTP error, malformed answer) is retried this many times, then its "
                                "items score 0 and are counted", NONNEG_INT)

  def __post_init__(self):
    check(self, "reward")


@dataclasses.dataclass(frozen=True)
class RewardModelSettings:
  """``config.reward_model``: training one (``job='reward_model'``) and using one as the RL reward."""

  data: str = setting("", "training pairs, JSONL of {prompt, chosen, rejected[, margin]}; empty: the task's "
                      "built-in pairs", STRING)
  eval_data: str = setting("", "held-out JSONL pairs; empty: a hash split of `data` by prompt", STRING)
  eval_fraction: float = setting(0.05, "share of prompts held out when eval_data is empty",
                                 in_range(0, 1, high_open=True))
  prompt_field: str = setting("prompt", "JSONL field of the prompt", NONEMPTY_STRING)
  chosen_field: str = setting("chosen", "JSONL field of the preferred response", NONEMPTY_STRING)
  rejected_field: str = setting("rejected", "JSONL field of the other response", NONEMPTY_STRING)
  margin_field: str = setting("margin", "JSONL field of an optional per-pair margin", NONEMPTY_STRING)
  pair_kinds: str = setting("", "comma-separated kinds of built-in pairs (the task's wrong answers); empty: all "
                            "of the task's own kinds (Task.pair_kinds)", STRING)
  eval_pairs: int = setting(512, "held-out built-in pairs", POSITIVE_INT)
  steps: int = setting(300, "reward-model training steps", NONNEG_INT)
  batch_size: int = setting(32, "pairs per training step", POSITIVE_INT)
  lr: float = setting(1e-4, "reward-model learning rate", POSITIVE)
  margin: float = setting(0.0, "margin of pairs without one: loss -log sigmoid(r_chosen - r_rejected - margin)",
                          NONNEG)
  lm_coef: float = setting(0.0, "weight of a language-model loss on the chosen responses; 0: off", NONNEG)
  path: str = setting("", "job='rl': export folder of a trained reward model used as reward; empty: the task's "
                      "reward only", STRING)
  rm_weight: float = setting(1.0, "reward = rule_weight * task reward + rm_weight * processed RM score", NONNEG)
  rule_weight: float = setting(0.0, "weight of the task's rule reward next to the reward model", NONNEG)
  normalize: str = setting("none", "'running': running z-score of the RM scores", choices=RM_NORMALIZATIONS)
  clip: float = setting(0.0, "clip the processed RM score to [-clip, clip]; 0: off", NONNEG)
  baseline: str = setting("none", "subtract the RM score of the current policy's greedy response ('greedy') or of the "
                          "task's gold answer ('answer')", choices=RM_BASELINES)
  no_eos_penalty: float = setting(0.0, "subtracted from the RM score of responses cut without an EOS", NONNEG)

  def __post_init__(self):
    check(self, "reward_model")


@dataclasses.dataclass(frozen=True)
class PreferenceOptimizationSettings:
  """``config.dpo``: offline preference optimisation of the policy (``job='dpo'``: DPO, IPO or SimPO).

  The pairs are those of the reward model (``reward_model.data``, ``eval_data``, ``eval_fraction``,
  the ``*_field`` names, ``pair_kinds`` and ``eval_pairs``): one data declaration serves both jobs.
  """

  loss: str = setting("dpo", "'dpo': -log sigmoid(beta h) (arXiv:2305.18290); 'ipo': (h - 1/(2 beta))^2 "
                      "(arXiv:2310.12036); 'simpo': reference-free, -log sigmoid(beta (length-normalised log-prob "
                      "margin) - simpo_gamma) (arXiv:2405.14734); h = the policy's log-ratio margin over the "
                      "reference", choices=objectives.PREFERENCE_LOSSES)
  beta: float = setting(0.1, "DPO: inverse temperature of the implicit reward; IPO: tau; SimPO: reward scale "
                        "(the paper uses 2 to 10)", POSITIVE)
  label_smoothing: float = setting(0.0, "loss='dpo': share eps of flipped labels (conservative DPO); 0: off",
                                   in_range(0, 0.5, high_open=True))
  simpo_gamma: float = setting(0.5, "loss='simpo': target margin gamma of the length-normalised rewards", NONNEG)
  nll_coef: float = setting(0.0, "weight of the chosen response's per-token NLL added to the loss (RPO, "
                            "arXiv:2404.19733: keeps the preferred answers' likelihood up); 0: off", NONNEG)
  steps: int = setting(200, "preference-optimisation steps (after the sft.steps warm start)", NONNEG_INT)
  batch_size: int = setting(32, "pairs per step", POSITIVE_INT)
  lr: float = setting(1e-5, "learning rate (optimizer.* otherwise; its state is reset after the warm start)",
                      POSITIVE)

  def __post_init__(self):
    check(self, "dpo")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """``config.eval``: the periodic held-out evaluation."""

  every: int = setting(20, "RL steps between held-out evaluations", POSITIVE_INT)
  pass_k: int = setting(4, "k of the reported pass@k (k samples per held-out prompt)", POSITIVE_INT)

  def __post_init__(self):
    check(self, "eval")


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
  """``config.checkpoint``: orbax checkpoints under <run_dir>/checkpoints."""

  every: int = setting(50, "steps between checkpoints", POSITIVE_INT)
  keep: int = setting(2, "checkpoints kept", POSITIVE_INT)
  resume: bool = setting(True, "resume from the newest usable checkpoint of the run folder", BOOL)
  verify: bool = setting(True, "on resume, check the sha256 of every checkpoint file against the manifest written "
                         "last at its save (sizes are always checked)", BOOL)

  def __post_init__(self):
    check(self, "checkpoint")


@dataclasses.dataclass(frozen=True)
class LogSettings:
  """``config.log``."""

  progress: bool = setting(True, "show a progress bar", BOOL)
  tensorboard: bool = setting(True, "write TensorBoard event files", BOOL)
  wandb: bool = setting(False, "also log to Weights & Biases (the [wandb] extra; WANDB_MODE=offline works without a "
                        "network; jaxrl_llm.diagnostics.wandb_sink)", BOOL)
  wandb_project: str = setting("jaxrl_llm", "log.wandb: the W&B project", NONEMPTY_STRING)
  wandb_entity: str = setting("", "log.wandb: the W&B entity (team or user); empty: your default", STRING)
  every: int = setting(1, "steps between two metrics records", POSITIVE_INT)

  def __post_init__(self):
    check(self, "log")


@dataclasses.dataclass(frozen=True)
class ExportSettings:
  """``config.export``."""

  hf: bool = setting(True, "export the final policy as a Hugging Face folder (<run_dir>/hf_export)", BOOL)

  def __post_init__(self):
    check(self, "export")


__all__ = [
    "SAMPLER_KINDS", "ROLLOUT_MODES", "CONSISTENCY_ACTIONS", "RM_NORMALIZATIONS", "RM_BASELINES", "REWARD_MODES",
    "SamplerSettings", "RolloutSettings", "DataSettings", "DiagnosticsSettings", "RewardSettings",
    "RewardModelSettings", "PreferenceOptimizationSettings", "EvalSettings", "CheckpointSettings", "LogSettings",
    "ExportSettings",
]
