"""Running reward z-score normalisation with a checkpointable Welford/Chan state.

The state is a small pytree of arrays (``count``, ``mean``, ``m2``) that orbax
saves as-is; updates are pure and merge a batch's moments into the running ones
with the parallel (Chan et al.) formula, the batch moments coming from the
deterministic reductions of :mod:`jaxrl_llm.reduce` (so the update has the same
bits for any padding or sharding of the batch, and spans all data-parallel
devices with ``axis_name`` inside ``shard_map``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.advantages import checks


class RunningMoments(NamedTuple):
  """Running statistics of every value seen so far.

  Attributes:
    count: int32 scalar, number of values (exact up to 2^31).
    mean: float32 scalar.
    m2: float32 scalar, sum of squared deviations from the mean
      (population variance = m2 / count).
  """

  count: Array
  mean: Array
  m2: Array


def running_moments_init() -> RunningMoments:
  """The empty state: count 0, mean 0, m2 0."""
  return RunningMoments(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32),
                        jnp.zeros((), jnp.float32))


def running_moments_update(
    state: RunningMoments,
    values_b: Float[ArrayLike, "B"],
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
    *,
    axis_name: Optional[str] = None,
) -> RunningMoments:
  """Merges a batch into the running moments (parallel Welford / Chan update).

  With the state (n_a, mean_a, M2_a) and the batch's (n_b, mean_b, M2_b)::

    n     = n_a + n_b
    delta = mean_b - mean_a
    mean  = mean_a + delta * n_b / n
    M2    = M2_a + M2_b + delta^2 * n_a * n_b / n

  An empty batch (no valid value) leaves the state unchanged.

  Args:
    state: :class:`RunningMoments`.
    values_b: float [B] (e.g. sequence rewards).
    valid_b: optional bool [B]; False rows are ignored (padding).
    axis_name: data-parallel axis inside ``shard_map``.

  Returns:
    The updated :class:`RunningMoments`.

  References:
    Chan, Golub, LeVeque, Updating Formulae and a Pairwise Algorithm for
    Computing Sample Variances (1979); Welford (1962).
  """
  who = "running_moments_update"
  checks.check_rank(who, "values_b", values_b, 1, "[B]")
  checks.optional_valid(valid_b, who, checks.shape_of(values_b)[0], "values_b")
  values = jnp.asarray(values_b, jnp.float32)
  valid = jnp.ones(values.shape, bool) if valid_b is None else jnp.asarray(valid_b).astype(bool)
  n_new = jnp.sum(valid.astype(jnp.int32))
  if axis_name is not None:
    n_new = jax.lax.psum(n_new, axis_name)
  n_b = n_new.astype(jnp.float32)
  mean_b, var_b = reduce.batch_moments(values, valid, axis_name)
  n_a = state.count.astype(jnp.float32)
  n = n_a + n_b
  delta = mean_b - state.mean
  mean = state.mean + delta * reduce.safe_div(n_b, n)
  m2 = state.m2 + var_b * n_b + delta * delta * reduce.safe_div(n_a * n_b, n)
  return RunningMoments(state.count + n_new, mean, m2)


def running_variance(state: RunningMoments) -> Array:
  """Population variance m2 / count (0 for an empty state)."""
  return reduce.safe_div(state.m2, state.count.astype(jnp.float32))


def running_zscore(
    state: RunningMoments,
    values: Float[ArrayLike, "..."],
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
) -> Float[Array, "..."]:
  """Normalises values with running statistics.

  ``z = (x - mean) / (std + eps)`` (``shift_mean=True``) or ``x / (std + eps)``
  (``shift_mean=False``: scale only). While the running variance is exactly 0
  (no data yet, one value, or all values equal) nothing is scaled: the result is
  ``x - mean`` or ``x``.

  Args:
    state: :class:`RunningMoments`.
    values: float array of any shape.
    eps: added to the std (> 0).
    shift_mean: subtract the running mean.

  Returns:
    float32, the shape of ``values``.
  """
  checks.check_positive("running_zscore", "eps", eps)
  x = jnp.asarray(values, jnp.float32)
  centred = x - state.mean if shift_mean else x
  var = running_variance(state)
  # a product with the scalar reciprocal: the same bits eagerly and under jit.
  return jnp.where(var > 0, centred * (1.0 / (jnp.sqrt(var) + eps)), centred)


class RewardNormalizer(NamedTuple):
  """Pure pair: ``init() -> state``; ``update(state, rewards_b, valid_b) -> (z_b, state)``."""

  init: Callable[[], RunningMoments]
  update: Callable[..., tuple[Array, RunningMoments]]


def running_reward_normalizer(
    *,
    eps: float = 1e-8,
    shift_mean: bool = True,
    axis_name: Optional[str] = None,
) -> RewardNormalizer:
  """Running reward z-score: each call first merges the batch, then normalises it.

  ``update(state, rewards_b, valid_b=None)`` returns ``(z_b, new_state)`` with
  ``z_b = running_zscore(new_state, rewards_b)`` and 0 on invalid rows.

  Args:
    eps: added to the std (> 0).
    shift_mean: subtract the running mean (z-score) or only scale.
    axis_name: data-parallel axis inside ``shard_map``.

  Returns:
    :class:`RewardNormalizer`.
  """
  checks.check_positive("running_reward_normalizer", "eps", eps)

  def update(state, rewards_b, valid_b=None):
    state = running_moments_update(state, rewards_b, valid_b, axis_name=axis_name)
    z = running_zscore(state, rewards_b, eps=eps, shift_mean=shift_mean)
    if valid_b is not None:
      z = jnp.where(jnp.asarray(valid_b).astype(bool), z, 0.0)
    return z, state

  return RewardNormalizer(running_moments_init, update)
