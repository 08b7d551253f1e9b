"""The learner-facing entry points: objective -> (loss, metrics, state).

Two-stage structure, so that micro-batching and data parallelism cannot change
a single bit:

1. :func:`per_example_partials` runs the chain on a (micro-)batch and returns
   :class:`Partials`: the loss numerator/denominator per example and every
   metric as per-example partials. Each row's partials depend on that row
   only (and, for ``prompt_mean``, on its group).
2. :func:`finalize` reduces partials to the scalar loss and metrics with the
   pairwise trees of :mod:`jaxrl_llm.reduce`.

:func:`objective_loss` is both in one call, for use inside
``jax.value_and_grad``. For gradient accumulation over micro-batches, compute
``normaliser = loss_normaliser(partials_of_the_whole_batch)`` first (it does
not depend on the parameters; it can come from a forward-free pass with
``logp_bt = prox_logp_bt``), then differentiate
``micro_batch_loss(per_example_partials(mb)[0], normaliser)`` per micro-batch
and add the gradients; their sum is the gradient of the whole-batch loss. For
the reported loss and metrics, :func:`concat_partials` the micro-batches'
partials in global row order and :func:`finalize` them: the result has the bits
of the whole batch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from jaxrl_llm import reduce
from jaxrl_llm.objectives import differentiable
from jaxrl_llm.objectives import stats as S
from jaxrl_llm.objectives.base import ObjectiveTransform
from jaxrl_llm.objectives.record import TokenRecord, make_record


@struct.dataclass
class Partials:
  """Per-example loss and metric partials (leading axis B on every leaf).

  Attributes:
    loss_num_b: float32 [B] loss numerators.
    loss_den_b: float32 [B] loss denominators (independent of ``logp_bt``).
    metrics: dict name -> metric partial (:mod:`~jaxrl_llm.objectives.stats`).
  """

  loss_num_b: Array
  loss_den_b: Array
  metrics: dict


def _common_metrics(record: TokenRecord, quantiles: Sequence[float]) -> dict:
  """Diagnostics every objective reports (sampler-vs-learner consistency, ESS, masking)."""
  given = record.response_mask_bt
  log_ratio = jax.lax.stop_gradient(record.logp_bt) - record.behaviour_logp_bt
  ratio = jnp.exp(log_ratio)
  out = S.value_stats("ratio", ratio, given, quantiles)
  out["approx_kl_k1"] = S.token_mean(-log_ratio, given)
  out["approx_kl_k3"] = S.token_mean(jnp.expm1(log_ratio) - log_ratio, given)
  out["ess"] = S.ess(record.weights_bt, record.mask_bt)
  out["masked_share"] = S.token_fraction(~record.mask_bt, given)
  n_b = reduce.row_count(record.mask_bt)
  out["tokens"] = S.SumStat(n_b)
  out["sequences"] = S.SumStat((n_b > 0).astype(jnp.float32))
  return out


def per_example_partials(
    objective: ObjectiveTransform,
    logp_bt: Float[ArrayLike, "B T"],
    *,
    mask_bt: Bool[ArrayLike, "B T"],
    advantages_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Float[ArrayLike, "B T"],
    state: Any,
    prox_logp_bt: Optional[Float[ArrayLike, "B T"]] = None,
    ref_logp_bt: Optional[Float[ArrayLike, "B T"]] = None,
    lag_bt: Optional[Int[ArrayLike, "B T"]] = None,
    entropy_bt: Optional[Float[ArrayLike, "B T"]] = None,
    values_bt: Optional[Float[ArrayLike, "B T"]] = None,
    old_values_bt: Optional[Float[ArrayLike, "B T"]] = None,
    returns_bt: Optional[Float[ArrayLike, "B T"]] = None,
    sft_mask_bt: Optional[Bool[ArrayLike, "B T"]] = None,
    group_size: Optional[int] = None,
    quantiles: Sequence[float] = S.DEFAULT_QUANTILES,
) -> tuple[Partials, Any]:
  """Runs ``objective`` on a (micro-)batch and returns its per-example partials.

  Args:
    objective: an :class:`ObjectiveTransform` whose chain ends with
      :func:`~jaxrl_llm.objectives.aggregation.aggregate`.
    logp_bt: float [B, T] log pi_theta of the sampled tokens (differentiable).
    mask_bt: bool [B, T] tokens in the loss (response tokens incl. EOS).
    advantages_bt: float [B, T].
    behaviour_logp_bt: float [B, T] log mu recorded at sampling time.
    state: the objective's state (``objective.init(None)`` initially).
    prox_logp_bt: optional float [B, T] log pi_k (default: behaviour).
    ref_logp_bt: optional float [B, T] reference log-probabilities (KL terms).
    lag_bt: optional int [B, T] policy-version lag (staleness filter).
    entropy_bt: optional float [B, T] per-token entropy (entropy bonus).
    values_bt, old_values_bt, returns_bt: optional float [B, T] (value loss).
    sft_mask_bt: optional bool [B, T] tokens for the SFT term.
    group_size: optional N, samples per prompt (contiguous rows).
    quantiles: levels of the common ``ratio`` quantiles.

  Returns:
    (:class:`Partials`, new_state).

  Raises:
    ValueError: shapes differ (named in the message), a transform lacks an
      input it needs, or the chain has no ``aggregate``.
  """
  quantiles = S.check_quantiles("per_example_partials", quantiles)
  record = make_record(
      logp_bt, mask_bt=mask_bt, advantages_bt=advantages_bt,
      behaviour_logp_bt=behaviour_logp_bt, prox_logp_bt=prox_logp_bt, ref_logp_bt=ref_logp_bt,
      lag_bt=lag_bt, entropy_bt=entropy_bt, values_bt=values_bt, old_values_bt=old_values_bt,
      returns_bt=returns_bt, sft_mask_bt=sft_mask_bt, group_size=group_size,
      who="objective_loss")
  record, new_state = objective.update(record, state)
  if not isinstance(record, TokenRecord):
    raise TypeError(f"objective_loss: the objective's update returned {type(record).__name__}, "
                    "not a TokenRecord")
  if record.aggregation is None:
    raise ValueError("objective_loss: the objective has no aggregation; end the chain with "
                     "aggregate(mode), e.g. aggregate('token_mean')")
  metrics = dict(record.metrics)
  metrics.update(_common_metrics(record, quantiles))
  return Partials(record.loss_num_b, record.loss_den_b, metrics), new_state


def loss_normaliser(partials: Partials, axis_name: Optional[str] = None) -> jax.Array:
  """``batch_sum(loss_den_b)``: the loss denominator of the batch (float32 scalar)."""
  return reduce.batch_sum(partials.loss_den_b, axis_name=axis_name)


def micro_batch_loss(partials: Partials, normaliser: jax.Array,
                     axis_name: Optional[str] = None) -> jax.Array:
  """A micro-batch's share of the loss: ``batch_sum(loss_num_b) / normaliser`` (0 if 0)."""
  return reduce.safe_div(differentiable.batch_sum(partials.loss_num_b, axis_name), normaliser)


def finalize(partials: Partials, axis_name: Optional[str] = None) -> tuple[jax.Array, dict]:
  """Reduces partials to ``(loss, metrics)`` deterministically.

  ``loss = safe_div(batch_sum(num_b), batch_sum(den_b))``; metrics are
  finalised by :func:`~jaxrl_llm.objectives.stats.finalize_stats` and
  include ``loss`` and ``all_masked`` (1.0 when no token is left in the loss,
  in which case the loss and its gradient are exactly 0; when no token was
  given at all every metric is 0; never NaN).

  Args:
    partials: :class:`Partials` (of one batch or concatenated micro-batches).
    axis_name: optional mapped batch axis (inside ``shard_map``); every
      device must hold a power-of-two block for bitwise equality with the
      unsharded result.

  Returns:
    (float32 scalar loss, dict of float32 scalars).
  """
  normaliser = loss_normaliser(partials, axis_name)
  loss = micro_batch_loss(partials, normaliser, axis_name)
  metrics = S.finalize_stats(partials.metrics, axis_name)
  metrics["loss"] = jax.lax.stop_gradient(loss)
  # The normaliser is 0 exactly when no token is left in the loss (every mode).
  metrics["all_masked"] = (jax.lax.stop_gradient(normaliser) == 0).astype(jnp.float32)
  return loss, metrics


def objective_loss(
    objective: ObjectiveTransform,
    logp_bt: Float[ArrayLike, "B T"],
    *,
    mask_bt: Bool[ArrayLike, "B T"],
    advantages_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Float[ArrayLike, "B T"],
    state: Any,
    axis_name: Optional[str] = None,
    **fields: Any,
) -> tuple[jax.Array, tuple[dict, Any]]:
  """The scalar loss of ``objective`` on a batch, for ``jax.value_and_grad``.

  A pure function of arrays (never of the model)::

    def loss_fn(params):
      logp_bt = model_logp(params, batch)          # the learner's job
      return objective_loss(objective, logp_bt, mask_bt=..., advantages_bt=...,
                            behaviour_logp_bt=..., state=state)
    (loss, (metrics, state)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)

  Args:
    objective: see :func:`per_example_partials`.
    logp_bt, mask_bt, advantages_bt, behaviour_logp_bt, state: see there.
    axis_name: optional mapped batch axis (inside ``shard_map``).
    **fields: the optional [B, T] inputs and ``group_size`` / ``quantiles``
      of :func:`per_example_partials`.

  Returns:
    ``(loss, (metrics, new_state))``; loss is a float32 scalar.
  """
  partials, new_state = per_example_partials(
      objective, logp_bt, mask_bt=mask_bt, advantages_bt=advantages_bt,
      behaviour_logp_bt=behaviour_logp_bt, state=state, **fields)
  loss, metrics = finalize(partials, axis_name)
  return loss, (metrics, new_state)


def concat_partials(parts: Sequence[Partials]) -> Partials:
  """Concatenates micro-batch partials along the batch axis, in the given order.

  [B, T] leaves of different T are right-padded (value 0, mask False), which
  changes no result.
  """
  if not parts:
    raise ValueError("concat_partials: no partials given")
  keys = [sorted(p.metrics) for p in parts]
  if any(k != keys[0] for k in keys):
    raise ValueError("concat_partials: the partials come from different objectives "
                     "(metric names differ)")

  def cat(*leaves):
    if leaves[0].ndim == 2:
      t = max(x.shape[1] for x in leaves)
      leaves = [jnp.pad(x, ((0, 0), (0, t - x.shape[1]))) for x in leaves]
    return jnp.concatenate(leaves, axis=0)

  return jax.tree_util.tree_map(cat, *parts)
