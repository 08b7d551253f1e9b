"""Generalised advantage estimation over variable-length responses.

A row of a batch is ``prompt | response | padding`` (``Trajectory`` layout): the
response starts at a different position in each row and is followed by a
different amount of padding. GAE is a reverse ``lax.scan`` over the time axis in
which positions outside ``mask_bt`` are *skipped*: they emit 0 and pass the
running (next value, next advantage) through unchanged. Hence

* trailing padding sits between the last response token and the terminal, so the
  last response token sees the terminal value (0, or the bootstrap value);
* leading prompt tokens are visited after the response and emit 0;
* a masked gap inside a response (e.g. tool output in a multi-turn episode) is
  not a time step: the token before the gap bootstraps from the value of the
  first response token after it, discounted once.

The computation is per row and element-wise across rows, so it is shardable
over the batch axis and its bits do not depend on batch composition, padding or
micro-batching.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm.advantages import checks


def gae(
    rewards_bt: Float[ArrayLike, "B T"],
    values_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    *,
    gamma: float,
    lam: float,
    bootstrap_value_b: Optional[Float[ArrayLike, "B"]] = None,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  """Generalised advantage estimates and value targets for a token-level MDP.

  With t ranging over the response tokens of a row (in order) and t+1 the next
  response token::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                       (the critic's target, TD(lam) return)

  After the last response token, ``V = bootstrap_value_b`` (0 when ``None``) and
  ``A = 0``. A finished response (ending in EOS) is terminal, so its value after
  EOS is 0; a response cut by the length limit is not, and the caller may pass
  the critic's estimate of the state after the cut as ``bootstrap_value_b``,
  e.g. ``jnp.where(finished_b, 0.0, v_next_b)``. With ``lam = 1`` the advantage
  is the discounted (Monte Carlo) return minus the value, ``R_t`` is that return,
  and with ``gamma = lam = 1`` it is the plain sum of future rewards.

  Example::

    adv_bt, ret_bt = gae(r_bt, v_bt, response_mask_bt, gamma=1.0, lam=0.95)

  Args:
    rewards_bt: float [B, T] per-token rewards (e.g. from
      :func:`jaxrl_llm.advantages.kl_penalized_rewards`); ignored outside the mask.
    values_bt: float [B, T] critic values V(s_t) at the response tokens; ignored
      outside the mask (NaN there is harmless).
    mask_bt: bool [B, T] True on response tokens (may start late and end early).
    gamma: discount in [0, 1].
    lam: GAE lambda in [0, 1].
    bootstrap_value_b: optional float [B] value after the last response token.

  Returns:
    ``(advantages_bt, returns_bt)``, float32 [B, T], exactly 0 outside the mask.

  Raises:
    ValueError: on mismatched shapes (naming the arrays) or gamma/lam outside [0, 1].

  References:
    Schulman et al., High-Dimensional Continuous Control Using Generalized
    Advantage Estimation, arXiv:1506.02438.
    Ouyang et al., InstructGPT, arXiv:2203.02155 (token-level PPO for LMs).
  """
  who = "gae"
  b, _ = checks.check_bt(who, rewards_bt=rewards_bt, values_bt=values_bt, mask_bt=mask_bt)
  checks.check_in_unit_interval(who, "gamma", gamma)
  checks.check_in_unit_interval(who, "lam", lam)
  if bootstrap_value_b is not None:
    checks.check_b(who, "bootstrap_value_b", bootstrap_value_b, b, "rewards_bt")
    next_value_b = jnp.asarray(bootstrap_value_b, jnp.float32)
  else:
    next_value_b = jnp.zeros((b,), jnp.float32)

  mask = jnp.asarray(mask_bt).astype(bool)
  rewards = jnp.where(mask, jnp.asarray(rewards_bt, jnp.float32), 0.0)
  values = jnp.where(mask, jnp.asarray(values_bt, jnp.float32), 0.0)
  gamma = jnp.asarray(gamma, jnp.float32)
  gamma_lam = gamma * jnp.asarray(lam, jnp.float32)

  def step(carry, xs):
    next_value, next_adv = carry
    r_t, v_t, m_t = xs
    delta = r_t + gamma * next_value - v_t
    adv_t = delta + gamma_lam * next_adv
    carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv_t, next_adv))
    return carry, jnp.where(m_t, adv_t, 0.0)

  init = (next_value_b, jnp.zeros((b,), jnp.float32))
  _, adv_tb = jax.lax.scan(step, init, (rewards.T, values.T, mask.T), reverse=True)
  advantages = adv_tb.T
  returns = jnp.where(mask, advantages + values, 0.0)
  return advantages, returns
