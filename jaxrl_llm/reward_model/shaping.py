"""Token-level KL shaping of the RL reward against the warm-start (SFT) policy, GAE path.

The per-token KL penalty of RLHF (Ziegler et al., arXiv:1909.08593;
InstructGPT, arXiv:2203.02155)::

  r_t   = 1[t = EOS] * r(x, y) - beta * KL_t
  KL_t  = log pi_old(a_t | s_t) - log pi_SFT(a_t | s_t)

``pi_old`` is the policy that sampled the tokens (the behaviour log-probabilities
recorded at sampling time) and ``pi_SFT`` the frozen copy of the policy taken
after the warm start (the run's reference parameters). ``beta`` is fixed
(``advantage.kl_reward_coef``) or adapted after every batch by the proportional
controller of :func:`jaxrl_llm.advantages.adaptive_kl_controller` toward
``advantage.kl_reward_target`` nats per sequence (``kl_reward_horizon``
episodes). The coefficient is a plain float the run saves as JSON with its
progress, so a resumed run continues with the same beta.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import ml_collections
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import advantages as A


class KLRewardShaper:
  """Applies the token-level KL penalty and steps the (optional) adaptive coefficient.

  Args:
    coef: initial beta (> 0).
    target: target sequence KL in nats; 0 keeps beta fixed.
    horizon: episodes over which beta moves by at most +-20 % (adaptive only).
  """

  def __init__(self, coef: float, target: float = 0.0, horizon: float = 10000.0):
    self.initial_coef = float(coef)
    self.adaptive = bool(target)
    self.controller = (A.adaptive_kl_controller(coef, target, horizon) if self.adaptive
                       else A.fixed_kl_controller(coef))

    @jax.jit
    def shape(rewards_b, logp_bt, ref_logp_bt, mask_bt, coef):
      rewards_bt, kl_bt = A.kl_penalized_rewards(rewards_b, logp_bt, ref_logp_bt, mask_bt, coef)
      mean_kl = A.mean_sequence_kl(kl_bt, mask_bt)
      new = self.controller.update(A.KLControllerState(coef), mean_kl, mask_bt.shape[0]).coef
      return rewards_bt, mean_kl, new

    self._shape = shape

  def __call__(self, rewards_b: Float[ArrayLike, "B"], logp_bt: Float[ArrayLike, "B T"],
               ref_logp_bt: Float[ArrayLike, "B T"], mask_bt: Bool[ArrayLike, "B T"],
               coef: Optional[float] = None) -> tuple[Float[Array, "B T"], float, dict[str, float]]:
    """Shaped token rewards for one batch, and the coefficient for the next one.

    Args:
      rewards_b: float [B] sequence rewards r(x, y).
      logp_bt: float [B, T] behaviour log-probabilities of the sampled tokens.
      ref_logp_bt: float [B, T] the reference (SFT) policy's.
      mask_bt: bool [B, T] response mask (EOS included).
      coef: the current beta (None: the initial one).

    Returns:
      ``(rewards_bt, next_coef, metrics)``: float32 [B, T] rewards for GAE, the
      updated beta as a Python float, and ``kl_reward/coef`` (the beta used)
      and ``kl_reward/sequence_kl`` (mean summed KL per sequence, nats).
    """
    coef = self.initial_coef if coef is None else float(coef)
    rewards_bt, mean_kl, new = self._shape(jnp.asarray(rewards_b, jnp.float32), jnp.asarray(logp_bt, jnp.float32),
                                           jnp.asarray(ref_logp_bt, jnp.float32), jnp.asarray(mask_bt, bool),
                                           jnp.asarray(coef, jnp.float32))
    return rewards_bt, float(new), {"kl_reward/coef": coef, "kl_reward/sequence_kl": float(mean_kl)}


def build_kl_shaper(config: ml_collections.ConfigDict) -> Optional[KLRewardShaper]:
  """The run's shaper from ``advantage.kl_reward_*``; None when ``kl_reward_coef`` is 0."""
  a = config.advantage
  if not a.kl_reward_coef:
    return None
  return KLRewardShaper(a.kl_reward_coef, a.kl_reward_target, a.kl_reward_horizon)
