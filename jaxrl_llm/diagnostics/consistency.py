"""Sampler-vs-learner consistency check: importance-ratio statistics before an update.

Before any parameter update the learner recomputes log pi(a_t | s_t) for every
sampled token of the batch and compares it with the behaviour log-probability
log mu(a_t | s_t) that the sampler recorded. Per token (t over the masked
response tokens, N of them)::

  d_t = log pi(a_t | s_t) - log mu(a_t | s_t)        r_t = exp(d_t) = pi / mu

On fresh data (lag 0) with a sampler and learner that compute the same numbers
r_t = 1 exactly; any spread is numerical mismatch (precision, reduction order,
kernels, temperature or top-k/top-p applied differently) and turns nominally
on-policy training into off-policy training (Yao et al., 2025; Qi et al.,
arXiv:2510.26788). The check therefore monitors, before every update, the mean,
quantiles and extremes of r_t, approximate KL estimates and the share of ratios
outside a trust band.

On stale data (lag > 0) the same statistics measure the policy change since
sampling as well; :class:`jaxrl_llm.diagnostics.StepDiagnostics` therefore runs
the check on the lag-0 tokens and reports the whole batch's ratios under the
``offpolicy/`` prefix.

All computations are host-side numpy in float64; see
:mod:`jaxrl_llm.diagnostics._host` for masking, determinism (row-order
invariant bits) and the NaN convention for empty masks.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Float

from jaxrl_llm.diagnostics import _host as H
from jaxrl_llm.diagnostics.alerts import Alert, alert_if
from jaxrl_llm.settings import NONNEG, UNIT, at_least, check, optional, setting

DEFAULT_BOUNDS = (0.8, 1.25)
DEFAULT_QUANTILES = (0.01, 0.5, 0.99)


def check_bounds(who: str, bounds: Sequence[float]) -> tuple[float, float]:
  """Validates ratio bounds ``(lo, hi)`` with ``0 <= lo <= 1 <= hi``."""
  try:
    lo, hi = (float(b) for b in bounds)
  except (TypeError, ValueError):
    raise ValueError(f"{who}: bounds must be a pair (lo, hi); got {bounds!r}") from None
  if not (0.0 <= lo <= 1.0 <= hi):
    raise ValueError(f"{who}: bounds must satisfy 0 <= lo <= 1 <= hi; got {bounds!r}")
  return lo, hi


def log_ratio(who: str, logp_bt, behaviour_logp_bt, mask_bt, logp_name: str = "logp_bt",
              behaviour_name: str = "behaviour_logp_bt") -> tuple[np.ndarray, np.ndarray]:
  """Checks the arrays and returns ``(d_bt, mask_bt)``: float64 ``logp - behaviour_logp``
  on the mask (exact zeros elsewhere) and the bool mask."""
  H.check_bt(who, **{logp_name: logp_bt, behaviour_name: behaviour_logp_bt, "mask_bt": mask_bt})
  mask = H.as_mask(who, "mask_bt", mask_bt)
  logp = H.masked_f64(who, logp_name, logp_bt, mask)
  behaviour = H.masked_f64(who, behaviour_name, behaviour_logp_bt, mask)
  return logp - behaviour, mask


def consistency_stats(
    logp_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    bounds: Sequence[float] = DEFAULT_BOUNDS,
    quantiles: Sequence[float] = DEFAULT_QUANTILES,
    prefix: str = "consistency",
) -> dict[str, float]:
  """Importance-ratio statistics of learner log pi against behaviour log mu.

  With r_t = pi(a_t|s_t) / mu(a_t|s_t), d_t = log r_t and the mean taken over
  the N masked tokens (tokens are samples of mu, so every mean estimates an
  expectation under mu)::

    ratio_mean          = mean r_t                     (E_mu[pi/mu] = 1 when supp pi ⊆ supp mu)
    ratio_min/_max      = min / max r_t
    ratio_p1/_p50/_p99  = order-statistic quantiles of r_t (inverted CDF, no interpolation)
    log_ratio_mean      = mean d_t
    abs_log_ratio_mean  = mean |d_t|                   (mismatch size; signs do not cancel)
    kl_k1               = mean (-d_t)                  = E_mu[log mu - log pi]
    kl_k2               = mean d_t^2 / 2
    kl_k3               = mean (r_t - 1 - d_t)         = E_mu[r - 1 - log r]
    out_of_bounds       = share of tokens with r_t < lo or r_t > hi   (default [0.8, 1.25])
    ess_rate            = (sum r_t)^2 / (N sum r_t^2)  (Kish effective sample size / N)
    tokens              = N

  k1, k2 and k3 are Schulman's estimators of KL(mu || pi) from samples of mu
  (k1 and k3 unbiased, k3 >= 0 per token with low variance; k2 biased, >= 0).
  This is the opposite direction to :func:`jaxrl_llm.objectives.kl_estimate`,
  which estimates KL(pi_theta || pi_ref) from samples of pi_theta. The ESS
  treats the tokens as N weighted samples with weights r_t: 1 when all r_t are
  equal, about 1/N when one token dominates.

  Example::

    m = consistency_stats(logp_bt, batch.behaviour_logp_bt, batch.response_mask_bt)
    m["consistency/kl_k3"]   # 0.0 for bit-identical sampler and learner

  Args:
    logp_bt: float [B, T] learner log pi of the sampled tokens.
    behaviour_logp_bt: float [B, T] log mu recorded by the sampler.
    mask_bt: bool [B, T] tokens to include (response tokens).
    bounds: ``(lo, hi)`` of the out-of-bounds share, 0 <= lo <= 1 <= hi.
    quantiles: quantile levels in [0, 1] (names per :func:`jaxrl_llm.objectives.stats.quantile_name`).
    prefix: metric name prefix.

  Returns:
    ``{f"{prefix}/{name}": float}``; every value but ``tokens`` is NaN when the
    mask is empty.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-finite masked entries or
      invalid bounds / quantiles.

  References:
    Yao, Liu et al., Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training (sampler/trainer mismatch; blog post, 2025,
    fengyao.notion.site/off-policy-rl); Qi et al., Defeating the
    Training-Inference Mismatch via FP16, arXiv:2510.26788; MiniMax-M1,
    arXiv:2506.13585 (FP32 LM head against the mismatch);
    Schulman, Approximating KL Divergence (k1/k2/k3), joschu.net, 2020;
    Kish, Survey Sampling (1965) / Owen, Monte Carlo theory (ESS), ch. 9.
  """
  who = "consistency_stats"
  lo, hi = check_bounds(who, bounds)
  qs = H.check_quantiles(who, quantiles)
  d, mask = log_ratio(who, logp_bt, behaviour_logp_bt, mask_bt)
  n = H.count(mask)
  with np.errstate(over="ignore", invalid="ignore"):
    r = np.exp(d)
    k3 = np.expm1(d) - d
    sum_r = H.total(r, mask)
    sum_r2 = H.total(r * r, mask)
  out = {
      "tokens": float(n),
      "ratio_mean": H.safe_ratio(sum_r, n),
      "ratio_min": H.extremum(r, mask, np.min),
      "ratio_max": H.extremum(r, mask, np.max),
      "log_ratio_mean": H.mean(d, mask, n),
      "abs_log_ratio_mean": H.mean(np.abs(d), mask, n),
      "kl_k1": H.mean(-d, mask, n),
      "kl_k2": H.mean(0.5 * d * d, mask, n),
      "kl_k3": H.mean(k3, mask, n),
      "out_of_bounds": H.share((r < lo) | (r > hi), mask, n),
      "ess_rate": H.safe_ratio(H.safe_ratio(sum_r * sum_r, sum_r2), n),
  }
  for q, v in zip(qs, H.quantiles(r, mask, qs)):
    out[H.quantile_name("ratio", q)] = v
  return {f"{prefix}/{k}": float(v) for k, v in sorted(out.items())}


_LIMIT = optional(NONNEG, "no limit")
_SHARE = optional(UNIT, "no limit")


@dataclasses.dataclass(frozen=True)
class ConsistencyThresholds:
  """Limits of the consistency check; ``None`` disables a limit.

  The defaults flag a sampler/learner mismatch that already changes training:
  k3 = 1e-3 is an RMS log-ratio of about 0.045 (k3 ~ E[d^2]/2 for small d),
  matching the 0.05 limit on mean |d|; 5 % of tokens outside [0.8, 1.25] (the
  default band of :func:`jaxrl_llm.objectives.staleness_filter`) is the share
  that filter would start discarding on fresh data; an ESS rate
  under 0.5 means a few tokens carry half the importance weight (one token
  with r = 100 among 10^4 tokens already brings it to about 0.5; ``max_ratio``
  flags such a token by itself). These limits are for fresh (lag-0) tokens:
  stale tokens differ by the policy change since sampling, so run the check
  on ``mask_bt & (lag_bt == 0)`` in asynchronous training.
  A bit-identical sampler (batch-invariant mode) gives 0 / 0 / 0 / 1 / 1 / 1.
  The fields are ``config.diagnostics`` fields (limits on ``abs_log_ratio_mean``,
  ``kl_k3``, ``out_of_bounds``, ``ess_rate``, ``ratio_max``, ``ratio_min``).
  """

  max_abs_log_ratio_mean: Optional[float] = setting(
      0.05, "consistency alert above this mean |log pi - log mu| on fresh tokens (None: no limit)", _LIMIT)
  max_kl_k3: Optional[float] = setting(1e-3, "consistency alert above this k3 KL(mu || pi) (None: no limit)", _LIMIT)
  max_out_of_bounds: Optional[float] = setting(
      0.05, "consistency alert above this share of tokens with pi / mu outside [0.8, 1.25] (None: no limit)", _SHARE)
  min_ess_rate: Optional[float] = setting(
      0.5, "consistency alert below this effective-sample-size rate of pi / mu (None: no limit)", _SHARE)
  max_ratio: Optional[float] = setting(10.0, "consistency alert above this largest pi / mu (None: no limit)",
                                       optional(at_least(1), "no limit"))
  min_ratio: Optional[float] = setting(0.1, "consistency alert below this smallest pi / mu (None: no limit)", _SHARE)

  def __post_init__(self):
    check(self, "diagnostics")


_HINT = ("sampler and learner disagree on log pi: check temperature, top-k/top-p, dtype, "
         "weight sync and batch-invariant mode")

# (metric, threshold field, relation)
_CHECKS = (
    ("abs_log_ratio_mean", "max_abs_log_ratio_mean", ">"),
    ("kl_k3", "max_kl_k3", ">"),
    ("out_of_bounds", "max_out_of_bounds", ">"),
    ("ess_rate", "min_ess_rate", "<"),
    ("ratio_max", "max_ratio", ">"),
    ("ratio_min", "min_ratio", "<"),
)


def consistency_alerts(stats: dict[str, float],
                       thresholds: ConsistencyThresholds = ConsistencyThresholds(),
                       prefix: str = "consistency") -> list[Alert]:
  """Alerts for the consistency metrics that cross their thresholds.

  Each :class:`Alert` names the metric, its value and the limit, e.g.
  ``consistency/kl_k3 = 0.0042 > maximum 0.001 (sampler and learner disagree
  ...)``. Metrics that are NaN (empty mask) raise no alert.

  Args:
    stats: the output of :func:`consistency_stats` with the same ``prefix``.
    thresholds: the limits.
    prefix: the metric prefix used in ``stats``.

  Returns:
    alerts in the fixed order abs_log_ratio_mean, kl_k3, out_of_bounds,
    ess_rate, ratio_max, ratio_min.

  Raises:
    ValueError: when ``stats`` lacks a checked metric.
  """
  alerts: list[Alert] = []
  for metric, field, relation in _CHECKS:
    key = f"{prefix}/{metric}"
    if key not in stats:
      raise ValueError(f"consistency_alerts: stats has no {key!r}; pass the output of "
                       f"consistency_stats(..., prefix={prefix!r})")
    alerts += alert_if(stats, key, getattr(thresholds, field), relation, _HINT)
  return alerts

