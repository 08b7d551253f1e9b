"""Importance corrections and filters for off-policy (stale / mismatched) tokens.

All of them look at the *behaviour* ratio rho_k = pi_k / mu = exp(p - m): how
far the learner's pre-update weights (p, ``prox_logp_bt``) are from the
distribution that actually sampled the tokens (m, ``behaviour_logp_bt``),
whether from staleness (asynchronous sampling) or sampler/learner numerical
mismatch. rho_k does not depend on the parameters being trained, so these
transforms are constants for the gradient and the normaliser of the loss is
known before the update (micro-batching stays exact).

*Weights* (:func:`truncated_is`, :func:`segment_is`) multiply ``weights_bt``;
chain them before the policy term that consumes the weights. *Filters*
(:func:`masked_is`, :func:`staleness_filter`) remove tokens from ``mask_bt``:
a dropped token leaves the loss and the normaliser. Levels:

* ``"token"``      log w_t = p_t - m_t
* ``"sequence"``   log w_t = sum_{s in seq} (p_s - m_s)        (the full product)
* ``"geometric"``  log w_t = (1/n) sum_{s in seq} (p_s - m_s)  (length-normalised)
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm import reduce
from jaxrl_llm.objectives import stats as S
from jaxrl_llm.objectives.base import ObjectiveTransform, check_choice, check_hyper, stateless
from jaxrl_llm.objectives.record import (TokenRecord, add_metrics, drop_tokens, require,
                                         scale_weights)

LEVELS = ("token", "sequence", "geometric")


def log_behaviour_ratio(record: TokenRecord, level: str) -> jax.Array:
  """log rho_k = log(pi_k / mu) per token at ``level`` (see the module docstring).

  Returns:
    float32 [B, T], 0 off the mask.
  """
  mask = record.mask_bt
  lr = jnp.where(mask, record.prox_logp_bt - record.behaviour_logp_bt, 0.0)
  if level == "token":
    return lr
  total_b = reduce.masked_row_sum(lr, mask)
  if level == "geometric":
    total_b = reduce.safe_div(total_b, reduce.row_count(mask))
  return jnp.where(mask, total_b[:, None], 0.0)


def _filter(record: TokenRecord, keep_bt, name: str, stats: dict) -> TokenRecord:
  before = record.mask_bt
  record = drop_tokens(record, keep_bt, name)
  stats = dict(stats, masked_share=S.token_fraction(~keep_bt, before))
  return add_metrics(record, name, stats)


def truncated_is(cap: float = 2.0, *, level: str = "token") -> ObjectiveTransform:
  """Truncated importance sampling: multiply the weights by min(rho_k, C).

  Per token, with log w from ``level`` (token, sequence product, geometric)::

    weights_t <- weights_t * min(exp(log w_t), C)

  Computed as ``min(exp(min(log w, log C)), C)`` so long sequence products
  cannot overflow. Bias traded for bounded variance; a constant for the
  gradient. Metrics: ``truncated_share`` (tokens whose weight hit C),
  ``weight_mean/min/max``, ``ess``.

  Args:
    cap: C > 0.
    level: "token", "sequence" or "geometric".

  References:
    Espeholt et al., IMPALA (truncated importance weights), arXiv:1802.01561.
    Yao et al., Your Efficient RL Framework Secretly Brings You Off-Policy RL
    Training (2025 blog; token-level TIS for sampler/learner mismatch).
  """
  check_hyper("truncated_is", "cap", cap, gt=0.0)
  check_choice("truncated_is", "level", level, LEVELS)
  name, log_cap = "truncated_is", math.log(cap)

  def fn(record: TokenRecord) -> TokenRecord:
    lw = log_behaviour_ratio(record, level)
    w = jnp.minimum(jnp.exp(jnp.minimum(lw, log_cap)), cap)
    stats = {"truncated_share": S.token_fraction(lw > log_cap, record.mask_bt),
             "ess": S.ess(w, record.mask_bt)}
    stats.update(S.value_stats("weight", w, record.mask_bt, ()))
    record = scale_weights(record, w, name)
    return add_metrics(record, name, stats)

  return stateless(fn)


def _check_bounds(who, lo, hi):
  check_hyper(who, "lo", lo, ge=0.0)
  check_hyper(who, "hi", hi, gt=0.0)
  if not float(lo) < float(hi):
    raise ValueError(f"{who}: lo must be < hi; got lo={lo} and hi={hi}")


def masked_is(lo: float = 0.5, hi: float = 2.0, *, level: str = "token") -> ObjectiveTransform:
  """Masked importance sampling: drop tokens (or sequences) whose rho_k leaves [lo, hi].

  Per token, with w = exp(log w) at ``level``::

    keep_t = lo <= w_t <= hi ;   mask_t <- mask_t and keep_t

  Dropped tokens leave the loss and its normaliser (no gradient, no count).
  At sequence levels the whole sequence is kept or dropped. Metric:
  ``masked_share`` (share of the tokens present before this filter that it
  dropped).

  Args:
    lo: lower bound (>= 0).
    hi: upper bound (> lo).
    level: "token", "sequence" or "geometric".

  References:
    Ling Team, Every Step Evolves: Scaling Reinforcement Learning for
    Trillion-Scale Thinking Model (IcePop token masking), arXiv:2510.18855.
  """
  _check_bounds("masked_is", lo, hi)
  check_choice("masked_is", "level", level, LEVELS)

  def fn(record: TokenRecord) -> TokenRecord:
    w = jnp.exp(log_behaviour_ratio(record, level))
    return _filter(record, (w >= lo) & (w <= hi), "masked_is", {})

  return stateless(fn)


def staleness_filter(lo: Optional[float] = 0.8, hi: Optional[float] = 1.25, *,
                     max_lag: Optional[int] = None,
                     level: str = "token") -> ObjectiveTransform:
  """Drops stale tokens: behaviour ratio outside [lo, hi] or version lag > max_lag.

  Per token::

    keep_t = (lo <= rho_k,t <= hi)  and  (lag_t <= max_lag)
    mask_t <- mask_t and keep_t

  ``lag_bt`` (current learner version minus the version that sampled the
  token) must be passed when ``max_lag`` is set. At sequence levels a sequence
  is dropped when its ratio is out of bounds or any of its tokens is too
  stale. Metrics: ``masked_share``, ``stale_share`` (lag > max_lag),
  ``ratio_out_share``.

  Args:
    lo, hi: ratio bounds (0 <= lo < hi), or both None for a lag-only filter.
    max_lag: maximum version lag (int >= 0) or None.
    level: "token", "sequence" or "geometric" (how rho_k is formed).

  References:
    Noukhovitch et al., Asynchronous RLHF, arXiv:2410.18252 (training on
    samples of older policies, bounded lag); Queeney et al., GePPO,
    arXiv:2111.00072 (the ratio to the sampling policy bounds the penalty of
    reused samples).
  """
  who = "staleness_filter"
  if (lo is None) != (hi is None):
    raise ValueError(f"{who}: give both lo and hi, or neither; got lo={lo}, hi={hi}")
  if lo is not None:
    _check_bounds(who, lo, hi)
  if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int)
                              or max_lag < 0):
    raise ValueError(f"{who}: max_lag must be an int >= 0 or None; got {max_lag!r}")
  if lo is None and max_lag is None:
    raise ValueError(f"{who}: nothing to filter; set lo/hi and/or max_lag")
  check_choice(who, "level", level, LEVELS)

  def fn(record: TokenRecord) -> TokenRecord:
    mask = record.mask_bt
    keep = jnp.ones_like(mask)
    stats = {}
    if lo is not None:
      w = jnp.exp(log_behaviour_ratio(record, level))
      in_bounds = (w >= lo) & (w <= hi)
      stats["ratio_out_share"] = S.token_fraction(~in_bounds, mask)
      keep = keep & in_bounds
    if max_lag is not None:
      stale = require(record, "lag_bt", who) > max_lag
      stats["stale_share"] = S.token_fraction(stale, mask)
      if level != "token":
        stale = jnp.broadcast_to(jnp.any(stale & mask, axis=1, keepdims=True), stale.shape)
      keep = keep & ~stale
    return _filter(record, keep, who, stats)

  return stateless(fn)


def segment_sums(values_bt: jax.Array, mask_bt: jax.Array, segment_len: int) -> jax.Array:
  """Per token, the sum of ``values_bt`` over its segment of ``segment_len`` masked tokens.

  The masked tokens of a row are numbered 0, 1, ... in order; token j belongs
  to segment ``j // segment_len``. The row's masked values are compacted to
  the front (stable order), segments are summed with the pairwise tree and
  gathered back, so the bits depend neither on padding nor on unmasked gaps.

  Args:
    values_bt: float [B, T].
    mask_bt: bool [B, T].
    segment_len: L, a positive int.

  Returns:
    float32 [B, T], 0 off the mask.
  """
  mask = mask_bt.astype(bool)
  b, t = mask.shape
  values = jnp.where(mask, values_bt.astype(jnp.float32), 0.0)
  order = jnp.argsort(~mask, axis=1, stable=True)  # masked positions first, in order
  compact = jnp.take_along_axis(values, order, axis=1)
  n_seg = -(-t // segment_len)
  compact = jnp.pad(compact, ((0, 0), (0, n_seg * segment_len - t)))
  seg_sum = reduce.tree_sum(compact.reshape(b, n_seg, segment_len), axis=2)
  index = jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1
  seg_of = jnp.clip(index // segment_len, 0, n_seg - 1)
  return jnp.where(mask, jnp.take_along_axis(seg_sum, seg_of, axis=1), 0.0)


def segment_is(segment_len: int, *, cap: Optional[float] = None) -> ObjectiveTransform:
  """Segment-wise importance weights: products of rho_k over fixed-length segments.

  A sequence's full importance product prod_t rho_k,t explodes or vanishes
  with length (4,000 tokens of +1e-3 log-ratio give e^4). Splitting the
  response into consecutive segments of L masked tokens and weighting each
  token by its segment's product bounds the accumulation to L factors::

    log w_t = sum_{s in segment(t)} (p_s - m_s)
    weights_t <- weights_t * min(exp(log w_t), C)     (no cap when C is None)

  L = 1 is token-level IS; L >= T is sequence-level IS. Metrics:
  ``weight_mean/min/max``, ``ess`` and, with a cap, ``truncated_share``.

  Args:
    segment_len: L, a positive int.
    cap: optional C > 0.

  References:
    Precup, Sutton, Singh, Eligibility Traces for Off-Policy Policy Evaluation
    (ICML 2000) for per-decision products; truncation as in IMPALA,
    arXiv:1802.01561.
  """
  who = "segment_is"
  if isinstance(segment_len, bool) or not isinstance(segment_len, int) or segment_len < 1:
    raise ValueError(f"{who}: segment_len must be a positive int; got {segment_len!r}")
  check_hyper(who, "cap", cap, gt=0.0, allow_none=True)

  def fn(record: TokenRecord) -> TokenRecord:
    mask = record.mask_bt
    lw = segment_sums(record.prox_logp_bt - record.behaviour_logp_bt, mask, segment_len)
    stats = {}
    if cap is None:
      w = jnp.exp(lw)
    else:
      log_cap = math.log(cap)
      w = jnp.minimum(jnp.exp(jnp.minimum(lw, log_cap)), cap)
      stats["truncated_share"] = S.token_fraction(lw > log_cap, mask)
    stats["ess"] = S.ess(w, mask)
    stats.update(S.value_stats("weight", w, mask, ()))
    record = scale_weights(record, w, who)
    return add_metrics(record, who, stats)

  return stateless(fn)


CORRECTIONS = {"truncated_is": truncated_is, "masked_is": masked_is, "segment_is": segment_is,
               "staleness_filter": staleness_filter}
"""The importance corrections and filters a run config names in ``objective.corrections``.

Each reads rho_k = pi_k / mu (``prox_logp_bt`` against ``behaviour_logp_bt``),
so each needs the learner's pi_k (``objective.proximal='learner'``);
``staleness_filter(max_lag=...)`` also reads the tokens' version lags.
"""
