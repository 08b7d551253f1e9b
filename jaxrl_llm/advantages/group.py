"""Group-relative (critic-free) sequence advantages: GRPO, Dr.GRPO, RLOO.

The N samples of a prompt are contiguous rows of the batch, so a reward vector
``rewards_b`` [B] reshapes to [G, N] with B = G * N. All statistics go through
:mod:`jaxrl_llm.reduce` (per-group pairwise trees), so a row's advantage has the
same bits whatever else is in the batch: splitting a batch at group boundaries,
appending padding groups or sharding the batch axis changes nothing. Under
``shard_map`` every device must hold whole groups (B_local % N == 0).

A group whose valid rewards are all equal (zero variance; "all right" or "all
wrong") carries no learning signal: its advantages are exactly 0 and it is
flagged in ``zero_variance_g`` / ``zero_variance_b`` for the data filter.
Equality is tested exactly (max == min over the valid rewards), never through a
rounded variance. A group with fewer than two valid samples is flagged too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.advantages import checks

# Names of the group-relative estimators (``advantage.estimator`` in a run config).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


class GroupAdvantages(NamedTuple):
  """Sequence-level advantages with the zero-variance flags.

  Attributes:
    advantages_b: float32 [B]; 0 for invalid rows and zero-variance groups.
    zero_variance_b: bool [B], the group's flag repeated on each of its rows.
    zero_variance_g: bool [G], True where all valid rewards of the group are
      equal or the group has fewer than two valid samples.
  """

  advantages_b: Array
  zero_variance_b: Array
  zero_variance_g: Array


def _prepare(who: str, rewards_b, group_size, valid_b):
  checks.check_rank(who, "rewards_b", rewards_b, 1, "[B]")
  b = checks.shape_of(rewards_b)[0]
  n = checks.check_group_size(who, b, group_size)
  checks.optional_valid(valid_b, who, b, "rewards_b")
  rewards = jnp.asarray(rewards_b, jnp.float32)
  valid = jnp.ones((b,), bool) if valid_b is None else jnp.asarray(valid_b).astype(bool)
  return rewards, valid, n


def group_zero_variance(
    rewards_b: Float[ArrayLike, "B"],
    group_size: int,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
) -> Bool[Array, "G"]:
  """Flags groups whose valid rewards are all equal (or that have < 2 valid samples).

  Args:
    rewards_b: float [B] sequence rewards, groups of ``group_size`` contiguous rows.
    group_size: N, dividing B.
    valid_b: optional bool [B]; invalid rows are ignored.

  Returns:
    bool [G]: ``max_g == min_g`` over valid rewards, or valid count < 2.
  """
  rewards, valid, n = _prepare("group_zero_variance", rewards_b, group_size, valid_b)
  return _zero_variance_g(rewards, valid, n)


def _zero_variance_g(rewards, valid, n):
  g = rewards.shape[0] // n
  r_gn = rewards.reshape(g, n)
  v_gn = valid.reshape(g, n)
  hi = jnp.max(jnp.where(v_gn, r_gn, -jnp.inf), axis=1)
  lo = jnp.min(jnp.where(v_gn, r_gn, jnp.inf), axis=1)
  count = jnp.sum(v_gn.astype(jnp.int32), axis=1)
  return (hi == lo) | (count < 2)


def group_advantages(
    rewards_b: Float[ArrayLike, "B"],
    group_size: int,
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    ddof: int = 0,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
) -> GroupAdvantages:
  """Group-relative sequence advantages for one of ``GROUP_ESTIMATORS``.

  With ``mean_g``/``std_g`` over the valid rewards of row i's group g and n_g
  valid samples::

    grpo:    A_i = (r_i - mean_g) / (std_g + eps)
    dr_grpo: A_i =  r_i - mean_g
    rloo:    A_i =  r_i - (sum_{j in g} r_j - r_i) / (n_g - 1)
                 =  n_g / (n_g - 1) * (r_i - mean_g)

  ``std_g`` is the population standard deviation (``ddof=0``) or the sample one
  (``ddof=1``, as ``torch.std`` in TRL / verl). Invalid rows and zero-variance
  groups get exactly 0. Divisions are computed as products with the reciprocal
  of the group statistic (``(r_i - mean_g) * (1 / (std_g + eps))``), which keeps
  the bits independent of the number of groups in the batch.

  Example::

    out = group_advantages(rewards_b, group_size=8, estimator="grpo")
    adv_bt = sequence_to_tokens(out.advantages_b, response_mask_bt)

  Args:
    rewards_b: float [B] sequence rewards; the N samples of a prompt contiguous.
    group_size: N, a positive int dividing B.
    estimator: "grpo", "dr_grpo" or "rloo".
    eps: GRPO's denominator epsilon (> 0).
    ddof: 0 or 1, the delta degrees of freedom of GRPO's std.
    valid_b: optional bool [B]; False rows (e.g. padding, failed samples) are
      left out of their group's statistics and get advantage 0.

  Returns:
    :class:`GroupAdvantages`.

  Raises:
    ValueError: unknown estimator, group_size not dividing B, bad shapes.

  References:
    GRPO: Shao et al., DeepSeekMath, arXiv:2402.03300.
    Dr.GRPO: Liu et al., Understanding R1-Zero-Like Training, arXiv:2503.20783.
    RLOO: Ahmadian et al., Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback, arXiv:2402.14740.
  """
  who = "group_advantages"
  checks.check_choice(who, "estimator", estimator, GROUP_ESTIMATORS)
  if ddof not in (0, 1):
    raise ValueError(f"{who}: ddof must be 0 or 1; got {ddof!r}")
  checks.check_positive(who, "eps", eps)
  rewards, valid, n = _prepare(who, rewards_b, group_size, valid_b)

  mean_g, var_g, count_g = reduce.group_moments(rewards, n, valid)
  zero_var_g = _zero_variance_g(rewards, valid, n)
  mean_b = jnp.repeat(mean_g, n)
  # Divisions by a per-group statistic are written as products with a reciprocal
  # taken at shape [G]: XLA rewrites x / broadcast(y) into x * broadcast(1 / y) for
  # some shapes only (e.g. G == 1), which would make the bits depend on the batch.
  if estimator == "grpo":
    if ddof:
      var_g = reduce.safe_div(var_g * count_g, count_g - 1.0)
    inv_std_b = jnp.repeat(1.0 / (jnp.sqrt(var_g) + eps), n)
    adv = (rewards - mean_b) * inv_std_b
  elif estimator == "dr_grpo":
    adv = rewards - mean_b
  else:
    sum_b = jnp.repeat(reduce.group_sum(rewards, n, valid), n)
    inv_others_b = jnp.repeat(reduce.safe_div(1.0, count_g - 1.0), n)
    adv = rewards - (sum_b - rewards) * inv_others_b
  zero_var_b = jnp.repeat(zero_var_g, n)
  adv = jnp.where(valid & ~zero_var_b, adv, 0.0)
  return GroupAdvantages(adv, zero_var_b, zero_var_g)


def grpo_advantages(
    rewards_b: Float[ArrayLike, "B"],
    group_size: int,
    *,
    eps: float = 1e-6,
    ddof: int = 0,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
) -> GroupAdvantages:
  """GRPO: ``A_i = (r_i - mean_g) / (std_g + eps)``.

  Arguments and returns as :func:`group_advantages` with ``estimator="grpo"``.

  References:
    Shao et al., DeepSeekMath, arXiv:2402.03300.
  """
  return group_advantages(rewards_b, group_size, estimator="grpo", eps=eps, ddof=ddof,
                          valid_b=valid_b)


def dr_grpo_advantages(
    rewards_b: Float[ArrayLike, "B"],
    group_size: int,
    *,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
) -> GroupAdvantages:
  """Dr.GRPO: ``A_i = r_i - mean_g`` (no division by the group std).

  Arguments and returns as :func:`group_advantages` with ``estimator="dr_grpo"``.

  References:
    Liu et al., Understanding R1-Zero-Like Training, arXiv:2503.20783.
  """
  return group_advantages(rewards_b, group_size, estimator="dr_grpo", valid_b=valid_b)


def rloo_advantages(
    rewards_b: Float[ArrayLike, "B"],
    group_size: int,
    *,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
) -> GroupAdvantages:
  """RLOO: ``A_i = r_i - mean_{j != i} r_j`` (leave-one-out baseline within the group).

  Arguments and returns as :func:`group_advantages` with ``estimator="rloo"``.

  References:
    Ahmadian et al., Back to Basics, arXiv:2402.14740.
  """
  return group_advantages(rewards_b, group_size, estimator="rloo", valid_b=valid_b)


def sequence_to_tokens(
    values_b: Float[ArrayLike, "B"],
    mask_bt: Bool[ArrayLike, "B T"],
) -> Float[Array, "B T"]:
  """Broadcasts a per-sequence value to that sequence's response tokens.

  ``out[b, t] = values_b[b] if mask_bt[b, t] else 0``.

  Args:
    values_b: float [B], e.g. ``GroupAdvantages.advantages_b``.
    mask_bt: bool [B, T] response mask.

  Returns:
    float32 [B, T].
  """
  who = "sequence_to_tokens"
  b, _ = checks.check_bt(who, mask_bt=mask_bt)
  checks.check_b(who, "values_b", values_b, b, "mask_bt")
  values = jnp.asarray(values_b, jnp.float32)[:, None]
  return jnp.where(jnp.asarray(mask_bt).astype(bool), values, 0.0)
