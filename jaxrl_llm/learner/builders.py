"""Turns a validated run config into the objects a run needs.

Each builder reads one part of the config and names the field in its errors:
the tokenizer (a Hugging Face folder or a char tokenizer for built-in tasks), the
model config and initial parameters (random or imported from a HF checkpoint,
straight into the mesh sharding), the objective chain and the optimizers.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import jax
import ml_collections
import optax
from jax.sharding import Mesh

from jaxrl_llm import bridge, models, objectives as O
from jaxrl_llm.learner import optim
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.tasks import base as task_base

# config.advantage.estimator -> jaxrl_llm.advantages estimator name.
GROUP_ESTIMATORS = {"grpo": "grpo", "dr_grpo": "drgrpo", "rloo": "rloo"}


def build_tokenizer(config: ml_collections.ConfigDict, task: task_base.Task) -> bridge.Tokenizer:
  """``init.tokenizer`` folder, else the HF checkpoint's, else a char tokenizer of the task."""
  folder = config.init.tokenizer or config.init.hf_checkpoint
  if folder:
    return bridge.Tokenizer.from_folder(folder)
  return bridge.build_char_tokenizer(task.alphabet)


def build_model_config(config: ml_collections.ConfigDict, tokenizer: bridge.Tokenizer,
                       **overrides: Any) -> ModelConfig:
  """The policy's ModelConfig: from the HF checkpoint's config.json, or from ``config.model``."""
  m = config.model
  if config.init.hf_checkpoint:
    base = bridge.config_from_hf(config.init.hf_checkpoint, param_dtype=m.param_dtype)
    return base.replace(dtype=m.dtype, remat=m.remat, batch_invariant=m.batch_invariant,
                        pad_token_id=tokenizer.pad_id, **overrides)
  return ModelConfig(
      family=m.family, vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
      intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
      num_kv_heads=m.num_kv_heads, rope_theta=m.rope_theta, max_position_embeddings=m.max_position_embeddings,
      tie_word_embeddings=m.tie_word_embeddings, attention_bias=(m.family == "qwen2"),
      qk_norm=(m.family == "qwen3"), param_dtype=m.param_dtype, dtype=m.dtype, remat=m.remat,
      batch_invariant=m.batch_invariant, pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id,
      bos_token_id=tokenizer.bos_id, **overrides)


def build_params(config: ml_collections.ConfigDict, model_config: ModelConfig, mesh: Mesh, seed: int,
                 hf_folder: Optional[str] = None) -> Any:
  """Parameters placed in the mesh sharding: imported tensor by tensor, or random."""
  shardings = models.param_shardings(model_config, mesh)
  if hf_folder:
    return bridge.load_hf_params(hf_folder, model_config, shardings=shardings)
  params = jax.jit(lambda key: models.init_params(model_config, key), out_shardings=shardings)(
      jax.random.PRNGKey(seed))
  return params


def build_objective(config: ml_collections.ConfigDict, max_new_tokens: int) -> O.ObjectiveTransform:
  """``objectives.recipe(config.objective.recipe, **set fields)``.

  Fields left at None take the recipe's default. A set field that the recipe
  does not accept is an error naming the field and the recipe's parameters.
  ``dr_grpo``'s normalising constant defaults to ``rl.max_new_tokens``; the PPO
  value-loss terms are dropped when no critic is configured.
  """
  oc = config.objective
  name = oc.recipe
  fn = O.RECIPES[name]
  accepted = set(inspect.signature(fn).parameters)
  kwargs = {}
  for key, value in oc.items():
    if key == "recipe" or value is None:
      continue
    if key not in accepted:
      raise ValueError(f"objective.{key}={value!r} is not a parameter of recipe {name!r} "
                       f"(it takes: {sorted(accepted)})")
    kwargs[key] = value
  if name == "dr_grpo":
    kwargs.setdefault("constant", float(max_new_tokens))
  if name == "ppo" and not config.critic.enabled:
    kwargs["value_coef"] = None
  if name == "grpo" and "kl_coef" not in kwargs:
    kwargs["kl_coef"] = 0.0  # a KL term needs a reference policy; ask for it explicitly
  return fn(**kwargs)


def objective_uses_reference(config: ml_collections.ConfigDict) -> bool:
  return bool(config.objective.kl_coef)


def build_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  o = config.optimizer
  return optim.make_optimizer(o.lr, o.warmup_steps, total_steps, o.schedule, weight_decay=o.weight_decay,
                              b1=o.b1, b2=o.b2, max_grad_norm=o.max_grad_norm)
