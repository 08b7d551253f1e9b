"""The off-policy diagnostics of one RL step: data checks and :class:`StepDiagnostics`.

Each step the job measures, on host copies of the batch's [B, T] arrays:

* the sampler-vs-learner consistency of fresh tokens
  (:mod:`jaxrl_llm.diagnostics.consistency`);
* update drift U_k and sampling staleness S_k
  (:mod:`jaxrl_llm.diagnostics.drift`);
* the advantage substitution error and advantage drift
  (:mod:`jaxrl_llm.diagnostics.advantage_error`);
* the data checks of this module (:func:`data_alerts`): the largest advantage
  and the share of sampled data the filters removed.

:class:`StepDiagnostics` runs the per-step checks with one configuration and
returns their metrics and alerts; it keeps no state. Counting alerts over the
run and logging them once, with their cause, is the job of
:class:`jaxrl_llm.diagnostics.alerts.AlertReporter`.

The measures of the other modules and the alert types are re-exported here,
so ``offpolicy.<name>`` reaches every per-step diagnostic. See docs/off_policy.md
for formulas, healthy ranges and what to change when a metric is out of range.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Float

from jaxrl_llm.diagnostics import _host as H
from jaxrl_llm.diagnostics.advantage_error import (advantage_drift, advantage_substitution_error,
                                                   monte_carlo_returns)
from jaxrl_llm.diagnostics.alerts import Alert, AlertReporter, alert_if
from jaxrl_llm.diagnostics.consistency import (DEFAULT_BOUNDS, ConsistencyThresholds, check_bounds,
                                               consistency_alerts, consistency_stats)
from jaxrl_llm.diagnostics.drift import DEFAULT_CHANGE, staleness, update_drift, version_lags

DEFAULT_MAX_ABS_ADVANTAGE = 100.0


def data_alerts(
    advantages_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    filter_rate: Optional[float] = None,
    max_abs_advantage: Optional[float] = DEFAULT_MAX_ABS_ADVANTAGE,
) -> tuple[dict[str, float], list[Alert]]:
  """Data checks of a learner batch: exploding advantages (an alert) and the filter rate (a metric).

  Over the N masked tokens, with f the share of sampled data the filters
  removed this step (zero-variance groups, staleness / ratio filters; computed
  by the caller)::

    adv_abs_max         = max_t |A_t|           alert when > max_abs_advantage (100)
    adv_outside_unit    = share of |A_t| > 1    (normalised advantages mostly lie in [-1, 1])
    filter_rate         = f                     a metric only
    kept_share          = 1 - f                 effective sample rate after filtering

  A high filter rate is expected, not a fault: once the task is mostly
  solved, most groups of the zero-variance filter (DAPO's dynamic sampling,
  arXiv:2503.14476) have equal rewards and are dropped as designed. It is
  reported as a metric so that curriculum or harder prompts can be judged by
  it, and raises no alert.

  Args:
    advantages_bt: float [B, T] advantages used by the update.
    mask_bt: bool [B, T] tokens in the loss.
    filter_rate: share in [0, 1] of the sampled data removed by filters, or
      None when unknown (then ``filter_rate`` / ``kept_share`` are NaN).
    max_abs_advantage: alert limit on ``adv_abs_max`` (None disables).

  Returns:
    ``(metrics, alerts)``: ``{"data/adv_abs_max", "data/adv_outside_unit",
    "data/filter_rate", "data/kept_share"}`` and the alert
    ``data_adv_abs_max`` when it fired.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-finite masked advantages
      or a filter rate / limit out of range.

  References:
    Yu et al., DAPO, arXiv:2503.14476 (dynamic sampling drops zero-variance
    groups); Khatri et al., The Art of Scaling Reinforcement Learning Compute
    for LLMs (ScaleRL), arXiv:2510.13786 (zero-variance filtering, batch-level
    advantage normalisation).
  """
  who = "data_alerts"
  H.check_bt(who, advantages_bt=advantages_bt, mask_bt=mask_bt)
  H.check_limit(who, "filter_rate", filter_rate, hi=1.0)
  H.check_limit(who, "max_abs_advantage", max_abs_advantage)
  mask = H.as_mask(who, "mask_bt", mask_bt)
  adv = np.abs(H.masked_f64(who, "advantages_bt", advantages_bt, mask))
  n = H.count(mask)
  f = H.NAN if filter_rate is None else float(filter_rate)
  metrics = {"data/adv_abs_max": H.extremum(adv, mask, np.max),
             "data/adv_outside_unit": H.share(adv > 1.0, mask, n),
             "data/filter_rate": f, "data/kept_share": 1.0 - f}
  alerts = alert_if(metrics, "data/adv_abs_max", max_abs_advantage, ">",
                    "check the reward scale, advantage normalisation and critic")
  return metrics, alerts


class StepDiagnostics:
  """Runs the per-step checks with one configuration (stateless).

  Typical use in an RL job (arrays gathered to the host once per step)::

    diag = StepDiagnostics(thresholds, max_abs_advantage=100.0)
    reporter = AlertReporter(every=50)
    m, alerts = diag.before_update(logp_bt, behaviour_bt, mask_bt, lag_bt, adv_bt, filter_rate)
    ... update ...
    m2, alerts2 = diag.after_update(logp_bt, logp_new_bt, behaviour_bt, mask_bt)
    metrics.update(m); metrics.update(m2)
    for line in reporter.report(step, alerts + alerts2): log.warning("%s", line)
    metrics.update(reporter.metrics())

  ``before_update`` runs :func:`consistency_stats` and
  :func:`consistency_alerts` on the lag-0 tokens (fresh data: any mismatch is
  numerical), the same ratio statistics on all tokens under ``offpolicy/``
  (``offpolicy/ratio_mean`` ...), :func:`staleness` and, with advantages,
  :func:`data_alerts`. ``after_update`` runs :func:`update_drift`.

  Args:
    thresholds: consistency limits.
    bounds: ratio bounds of the out-of-bounds shares.
    change: relative probability change of ``prob_change_rate``.
    max_abs_advantage: data alert limit (None disables).
    max_prob_change_rate: alert limit on ``offpolicy/prob_change_rate`` (None
      disables): many tokens moving by more than ``change`` in one update
      call for a tighter clip range or a smaller learning rate.
    max_stale_share: alert limit on ``offpolicy/stale_share`` (None disables;
      a synchronous-style run should have few stale tokens, PipelineRL is
      stale by design).
  """

  def __init__(self, thresholds: ConsistencyThresholds = ConsistencyThresholds(),
               bounds: Sequence[float] = DEFAULT_BOUNDS, change: float = DEFAULT_CHANGE,
               max_abs_advantage: Optional[float] = DEFAULT_MAX_ABS_ADVANTAGE,
               max_prob_change_rate: Optional[float] = None,
               max_stale_share: Optional[float] = None):
    who = "StepDiagnostics"
    if not isinstance(thresholds, ConsistencyThresholds):
      raise ValueError(f"{who}: thresholds must be a ConsistencyThresholds; got {type(thresholds).__name__}")
    self.thresholds = thresholds
    self.bounds = check_bounds(who, bounds)
    H.check_limit(who, "change", change, allow_none=False)
    if change <= 0:
      raise ValueError(f"{who}: change must be > 0; got {change!r}")
    H.check_limit(who, "max_abs_advantage", max_abs_advantage)
    H.check_limit(who, "max_prob_change_rate", max_prob_change_rate, hi=1.0)
    H.check_limit(who, "max_stale_share", max_stale_share, hi=1.0)
    self.change = float(change)
    self.max_abs_advantage = max_abs_advantage
    self.max_prob_change_rate = max_prob_change_rate
    self.max_stale_share = max_stale_share

  def before_update(self, logp_bt, behaviour_logp_bt, mask_bt, lag_bt=None, advantages_bt=None,
                    filter_rate: Optional[float] = None) -> tuple[dict[str, float], list[Alert]]:
    """Consistency (lag-0 tokens), ratio statistics and staleness (all tokens), data checks.

    Args:
      logp_bt: float [B, T] learner log pi_k before the update.
      behaviour_logp_bt: float [B, T] log mu.
      mask_bt: bool [B, T] response tokens in the loss.
      lag_bt: int [B, T] version lags, or None (all 0: synchronous sampling).
      advantages_bt: float [B, T] advantages, or None to skip the data checks.
      filter_rate: share of sampled data removed by filters (or None).

    Returns:
      ``(metrics, alerts)``: one flat dict and this call's alerts.
    """
    who = "StepDiagnostics.before_update"
    H.check_bt(who, logp_bt=logp_bt, behaviour_logp_bt=behaviour_logp_bt, mask_bt=mask_bt, lag_bt=lag_bt,
               advantages_bt=advantages_bt)
    mask = H.as_mask(who, "mask_bt", mask_bt)
    lag = np.zeros(mask.shape, np.int64) if lag_bt is None else version_lags(who, lag_bt, mask)
    metrics = consistency_stats(logp_bt, behaviour_logp_bt, mask & (lag == 0), self.bounds)
    alerts = consistency_alerts(metrics, self.thresholds)
    metrics.update(consistency_stats(logp_bt, behaviour_logp_bt, mask, self.bounds, prefix="offpolicy"))
    metrics.update(staleness(logp_bt, behaviour_logp_bt, lag, mask))
    alerts += alert_if(metrics, "offpolicy/stale_share", self.max_stale_share, ">",
                       "lower rollout.max_lag or add samplers")
    if advantages_bt is not None:
      m, a = data_alerts(advantages_bt, mask, filter_rate, self.max_abs_advantage)
      metrics.update(m)
      alerts += a
    return metrics, alerts

  def after_update(self, logp_before_bt, logp_after_bt, behaviour_logp_bt,
                   mask_bt) -> tuple[dict[str, float], list[Alert]]:
    """Update drift and per-token probability change (:func:`update_drift`).

    Returns:
      ``(metrics, alerts)``.
    """
    metrics = update_drift(logp_before_bt, logp_after_bt, behaviour_logp_bt, mask_bt, self.change)
    alerts = alert_if(metrics, "offpolicy/prob_change_rate", self.max_prob_change_rate, ">",
                      "updates too large: lower the learning rate or clip epsilon, fewer updates per batch")
    return metrics, alerts


__all__ = [
    "Alert", "AlertReporter", "ConsistencyThresholds", "DEFAULT_MAX_ABS_ADVANTAGE", "StepDiagnostics",
    "advantage_drift", "advantage_substitution_error", "alert_if", "consistency_alerts", "consistency_stats",
    "data_alerts", "monte_carlo_returns", "staleness", "update_drift",
]
