"""The seed documents' off-policy diagnostics, measured on a batch each step.

The monotonic-improvement seed ("单调推理策略") splits what can break
improvement in asynchronous RL into three measurable errors; this module
measures each, plus the data checks of the ScaleRL seed:

* **update drift** U_k = E_s[TV(pi_{k+1}, pi_k; s)]: how far one update moved
  the policy (:func:`update_drift`, with the per-token probability change rate
  of the seed: share of tokens whose probability moved by more than 10 %);
* **sampling staleness** S_k = E_s[TV(pi_k, pi^(i); s)]: how far the current
  policy is from the policies that sampled the data, overall and per version
  lag (:func:`staleness`, with the stale-sample share and the effective sample
  rate of the importance weights);
* **advantage substitution error**: advantage or value estimates against Monte
  Carlo returns (:func:`monte_carlo_returns`,
  :func:`advantage_substitution_error`) and the drift of a batch's advantages
  between recomputations (:func:`advantage_drift`);
* **data alerts**: |advantage| > 100 and filter rate > 50 % (:func:`data_alerts`).

By the triangle inequality, TV(pi_{k+1}, pi^(i)) <= U_k + S_k: the off-policy
improvement bounds (GePPO, arXiv:2111.00072, Theorem 1) charge a penalty
proportional to the left side, so the two metrics say which of "updates too
large" and "data too old" dominates.

**TV from samples.** The vocabulary distributions are never formed: each
metric is a mean over the batch's sampled tokens a_t ~ mu(.|s_t) of a
one-sample, per-token estimate of the TV at state s_t. For two distributions p
and q over the vocabulary, TV(p, q) = 0.5 sum_a |p(a) - q(a)| = sum_a (q(a) -
p(a))^+, hence, with mu the sampling distribution::

  TV(pi, mu; s)        = E_{a~mu}[(1 - pi(a)/mu(a))^+]
  TV(pi_{k+1}, pi_k; s) = E_{a~mu}[(pi_k/mu) (1 - pi_{k+1}/pi_k)^+]

The one-sided form is used rather than the seed's 0.5 E_mu|pi/mu - 1|: both
are unbiased when mu covers the support, but the one-sided term lies in [0, 1]
(in [0, pi_k/mu] for the drift) instead of growing with the ratio, and it
stays exact for TV(pi, mu) when mu is truncated by top-k / top-p (the mass pi
puts outside mu's support enters through sum_a (mu - pi)^+ = sum_a (pi - mu)^+).
The states s_t are the prefixes the behaviour policies sampled, so the means
estimate E_{s ~ d_mu}[TV(.; s)], the state distribution of the generalised
(off-policy) bounds; re-weighting states to d_{pi_k} would need products of
ratios over whole prefixes, whose variance explodes on long sequences.

All functions are host-side numpy in float64 on full [B, T] arrays; see
:mod:`jaxrl_llm.diagnostics._host` for masking, determinism (row-order
invariant bits) and the NaN convention for empty masks. See docs/off_policy.md
for healthy ranges and what to change when a metric is out of range.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
from jaxtyping import ArrayLike, Bool, Float, Int

from jaxrl_llm.diagnostics import _host as H
from jaxrl_llm.diagnostics._host import Alert
from jaxrl_llm.diagnostics.consistency import (DEFAULT_BOUNDS, ConsistencyThresholds, check_bounds,
                                               consistency_alerts, consistency_stats, log_ratio)

DEFAULT_CHANGE = 0.1
DEFAULT_MAX_ABS_ADVANTAGE = 100.0
DEFAULT_MAX_FILTER_RATE = 0.5


# ----------------------------------------------------------------------------- drift


def update_drift(
    logp_before_bt: Float[ArrayLike, "B T"],
    logp_after_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Optional[Float[ArrayLike, "B T"]],
    mask_bt: Bool[ArrayLike, "B T"],
    change: float = DEFAULT_CHANGE,
) -> dict[str, float]:
  """Update drift U_k and the per-token probability change of one update.

  With pi_k the policy before the update, pi_{k+1} after it, mu the behaviour
  policy, w_t = pi_k(a_t|s_t) / mu(a_t|s_t) and q_t = pi_{k+1}(a_t|s_t) /
  pi_k(a_t|s_t), over the N masked tokens::

    drift_tv         = mean_t w_t (1 - q_t)^+                  U_k = E_s[TV(pi_{k+1}, pi_k; s)]
    drift_kl_k3      = mean_t w_t (q_t - 1 - log q_t)          KL(pi_k || pi_{k+1})
    prob_change_rate = share of tokens with |q_t - 1| > change
    prob_change_max  = max_t |q_t - 1|
    drift_tokens     = N

  Why the weight w_t: the tokens were sampled from mu, not pi_k, and
  TV(pi_{k+1}, pi_k; s) = sum_a (pi_k(a) - pi_{k+1}(a))^+ =
  E_{a~mu}[(pi_k(a)/mu(a)) (1 - q(a))^+]. The estimate is unbiased for each
  state when mu puts mass wherever pi_k does (always on-policy, where w = 1);
  the weight is not self-normalised (that would bias it) nor clipped. The same
  argument gives drift_kl_k3 (Schulman's k3 with samples of pi_k re-weighted
  from mu). Each term is a one-sample estimate of the TV at its state; the
  mean over the batch concentrates as 1/sqrt(N). ``prob_change_rate`` is the
  seed's check ("单个更新步骤内某些 token 的概率变化超过 10%"): an unweighted
  share of the batch's sampled tokens, relative change ``|pi_{k+1}/pi_k - 1|``.

  Args:
    logp_before_bt: float [B, T] log pi_k (learner, before the update).
    logp_after_bt: float [B, T] log pi_{k+1} (learner, after the update).
    behaviour_logp_bt: float [B, T] log mu, or None when the batch was sampled
      by pi_k itself (w_t = 1).
    mask_bt: bool [B, T] tokens to include.
    change: relative change threshold of ``prob_change_rate`` (> 0).

  Returns:
    ``{"offpolicy/drift_tv", "offpolicy/drift_kl_k3", "offpolicy/prob_change_rate",
    "offpolicy/prob_change_max", "offpolicy/drift_tokens"}``; NaN (tokens 0)
    on an empty mask.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-finite masked entries or
      ``change <= 0``.

  References:
    Seed document "单调推理策略" (U_k, 10 % probability change check);
    Queeney et al., Generalized Proximal Policy Optimization with Sample Reuse,
    arXiv:2111.00072; Levin, Peres & Wilmer, Markov Chains and Mixing Times,
    Prop. 4.2 (TV = sum (p - q)^+); Schulman, Approximating KL Divergence (k3).
  """
  who = "update_drift"
  H.check_limit(who, "change", change, allow_none=False)
  if change <= 0:
    raise ValueError(f"{who}: change must be > 0; got {change!r}")
  q_log, mask = log_ratio(who, logp_after_bt, logp_before_bt, mask_bt, "logp_after_bt", "logp_before_bt")
  if behaviour_logp_bt is None:
    w_log = np.zeros_like(q_log)
  else:
    w_log, _ = log_ratio(who, logp_before_bt, behaviour_logp_bt, mask_bt, "logp_before_bt",
                         "behaviour_logp_bt")
  n = H.count(mask)
  with np.errstate(over="ignore", invalid="ignore"):
    w = np.exp(w_log)
    q = np.exp(q_log)
    moved = np.abs(q - 1.0)
    out = {
        "drift_tv": H.mean(w * np.maximum(1.0 - q, 0.0), mask, n),
        "drift_kl_k3": H.mean(w * (np.expm1(q_log) - q_log), mask, n),
        "prob_change_rate": H.share(moved > change, mask, n),
        "prob_change_max": H.extremum(moved, mask, np.max),
        "drift_tokens": float(n),
    }
  return {f"offpolicy/{k}": float(v) for k, v in sorted(out.items())}


# ----------------------------------------------------------------------------- staleness


def _lags(who: str, lag_bt: Any, mask: np.ndarray) -> np.ndarray:
  lag = np.asarray(lag_bt)
  if not np.issubdtype(lag.dtype, np.integer):
    raise ValueError(f"{who}: lag_bt must be an integer array; got dtype {lag.dtype}")
  lag = np.where(mask, lag, 0).astype(np.int64)
  if (lag < 0).any():
    first = [int(i) for i in np.argwhere(lag < 0)[0]]
    raise ValueError(f"{who}: lag_bt must be >= 0 on the mask (lag = learner version - sampling "
                     f"version); got {int(lag[tuple(first)])} at [b, t] = {first}")
  return lag


def staleness(
    logp_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Float[ArrayLike, "B T"],
    lag_bt: Int[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
) -> dict[str, float]:
  """Sampling staleness S_k, overall and per version lag, stale share and ESS rate.

  With pi_k the learner's current policy (before the update), mu_t the policy
  that sampled token t (version k - lag_t) and r_t = pi_k(a_t|s_t) /
  mu_t(a_t|s_t), over the N masked tokens::

    staleness_tv         = mean_t (1 - r_t)^+               S_k = E_s[TV(pi_k, pi^(i); s)]
    staleness_tv_lag{j}  = the same mean over tokens with lag_t = j (each lag present)
    lag_share{j}         = share of tokens with lag_t = j
    stale_share          = share of tokens with lag_t > 0
    ess_rate             = (sum r_t)^2 / (N sum r_t^2)       effective sample rate
    tokens               = N

  (1 - r)^+ is a one-sample estimate of TV(pi_k, mu_t; s_t) (see the module
  docstring); ``staleness_tv_lag0`` is the floor set by sampler/learner
  numerical mismatch, and the growth with j is the policy's drift over j
  versions. The seed defines S_k with pi^(i) "the i-th old policy"; a token
  sampled after an in-flight weight update carries its own version, so mixed
  sequences are handled token by token.

  Args:
    logp_bt: float [B, T] learner log pi_k.
    behaviour_logp_bt: float [B, T] log mu recorded by the sampler.
    lag_bt: int [B, T] version lag of each token (learner version - sampling
      version; >= 0 on the mask).
    mask_bt: bool [B, T] tokens to include.

  Returns:
    ``{"offpolicy/staleness_tv", "offpolicy/staleness_tv_lag{j}" ...,
    "offpolicy/lag_share{j}" ..., "offpolicy/stale_share", "offpolicy/ess_rate",
    "offpolicy/tokens"}``; NaN (tokens 0, no per-lag keys) on an empty mask.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-integer or negative lag,
      non-finite masked entries.

  References:
    Seed document "单调推理策略" (S_k, stale share); Noukhovitch et al.,
    Asynchronous RLHF, arXiv:2410.18252; Queeney et al., arXiv:2111.00072;
    Kish (1965) for the effective sample size.
  """
  who = "staleness"
  H.check_bt(who, logp_bt=logp_bt, behaviour_logp_bt=behaviour_logp_bt, lag_bt=lag_bt, mask_bt=mask_bt)
  d, mask = log_ratio(who, logp_bt, behaviour_logp_bt, mask_bt)
  lag = _lags(who, lag_bt, mask)
  n = H.count(mask)
  with np.errstate(over="ignore", invalid="ignore"):
    r = np.exp(d)
    tv = np.maximum(-np.expm1(d), 0.0)  # (1 - r)^+, exact for r near 1
    sum_r, sum_r2 = H.total(r, mask), H.total(r * r, mask)
  out = {
      "staleness_tv": H.mean(tv, mask, n),
      "stale_share": H.share(lag > 0, mask, n),
      "ess_rate": H.safe_ratio(H.safe_ratio(sum_r * sum_r, sum_r2), n),
      "tokens": float(n),
  }
  for j in np.unique(lag[mask]).tolist():
    at = mask & (lag == j)
    out[f"staleness_tv_lag{j}"] = H.mean(tv, at, H.count(at))
    out[f"lag_share{j}"] = H.share(at, mask, n)
  return {f"offpolicy/{k}": float(v) for k, v in sorted(out.items())}


# ----------------------------------------------------------------------------- advantages


def monte_carlo_returns(rewards_bt: Float[ArrayLike, "B T"], mask_bt: Bool[ArrayLike, "B T"],
                        gamma: float) -> np.ndarray:
  """Discounted Monte Carlo returns over each row's masked tokens.

  With t over the masked tokens of a row in order and t+1 the next masked
  token: ``G_t = r_t + gamma * G_{t+1}``, 0 after the last one. Unmasked
  positions are not time steps (the convention of
  :func:`jaxrl_llm.advantages.gae`: a masked gap inside a response is skipped),
  so this equals ``gae(rewards, 0, mask, gamma=gamma, lam=1)``. A response cut
  by the length limit is treated as terminal (no bootstrap).

  Args:
    rewards_bt: float [B, T] per-token rewards (e.g. the sequence reward on the
      last response token); ignored outside the mask.
    mask_bt: bool [B, T] response tokens.
    gamma: discount in [0, 1].

  Returns:
    float64 [B, T] returns, exactly 0 outside the mask.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-finite masked rewards or
      gamma outside [0, 1].

  References:
    Sutton & Barto, Reinforcement Learning (2nd ed.), eq. 3.8; seed document
    "强化学习训练技巧" 1.4 (GAE with lambda = 1 is the Monte Carlo estimate).
  """
  who = "monte_carlo_returns"
  H.check_bt(who, rewards_bt=rewards_bt, mask_bt=mask_bt)
  H.check_limit(who, "gamma", gamma, hi=1.0, allow_none=False)
  mask = H.as_mask(who, "mask_bt", mask_bt)
  rewards = H.masked_f64(who, "rewards_bt", rewards_bt, mask)
  out = np.zeros_like(rewards)
  carry = np.zeros(rewards.shape[0], np.float64)
  g = float(gamma)
  for t in range(rewards.shape[1] - 1, -1, -1):
    carry = np.where(mask[:, t], rewards[:, t] + g * carry, carry)
    out[:, t] = np.where(mask[:, t], carry, 0.0)
  return out


def advantage_substitution_error(
    estimates_bt: Float[ArrayLike, "B T"],
    mc_returns_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
) -> dict[str, float]:
  """Error of return (or advantage) estimates against Monte Carlo returns.

  The improvement theory assumes the true advantage A(s, a); training uses an
  estimate. With E_t the estimate, G_t the Monte Carlo return
  (:func:`monte_carlo_returns`) and e_t = E_t - G_t over the N masked tokens::

    adv_substitution_mse  = mean e_t^2
    adv_substitution_bias = mean e_t
    adv_substitution_rel  = mse / Var(G)                     Var(G) = mean (G_t - mean G)^2
    adv_substitution_ev   = 1 - Var(e) / Var(G)              explained variance

  What to pass as E_t: the critic's values V(s_t) measure the critic's fit
  (``ev`` near 1 is a good critic, <= 0 is no better than a constant); the
  GAE targets R_t = A_t + V(s_t) (``returns_bt`` of
  :func:`jaxrl_llm.advantages.gae`) measure the advantage substitution error
  itself, since R_t - G_t = A_t - (G_t - V(s_t)), the gap between the advantage
  used and the Monte Carlo advantage (0 with lambda = 1). G_t is one sample of
  the return, so the MSE includes its noise: compare it across steps rather
  than against 0. Tokens are weighted equally (long responses count more).

  Args:
    estimates_bt: float [B, T] value or return estimates.
    mc_returns_bt: float [B, T] Monte Carlo returns.
    mask_bt: bool [B, T] tokens to include.

  Returns:
    ``{"offpolicy/adv_substitution_mse", ..._bias, ..._rel, ..._ev}``; NaN on
    an empty mask, and ``rel`` / ``ev`` NaN when Var(G) = 0 (e.g. every
    response got the same reward).

  Raises:
    ValueError: on shape mismatch, non-bool mask or non-finite masked entries.

  References:
    Seed document "单调推理策略" 2.3 (advantage substitution error);
    Schulman et al., GAE, arXiv:1506.02438; explained variance as in OpenAI
    baselines' PPO2 logging.
  """
  who = "advantage_substitution_error"
  H.check_bt(who, estimates_bt=estimates_bt, mc_returns_bt=mc_returns_bt, mask_bt=mask_bt)
  mask = H.as_mask(who, "mask_bt", mask_bt)
  est = H.masked_f64(who, "estimates_bt", estimates_bt, mask)
  ret = H.masked_f64(who, "mc_returns_bt", mc_returns_bt, mask)
  n = H.count(mask)
  e = est - ret
  mse = H.mean(e * e, mask, n)
  bias = H.mean(e, mask, n)
  var_g = H.mean((ret - H.mean(ret, mask, n)) ** 2, mask, n) if n else H.NAN
  var_e = H.mean((e - bias) ** 2, mask, n) if n else H.NAN
  ev = 1.0 - H.safe_ratio(var_e, var_g)
  out = {"adv_substitution_mse": mse, "adv_substitution_bias": bias,
         "adv_substitution_rel": H.safe_ratio(mse, var_g), "adv_substitution_ev": ev}
  return {f"offpolicy/{k}": float(v) for k, v in sorted(out.items())}


def advantage_drift(adv_a_bt: Float[ArrayLike, "B T"], adv_b_bt: Float[ArrayLike, "B T"],
                    mask_bt: Bool[ArrayLike, "B T"]) -> dict[str, float]:
  """How much a batch's advantages changed between two computations.

  The seed's check for stale advantages ("对比同一批数据在不同训练阶段的优势估计值"):
  A^a are the advantages the batch was given (e.g. at sampling time, with the
  critic of then), A^b the same tokens' advantages recomputed now. Over the N
  masked tokens, with D_t = A^b_t - A^a_t::

    adv_drift           = sqrt(mean D_t^2) / sqrt(mean (A^a_t)^2)   relative RMS change
    adv_drift_mse       = mean D_t^2
    adv_drift_sign_flip = share of tokens with A^a_t A^b_t < 0       (update direction reversed)

  Args:
    adv_a_bt: float [B, T] the earlier advantages.
    adv_b_bt: float [B, T] the recomputed advantages.
    mask_bt: bool [B, T] tokens to include.

  Returns:
    ``{"offpolicy/adv_drift", "offpolicy/adv_drift_mse",
    "offpolicy/adv_drift_sign_flip"}``; NaN on an empty mask, ``adv_drift``
    NaN when A^a is 0 on every token.

  Raises:
    ValueError: on shape mismatch, non-bool mask or non-finite masked entries.

  References:
    Seed document "单调推理策略" 2.3 (re-estimate or down-weight data whose
    advantages have gone stale).
  """
  who = "advantage_drift"
  H.check_bt(who, adv_a_bt=adv_a_bt, adv_b_bt=adv_b_bt, mask_bt=mask_bt)
  mask = H.as_mask(who, "mask_bt", mask_bt)
  a = H.masked_f64(who, "adv_a_bt", adv_a_bt, mask)
  b = H.masked_f64(who, "adv_b_bt", adv_b_bt, mask)
  n = H.count(mask)
  diff = b - a
  mse = H.mean(diff * diff, mask, n)
  ms_a = H.mean(a * a, mask, n)
  rel = H.safe_ratio(mse, ms_a)
  out = {"adv_drift": math.sqrt(rel) if not math.isnan(rel) else H.NAN, "adv_drift_mse": mse,
         "adv_drift_sign_flip": H.share(a * b < 0, mask, n)}
  return {f"offpolicy/{k}": float(v) for k, v in sorted(out.items())}


# ----------------------------------------------------------------------------- data alerts


def data_alerts(
    advantages_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    filter_rate: Optional[float] = None,
    max_abs_advantage: Optional[float] = DEFAULT_MAX_ABS_ADVANTAGE,
    max_filter_rate: Optional[float] = DEFAULT_MAX_FILTER_RATE,
) -> tuple[dict[str, float], list[Alert]]:
  """The ScaleRL seed's data alerts: exploding advantages and over-filtering.

  Over the N masked tokens, with f the share of sampled data the filters
  removed this step (zero-variance groups, staleness / ratio filters; computed
  by the caller)::

    adv_abs_max         = max_t |A_t|           alert when > max_abs_advantage (100)
    adv_outside_unit    = share of |A_t| > 1    (the seed: most advantages lie in [-1, 1])
    filter_rate         = f                     alert when > max_filter_rate (0.5)
    kept_share          = 1 - f                 ("有效样本率（过滤后样本占比）")

  Args:
    advantages_bt: float [B, T] advantages used by the update.
    mask_bt: bool [B, T] tokens in the loss.
    filter_rate: share in [0, 1] of the sampled data removed by filters, or
      None when unknown (then ``filter_rate`` / ``kept_share`` are NaN).
    max_abs_advantage: alert limit on ``adv_abs_max`` (None disables).
    max_filter_rate: alert limit on ``filter_rate`` (None disables).

  Returns:
    ``(metrics, alerts)``: ``{"data/adv_abs_max", "data/adv_outside_unit",
    "data/filter_rate", "data/kept_share"}`` and the alerts
    ``data_adv_abs_max`` / ``data_filter_rate`` that fired.

  Raises:
    ValueError: on shape mismatch, non-bool mask, non-finite masked advantages
      or a filter rate / limit out of range.

  References:
    Seed document "ScaleRL" 7 (alerts: advantages > 100, filter rate > 50 %);
    seed document "单调推理策略" 5.1 (advantages mostly in [-1, 1]).
  """
  who = "data_alerts"
  H.check_bt(who, advantages_bt=advantages_bt, mask_bt=mask_bt)
  H.check_limit(who, "filter_rate", filter_rate, hi=1.0)
  H.check_limit(who, "max_abs_advantage", max_abs_advantage)
  H.check_limit(who, "max_filter_rate", max_filter_rate, hi=1.0)
  mask = H.as_mask(who, "mask_bt", mask_bt)
  adv = np.abs(H.masked_f64(who, "advantages_bt", advantages_bt, mask))
  n = H.count(mask)
  f = H.NAN if filter_rate is None else float(filter_rate)
  metrics = {"data/adv_abs_max": H.extremum(adv, mask, np.max),
             "data/adv_outside_unit": H.share(adv > 1.0, mask, n),
             "data/filter_rate": f, "data/kept_share": 1.0 - f}
  alerts = H.alert_if(metrics, "data/adv_abs_max", max_abs_advantage, ">",
                      "check the reward scale, advantage normalisation and critic")
  alerts += H.alert_if(metrics, "data/filter_rate", max_filter_rate, ">",
                       "too much data filtered: widen the ratio bounds / lag window or sample harder prompts")
  return metrics, alerts


# ----------------------------------------------------------------------------- per-step helper


class StepDiagnostics:
  """Runs the per-step checks with one configuration and counts alerts over the run.

  Typical use in the RL loop (arrays gathered to the host once per step)::

    diag = StepDiagnostics()
    m, alerts = diag.before_update(logp_bt, behaviour_bt, mask_bt, lag_bt, adv_bt, filter_rate)
    ... update ...
    m2, alerts2 = diag.after_update(logp_bt, logp_new_bt, behaviour_bt, mask_bt)
    metrics.update(m); metrics.update(m2)
    for a in alerts + alerts2: log.warning("%s", a)
    extra["diagnostics"] = diag.state_dict()      # JSON, saved with checkpoints

  ``before_update`` runs :func:`consistency_stats` and
  :func:`consistency_alerts` on the lag-0 tokens (fresh data: any mismatch is
  numerical), the same ratio statistics on all tokens under ``offpolicy/``
  (``offpolicy/ratio_mean`` ...), :func:`staleness` and, with advantages,
  :func:`data_alerts`. ``after_update`` runs :func:`update_drift`. Both return
  the cumulative alert counts ``alerts/total`` and ``alerts/<name>`` (every
  name seen so far in the run, so a curve appears at the first alert and steps
  up at each new one).

  Args:
    thresholds: consistency limits.
    bounds: ratio bounds of the out-of-bounds shares.
    change: relative probability change of ``prob_change_rate``.
    max_abs_advantage: data alert limit (None disables).
    max_filter_rate: data alert limit (None disables).
    max_prob_change_rate: alert limit on ``offpolicy/prob_change_rate`` (None
      disables; the seed's advice is to tighten the clip range when many
      tokens move by more than ``change`` in one update).
    max_stale_share: alert limit on ``offpolicy/stale_share`` (None disables;
      the seed names 30 % for synchronous-style training; PipelineRL is stale
      by design).
  """

  def __init__(self, thresholds: ConsistencyThresholds = ConsistencyThresholds(),
               bounds: Sequence[float] = DEFAULT_BOUNDS, change: float = DEFAULT_CHANGE,
               max_abs_advantage: Optional[float] = DEFAULT_MAX_ABS_ADVANTAGE,
               max_filter_rate: Optional[float] = DEFAULT_MAX_FILTER_RATE,
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
    H.check_limit(who, "max_filter_rate", max_filter_rate, hi=1.0)
    H.check_limit(who, "max_prob_change_rate", max_prob_change_rate, hi=1.0)
    H.check_limit(who, "max_stale_share", max_stale_share, hi=1.0)
    self.change = float(change)
    self.max_abs_advantage = max_abs_advantage
    self.max_filter_rate = max_filter_rate
    self.max_prob_change_rate = max_prob_change_rate
    self.max_stale_share = max_stale_share
    self.counts: dict[str, int] = {}

  def before_update(self, logp_bt, behaviour_logp_bt, mask_bt, lag_bt=None, advantages_bt=None,
                    filter_rate: Optional[float] = None) -> tuple[dict[str, float], list[Alert]]:
    """Consistency (lag-0 tokens), ratio statistics and staleness (all tokens), data alerts.

    Args:
      logp_bt: float [B, T] learner log pi_k before the update.
      behaviour_logp_bt: float [B, T] log mu.
      mask_bt: bool [B, T] response tokens in the loss.
      lag_bt: int [B, T] version lags, or None (all 0: synchronous sampling).
      advantages_bt: float [B, T] advantages, or None to skip the data alerts.
      filter_rate: share of sampled data removed by filters (or None).

    Returns:
      ``(metrics, alerts)``: one flat dict and this call's alerts.
    """
    who = "StepDiagnostics.before_update"
    H.check_bt(who, logp_bt=logp_bt, behaviour_logp_bt=behaviour_logp_bt, mask_bt=mask_bt, lag_bt=lag_bt,
               advantages_bt=advantages_bt)
    mask = H.as_mask(who, "mask_bt", mask_bt)
    lag = np.zeros(mask.shape, np.int64) if lag_bt is None else _lags(who, lag_bt, mask)
    metrics = consistency_stats(logp_bt, behaviour_logp_bt, mask & (lag == 0), self.bounds)
    alerts = consistency_alerts(metrics, self.thresholds)
    metrics.update(consistency_stats(logp_bt, behaviour_logp_bt, mask, self.bounds, prefix="offpolicy"))
    metrics.update(staleness(logp_bt, behaviour_logp_bt, lag, mask))
    alerts += H.alert_if(metrics, "offpolicy/stale_share", self.max_stale_share, ">",
                         "lower rollout.max_lag or add samplers")
    if advantages_bt is not None:
      m, a = data_alerts(advantages_bt, mask, filter_rate, self.max_abs_advantage, self.max_filter_rate)
      metrics.update(m)
      alerts += a
    metrics.update(self.record(alerts))
    return metrics, alerts

  def after_update(self, logp_before_bt, logp_after_bt, behaviour_logp_bt,
                   mask_bt) -> tuple[dict[str, float], list[Alert]]:
    """Update drift and per-token probability change (:func:`update_drift`).

    Returns:
      ``(metrics, alerts)``.
    """
    metrics = update_drift(logp_before_bt, logp_after_bt, behaviour_logp_bt, mask_bt, self.change)
    alerts = H.alert_if(metrics, "offpolicy/prob_change_rate", self.max_prob_change_rate, ">",
                        "updates too large: lower the learning rate or clip epsilon, fewer updates per batch")
    metrics.update(self.record(alerts))
    return metrics, alerts

  def record(self, alerts: Sequence[Alert]) -> dict[str, float]:
    """Counts ``alerts``; returns ``alerts/total`` and ``alerts/<name>`` (cumulative)."""
    for a in alerts:
      self.counts[a.name] = self.counts.get(a.name, 0) + 1
    out = {f"alerts/{k}": float(v) for k, v in sorted(self.counts.items())}
    out["alerts/total"] = float(sum(self.counts.values()))
    return out

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state (the alert counts) for checkpoints."""
    return {"counts": dict(sorted(self.counts.items()))}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :meth:`state_dict`'s output."""
    counts = state.get("counts") if isinstance(state, dict) else None
    if not isinstance(counts, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in counts.items()):
      raise ValueError(f"StepDiagnostics.load_state_dict: expected {{'counts': {{name: int >= 0}}}}; "
                       f"got {state!r}")
    self.counts = dict(counts)
