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
from typing import Any, Callable, Optional

import ml_collections
from ml_collections.config_dict import placeholder

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gae")
NORMALIZATIONS = ("none", "batch", "group", "global")
SAMPLER_KINDS = ("jax", "vllm")


def base_config() -> ml_collections.ConfigDict:
  """Every field of a run with its default; configs override a subset."""
  c = ml_collections.ConfigDict()
  c.name = "run"
  c.seed = 0
  c.run_dir = ""  # default: runs/<name>

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
      _one_of("sampler.kind", SAMPLER_KINDS),
      _one_of("rollout.mode", ("sync", "pipeline")), _pos_int("rollout.num_samplers"),
      _nonneg_int("rollout.max_lag"), _nonneg_int("rollout.chunks_per_step"), _nonneg_int("rollout.segment_tokens"),
      Rule("rollout.address", lambda v: isinstance(v, str), "a Ray address string (empty: local cluster)"),
      _pos("rollout.actor_cpus"),
      _pos_int("eval.every"), _pos_int("eval.pass_k"),
      _pos_int("checkpoint.every"), _pos_int("checkpoint.keep"), _bool("checkpoint.resume"),
      _bool("log.progress"), _bool("log.tensorboard"), _pos_int("log.every"), _bool("export.hf"),
  ]


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
    if config.model.hidden_size % config.model.num_heads:
      errors.append(f"model.num_heads={config.model.num_heads}: expected a divisor of "
                    f"model.hidden_size={config.model.hidden_size}")
    if config.model.num_heads % config.model.num_kv_heads:
      errors.append(f"model.num_kv_heads={config.model.num_kv_heads}: expected a divisor of "
                    f"model.num_heads={config.model.num_heads}")
  if errors:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
  return config


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
