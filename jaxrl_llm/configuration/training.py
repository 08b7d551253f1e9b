"""Settings of the training sections: the run, task, model, initialisation, SFT, RL,
advantages, objective, optimizer, critic and learner.

Each field is declared once with :func:`jaxrl_llm.settings.setting` (default, one-line
meaning, check); ``base_config``, ``validate`` and ``docs/config.md`` are derived from
these declarations. Choice lists come from the package that owns the names
(``models.FAMILIES``, ``advantages.ESTIMATORS``, ``objectives.RECIPES``, ...).
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm import advantages, models, objectives, tasks
from jaxrl_llm.learner.mesh import MESH_AXES
from jaxrl_llm.learner.optim import SCHEDULES
from jaxrl_llm.settings import (BOOL, MAPPING, NONNEG, NONNEG_INT, POSITIVE, POSITIVE_INT, POWER_OF_TWO, STRING,
                                UNIT, Check, check, in_range, require, setting)

JOBS = ("rl", "reward_model", "dpo")  # the job kinds a run config selects (config.job)
DTYPES = ("float32", "bfloat16")  # parameter / activation dtypes of a model built from config.model

PROXIMAL = ("learner", "behaviour")  # where the objective's pi_k comes from (objective.proximal)
CORRECTION_LIST = Check(lambda v: isinstance(v, (tuple, list)) and all(
    isinstance(e, (tuple, list)) and len(e) == 2 and isinstance(e[0], str) and MAPPING(e[1]) for e in v),
    "a sequence of (name, {argument: value}) pairs")
RUN_NAME = Check(lambda v: isinstance(v, str) and bool(v) and "/" not in v, "a non-empty name without '/'")
TASK_NAME = Check(lambda v: v in tasks.list_tasks(), "a registered task (jaxrl_llm.tasks.list_tasks())",
                  names=tasks.list_tasks)
BELOW_ONE = in_range(0, 1, high_open=True)


def _mesh_sizes(v) -> bool:
  if not MAPPING(v):
    return False
  return set(v.keys()) <= set(MESH_AXES) and all(isinstance(n, int) and (n > 0 or n == -1) for n in v.values())


MESH = Check(_mesh_sizes, f"sizes (> 0, or -1 for the remaining devices) of mesh axes among {MESH_AXES}")


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """The top level of a run config: its name, seed, folder and job kind."""

  name: str = setting("run", "run name; the run folder is runs/<name> unless run_dir is set", RUN_NAME)
  seed: int = setting(0, "seed of parameter initialisation, sampling and prompt order", NONNEG_INT)
  run_dir: str = setting("", "run folder (metrics, checkpoints, export); empty: runs/<name>", STRING)
  job: str = setting("rl", "'rl': optional SFT warm start, then RL; 'reward_model': train a reward model "
                     "(jaxrl_llm.reward_model); 'dpo': preference optimisation of the policy (config.dpo)",
                     choices=JOBS)

  def __post_init__(self):
    check(self, "")


@dataclasses.dataclass(frozen=True)
class TaskSettings:
  """``config.task``: where prompts and verifiable rewards come from (``jaxrl_llm.tasks``)."""

  name: str = setting(tasks.DEFAULT_TASK, "registered task (see Tasks below)", TASK_NAME)
  kwargs: dict = setting({}, "keyword arguments of the task (see Tasks below; unset ones keep the task's default)",
                         MAPPING, free=True)
  eval_size: int = setting(256, "held-out prompts of the periodic evaluation", POSITIVE_INT)
  use_chat_template: bool = setting(False, "wrap prompts in the tokenizer's chat template", BOOL)

  def __post_init__(self):
    check(self, "task")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """``config.model``: the decoder built when ``init.hf_checkpoint`` is empty (dtypes and modes always apply)."""

  family: str = setting("qwen2", "architecture family (attention bias: qwen2; q/k norm: qwen3)",
                        choices=models.FAMILIES)
  hidden_size: int = setting(128, "width of the residual stream", POSITIVE_INT)
  intermediate_size: int = setting(512, "width of the MLP", POSITIVE_INT)
  num_layers: int = setting(4, "decoder layers", POSITIVE_INT)
  num_heads: int = setting(4, "attention heads (a divisor of hidden_size)", POSITIVE_INT)
  num_kv_heads: int = setting(2, "key/value heads (a divisor of num_heads; grouped-query attention)", POSITIVE_INT)
  max_position_embeddings: int = setting(64, "longest sequence (prompt + response) in tokens", POSITIVE_INT)
  rope_theta: float = setting(10000.0, "RoPE base frequency", POSITIVE)
  tie_word_embeddings: bool = setting(False, "share the input embedding and the LM head", BOOL)
  param_dtype: str = setting("float32", "dtype parameters are stored in", choices=DTYPES)
  dtype: str = setting("float32", "compute dtype of the trunk (logits are float32 at the LM head)", choices=DTYPES)
  remat: bool = setting(False, "recompute layer activations in the backward pass (saves memory)", BOOL)
  batch_invariant: bool = setting(False, "bitwise-repeatable mode: the same bits for any micro-batching, mesh or "
                                  "process count (see learner.grad_atoms)", BOOL)

  def __post_init__(self):
    check(self, "model")
    require(self, "model", self.hidden_size % self.num_heads == 0, "num_heads",
            f"a divisor of model.hidden_size={self.hidden_size}")
    require(self, "model", self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
            f"a divisor of model.num_heads={self.num_heads}")


LORA_TARGET_LIST = Check(lambda v: isinstance(v, (tuple, list)) and bool(v) and all(t in models.LORA_TARGETS for t in v)
                         and len(set(v)) == len(v), f"a non-empty tuple of distinct projections among "
                         f"{models.LORA_TARGETS}")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """``config.model.lora``: LoRA adapters (Hu et al. 2021, arXiv:2106.09685); see jaxrl_llm/models/lora.py.

  With ``rank`` > 0 every phase of the job (SFT warm start, RL, reward-model training)
  trains only the adapters and the scalar heads; the base weights stay frozen and the
  optimizer state holds the adapters alone. Exports: ``hf_export/`` (merged weights)
  and ``hf_export/adapter/`` (a PEFT folder).
  """

  rank: int = setting(0, "adapter rank r; 0: no adapters (every weight trains)", NONNEG_INT)
  alpha: float = setting(16.0, "adapters add (alpha / rank) * x A B (PEFT's lora_alpha)", POSITIVE)
  targets: tuple = setting(models.LORA_TARGETS, "projections carrying adapters", LORA_TARGET_LIST)

  def __post_init__(self):
    check(self, "model.lora")


@dataclasses.dataclass(frozen=True)
class InitSettings:
  """``config.init``: where the policy's weights and tokenizer come from."""

  hf_checkpoint: str = setting("", "Hugging Face checkpoint folder to start from; empty: random init from "
                               "config.model", STRING)
  tokenizer: str = setting("", "tokenizer folder; empty: the checkpoint's, else a character tokenizer of the task",
                           STRING)

  def __post_init__(self):
    check(self, "init")


@dataclasses.dataclass(frozen=True)
class SftSettings:
  """``config.sft``: the supervised warm start on the task's gold answers."""

  steps: int = setting(0, "supervised steps before RL (or before reward-model training); 0: none", NONNEG_INT)
  batch_size: int = setting(64, "examples per SFT step", POSITIVE_INT)
  lr: float = setting(1e-3, "SFT learning rate (constant after the warm-up)", POSITIVE)
  warmup_steps: int = setting(20, "linear learning-rate warm-up steps of SFT", NONNEG_INT)

  def __post_init__(self):
    check(self, "sft")


@dataclasses.dataclass(frozen=True)
class RLSettings:
  """``config.rl``: the RL phase's length, batch and sampling."""

  steps: int = setting(100, "RL steps (one batch of samples each)", NONNEG_INT)
  prompts_per_step: int = setting(16, "prompts sampled per RL step", POSITIVE_INT)
  samples_per_prompt: int = setting(8, "responses per prompt (the group size of group estimators)", POSITIVE_INT)
  max_new_tokens: int = setting(8, "longest response in tokens (EOS included)", POSITIVE_INT)
  temperature: float = setting(1.0, "sampling temperature", POSITIVE)
  top_k: int = setting(0, "sample among the k most likely tokens; 0: off", NONNEG_INT)
  top_p: float = setting(1.0, "nucleus sampling mass; 1: off", in_range(0, 1, low_open=True))
  updates_per_batch: int = setting(1, "optimizer updates on each batch of samples", POSITIVE_INT)
  filter_zero_variance: bool = setting(False, "drop groups whose samples all got the same reward from the learner "
                                       "batch (they carry no gradient)", BOOL)

  def __post_init__(self):
    check(self, "rl")


@dataclasses.dataclass(frozen=True)
class AdvantageSettings:
  """``config.advantage``: advantage estimation, normalisation and reward shaping (``jaxrl_llm.advantages``)."""

  estimator: str = setting("grpo", "advantage estimator: group-relative (grpo, dr_grpo, rloo) or gae (needs "
                           "critic.enabled)", choices=advantages.ESTIMATORS)
  normalization: str = setting("none", "advantage normalisation mode (docs/advantages.md); 'global' reduces over the "
                               "learner mesh's batch axes", choices=advantages.MODES)
  norm_level: str = setting("token", "statistics of the normalisation: every response token counts once ('token') "
                            "or every sequence once ('sequence', ScaleRL)", choices=advantages.LEVELS)
  norm_shift_mean: bool = setting(True, "subtract the mean before dividing by the std (False: scale only, ScaleRL)",
                                  BOOL)
  gamma: float = setting(1.0, "GAE discount", UNIT)
  lam: float = setting(1.0, "GAE lambda", UNIT)
  reward_clip: float = setting(0.0, "clip rewards to [-reward_clip, reward_clip]; 0: no clipping", NONNEG)
  kl_reward_coef: float = setting(0.0, "beta of the token-level KL penalty in the reward against the warm start "
                                  "(GAE only); 0: off", NONNEG)
  kl_reward_target: float = setting(0.0, "> 0: adapt beta so the sequence KL tracks this many nats", NONNEG)
  kl_reward_horizon: float = setting(10000.0, "episodes over which the adaptive beta moves by at most 20 %", POSITIVE)

  def __post_init__(self):
    check(self, "advantage")


@dataclasses.dataclass(frozen=True)
class ObjectiveSettings:
  """``config.objective``: a named recipe and its keyword arguments (``jaxrl_llm.objectives.RECIPES``)."""

  recipe: str = setting("grpo", "named objective (see Recipes below)", choices=tuple(objectives.RECIPES))
  kwargs: dict = setting({}, "keyword arguments of the recipe (see Recipes below; unset ones take the recipe's "
                         "default or the run's value)", MAPPING, free=True)
  proximal: str = setting("learner", "pi_k of the objective: 'learner' (the learner's log-probabilities before the "
                          "update, as decoupled PPO, GePPO and the IS corrections define it) or 'behaviour' (pi_k := "
                          "mu, PPO clipped against the sampler)", choices=PROXIMAL)
  corrections: tuple = setting((), "importance corrections / filters applied before the recipe, in order: "
                               "(name, {argument: value}) pairs, names from objectives.CORRECTIONS (see Corrections "
                               "below)", CORRECTION_LIST)

  def __post_init__(self):
    check(self, "objective")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
  """``config.optimizer``: AdamW for the RL phase (its betas, decay and clipping also apply to SFT)."""

  lr: float = setting(1e-4, "peak RL learning rate", POSITIVE)
  warmup_steps: int = setting(0, "linear warm-up steps", NONNEG_INT)
  schedule: str = setting("constant", "learning-rate schedule after the warm-up", choices=SCHEDULES)
  weight_decay: float = setting(0.0, "AdamW weight decay", NONNEG)
  b1: float = setting(0.9, "Adam beta1", BELOW_ONE)
  b2: float = setting(0.99, "Adam beta2", BELOW_ONE)
  max_grad_norm: float = setting(1.0, "clip the global gradient norm to this", POSITIVE)

  def __post_init__(self):
    check(self, "optimizer")


@dataclasses.dataclass(frozen=True)
class CriticSettings:
  """``config.critic``: a separate value model for GAE."""

  enabled: bool = setting(False, "train a critic (a decoder with a value head); needs advantage.estimator='gae'",
                          BOOL)
  lr: float = setting(1e-3, "critic learning rate", POSITIVE)
  warmup_steps: int = setting(0, "critic-only steps with the actor frozen before RL updates the actor", NONNEG_INT)
  init_from: str = setting("", "reward-model export folder to initialise the critic from; empty: the policy's init",
                           STRING)

  def __post_init__(self):
    check(self, "critic")


@dataclasses.dataclass(frozen=True)
class LearnerSettings:
  """``config.learner``: the device mesh and how a batch is cut for the update."""

  mesh: dict = setting({"data": -1, "fsdp": 1, "tensor": 1}, "device mesh axis sizes (data, fsdp, tensor); -1: "
                       "the remaining devices", MESH)
  micro_batches: int = setting(1, "micro-batches per update (gradient accumulation)", POSITIVE_INT)
  max_nonfinite_in_a_row: int = setting(5, "stop the run after this many consecutive updates skipped for a "
                                        "non-finite loss or gradient", POSITIVE_INT)
  grad_atoms: int = setting(8, "model.batch_invariant: equal atoms whose gradients are summed by a fixed tree (a "
                            "divisor of rl.prompts_per_step and sft.batch_size)", POWER_OF_TWO)

  def __post_init__(self):
    check(self, "learner")


__all__ = [
    "JOBS", "DTYPES", "PROXIMAL", "RunSettings", "TaskSettings", "ModelSettings", "InitSettings", "SftSettings",
    "RLSettings", "AdvantageSettings", "ObjectiveSettings", "OptimizerSettings", "CriticSettings", "LearnerSettings",
]
