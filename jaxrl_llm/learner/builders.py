"""Turns a validated run config into the objects a run needs.

Each builder reads one part of the config and names the field in its errors:
the tokenizer (a Hugging Face folder or a char tokenizer for built-in tasks), the
model config and initial parameters (random or imported from a HF checkpoint,
straight into the mesh sharding), the objective chain and the optimizers.
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from jaxrl_llm import bridge, models, objectives as O
from jaxrl_llm.bridge.safetensors_io import SafetensorsCheckpoint
from jaxrl_llm.diagnostics import control
from jaxrl_llm.learner import optim
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import INIT_STD
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
  """Parameters placed in the mesh sharding: imported tensor by tensor, or random.

  Scalar heads on import (see :func:`stored_heads`): a head the folder's side
  file holds is imported; a critic (``value_head``) imported from a reward
  model's export, which has a ``reward_head`` and no value head, takes the
  reward head as its value head (the seeds' "critic initialised from the reward
  model": trunk and scalar head); any other head the folder lacks starts fresh
  (normal(0, 0.02) kernel, zero bias, from ``seed``).
  """
  shardings = models.param_shardings(model_config, mesh)
  if hf_folder:
    return _import_with_heads(hf_folder, model_config, mesh, seed)
  params = jax.jit(lambda key: models.init_params(model_config, key), out_shardings=shardings)(
      jax.random.PRNGKey(seed))
  return params


def stored_heads(hf_folder: str) -> frozenset[str]:
  """Names of the scalar heads (``value_head``, ``reward_head``) in a folder's heads side file."""
  path = os.path.join(hf_folder, bridge.hf_import.HEADS_FILE)
  if not os.path.isfile(path):
    return frozenset()
  with SafetensorsCheckpoint(hf_folder, filename=bridge.hf_import.HEADS_FILE) as reader:
    return frozenset(name.split("/")[0] for name in reader.names())


def _import_with_heads(hf_folder: str, model_config: ModelConfig, mesh: Mesh, seed: int) -> Any:
  stored = stored_heads(hf_folder)
  reward_as_value = (model_config.value_head and not model_config.reward_head and "value_head" not in stored
                     and "reward_head" in stored)
  load_config = model_config.replace(
      value_head=model_config.value_head and "value_head" in stored,
      reward_head=(model_config.reward_head and "reward_head" in stored) or reward_as_value)
  params = bridge.load_hf_params(hf_folder, load_config, shardings=models.param_shardings(load_config, mesh),
                                 require_heads=True)
  if reward_as_value:
    params["value_head"] = params.pop("reward_head")
    logging.warning("critic: value head and trunk initialised from the reward model in %s", hf_folder)
  shardings = models.param_shardings(model_config, mesh)
  for k, head in enumerate(h for h in ("value_head", "reward_head") if getattr(model_config, h) and h not in params):
    logging.warning("%s: no %s in %s; it starts from a random init", hf_folder, head, bridge.hf_import.HEADS_FILE)
    params[head] = _fresh_head(model_config, shardings[head], jax.random.fold_in(jax.random.PRNGKey(seed), k))
  return params


def _fresh_head(model_config: ModelConfig, shardings: Any, key: jax.Array) -> dict:
  """A scalar head as ``init_params`` makes it: kernel [D, 1] ~ normal(0, 0.02), bias [1] = 0."""
  dtype = jnp.dtype(model_config.param_dtype)

  def init(k):
    return {"kernel": (jax.random.normal(k, (model_config.hidden_size, 1), jnp.float32) * INIT_STD).astype(dtype),
            "bias": jnp.zeros((1,), dtype)}

  return jax.jit(init, out_shardings=shardings)(key)


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
  if config.control.enabled:
    kwargs.update(controlled_hypers(fn, kwargs, kl=config.control.kl_target > 0))
  return fn(**kwargs)


CLIP_HYPERS = ("eps", "eps_low", "eps_high")


def controlled_hypers(recipe_fn, kwargs: dict, kl: bool = False) -> dict:
  """The recipe's clip-range hyper-parameters (and KL coefficient) as
  :class:`~jaxrl_llm.objectives.Controlled` values, so the off-policy controller
  can scale them between steps (eps = base * clip scale).

  Args:
    recipe_fn: the recipe factory.
    kwargs: the arguments it will get (set fields); defaults fill the rest.
    kl: also control ``kl_coef`` (adaptive KL coefficient).

  Returns:
    ``{name: Controlled(base, key)}`` for each clip hyper-parameter the recipe
    takes with a numeric value.
  """
  params = inspect.signature(recipe_fn).parameters
  out = {}
  for name in CLIP_HYPERS + (("kl_coef",) if kl else ()):
    if name not in params:
      continue
    value = kwargs.get(name, params[name].default)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      out[name] = O.Controlled(float(value), control.KL_KEY if name == "kl_coef" else control.CLIP_KEY)
  return out


def objective_uses_reference(config: ml_collections.ConfigDict) -> bool:
  return bool(config.objective.kl_coef)


def needs_reference_policy(config: ml_collections.ConfigDict) -> bool:
  """A frozen copy of the warm-started policy is kept: for a KL loss term or the KL penalty in the reward."""
  return objective_uses_reference(config) or bool(config.advantage.kl_reward_coef)


def build_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  o = config.optimizer
  return optim.make_optimizer(o.lr, o.warmup_steps, total_steps, o.schedule, weight_decay=o.weight_decay,
                              b1=o.b1, b2=o.b2, max_grad_norm=o.max_grad_norm)


def build_sft_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The supervised warm start's optimizer: ``sft.lr`` after ``sft.warmup_steps``, constant, AdamW."""
  o = config.optimizer
  return optim.make_optimizer(config.sft.lr, config.sft.warmup_steps, max(1, config.sft.steps), "constant",
                              weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, max_grad_norm=o.max_grad_norm)
