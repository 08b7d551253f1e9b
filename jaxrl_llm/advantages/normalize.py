"""Advantage normalisation modes and whitening, with batch-invariant statistics.

Statistics are taken over the *masked* entries only (response tokens, or valid
sequences at ``level="sequence"``), through :mod:`jaxrl_llm.reduce`, so the
result has the same bits for any padding, micro-batching at group boundaries
(``group`` mode) and data-parallel sharding of the batch axis.

Modes (see docs/advantages.md):

=========  ==========================================  ==========================
mode       statistics over                             use
=========  ==========================================  ==========================
none       (identity; zeros outside the mask)          Dr.GRPO, RLOO
batch      all masked entries of the arrays passed     PPO whitening, ScaleRL
group      the masked entries of each prompt's group   prompt-level normalisation
global     all masked entries on every device of       PPO / ScaleRL inside
           ``axis_name`` (inside ``shard_map``)        ``shard_map``
=========  ==========================================  ==========================

``batch`` versus ``global``: under plain ``jit`` a batch sharded with
``NamedSharding`` is one global array and ``batch`` statistics already span all
data-parallel ranks (GSPMD inserts the collectives). Inside ``shard_map`` each
device sees only its block, so ``batch`` would normalise per device; ``global``
combines the per-device partial sums over ``axis_name`` with
:mod:`jaxrl_llm.reduce` and gives the bits of the unsharded computation
(per-device block sizes a power of two).

Degenerate statistics: where the selected entries are all equal up to float32
rounding (or there are none), nothing is scaled: the output is exactly 0 when the
mean is shifted, else the input. "Equal up to rounding" means that their range
is at most ``DEGENERATE_RTOL`` = 2^-18 = 64 u (u = 2^-24, the float32 unit
roundoff) times the largest magnitude of the masked *token* values they come
from::

  degenerate  <=>  max(v) - min(v) <= DEGENERATE_RTOL * max_t |x_t|   (or no entry)

An exact ``max == min`` test is not enough at ``level="sequence"``: a sequence's
value is the mean of its tokens, and the pairwise mean of three copies of
``a = 0.4639781`` is ``a`` + 1 ulp in float32, so a constant advantage would have
a 1-ulp spread, which ``1 / (std + eps)`` blows up to ~4.5e5. Two guards:

* a row whose masked tokens are all equal (a sequence advantage broadcast over
  its tokens) is valued by that token value, exactly, not by a rounded mean, so
  equal sequence advantages give equal sequence values whatever the lengths;
* the relative tolerance covers the remaining rounding: a masked mean of T
  values by the pairwise tree is off by at most ``(ceil(log2 T) + 1) u max_t |x_t|``
  (the sum's error bound plus the division), so the means of two rows of equal
  exact mean differ by at most ``2 (ceil(log2 T) + 1) u max_t |x_t|``, within
  the tolerance for any T <= 2^31. A spread that small carries no information
  in float32, at either level.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.advantages import checks

MODES = ("none", "batch", "group", "global")
LEVELS = ("token", "sequence")
# Largest range, relative to the largest masked |token value|, that counts as "all
# equal" (module docstring): 64 u (float32 unit roundoff u = 2^-24), above the
# rounding of any masked mean of up to 2^31 tokens.
DEGENERATE_RTOL = 2.0 ** -18


class Moments(NamedTuple):
  """Masked statistics.

  Attributes:
    mean: float32 scalar (batch) or [G] (group).
    var: population variance, same shape.
    count: number of entries (tokens or sequences) the statistics cover.
    degenerate: bool, True where all covered entries are equal up to rounding
      (range <= ``DEGENERATE_RTOL`` * largest masked |token value|) or none exist.
  """

  mean: Array
  var: Array
  count: Array
  degenerate: Array


def _as_bt(who, x, mask):
  """Accepts [B] (+ optional [B]) or [B, T] (+ optional [B, T]); returns [B, T'] pair."""
  if mask is None:
    mask = jnp.ones(checks.shape_of(x), bool)
  if jnp.ndim(x) == 1:
    checks.check_same_shape(who, values=x, mask=mask)
    return jnp.asarray(x, jnp.float32)[:, None], jnp.asarray(mask).astype(bool)[:, None]
  checks.check_bt(who, values=x, mask=mask)
  return jnp.asarray(x, jnp.float32), jnp.asarray(mask).astype(bool)


def _extremes(x, valid, axis=None, axis_name=None):
  """(max, min) over the valid entries (-inf / +inf where there are none)."""
  hi = jnp.max(jnp.where(valid, x, -jnp.inf), axis=axis)
  lo = jnp.min(jnp.where(valid, x, jnp.inf), axis=axis)
  if axis_name is not None:
    hi = jax.lax.pmax(hi, axis_name)
    lo = jax.lax.pmin(lo, axis_name)
  return hi, lo


def _negligible_spread(hi, lo, tok_hi, tok_lo):
  """True where the range ``hi - lo`` is rounding noise at the scale of the token values.

  ``tok_hi`` / ``tok_lo`` are the extremes of the masked token values the entries
  come from (the entries themselves at token level). With no entry, ``hi - lo`` is
  -inf and the result is True.
  """
  scale = jnp.maximum(jnp.abs(tok_hi), jnp.abs(tok_lo))
  return (hi - lo) <= DEGENERATE_RTOL * scale


def masked_moments(
    x_bt: Float[ArrayLike, "B T"],
    mask_bt: Optional[Bool[ArrayLike, "B T"]] = None,
    *,
    axis_name: Optional[str] = None,
) -> Moments:
  """Token-level mean and population variance over the masked entries.

  ``mean = sum(m x) / sum(m)``, ``var = sum(m (x - mean)^2) / sum(m)`` (two-pass),
  with deterministic sums (:func:`jaxrl_llm.reduce.token_sum`). ``x_bt`` may also
  be a [B] vector (with an optional [B] mask).

  Args:
    x_bt: float [B, T] or [B].
    mask_bt: optional bool of the same shape (all True when None).
    axis_name: data-parallel axis inside ``shard_map``; the statistics then span
      all devices.

  Returns:
    :class:`Moments` of scalars; all 0 (and ``degenerate``) for an empty mask.
  """
  x, mask = _as_bt("masked_moments", x_bt, mask_bt)
  count = reduce.token_count(mask, axis_name)
  mean = reduce.token_mean(x, mask, axis_name)
  dev = x - mean
  var = reduce.token_mean(dev * dev, mask, axis_name)
  hi, lo = _extremes(x, mask, axis_name=axis_name)
  degenerate = _negligible_spread(hi, lo, hi, lo) | (count == 0)
  return Moments(mean, var, count, degenerate)


def _sequence_values(x_bt, mask_bt):
  """Per-row value (exact for a constant row, else the masked mean), validity, token extremes.

  Returns:
    (seq_b, valid_b, row_hi_b, row_lo_b): float32 [B], bool [B] (row has a masked
    token) and the extremes of each row's masked tokens (-inf / +inf when empty).
  """
  count_b = reduce.row_count(mask_bt)
  mean_b = reduce.safe_div(reduce.masked_row_sum(x_bt, mask_bt), count_b)
  row_hi, row_lo = _extremes(x_bt, mask_bt, axis=1)
  # A broadcast sequence advantage is taken as it is, not as a rounded mean of copies.
  seq_b = jnp.where(row_hi == row_lo, row_hi, mean_b)
  return seq_b, count_b > 0, row_hi, row_lo


def _batch_moments(x_bt, mask_bt, level, axis_name) -> Moments:
  if level == "token":
    return masked_moments(x_bt, mask_bt, axis_name=axis_name)
  seq_b, valid_b, row_hi, row_lo = _sequence_values(x_bt, mask_bt)
  mean, var = reduce.batch_moments(seq_b, valid_b, axis_name)
  count = reduce.batch_count(valid_b, axis_name)
  hi, lo = _extremes(seq_b, valid_b, axis_name=axis_name)
  tok_hi = jnp.max(row_hi)
  tok_lo = jnp.min(row_lo)
  if axis_name is not None:
    tok_hi = jax.lax.pmax(tok_hi, axis_name)
    tok_lo = jax.lax.pmin(tok_lo, axis_name)
  degenerate = _negligible_spread(hi, lo, tok_hi, tok_lo) | (count == 0)
  return Moments(mean, var, count, degenerate)


def _group_moments(x_bt, mask_bt, level, n) -> Moments:
  """Per-group statistics, each [G]."""
  b, t = x_bt.shape
  g = b // n
  if level == "token":
    count_g = reduce.group_sum(reduce.row_count(mask_bt), n)
    mean_g = reduce.safe_div(reduce.group_sum(reduce.masked_row_sum(x_bt, mask_bt), n), count_g)
    dev = x_bt - jnp.repeat(mean_g, n)[:, None]
    var_g = reduce.safe_div(reduce.group_sum(reduce.masked_row_sum(dev * dev, mask_bt), n),
                            count_g)
    hi, lo = _extremes(x_bt.reshape(g, n * t), mask_bt.reshape(g, n * t), axis=1)
    tok_hi, tok_lo = hi, lo
  else:
    seq_b, valid_b, row_hi, row_lo = _sequence_values(x_bt, mask_bt)
    mean_g, var_g, count_g = reduce.group_moments(seq_b, n, valid_b)
    hi, lo = _extremes(seq_b.reshape(g, n), valid_b.reshape(g, n), axis=1)
    tok_hi = jnp.max(row_hi.reshape(g, n), axis=1)
    tok_lo = jnp.min(row_lo.reshape(g, n), axis=1)
  degenerate = _negligible_spread(hi, lo, tok_hi, tok_lo) | (count_g == 0)
  return Moments(mean_g, var_g, count_g, degenerate)


def _finish(scaled, x_bt, mask_bt, degenerate, shift_mean):
  """Applies the degenerate rule (0 if shift_mean else x) and zeros the off-mask entries."""
  unscaled = jnp.zeros_like(x_bt) if shift_mean else x_bt
  return jnp.where(mask_bt, jnp.where(degenerate, unscaled, scaled), 0.0)


def whiten(
    values: Float[ArrayLike, "B T"] | Float[ArrayLike, "B"],
    mask: Optional[Bool[ArrayLike, "B T"] | Bool[ArrayLike, "B"]] = None,
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
    axis_name: Optional[str] = None,
) -> Float[Array, "B T"] | Float[Array, "B"]:
  """Whitening as in OpenAI lm-human-preferences and TRL (population variance)::

    shift_mean=True:   w = (x - mean) * rsqrt(var + eps)
    shift_mean=False:  w = (x - mean) * rsqrt(var + eps) + mean

  Statistics are over the masked entries (token level for [B, T]). For rewards
  use ``shift_mean=False``: the scale is normalised but the mean reward is kept,
  so the sign/level of the reward still carries information (lm-human-preferences
  ``whiten(rewards, shift_mean=False)``); advantages use ``shift_mean=True``.
  Entries outside the mask are 0. When all masked entries are equal (up to
  rounding: range <= ``DEGENERATE_RTOL`` * max |x|) the result is exactly 0
  (``shift_mean``) or the input.

  Args:
    values: float [B, T] (token level) or [B] (per sequence).
    mask: optional bool of the same shape.
    shift_mean: subtract the mean (True) or keep it (False).
    eps: added to the variance (> 0).
    axis_name: data-parallel axis inside ``shard_map`` for global statistics.

  Returns:
    float32, the shape of ``values``.

  References:
    Ziegler et al., Fine-Tuning Language Models from Human Preferences,
    arXiv:1909.08593 (lm-human-preferences ``whiten``).
  """
  checks.check_positive("whiten", "eps", eps)
  if jnp.ndim(values) not in (1, 2):
    raise ValueError(f"whiten: values must be [B] or [B, T]; got shape {checks.shape_of(values)}")
  x, m = _as_bt("whiten", values, mask)
  mom = masked_moments(x, m, axis_name=axis_name)
  scaled = (x - mom.mean) * jax.lax.rsqrt(mom.var + eps)
  if not shift_mean:
    scaled = scaled + mom.mean
  out = _finish(scaled, x, m, mom.degenerate, shift_mean)
  return out[:, 0] if jnp.ndim(values) == 1 else out


AdvantageNormalizer = Callable[[Array, Array], Array]


def make_advantage_normalizer(
    mode: str,
    *,
    group_size: Optional[int] = None,
    axis_name: Optional[str] = None,
    eps: float = 1e-6,
    shift_mean: bool = True,
    level: str = "token",
) -> AdvantageNormalizer:
  """Builds ``normalize(advantages_bt, mask_bt) -> advantages_bt`` for one mode.

  For ``batch``/``global`` the statistics are scalars over the batch, for
  ``group`` one mean/std per prompt group (rows ``[g N, (g+1) N)``)::

    A'_{b,t} = (A_{b,t} - mean) * (1 / (std + eps))     (shift_mean=True)
    A'_{b,t} =  A_{b,t}         * (1 / (std + eps))     (shift_mean=False)

  with population statistics over masked tokens (``level="token"``: every
  response token counts once) or over sequences (``level="sequence"``: each row
  with at least one masked token counts once with the masked mean of its
  advantages; a row whose masked advantages are all equal, i.e. a sequence
  value broadcast over its tokens, counts with that value exactly). See the
  module docstring for the modes and the degenerate rule.

  Example::

    norm = make_advantage_normalizer("batch", shift_mean=False, level="sequence")
    adv_bt = norm(adv_bt, response_mask_bt)        # ScaleRL-style

  Args:
    mode: one of ``MODES``.
    group_size: N, required for ``group``; validated but unused by the other
      modes (so one call site can serve every mode).
    axis_name: the data-parallel mesh axis, required for ``global`` and only
      accepted there (use ``batch`` under plain ``jit``).
    eps: added to the std (> 0).
    shift_mean: subtract the mean before scaling.
    level: ``token`` or ``sequence`` statistics.

  Returns:
    A pure function of ``(advantages_bt float [B, T], mask_bt bool [B, T])``
    returning float32 [B, T], zero outside the mask.

  Raises:
    ValueError: at construction, for an unknown mode or level or a missing /
      misplaced ``group_size`` / ``axis_name``.
  """
  who = "make_advantage_normalizer"
  checks.check_choice(who, "advantage normalisation mode", mode, MODES)
  checks.check_choice(who, "statistics level", level, LEVELS)
  checks.check_positive(who, "eps", eps)
  if mode == "group" and group_size is None:
    raise ValueError(f"{who}: mode 'group' needs group_size (samples per prompt)")
  if group_size is not None:
    checks.check_positive_int(who, "group_size", group_size)
  if mode == "global" and axis_name is None:
    raise ValueError(f"{who}: mode 'global' needs axis_name (the data-parallel mesh axis "
                     "inside shard_map); under plain jit use mode 'batch'")
  if mode != "global" and axis_name is not None:
    raise ValueError(f"{who}: axis_name is only used by mode 'global'; got mode {mode!r} "
                     f"with axis_name={axis_name!r}")

  def normalize(advantages_bt, mask_bt):
    nwho = f"advantage normalizer ({mode})"
    b, _ = checks.check_bt(nwho, advantages_bt=advantages_bt, mask_bt=mask_bt)
    x = jnp.asarray(advantages_bt, jnp.float32)
    mask = jnp.asarray(mask_bt).astype(bool)
    if mode == "none":
      return jnp.where(mask, x, 0.0)
    if mode == "group":
      n = checks.check_group_size(nwho, b, group_size)
      mom = _group_moments(x, mask, level, n)
      expand = lambda v: jnp.repeat(v, n)[:, None]  # noqa: E731
    else:
      mom = _batch_moments(x, mask, level, axis_name if mode == "global" else None)
      expand = lambda v: v  # noqa: E731
    # Reciprocal at the statistic's shape, then a product: XLA turns a division by
    # a broadcast into this for some shapes only, which would make bits shape-dependent.
    inv_scale = expand(1.0 / (jnp.sqrt(mom.var) + eps))
    scaled = ((x - expand(mom.mean)) if shift_mean else x) * inv_scale
    return _finish(scaled, x, mask, expand(mom.degenerate), shift_mean)

  return normalize


def normalize_advantages(
    advantages_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    mode: str,
    **kwargs,
) -> Float[Array, "B T"]:
  """One-shot ``make_advantage_normalizer(mode, **kwargs)(advantages_bt, mask_bt)``."""
  return make_advantage_normalizer(mode, **kwargs)(advantages_bt, mask_bt)
