"""Turns a validated run config into the objects a run needs.

Each builder reads one part of the config and names the field in its errors:
the tokenizer (a Hugging Face folder or a char tokenizer for built-in tasks), the
model config and initial parameters (random or imported from a HF checkpoint,
straight into the mesh sharding), the objective (``objective.recipe`` with
``objective.kwargs``, see :func:`recipe_call`) and the optimizers.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_collections
import optax
from jax.sharding import Mesh

from jaxrl_llm import bridge, models, objectives as O, settings as settings_lib
from jaxrl_llm.bridge.safetensors_io import SafetensorsCheckpoint
from jaxrl_llm.diagnostics import control
from jaxrl_llm.learner import optim
from jaxrl_llm.models import lora
from jaxrl_llm.models.api import LORA_KEY
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import INIT_STD
from jaxrl_llm.tasks import base as task_base


def build_tokenizer(config: ml_collections.ConfigDict, task: task_base.Task) -> bridge.Tokenizer:
  """``init.tokenizer`` folder, else the HF checkpoint's, else a char tokenizer of the task."""
  folder = config.init.tokenizer or config.init.hf_checkpoint
  if folder:
    return bridge.Tokenizer.from_folder(folder)
  specials = bridge.tokenizer.DEFAULT_CHAR_SPECIALS + tuple(getattr(task, "special_tokens", ()))
  return bridge.build_char_tokenizer(task.alphabet, specials)


def build_model_config(config: ml_collections.ConfigDict, tokenizer: bridge.Tokenizer,
                       **overrides: Any) -> ModelConfig:
  """The policy's ModelConfig: from the HF checkpoint's config.json, or from ``config.model``.

  ``config.model.lora`` gives the adapters (rank 0: none) in either case.
  """
  m = config.model
  lo = m.lora
  overrides = dict(lora_rank=lo.rank, lora_alpha=float(lo.alpha), lora_targets=tuple(lo.targets) if lo.rank else (),
                   **overrides)
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
  reward head as its value head (the critic initialised from the reward model,
  trunk and scalar head, as in Ouyang et al., arXiv:2203.02155); any other head the folder lacks starts fresh
  (normal(0, 0.02) kernel, zero bias, from ``seed``).
  """
  shardings = models.param_shardings(model_config, mesh)
  if hf_folder:
    if not model_config.lora_rank:
      return _import_with_heads(hf_folder, model_config, mesh, seed)
    base = _import_with_heads(hf_folder, model_config.replace(lora_rank=0, lora_targets=()), mesh, seed)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), LORA_KEY)
    return jax.jit(lambda p: lora.add_adapters(p, model_config, key), out_shardings=shardings)(base)
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


# ------------------------------------------------------------------ objective
#
# config.objective -> RECIPES[objective.recipe](**arguments). The recipe is the single
# default: a parameter left out of objective.kwargs takes the default of the recipe's
# signature, exactly as objectives.recipe(name) would; no recipe is special-cased by
# name. The few parameters that depend on the run rather than on the algorithm are
# filled in by parameter NAME, for every recipe that takes one (RUN_VALUES):
#   max_response_len  <- float(rl.max_new_tokens)   (Dr.GRPO's constant C)
#   value_coef        <- None when critic.enabled is False (no value loss);
#                        with a critic, the recipe's default
# A recipe parameter without a default that is not in this table cannot be built from
# a config. Whether a run needs a reference policy follows from the effective kl_coef
# of the call (the recipe's default included).


def parameters(fn: Callable) -> dict[str, inspect.Parameter]:
  """The keyword-passable parameters of a recipe or task factory, by name (in signature order)."""
  kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds}


def unknown_kwargs(path: str, kwargs: Mapping[str, Any], fn: Callable, what: str) -> list[str]:
  """Errors for keys of ``kwargs`` that ``fn`` does not take, each naming ``<path>.<key>`` and what ``fn`` takes."""
  accepted = parameters(fn)
  return [f"{path}.{k}={v!r}: not a parameter of {what} (it takes: {', '.join(accepted) or 'nothing'})"
          f"{settings_lib.did_you_mean(k, accepted)}" for k, v in kwargs.items() if k not in accepted]


class _RecipeDefault:
  """Marker of :data:`RUN_VALUES`: the run leaves the recipe's default in place."""

  def __repr__(self):
    return "RECIPE_DEFAULT"


RECIPE_DEFAULT = _RecipeDefault()


@dataclasses.dataclass(frozen=True)
class RunValue:
  """A recipe parameter whose value comes from the run.

  Attributes:
    source: what the run provides, in words (shown in docs/config.md).
    value: ``config -> value`` (or :data:`RECIPE_DEFAULT`), used when
      ``objective.kwargs`` does not set the parameter.
    conflict: ``(config, explicit value) -> error text or None``: an explicit
      value the run cannot honour.
  """

  source: str
  value: Callable[[ml_collections.ConfigDict], Any]
  conflict: Optional[Callable[[ml_collections.ConfigDict, Any], Optional[str]]] = None


def _value_coef_conflict(config: ml_collections.ConfigDict, value: Any) -> Optional[str]:
  if value is None or config.critic.enabled:
    return None
  return "expected None or unset with critic.enabled=False (the value loss needs a critic's values)"


RUN_VALUES: dict[str, RunValue] = {
    "max_response_len": RunValue("float(rl.max_new_tokens)", lambda c: float(c.rl.max_new_tokens)),
    "value_coef": RunValue("None when critic.enabled=False (no value loss); else the recipe's default",
                           lambda c: RECIPE_DEFAULT if c.critic.enabled else None, _value_coef_conflict),
}


@dataclasses.dataclass(frozen=True)
class RecipeCall:
  """A resolved ``config.objective``.

  Attributes:
    recipe: the recipe name.
    arguments: what the recipe is called with: ``objective.kwargs`` plus the
      run-provided values of :data:`RUN_VALUES` (never a recipe default).
    values: every parameter's effective value (recipe defaults filled in).
  """

  recipe: str
  arguments: dict
  values: dict

  @property
  def fn(self) -> Callable[..., O.ObjectiveTransform]:
    return O.RECIPES[self.recipe]

  @property
  def kl_coef(self) -> float:
    """The effective coefficient of the recipe's KL-to-reference term (0.0 when it has none)."""
    return float(self.values.get("kl_coef") or 0.0)

  @property
  def entropy_coef(self) -> float:
    """The effective entropy-bonus coefficient (0.0 when the recipe has none)."""
    return float(self.values.get("entropy_coef") or 0.0)

  def build(self, **overrides: Any) -> O.ObjectiveTransform:
    """``RECIPES[recipe](**arguments, **overrides)`` (``overrides``: e.g. controlled hyper-parameters)."""
    return self.fn(**{**self.arguments, **overrides})


def recipe_call(config: ml_collections.ConfigDict) -> RecipeCall:
  """Resolves ``config.objective`` (and the run values) into a :class:`RecipeCall`.

  Raises:
    ValueError: naming ``objective.kwargs.<name>`` for a parameter the recipe
      does not take or an explicit value the run cannot honour, or a required
      parameter that neither the config nor the run provides.
  """
  errors = kwarg_errors(config)
  call = _resolve(config, errors)
  if errors:
    raise ValueError("; ".join(errors))
  return call


def kwarg_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Keys of ``objective.kwargs`` that the recipe does not take."""
  name = config.objective.recipe
  return unknown_kwargs("objective.kwargs", dict(config.objective.kwargs), O.RECIPES[name],
                        f"recipe {name!r}")


def objective_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Problems of a ``config.objective`` whose kwargs the recipe takes: values the run cannot honour, a
  required parameter nobody provides, values the recipe itself rejects (for ``validate``)."""
  errors: list[str] = []
  call = _resolve(config, errors)
  if errors:
    return errors
  try:
    call.build()
  except (TypeError, ValueError) as e:
    return [f"objective.kwargs={call.arguments!r}: recipe {call.recipe!r} rejects them: {e}"]
  return []


def _resolve(config: ml_collections.ConfigDict, errors: list[str]) -> RecipeCall:
  """The call of ``config.objective``; appends resolution problems to ``errors``."""
  name = config.objective.recipe
  given = dict(config.objective.kwargs)
  arguments, values = {}, {}
  for pname, param in parameters(O.RECIPES[name]).items():
    rule = RUN_VALUES.get(pname)
    if pname in given:
      value = given[pname]
      problem = rule.conflict(config, value) if rule and rule.conflict else None
      if problem:
        errors.append(f"objective.kwargs.{pname}={value!r}: {problem}")
    elif rule is not None and rule.value(config) is not RECIPE_DEFAULT:
      value = rule.value(config)
    elif param.default is not inspect.Parameter.empty:
      values[pname] = param.default
      continue
    else:
      errors.append(f"objective.kwargs.{pname}: recipe {name!r} needs it (no default, and the run provides none)")
      continue
    arguments[pname] = values[pname] = value
  return RecipeCall(name, arguments, values)


def build_objective(config: ml_collections.ConfigDict) -> O.ObjectiveTransform:
  """The objective of a run: ``chain(*corrections, [sft_loss], recipe)``.

  * ``objective.corrections`` (:func:`build_corrections`) come first, so their
    weights and filters reach the policy term that consumes them;
  * ``sft_loss(data.sft_mix_coef)`` when ``data.sft_mix`` mixes demonstrations in;
  * the recipe: :func:`recipe_call` built, with controlled hyper-parameters
    under ``control.enabled`` (the clip range; with ``control.kl_target``, the
    KL coefficient too). It ends with the aggregation.

  Raises:
    ValueError: naming ``objective.kwargs.<name>`` for a parameter the recipe
      does not take (and listing what it takes), or the ``objective.corrections``
      entry that cannot be built.
  """
  call = recipe_call(config)
  recipe = (call.build(**controlled_hypers(call, kl=config.control.kl_target > 0)) if config.control.enabled
            else call.build())
  parts = build_corrections(config)
  if config.data.sft_mix:
    parts.append(O.sft_loss(config.data.sft_mix_coef))
  return O.chain(*parts, recipe) if parts else recipe


# ------------------------------------------------------------------ corrections
#
# objective.corrections = ((name, {argument: value}), ...): transforms of
# objectives.CORRECTIONS inserted, in order, before the recipe's policy term.

NEEDS_PROX = ("decoupled_ppo", "geppo")  # recipes whose definition uses pi_k != mu


def build_corrections(config: ml_collections.ConfigDict) -> list[O.ObjectiveTransform]:
  """The transforms of ``objective.corrections``, in order.

  Raises:
    ValueError: naming the entry (``objective.corrections[i]``) and what was expected.
  """
  errors = correction_errors(config)
  if errors:
    raise ValueError("; ".join(errors))
  return [O.CORRECTIONS[name](**dict(kwargs)) for name, kwargs in config.objective.corrections]


def correction_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Problems of ``objective.corrections`` entries and of what they and the recipe need from the run.

  Each entry must name a transform of :data:`jaxrl_llm.objectives.CORRECTIONS` with
  arguments it takes and values it accepts. Every correction and the recipes
  of :data:`NEEDS_PROX` need the learner's pi_k (``objective.proximal='learner'``);
  ``staleness_filter(max_lag=...)`` needs stale data (``rollout.mode='pipeline'``
  with ``rollout.max_lag > 0``, or ``rollout.simulated_lag > 0``).
  """
  errors = []
  stale = ((config.rollout.mode == "pipeline" and config.rollout.max_lag > 0) or config.rollout.simulated_lag > 0)
  behaviour = config.objective.proximal == "behaviour"
  if behaviour and config.objective.recipe in NEEDS_PROX:
    errors.append(f"objective.recipe={config.objective.recipe!r} with objective.proximal='behaviour': expected "
                  "objective.proximal='learner' (the recipe clips against the learner's pi_k and weights by "
                  "pi_k / mu; with pi_k := mu it is plain PPO)")
  for i, entry in enumerate(config.objective.corrections):
    errors += _entry_errors(f"objective.corrections[{i}]", entry[0], dict(entry[1]), behaviour, stale, config)
  return errors


CLIP_HYPERS = ("eps", "eps_low", "eps_high")


def controlled_hypers(call: RecipeCall, kl: bool = False) -> dict:
  """The recipe's clip-range hyper-parameters (and KL coefficient) as
  :class:`~jaxrl_llm.objectives.Controlled` values, so the off-policy controller
  can scale them between steps (eps = base * clip scale).

  Args:
    call: the resolved recipe call (its effective values give the bases).
    kl: also control ``kl_coef`` (adaptive KL coefficient).

  Returns:
    ``{name: Controlled(base, key)}`` for each clip hyper-parameter the recipe
    takes with a numeric value.
  """
  out = {}
  for name in CLIP_HYPERS + (("kl_coef",) if kl else ()):
    value = call.values.get(name)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      out[name] = O.Controlled(float(value), control.KL_KEY if name == "kl_coef" else control.CLIP_KEY)
  return out


def objective_kl_coef(config: ml_collections.ConfigDict) -> float:
  """The effective coefficient of the recipe's KL term (the recipe's default when ``objective.kwargs`` omits it)."""
  return recipe_call(config).kl_coef


def objective_uses_entropy(config: ml_collections.ConfigDict) -> bool:
  """Whether the recipe has an entropy bonus (the learner then computes per-token entropies)."""
  return recipe_call(config).entropy_coef > 0


def objective_uses_reference(config: ml_collections.ConfigDict) -> bool:
  """Whether the built recipe has a KL term against the reference policy (effective ``kl_coef`` > 0)."""
  return objective_kl_coef(config) > 0


def needs_reference_policy(config: ml_collections.ConfigDict) -> bool:
  """A frozen copy of the warm-started policy is kept: for a KL loss term or the KL penalty in the reward."""
  return objective_uses_reference(config) or bool(config.advantage.kl_reward_coef)


def _entry_errors(where: str, name: str, kwargs: dict, behaviour: bool, stale: bool,
                  config: ml_collections.ConfigDict) -> list[str]:
  """Problems of one ``objective.corrections`` entry (see :func:`correction_errors`)."""
  if name not in O.CORRECTIONS:
    return [f"{where}: unknown correction {name!r}; expected one of {sorted(O.CORRECTIONS)}"]
  fn = O.CORRECTIONS[name]
  errors = [e.replace("objective.corrections.", f"{where}.") for e in
            unknown_kwargs("objective.corrections", kwargs, fn, f"correction {name!r}")]
  missing = [n for n, p in parameters(fn).items() if p.default is inspect.Parameter.empty and n not in kwargs]
  if missing:
    errors.append(f"{where}: correction {name!r} needs {', '.join(missing)}")
  if errors:
    return errors
  try:
    fn(**kwargs)
  except (TypeError, ValueError) as e:
    return [f"{where}={(name, kwargs)!r}: {e}"]
  if behaviour:
    errors.append(f"{where}: correction {name!r} reads rho_k = pi_k / mu, but objective.proximal='behaviour' "
                  "sets pi_k := mu (rho_k = 1); expected objective.proximal='learner'")
  if kwargs.get("max_lag") is not None and not stale:
    errors.append(f"{where}: {name}(max_lag=...) filters on version lags, but this run's data is never stale "
                  f"(rollout.mode={config.rollout.mode!r}, rollout.max_lag={config.rollout.max_lag}, "
                  "rollout.simulated_lag=0); expected rollout.mode='pipeline' with rollout.max_lag > 0 or "
                  "rollout.simulated_lag > 0")
  return errors


# ------------------------------------------------------------------ optimizers


def for_trainable(config: ml_collections.ConfigDict, optimizer: optax.GradientTransformation
                  ) -> optax.GradientTransformation:
  """``optimizer`` over the trainable leaves only when ``model.lora.rank`` > 0 (adapters and scalar heads)."""
  return optim.train_only(optimizer) if config.model.lora.rank else optimizer


def build_optimizer(config: ml_collections.ConfigDict, total_steps: int) -> optax.GradientTransformation:
  o = config.optimizer
  return for_trainable(config, optim.make_optimizer(o.lr, o.warmup_steps, total_steps, o.schedule,
                                                    weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                                    max_grad_norm=o.max_grad_norm))


def build_sft_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """The supervised warm start's optimizer: ``sft.lr`` after ``sft.warmup_steps``, constant, AdamW."""
  o = config.optimizer
  return for_trainable(config, optim.make_optimizer(config.sft.lr, config.sft.warmup_steps, max(1, config.sft.steps),
                                                    "constant", weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                                    max_grad_norm=o.max_grad_norm))
