"""Run configuration: the defaults every ``configs/*.py`` starts from, and validation.

Configs are code (``ml_collections.ConfigDict`` returned by ``get_config()``) and
any field can be overridden from the command line, for example
``--config.objective.eps_high=0.28``. :func:`base_config` returns a *locked*
ConfigDict: assigning a field that does not exist raises, so a typo in a config
file or a sweep fails before anything runs.

:func:`validate` checks the whole config at start-up. Each error names the
field, the value and what was expected; all errors are reported together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import ml_collections
from ml_collections.config_dict import placeholder

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gae")
NORMALIZATIONS = ("none", "batch", "group", "global")
SAMPLER_KINDS = ("jax", "vllm")
JOBS = ("rl", "reward_model")


def base_config() -> ml_collections.ConfigDict:
  """Every field of a run with its default; configs override a subset."""
  c = ml_collections.ConfigDict()
  c.name = "run"
  c.seed = 0
  c.run_dir = ""  # default: runs/<name>
  c.job = "rl"  # "rl": SFT warm start + RL; "reward_model": train a reward model (jaxrl_llm.reward_model)

  c.task = ml_collections.ConfigDict()
  c.task.name = "addition"
  c.task.kwargs = ml_collections.ConfigDict()  # task-specific (digits, dataset path, ...)
  c.task.eval_size = 256
  c.task.use_chat_template = False  # wrap prompts in the tokenizer's chat template

  c.model = ml_collections.ConfigDict()
  c.model.family = "qwen2"
  c.model.hidden_size = 128
  c.model.intermediate_size = 512
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.max_position_embeddings = 64
  c.model.rope_theta = 10000.0
  c.model.tie_word_embeddings = False
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"
  c.model.remat = False
  c.model.batch_invariant = False

  c.init = ml_collections.ConfigDict()
  c.init.hf_checkpoint = ""  # a Hugging Face folder; empty: random init
  c.init.tokenizer = ""  # tokenizer folder; empty: the checkpoint's, else a char tokenizer of the task

  c.sft = ml_collections.ConfigDict()
  c.sft.steps = 0
  c.sft.batch_size = 64
  c.sft.lr = 1e-3
  c.sft.warmup_steps = 20

  c.rl = ml_collections.ConfigDict()
  c.rl.steps = 100
  c.rl.prompts_per_step = 16
  c.rl.samples_per_prompt = 8
  c.rl.max_new_tokens = 8
  c.rl.temperature = 1.0
  c.rl.top_k = 0
  c.rl.top_p = 1.0
  c.rl.updates_per_batch = 1
  c.rl.filter_zero_variance = False

  c.advantage = ml_collections.ConfigDict()
  c.advantage.estimator = "grpo"
  c.advantage.normalization = "none"
  c.advantage.gamma = 1.0
  c.advantage.lam = 1.0
  c.advantage.reward_clip = 0.0  # 0: no clipping
  # Token-level KL penalty in the reward (GAE path): r_t = 1[EOS] r - beta KL_t against the warm start.
  c.advantage.kl_reward_coef = 0.0  # beta; 0: off
  c.advantage.kl_reward_target = 0.0  # > 0: adaptive beta steering the sequence KL to this many nats
  c.advantage.kl_reward_horizon = 10000.0  # episodes over which beta moves by at most +-20 %

  # Objective hyper-parameters: None means "the recipe's own default". A field
  # the chosen recipe does not take is an error at start-up (not silently ignored).
  c.objective = ml_collections.ConfigDict()
  c.objective.recipe = "grpo"
  c.objective.eps = placeholder(float)
  c.objective.eps_low = placeholder(float)
  c.objective.eps_high = placeholder(float)
  c.objective.aggregation = placeholder(str)
  c.objective.kl_coef = placeholder(float)
  c.objective.kl_estimator = placeholder(str)
  c.objective.entropy_coef = placeholder(float)
  c.objective.value_coef = placeholder(float)
  c.objective.value_clip = placeholder(float)

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.lr = 1e-4
  c.optimizer.warmup_steps = 0
  c.optimizer.schedule = "constant"
  c.optimizer.weight_decay = 0.0
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.99
  c.optimizer.max_grad_norm = 1.0

  c.critic = ml_collections.ConfigDict()
  c.critic.enabled = False
  c.critic.lr = 1e-3
  c.critic.warmup_steps = 0  # actor frozen while the critic warms up
  c.critic.init_from = ""  # reward-model checkpoint folder

  c.learner = ml_collections.ConfigDict()
  c.learner.mesh = ml_collections.ConfigDict({"data": -1, "fsdp": 1, "tensor": 1})
  c.learner.micro_batches = 1
  c.learner.max_nonfinite_in_a_row = 5
  # With model.batch_invariant=True: the batch is cut into this many equal atoms whose
  # gradients are summed by a fixed pairwise tree, so the bits do not depend on the
  # micro-batch count, the mesh or the number of processes (a power of two, a multiple
  # of the mesh's data x fsdp size and of learner.micro_batches, a divisor of
  # rl.prompts_per_step (atoms hold whole groups) and of sft.batch_size).
  c.learner.grad_atoms = 8

  c.sampler = ml_collections.ConfigDict()
  c.sampler.kind = "jax"

  # Where samples come from: "sync" samples in the learner's process between
  # updates; "pipeline" runs rollout.num_samplers Ray actors ahead of the
  # learner, at most rollout.max_lag policy versions behind (PipelineRL).
  c.rollout = ml_collections.ConfigDict()
  c.rollout.mode = "sync"
  c.rollout.num_samplers = 2
  c.rollout.max_lag = 4
  c.rollout.chunks_per_step = 0  # work items per step; 0: one per sampler
  c.rollout.segment_tokens = 0  # >0: weights may change every this many tokens of a response
  c.rollout.address = ""  # Ray cluster address; empty: a local cluster on 127.0.0.1
  c.rollout.actor_cpus = 1.0

  # Data curation (jaxrl_llm.tasks.curation, docs/off_policy.md): which prompts
  # are drawn, and how many sampling rounds fill a batch with informative groups.
  c.data = ml_collections.ConfigDict()
  c.data.curate = False  # True: draw prompts from a CuratedPromptSource with the fields below
  c.data.strategy = "stream"  # "stream" | "prioritized" (by 1 - pass rate) | "curriculum" (by difficulty)
  c.data.retire_solved = True  # no-positive resampling: a prompt with pass rate >= drop_pass_rate leaves the pool
  c.data.drop_pass_rate = 0.9
  c.data.window = 8  # attempts in a prompt's pass rate
  c.data.min_attempts = 0  # attempts before a prompt can retire; 0: window
  c.data.pool_size = 256  # "prioritized": candidate pool
  c.data.priority_floor = 0.05
  c.data.schedule = "pass_rate"  # "curriculum": promote on pass rate, or "steps"
  c.data.promote_pass_rate = 0.8
  c.data.steps_per_level = 100
  c.data.dynamic_sampling = False  # DAPO: resample until the batch has rl.prompts_per_step informative groups
  c.data.max_rounds = 4  # sampling rounds per step at most (then zero-variance groups pad the batch)
  c.data.rft_every = 0  # >0: every this many RL steps, an SFT step on the best-of-n samples (RFT)
  c.data.rft_min_reward = 1.0

  # Off-policy measurement (docs/off_policy.md): the consistency check of the
  # learner's log-probabilities against the sampler's before each update, and
  # the seed diagnostics (drift, staleness, advantage error, alerts).
  c.diagnostics = ml_collections.ConfigDict()
  c.diagnostics.drift_every = 1  # post-update forward for U_k every this many steps; 0: never
  c.diagnostics.consistency_action = "warn"  # on an alert: "warn" (log) | "skip" (discard the update)
  c.diagnostics.max_kl_k3 = 1e-3  # consistency thresholds (alerts above / below)
  c.diagnostics.max_out_of_bounds = 0.05
  c.diagnostics.min_ess_rate = 0.5
  c.diagnostics.max_abs_advantage = 100.0
  c.diagnostics.max_filter_rate = 0.5

  # Closed-loop control of the clip range / staleness window / KL coefficient
  # from the measured drift and staleness (jaxrl_llm.diagnostics.control).
  c.control = ml_collections.ConfigDict()
  c.control.enabled = False
  c.control.drift_target = 0.02
  c.control.staleness_target = 0.05
  c.control.tolerance = 1.5
  c.control.tighten = 0.8
  c.control.relax = 1.05
  c.control.min_clip_scale = 0.1
  c.control.max_clip_scale = 1.0
  c.control.min_lag = 0
  c.control.kl_target = 0.0  # > 0: adaptive coefficient of the KL loss (needs objective.kl_coef > 0)
  c.control.kl_horizon = 10000.0

  # Monotonic-improvement guard (jaxrl_llm.diagnostics.guard).
  c.guard = ml_collections.ConfigDict()
  c.guard.enabled = False
  c.guard.every = 25
  c.guard.eval_size = 128
  c.guard.min_drop = 0.05
  c.guard.z = 2.0
  c.guard.lr_shrink = 0.5
  c.guard.clip_shrink = 1.0
  c.guard.max_rollbacks = 3

  # Reward models (jaxrl_llm.reward_model, docs/reward_models.md). Training one
  # (job="reward_model"): config.model / init.hf_checkpoint plus a scalar head read at
  # the EOS token, optional SFT warm start (sft.*), Bradley-Terry loss on preference pairs.
  c.reward_model = ml_collections.ConfigDict()
  c.reward_model.data = ""  # JSONL of {prompt, chosen, rejected[, margin]}; empty: the task's built-in pairs
  c.reward_model.eval_data = ""  # held-out JSONL; empty: hash split of `data` by prompt
  c.reward_model.eval_fraction = 0.05
  c.reward_model.prompt_field = "prompt"
  c.reward_model.chosen_field = "chosen"
  c.reward_model.rejected_field = "rejected"
  c.reward_model.margin_field = "margin"
  c.reward_model.pair_kinds = "wrong_digit,carry,drop_digit,extra_digit,padded"  # built-in addition pairs
  c.reward_model.eval_pairs = 512  # held-out pairs of the built-in task
  c.reward_model.steps = 300
  c.reward_model.batch_size = 32  # pairs per step
  c.reward_model.lr = 1e-4
  c.reward_model.margin = 0.0  # margin of pairs that have none: loss -log sigmoid(r_c - r_r - m)
  c.reward_model.lm_coef = 0.0  # weight of the language-model loss on the chosen responses (0: off)
  # Using one as the RL reward (job="rl"): reward = rule_weight * task reward + rm_weight * processed RM score.
  c.reward_model.path = ""  # HF folder of a trained reward model (its hf_export); empty: task reward only
  c.reward_model.rm_weight = 1.0
  c.reward_model.rule_weight = 0.0
  c.reward_model.normalize = "none"  # "none" | "running": running z-score of the RM scores
  c.reward_model.clip = 0.0  # clip the processed RM score to [-clip, clip]; 0: off
  # "none" | "greedy": minus the score of the current policy's greedy response | "answer": of the task's gold one
  c.reward_model.baseline = "none"
  c.reward_model.no_eos_penalty = 0.0  # subtracted from the RM score of responses cut without an EOS

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 20
  c.eval.pass_k = 4

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 50
  c.checkpoint.keep = 2
  c.checkpoint.resume = True

  c.log = ml_collections.ConfigDict()
  c.log.progress = True
  c.log.tensorboard = True
  c.log.every = 1

  c.export = ml_collections.ConfigDict()
  c.export.hf = True
  c.lock()
  return c


@dataclasses.dataclass(frozen=True)
class Rule:
  path: str
  check: Callable[[Any], bool]
  expected: str


def _is_int(v):
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v):
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _pos_int(path):
  return Rule(path, lambda v: _is_int(v) and v > 0, "a positive integer")


def _nonneg_int(path):
  return Rule(path, lambda v: _is_int(v) and v >= 0, "an integer >= 0")


def _pos(path):
  return Rule(path, lambda v: _is_num(v) and v > 0, "a number > 0")


def _nonneg(path):
  return Rule(path, lambda v: _is_num(v) and v >= 0, "a number >= 0")


def _unit(path):
  return Rule(path, lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]")


def _one_of(path, options):
  return Rule(path, lambda v: v in options, f"one of {tuple(options)}")


def _optional(rule: Rule) -> Rule:
  return Rule(rule.path, lambda v: v is None or rule.check(v), rule.expected + " (or None for the recipe default)")


def _num(path):
  return Rule(path, _is_num, "a number")


def _bool(path):
  return Rule(path, lambda v: isinstance(v, bool), "true or false")


def rules() -> list[Rule]:
  """The validation table. Recipe and aggregation names come from the objective library."""
  from jaxrl_llm import objectives
  recipes = tuple(objectives.RECIPES)
  aggregations = tuple(objectives.AGGREGATIONS)
  return [
      _nonneg_int("seed"),
      Rule("name", lambda v: isinstance(v, str) and v and "/" not in v, "a non-empty name without '/'"),
      Rule("task.name", lambda v: isinstance(v, str) and v, "a task name"),
      _pos_int("task.eval_size"),
      _one_of("model.family", ("llama", "qwen2", "qwen3")),
      _pos_int("model.hidden_size"), _pos_int("model.intermediate_size"), _pos_int("model.num_layers"),
      _pos_int("model.num_heads"), _pos_int("model.num_kv_heads"), _pos_int("model.max_position_embeddings"),
      _pos("model.rope_theta"),
      _one_of("model.param_dtype", ("float32", "bfloat16")), _one_of("model.dtype", ("float32", "bfloat16")),
      _bool("model.remat"), _bool("model.batch_invariant"), _bool("model.tie_word_embeddings"),
      _nonneg_int("sft.steps"), _pos_int("sft.batch_size"), _pos("sft.lr"), _nonneg_int("sft.warmup_steps"),
      _nonneg_int("rl.steps"), _pos_int("rl.prompts_per_step"), _pos_int("rl.samples_per_prompt"),
      _pos_int("rl.max_new_tokens"), _pos("rl.temperature"), _nonneg_int("rl.top_k"),
      Rule("rl.top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
      _pos_int("rl.updates_per_batch"), _bool("rl.filter_zero_variance"),
      _one_of("advantage.estimator", ESTIMATORS), _one_of("advantage.normalization", NORMALIZATIONS),
      _unit("advantage.gamma"), _unit("advantage.lam"), _nonneg("advantage.reward_clip"),
      _nonneg("advantage.kl_reward_coef"), _nonneg("advantage.kl_reward_target"), _pos("advantage.kl_reward_horizon"),
      _one_of("job", JOBS),
      *[Rule(f"reward_model.{k}", lambda v: isinstance(v, str), "a string (empty: unset)")
        for k in ("data", "eval_data", "path", "pair_kinds")],
      *[Rule(f"reward_model.{k}", lambda v: isinstance(v, str) and v, "a non-empty field name")
        for k in ("prompt_field", "chosen_field", "rejected_field", "margin_field")],
      Rule("reward_model.eval_fraction", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
      _pos_int("reward_model.eval_pairs"), _nonneg_int("reward_model.steps"), _pos_int("reward_model.batch_size"),
      _pos("reward_model.lr"), _nonneg("reward_model.margin"), _nonneg("reward_model.lm_coef"),
      _nonneg("reward_model.rm_weight"),
      _nonneg("reward_model.rule_weight"), _one_of("reward_model.normalize", ("none", "running")),
      _nonneg("reward_model.clip"), _one_of("reward_model.baseline", ("none", "greedy", "answer")),
      _nonneg("reward_model.no_eos_penalty"),
      _one_of("objective.recipe", recipes),
      _optional(_pos("objective.eps")), _optional(_pos("objective.eps_low")),
      _optional(_pos("objective.eps_high")), _optional(_one_of("objective.aggregation", aggregations)),
      _optional(_nonneg("objective.kl_coef")), _optional(_one_of("objective.kl_estimator", ("k1", "k2", "k3"))),
      _optional(_nonneg("objective.entropy_coef")), _optional(_nonneg("objective.value_coef")),
      _optional(_pos("objective.value_clip")),
      _pos("optimizer.lr"), _nonneg_int("optimizer.warmup_steps"),
      _one_of("optimizer.schedule", ("constant", "cosine", "linear")), _nonneg("optimizer.weight_decay"),
      Rule("optimizer.b1", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
      Rule("optimizer.b2", lambda v: _is_num(v) and 0 <= v < 1, "a number in [0, 1)"),
      _pos("optimizer.max_grad_norm"),
      _bool("critic.enabled"), _pos("critic.lr"), _nonneg_int("critic.warmup_steps"),
      _pos_int("learner.micro_batches"), _pos_int("learner.max_nonfinite_in_a_row"),
      Rule("learner.grad_atoms", lambda v: _is_int(v) and v > 0 and v & (v - 1) == 0, "a power of two"),
      _one_of("sampler.kind", SAMPLER_KINDS),
      _one_of("rollout.mode", ("sync", "pipeline")), _pos_int("rollout.num_samplers"),
      _nonneg_int("rollout.max_lag"), _nonneg_int("rollout.chunks_per_step"), _nonneg_int("rollout.segment_tokens"),
      Rule("rollout.address", lambda v: isinstance(v, str), "a Ray address string (empty: local cluster)"),
      _pos("rollout.actor_cpus"),
      _bool("data.curate"), _bool("data.retire_solved"), _bool("data.dynamic_sampling"),
      _pos_int("data.max_rounds"), _nonneg_int("data.rft_every"), _num("data.rft_min_reward"),
      _nonneg_int("diagnostics.drift_every"), _one_of("diagnostics.consistency_action", ("warn", "skip")),
      _nonneg("diagnostics.max_kl_k3"), _unit("diagnostics.max_out_of_bounds"), _unit("diagnostics.min_ess_rate"),
      _pos("diagnostics.max_abs_advantage"), _unit("diagnostics.max_filter_rate"),
      _bool("control.enabled"), _pos("control.drift_target"), _pos("control.staleness_target"),
      Rule("control.tolerance", lambda v: _is_num(v) and v > 1, "a number > 1"),
      Rule("control.tighten", lambda v: _is_num(v) and 0 < v < 1, "a number in (0, 1)"),
      Rule("control.relax", lambda v: _is_num(v) and v >= 1, "a number >= 1"),
      _pos("control.min_clip_scale"), _pos("control.max_clip_scale"), _nonneg_int("control.min_lag"),
      _nonneg("control.kl_target"), _pos("control.kl_horizon"),
      _bool("guard.enabled"), _pos_int("guard.every"), _pos_int("guard.eval_size"), _nonneg("guard.min_drop"),
      _nonneg("guard.z"), Rule("guard.lr_shrink", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
      Rule("guard.clip_shrink", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
      _pos_int("guard.max_rollbacks"),
      _pos_int("eval.every"), _pos_int("eval.pass_k"),
      _pos_int("checkpoint.every"), _pos_int("checkpoint.keep"), _bool("checkpoint.resume"),
      _bool("log.progress"), _bool("log.tensorboard"), _pos_int("log.every"), _bool("export.hf"),
  ]


CURATION_FIELDS = ("strategy", "retire_solved", "drop_pass_rate", "window", "min_attempts", "pool_size",
                   "priority_floor", "schedule", "promote_pass_rate", "steps_per_level")


def curation_config(config: ml_collections.ConfigDict):
  """``config.data`` as a :class:`jaxrl_llm.tasks.curation.CurationConfig` (ValueError naming a bad field)."""
  from jaxrl_llm.tasks import curation
  return curation.CurationConfig(**{k: config.data[k] for k in CURATION_FIELDS})


class ConfigError(ValueError):
  """A config field is missing or holds a value outside what it accepts."""


def get_field(config: ml_collections.ConfigDict, path: str) -> Any:
  node: Any = config
  for part in path.split("."):
    if part not in node:
      raise ConfigError(f"config field {path!r} is missing")
    node = node[part]
  return node


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field; raises one ConfigError listing all problems.

  Besides per-field checks it verifies cross-field constraints: the response
  must fit the context, the GAE estimator needs a critic, and the micro-batch
  count must divide the batch.
  """
  errors: list[str] = []
  for rule in rules():
    try:
      value = get_field(config, rule.path)
    except ConfigError as e:
      errors.append(str(e))
      continue
    if not rule.check(value):
      errors.append(f"{rule.path}={value!r}: expected {rule.expected}")
  if not errors:
    batch = config.rl.prompts_per_step * config.rl.samples_per_prompt
    if batch % config.learner.micro_batches:
      errors.append(f"learner.micro_batches={config.learner.micro_batches}: expected a divisor of the RL batch "
                    f"rl.prompts_per_step*rl.samples_per_prompt={batch}")
    if config.model.batch_invariant:
      errors.extend(_atom_errors(config, batch))
    if config.advantage.estimator == "gae" and not config.critic.enabled:
      errors.append("advantage.estimator='gae': expected critic.enabled=True (GAE needs value estimates)")
    if config.rl.filter_zero_variance and config.advantage.estimator == "gae":
      errors.append("rl.filter_zero_variance=True with advantage.estimator='gae': expected False "
                    "(zero-variance groups are a group-relative notion)")
    if config.critic.enabled and config.advantage.estimator != "gae":
      errors.append(f"critic.enabled=True with advantage.estimator={config.advantage.estimator!r}: "
                    "expected 'gae' (the critic is only used by GAE)")
    if config.rl.max_new_tokens >= config.model.max_position_embeddings:
      errors.append(f"rl.max_new_tokens={config.rl.max_new_tokens}: expected < "
                    f"model.max_position_embeddings={config.model.max_position_embeddings}")
    if config.sampler.kind == "vllm" and config.rollout.mode != "pipeline":
      errors.append("sampler.kind='vllm' with rollout.mode='sync': expected rollout.mode='pipeline' "
                    "(vLLM engines run in Ray sampler actors)")
    if config.rollout.mode == "pipeline" and config.rl.updates_per_batch != 1:
      errors.append(f"rl.updates_per_batch={config.rl.updates_per_batch} with rollout.mode='pipeline': expected 1 "
                    "(the staleness bound counts one policy version per step)")
    if config.data.curate:
      try:
        curation_config(config)
      except ValueError as e:
        errors.append(f"data: {e}")
    if config.data.dynamic_sampling and config.rollout.mode == "pipeline":
      errors.append("data.dynamic_sampling=True with rollout.mode='pipeline': expected rollout.mode='sync' "
                    "(extra sampling rounds are drawn in the learner's process)")
    if config.data.dynamic_sampling and config.advantage.estimator == "gae":
      errors.append("data.dynamic_sampling=True with advantage.estimator='gae': expected a group estimator")
    if config.data.rft_every and config.rl.prompts_per_step % config.learner.micro_batches:
      errors.append(f"data.rft_every={config.data.rft_every}: expected rl.prompts_per_step "
                    f"({config.rl.prompts_per_step}) to be a multiple of learner.micro_batches "
                    f"({config.learner.micro_batches}) (the RFT batch has one row per prompt)")
    if config.control.min_clip_scale > config.control.max_clip_scale:
      errors.append(f"control.min_clip_scale={config.control.min_clip_scale}: expected <= "
                    f"control.max_clip_scale={config.control.max_clip_scale}")
    if config.control.enabled and config.control.kl_target > 0 and not config.objective.kl_coef:
      errors.append("control.kl_target > 0: expected objective.kl_coef > 0 (the adaptive KL coefficient "
                    "scales the objective's KL term)")
    if config.guard.clip_shrink < 1 and not config.control.enabled:
      errors.append(f"guard.clip_shrink={config.guard.clip_shrink}: expected 1.0 unless control.enabled=True "
                    "(the clip range is only adjustable under control)")
    if config.job == "reward_model" and config.reward_model.batch_size % config.learner.micro_batches:
      errors.append(f"learner.micro_batches={config.learner.micro_batches}: expected a divisor of "
                    f"reward_model.batch_size={config.reward_model.batch_size}")
    if config.job == "rl" and config.reward_model.path and not (config.reward_model.rm_weight
                                                               or config.reward_model.rule_weight):
      errors.append("reward_model.rm_weight=0 and reward_model.rule_weight=0: expected at least one > 0 "
                    "(the reward would be 0)")
    if config.advantage.kl_reward_coef and config.advantage.estimator != "gae":
      errors.append(f"advantage.kl_reward_coef={config.advantage.kl_reward_coef} with advantage.estimator="
                    f"{config.advantage.estimator!r}: expected 'gae' (a token-level reward needs GAE; group "
                    "estimators take one reward per sequence, use objective.kl_coef there)")
    if config.model.hidden_size % config.model.num_heads:
      errors.append(f"model.num_heads={config.model.num_heads}: expected a divisor of "
                    f"model.hidden_size={config.model.hidden_size}")
    if config.model.num_heads % config.model.num_kv_heads:
      errors.append(f"model.num_kv_heads={config.model.num_kv_heads}: expected a divisor of "
                    f"model.num_heads={config.model.num_heads}")
  if errors:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
  return config


def _atom_errors(config: ml_collections.ConfigDict, rl_batch: int) -> list[str]:
  """Batch-invariant mode: every learner batch must cut into learner.grad_atoms equal atoms."""
  atoms = config.learner.grad_atoms
  errors = []
  if atoms % config.learner.micro_batches:
    errors.append(f"learner.grad_atoms={atoms}: expected a multiple of learner.micro_batches="
                  f"{config.learner.micro_batches} (micro-batches group whole atoms)")
  if rl_batch % (atoms * config.rl.samples_per_prompt):
    errors.append(f"learner.grad_atoms={atoms}: expected a divisor of rl.prompts_per_step="
                  f"{config.rl.prompts_per_step} (model.batch_invariant=True: every atom holds whole groups of "
                  f"rl.samples_per_prompt={config.rl.samples_per_prompt} samples)")
  if config.sft.steps and config.sft.batch_size % atoms:
    errors.append(f"learner.grad_atoms={atoms}: expected a divisor of sft.batch_size={config.sft.batch_size} "
                  "(model.batch_invariant=True)")
  return errors


def override(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets ``config.<path> = value``, naming the field if it does not exist."""
  parts = path.split(".")
  node: Any = config
  for i, part in enumerate(parts[:-1]):
    if part not in node:
      raise ConfigError(f"config field {'.'.join(parts[:i + 1])!r} does not exist (in override {path!r})")
    node = node[part]
  if parts[-1] not in node:
    raise ConfigError(f"config field {path!r} does not exist")
  node[parts[-1]] = value


def run_dir(config: ml_collections.ConfigDict) -> str:
  return config.run_dir or f"runs/{config.name}"
