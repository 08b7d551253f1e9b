"""Policy-gradient surrogates: PPO clip and its descendants.

Each transform adds ``-weights_bt * objective_bt`` to the record's
``surrogate_bt`` (a loss, to be minimised) and records its metrics. Notation,
per token t of sequence i (all [B, T]):

  x = log pi_theta (``logp_bt``, differentiable)
  p = log pi_k     (``prox_logp_bt``, the learner's weights before the update)
  m = log mu       (``behaviour_logp_bt``, the sampler's distribution)
  A = advantage, w = ``weights_bt`` (importance corrections, stop-gradient)
  r = exp(x - p)   the PPO ratio pi_theta / pi_k

Where a paper applies ``stop_gradient`` (sg) it is noted per transform; every
quantity built from p, m, A or w is a constant anyway (see
:func:`~jaxrl_llm.objectives.record.make_record`).

Metrics (per transform, under its name): ``clip_frac_low`` / ``clip_frac_high``
(share of masked tokens whose clipped branch is active, i.e. whose gradient the
clip removes: ``A < 0`` below the lower bound, ``A > 0`` above the upper),
``ratio_mean/min/max`` and ratio quantiles ``ratio_p1/p50/p99``. The ratio stats
are left out when the transform's ratio is by construction pi_theta / mu (no
proximal log-probabilities given, or GePPO's rho_new): the objective's common
``ratio_*`` metrics are then the same numbers.
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp

from jaxrl_llm import reduce
from jaxrl_llm.objectives import stats as S
from jaxrl_llm.objectives.base import Hyper, ObjectiveTransform, check_hyper, scheduled
from jaxrl_llm.objectives.record import TokenRecord, add_metrics, add_surrogate, scale_weights

sg = jax.lax.stop_gradient


def clipped_objective(ratio_bt, adv_bt, lo_bt, hi_bt, dual_c=None):
  """PPO's pessimistic per-token objective and which clip is active.

  ``obj = min(r * A, clip(r, lo, hi) * A)``; with ``dual_c`` (c > 1) tokens with
  ``A < 0`` get ``max(obj, c * A)`` (dual clip).

  Args:
    ratio_bt: float [B, T] importance ratio r.
    adv_bt: float [B, T] advantages A.
    lo_bt, hi_bt: clip bounds, scalars or [B, T] (GePPO's moving window).
    dual_c: optional dual-clip constant c > 1.

  Returns:
    (obj_bt, low_bt, high_bt, dual_bt): the objective and bool masks of tokens
    whose lower clip, upper clip or dual bound is active.
  """
  unclipped = ratio_bt * adv_bt
  clipped = jnp.clip(ratio_bt, lo_bt, hi_bt) * adv_bt
  obj = jnp.minimum(unclipped, clipped)
  low = (adv_bt < 0) & (ratio_bt < lo_bt)
  high = (adv_bt > 0) & (ratio_bt > hi_bt)
  if dual_c is None:
    return obj, low, high, jnp.zeros_like(low)
  dual = (adv_bt < 0) & (obj < dual_c * adv_bt)
  return jnp.where(dual, dual_c * adv_bt, obj), low, high, dual


def _clip_metrics(record, ratio_bt, low_bt, high_bt, quantiles, behaviour_ratio=False):
  """Clip fractions and ratio stats; ``behaviour_ratio``: the ratio is pi_theta / mu.

  The stats of a ratio that is by construction pi_theta / mu (always for GePPO's
  rho_new; for pi_theta / pi_k when no proximal log-probabilities were given, so
  pi_k = mu) are not computed again: the objective's common ``ratio_*`` metrics
  are exactly those numbers (and each quantile set costs a pass over all tokens).
  """
  mask = record.mask_bt
  out = {"clip_frac_low": S.token_fraction(low_bt, mask),
         "clip_frac_high": S.token_fraction(high_bt, mask)}
  if not behaviour_ratio:
    out.update(S.value_stats("ratio", ratio_bt, mask, quantiles))
  return out


def _bounds(who, eps, eps_low, eps_high):
  check_hyper(who, "eps", eps, gt=0.0)
  check_hyper(who, "eps_low", eps_low, gt=0.0, allow_none=True)
  check_hyper(who, "eps_high", eps_high, gt=0.0, allow_none=True)
  return (eps if eps_low is None else eps_low), (eps if eps_high is None else eps_high)


def _ppo_family(name: str, eps_low: Hyper, eps_high: Hyper, dual_c: Optional[float],
                prox_weighted: bool, quantiles) -> ObjectiveTransform:
  quantiles = S.check_quantiles(name, quantiles)

  def fn(record: TokenRecord, eps_low, eps_high) -> TokenRecord:
    stats = {}
    if prox_weighted:
      rho_k = jnp.exp(record.prox_logp_bt - record.behaviour_logp_bt)
      record = scale_weights(record, rho_k, name)
      stats.update(S.value_stats("prox_weight", rho_k, record.mask_bt, ()))
      stats["prox_weight_ess"] = S.ess(rho_k, record.mask_bt)
    ratio = jnp.exp(record.logp_bt - record.prox_logp_bt)
    obj, low, high, dual = clipped_objective(ratio, record.advantages_bt, 1.0 - eps_low,
                                             1.0 + eps_high, dual_c)
    record = add_surrogate(record, -record.weights_bt * obj, name)
    stats.update(_clip_metrics(record, ratio, low, high, quantiles, not record.prox_given))
    if dual_c is not None:
      stats["clip_frac_dual"] = S.token_fraction(dual, record.mask_bt)
    return add_metrics(record, name, stats)

  return scheduled(fn, eps_low=eps_low, eps_high=eps_high)


def ppo_clip(eps: Hyper = 0.2, *, eps_low: Optional[Hyper] = None,
             eps_high: Optional[Hyper] = None, dual_c: Optional[float] = None,
             quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """PPO clipped surrogate, symmetric or clip-higher.

  Per token::

    r = exp(x - p)
    loss_t = -w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)

  The gradient is ``-w * A * r * grad x`` where the unclipped branch is the
  minimum and exactly 0 where the clip is active in the direction of the
  advantage (A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps_low). No
  explicit ``stop_gradient``: the clip itself removes the gradient (PPO eq. 7).
  DAPO's clip-higher sets ``eps_low=0.2, eps_high=0.28``; since the upper bound
  only binds for A > 0 it only widens updates that raise probabilities.

  Args:
    eps: symmetric clip range (> 0), used for a bound not given separately.
    eps_low: lower range (> 0); ``1 - eps_low`` is the lower bound.
    eps_high: upper range (> 0); ``1 + eps_high`` is the upper bound.
    dual_c: optional dual-clip constant c > 1 (see :func:`dual_clip`).
    quantiles: ratio quantiles to report.

  Each of eps / eps_low / eps_high may be a schedule ``count -> value``.

  References:
    Schulman et al., Proximal Policy Optimization Algorithms, arXiv:1707.06347.
    Yu et al., DAPO (clip-higher), arXiv:2503.14476.
  """
  lo, hi = _bounds("ppo_clip", eps, eps_low, eps_high)
  return _ppo_family("ppo_clip", lo, hi, _dual_c("ppo_clip", dual_c), False, quantiles)


def dual_clip(c: float = 3.0, eps: Hyper = 0.2, *, eps_low: Optional[Hyper] = None,
              eps_high: Optional[Hyper] = None,
              quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """PPO clip with the dual clip for negative advantages.

  Per token, with ``obj = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``::

    loss_t = -w * (max(obj, c * A) if A < 0 else obj)

  For A < 0 and a large ratio the PPO objective ``r * A`` is unbounded below;
  the dual clip bounds it by ``c * A`` (a constant: zero gradient where active).
  Metric ``clip_frac_dual``: share of tokens where the dual bound is active.

  Args:
    c: dual-clip constant, > 1 (the paper uses 3).
    eps, eps_low, eps_high, quantiles: as :func:`ppo_clip`.

  References:
    Ye et al., Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning (dual-clip PPO), arXiv:1912.09729.
  """
  lo, hi = _bounds("dual_clip", eps, eps_low, eps_high)
  return _ppo_family("dual_clip", lo, hi, _dual_c("dual_clip", c, "c"), False, quantiles)


def _dual_c(who: str, c: Optional[float], name: str = "dual_c") -> Optional[float]:
  if c is None:
    return None
  if isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 1.0:
    raise ValueError(f"{who}: {name} must be a number > 1; got {c!r}")
  return float(c)


def decoupled(eps: Hyper = 0.2, *, eps_low: Optional[Hyper] = None,
              eps_high: Optional[Hyper] = None, dual_c: Optional[float] = None,
              quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """Decoupled PPO: clip against the proximal policy, correct with pi_k / mu.

  Per token::

    rho_k = exp(p - m)          (constant: both are data)
    r     = exp(x - p)          (pi_theta / pi_k)
    loss_t = -w * rho_k * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)

  ``weights_bt`` is multiplied by ``rho_k`` (so the ESS metric sees it). The
  trust region is around pi_k, the importance correction is for mu; with
  on-policy data (p = m) this is :func:`ppo_clip`. rho_k is not truncated here
  (as in the paper); chain :func:`~jaxrl_llm.objectives.importance.truncated_is`
  before :func:`ppo_clip` for a capped variant. Extra metrics:
  ``prox_weight_mean/min/max`` and ``prox_weight_ess``.

  Args:
    eps, eps_low, eps_high, dual_c, quantiles: as :func:`ppo_clip`.

  References:
    Hilton, Cobbe, Schulman, Batch size-invariance for policy optimization,
    arXiv:2110.00641 (decoupled PPO objective).
  """
  lo, hi = _bounds("decoupled", eps, eps_low, eps_high)
  return _ppo_family("decoupled", lo, hi, _dual_c("decoupled", dual_c), True, quantiles)


def geppo_adaptive(eps: Hyper = 0.2, *,
                   quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """GePPO-style clipping centred on rho_k = pi_k / mu.

  Per token::

    rho_k   = exp(p - m)        (constant)
    rho_new = exp(x - m)        (pi_theta / mu)
    loss_t  = -w * min(rho_new A, clip(rho_new, rho_k - eps, rho_k + eps) A)

  The clip window moves with the data's staleness: the allowed change of the
  ratio is +-eps around where pi_k already is, in absolute (not relative)
  terms. On-policy (p = m) this is :func:`ppo_clip`. GePPO additionally adapts
  the learning rate from the update's total-variation drift; that belongs to
  the optimiser, and this transform reports the estimate it needs: the total
  variation distance between pi_theta and pi_k estimated on the behaviour
  policy's samples (importance-weighted by 1 / mu),
  ``tv_drift = 0.5 * mean_t |pi_theta / mu - pi_k / mu| = 0.5 * mean_t |rho_new - rho_k|``
  over the masked tokens (the estimate GePPO's adaptive learning rate uses). On-policy
  (pi_k = mu) this is ``0.5 * mean |pi_theta / pi_k - 1|``; off-policy the
  latter would weight each token by mu / pi_k and is not the TV distance. Other
  metrics: clip fractions and ``centre_mean`` (of rho_k); the stats of
  rho_new = pi_theta / mu are the objective's common ``ratio_*``.

  Args:
    eps: half-width of the window (> 0), or a schedule.
    quantiles: ratio quantiles to report.

  References:
    Queeney, Paschalidis, Cassandras, Generalized Proximal Policy Optimization
    with Sample Reuse, arXiv:2111.00072 (the clip window
    ``[rho_k - eps, rho_k + eps]`` around the behaviour ratio, and the TV
    estimate ``0.5 E_mu |pi_theta / mu - pi_k / mu|`` of its adaptive step size).
  """
  check_hyper("geppo_adaptive", "eps", eps, gt=0.0)
  quantiles = S.check_quantiles("geppo_adaptive", quantiles)
  name = "geppo_adaptive"

  def fn(record: TokenRecord, eps) -> TokenRecord:
    rho_k = jnp.exp(record.prox_logp_bt - record.behaviour_logp_bt)
    rho_new = jnp.exp(record.logp_bt - record.behaviour_logp_bt)
    obj, low, high, _ = clipped_objective(rho_new, record.advantages_bt, rho_k - eps,
                                          rho_k + eps)
    record = add_surrogate(record, -record.weights_bt * obj, name)
    stats = _clip_metrics(record, rho_new, low, high, quantiles, behaviour_ratio=True)
    # TV(pi_theta, pi_k) on samples of mu: 0.5 |pi_theta / mu - pi_k / mu| per token.
    drift = 0.5 * jnp.abs(sg(rho_new) - rho_k)
    stats["tv_drift"] = S.token_mean(drift, record.mask_bt)
    stats["centre_mean"] = S.token_mean(rho_k, record.mask_bt)
    return add_metrics(record, name, stats)

  return scheduled(fn, eps=eps)


def cispo(eps_high: Hyper = 2.0, *, eps_low: Optional[Hyper] = None,
          quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """CISPO: REINFORCE weighted by a clipped, stop-gradient importance ratio.

  Per token::

    r      = exp(x - p)
    r_hat  = sg(clip(r, 1 - eps_low, 1 + eps_high))   (lower bound 0 if eps_low is None)
    loss_t = -w * r_hat * A * x

  so ``grad loss_t = -w * r_hat * A * grad log pi_theta``: unlike PPO no token's
  gradient is dropped, the clip only bounds the weight. The ``stop_gradient`` is
  on the clipped ratio, exactly as in the paper (eq. 4). The paper sets no
  lower bound (a large eps_low) and tunes only eps_high, whose value it does
  not publish; 2.0 here is this library's default. Metrics: ``clip_frac_high``
  / ``clip_frac_low`` are the shares of tokens whose weight was clipped.

  Args:
    eps_high: upper range (> 0): weights are capped at ``1 + eps_high``.
    eps_low: optional lower range (> 0).
    quantiles: ratio quantiles to report.

  References:
    MiniMax, MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention (CISPO), arXiv:2506.13585.
  """
  check_hyper("cispo", "eps_high", eps_high, gt=0.0)
  check_hyper("cispo", "eps_low", eps_low, gt=0.0, allow_none=True)
  quantiles = S.check_quantiles("cispo", quantiles)
  name = "cispo"

  def fn(record: TokenRecord, eps_high, eps_low) -> TokenRecord:
    ratio = jnp.exp(record.logp_bt - record.prox_logp_bt)
    lo = 0.0 if eps_low is None else 1.0 - eps_low
    hi = 1.0 + eps_high
    r_hat = sg(jnp.clip(ratio, lo, hi))
    term = -record.weights_bt * r_hat * record.advantages_bt * record.logp_bt
    record = add_surrogate(record, term, name)
    stats = _clip_metrics(record, ratio, sg(ratio) < lo, sg(ratio) > hi, quantiles,
                          not record.prox_given)
    return add_metrics(record, name, stats)

  return scheduled(fn, eps_high=eps_high, eps_low=eps_low)


def gspo(eps_low: Hyper = 3e-4, eps_high: Hyper = 4e-4, *,
         quantiles: Sequence[float] = S.DEFAULT_QUANTILES) -> ObjectiveTransform:
  """GSPO (token form): a length-normalised sequence ratio, clipped per sequence.

  With n_i the masked tokens of sequence i::

    s_i    = exp( (1/n_i) * sum_t (x_t - p_t) )             (geometric-mean ratio)
    s_it   = sg(s_i) * exp(x_t - sg(x_t))                   (value s_i)
    loss_t = -w * min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t)

  This is GSPO-token (paper eq. 13-14, ``stop_gradient`` placed as there): the
  value of every token's ratio is the sequence's s_i, the gradient flows
  through the token's own log-probability. With sequence-level advantages and
  ``aggregate("seq_mean_token_mean")`` its value and gradient equal
  sequence-level GSPO, ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)``. Clipping is
  decided per sequence, hence the tiny default ranges (the paper's 3e-4/4e-4).
  Extra metrics: ``seq_ratio_mean/min/max`` over sequences.

  Args:
    eps_low, eps_high: clip ranges (> 0).
    quantiles: quantiles of the sequence ratio to report.

  References:
    Zheng et al., Group Sequence Policy Optimization, arXiv:2507.18071.
  """
  check_hyper("gspo", "eps_low", eps_low, gt=0.0)
  check_hyper("gspo", "eps_high", eps_high, gt=0.0)
  quantiles = S.check_quantiles("gspo", quantiles)
  name = "gspo"

  def fn(record: TokenRecord, eps_low, eps_high) -> TokenRecord:
    mask = record.mask_bt
    n_b = reduce.row_count(mask)
    seq_log_ratio_b = reduce.safe_div(
        reduce.masked_row_sum(record.logp_bt - record.prox_logp_bt, mask), n_b)
    x = record.logp_bt
    s_bt = jnp.exp(sg(seq_log_ratio_b)[:, None] + (x - sg(x)))
    obj, low, high, _ = clipped_objective(s_bt, record.advantages_bt, 1.0 - eps_low,
                                          1.0 + eps_high)
    record = add_surrogate(record, -record.weights_bt * obj, name)
    stats = _clip_metrics(record, s_bt, low, high, ())
    valid_b = n_b > 0
    s_b = jnp.exp(sg(seq_log_ratio_b))
    stats.update({"seq_ratio_mean": S.seq_mean(s_b, valid_b),
                  "seq_ratio_min": S.seq_min(s_b, valid_b),
                  "seq_ratio_max": S.seq_max(s_b, valid_b)})
    if quantiles:
      stats["seq_ratio"] = S.QuantileStat(s_b[:, None], valid_b[:, None], quantiles)
    return add_metrics(record, name, stats)

  return scheduled(fn, eps_low=eps_low, eps_high=eps_high)
