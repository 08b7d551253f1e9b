"""KL-coefficient controllers for the reward's KL penalty, as pure init/update pairs.

Same shape as an optax transform: a NamedTuple of pure functions closing over
the hyper-parameters, with the coefficient in a checkpointable state pytree::

  ctl = adaptive_kl_controller()              # 0.15, target 6.0, horizon 10000
  state = ctl.init()
  rewards_bt, kl_bt = kl_penalized_rewards(r_b, logp_bt, ref_logp_bt, mask_bt, state.coef)
  state = ctl.update(state, mean_sequence_kl(kl_bt, mask_bt), n_steps=batch_size)
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from jaxrl_llm.advantages import checks


class KLControllerState(NamedTuple):
  """Attributes: coef: float32 scalar, the current beta."""

  coef: Array


class KLController(NamedTuple):
  """``init() -> KLControllerState``; ``update(state, kl, n_steps) -> KLControllerState``."""

  init: Callable[[], KLControllerState]
  update: Callable[[KLControllerState, Float[ArrayLike, ""], ArrayLike], KLControllerState]


def adaptive_kl_controller(
    init_kl_coef: float = 0.15,
    target: float = 6.0,
    horizon: float = 10000,
) -> KLController:
  """Proportional controller steering the measured KL towards ``target``::

    error = clip(KL / target - 1, -0.2, 0.2)
    coef <- coef * (1 + error * n_steps / horizon)

  ``KL`` is the mean over sequences of the summed per-token KL in nats
  (:func:`jaxrl_llm.advantages.mean_sequence_kl`) and ``n_steps`` the number of
  episodes (sequences) behind that measurement, ``horizon`` being in episodes
  too: the coefficient changes by at most ±20 % per ``horizon`` episodes. KL
  above target raises the coefficient, below lowers it.

  Defaults are OpenAI lm-human-preferences' (sentiment / descriptiveness):
  ``init_kl_coef=0.15``, ``target=6.0``, ``horizon=10000``.

  Args:
    init_kl_coef: initial beta (>= 0).
    target: target KL in nats per sequence (> 0).
    horizon: episodes over which a full ±20 % correction is applied (> 0).

  Returns:
    :class:`KLController`; ``update`` is jit-able.

  References:
    Ziegler et al., Fine-Tuning Language Models from Human Preferences,
    arXiv:1909.08593, section 2.2.
  """
  who = "adaptive_kl_controller"
  checks.check_positive(who, "init_kl_coef", init_kl_coef, allow_zero=True)
  checks.check_positive(who, "target", target)
  checks.check_positive(who, "horizon", horizon)

  def init() -> KLControllerState:
    return KLControllerState(jnp.asarray(init_kl_coef, jnp.float32))

  def update(state: KLControllerState, kl, n_steps) -> KLControllerState:
    error = jnp.clip(jnp.asarray(kl, jnp.float32) / target - 1.0, -0.2, 0.2)
    mult = 1.0 + error * jnp.asarray(n_steps, jnp.float32) / horizon
    return KLControllerState(state.coef * mult)

  return KLController(init, update)


def fixed_kl_controller(kl_coef: float) -> KLController:
  """A constant coefficient with the :class:`KLController` interface.

  Args:
    kl_coef: beta (>= 0).

  Returns:
    :class:`KLController` whose ``update`` returns the state unchanged.
  """
  checks.check_positive("fixed_kl_controller", "kl_coef", kl_coef, allow_zero=True)

  def init() -> KLControllerState:
    return KLControllerState(jnp.asarray(kl_coef, jnp.float32))

  def update(state: KLControllerState, kl, n_steps) -> KLControllerState:
    del kl, n_steps
    return state

  return KLController(init, update)
