"""Policy drift measured on a batch: update drift U_k and sampling staleness S_k.

Two distances bound how much an update can improve the policy when the data
were sampled by older policies (off-policy improvement bounds; TRPO,
arXiv:1502.05477; GePPO, arXiv:2111.00072, Theorem 1):

* **update drift** U_k = E_s[TV(pi_{k+1}, pi_k; s)]: how far one update moved
  the policy (:func:`update_drift`, with the per-token probability change rate:
  share of tokens whose probability moved by more than 10 %);
* **sampling staleness** S_k = E_s[TV(pi_k, pi^(i); s)]: how far the current
  policy is from the policies pi^(i) that sampled the data, overall and per
  version lag (:func:`staleness`, with the stale-sample share and the effective
  sample rate of the importance weights).

By the triangle inequality, TV(pi_{k+1}, pi^(i)) <= U_k + S_k: the off-policy
improvement bounds charge a penalty proportional to the left side, so the two
metrics say which of "updates too large" and "data too old" dominates.

**TV from samples.** The vocabulary distributions are never formed: each
metric is a mean over the batch's sampled tokens a_t ~ mu(.|s_t) of a
one-sample, per-token estimate of the TV at state s_t. For two distributions p
and q over the vocabulary, TV(p, q) = 0.5 sum_a |p(a) - q(a)| = sum_a (q(a) -
p(a))^+, hence, with mu the sampling distribution::

  TV(pi, mu; s)        = E_{a~mu}[(1 - pi(a)/mu(a))^+]
  TV(pi_{k+1}, pi_k; s) = E_{a~mu}[(pi_k/mu) (1 - pi_{k+1}/pi_k)^+]

The one-sided form is used rather than the two-sided 0.5 E_mu|pi/mu - 1|: both
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

from typing import Any, Optional

import numpy as np
from jaxtyping import ArrayLike, Bool, Float, Int

from jaxrl_llm.diagnostics import _host as H
from jaxrl_llm.diagnostics.consistency import log_ratio

DEFAULT_CHANGE = 0.1


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
  mean over the batch concentrates as 1/sqrt(N). ``prob_change_rate`` counts
  the tokens whose probability one update moved by more than ``change``
  (10 % by default): an unweighted share of the batch's sampled tokens,
  relative change ``|pi_{k+1}/pi_k - 1|``; a large share says the step left the
  region where the ratio clip of PPO (arXiv:1707.06347) is meant to keep it.

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
    Schulman et al., Trust Region Policy Optimization, arXiv:1502.05477
    (improvement bound in the policies' TV / KL distance); Queeney et al.,
    Generalized Proximal Policy Optimization with Sample Reuse,
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


def version_lags(who: str, lag_bt: Any, mask: np.ndarray) -> np.ndarray:
  """``lag_bt`` as int64 with zeros outside ``mask``; raises unless it is an integer array >= 0 on the mask."""
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
  versions. S_k compares pi_k with the old policy pi^(i) that sampled each
  sample i; a token sampled after an in-flight weight update carries its own
  version, so mixed sequences are handled token by token.

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
    Queeney et al., arXiv:2111.00072 (penalty in TV(pi_k, pi^(i)) for reused
    samples); Noukhovitch et al., Asynchronous RLHF, arXiv:2410.18252;
    Kish (1965) for the effective sample size.
  """
  who = "staleness"
  H.check_bt(who, logp_bt=logp_bt, behaviour_logp_bt=behaviour_logp_bt, lag_bt=lag_bt, mask_bt=mask_bt)
  d, mask = log_ratio(who, logp_bt, behaviour_logp_bt, mask_bt)
  lag = version_lags(who, lag_bt, mask)
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


__all__ = ["DEFAULT_CHANGE", "staleness", "update_drift", "version_lags"]
