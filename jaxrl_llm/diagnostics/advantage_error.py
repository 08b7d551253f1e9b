"""Advantage substitution error: advantage estimates against Monte Carlo returns, and their drift.

Policy-improvement bounds are stated for the true advantage A(s, a); an RL step
uses an estimate (group baselines, a critic and GAE). Two host-side measures
say how far off the estimate is:

* :func:`advantage_substitution_error`: value or return estimates against the
  Monte Carlo returns of the batch (:func:`monte_carlo_returns`), as MSE, bias,
  relative error and explained variance;
* :func:`advantage_drift`: how much a batch's advantages changed between two
  computations (e.g. at sampling time and after the critic's update).

All functions are host-side numpy in float64 on full [B, T] arrays; see
:mod:`jaxrl_llm.diagnostics._host` for the conventions.
"""

from __future__ import annotations

import math

import numpy as np
from jaxtyping import ArrayLike, Bool, Float

from jaxrl_llm.diagnostics import _host as H


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
    Sutton & Barto, Reinforcement Learning (2nd ed.), eq. 3.8; Schulman et
    al., GAE, arXiv:1506.02438 (lambda = 1 gives the Monte Carlo estimate).
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

  The policy-improvement bounds (TRPO, arXiv:1502.05477; GePPO,
  arXiv:2111.00072) assume the true advantage A(s, a); training substitutes an
  estimate, and the gap enters the improvement as an extra error term. With E_t the estimate, G_t the Monte Carlo return
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

  A check for stale advantages: the same batch's advantage estimates at two
  stages of training. A^a are the advantages the batch was given (e.g. at sampling time, with the
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

  A large drift says the data's advantages have gone stale: re-estimate them
  (a recomputed critic, as in the GAE path) or down-weight older data.

  References:
    Schulman et al., GAE, arXiv:1506.02438; Noukhovitch et al., Asynchronous
    RLHF, arXiv:2410.18252 (training on data of older policies).
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


__all__ = ["advantage_drift", "advantage_substitution_error", "monte_carlo_returns"]
