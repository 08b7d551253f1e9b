"""The learner's train state: one pytree holding everything an update changes.

``TrainState`` is a flax struct so it passes through ``jit``, is sharded like
its parameters, and is saved and restored whole by orbax.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import optax
from flax import struct


@struct.dataclass
class TrainState:
  """Policy (and optional critic) parameters with their optimizer states.

  Attributes:
    step: int32 scalar, optimizer steps taken by the policy.
    params: policy parameter pytree (layout in :mod:`jaxrl_llm.models`).
    opt_state: optax state of the policy optimizer.
    rng: uint32 [2] raw PRNG key data (a plain array, so checkpoints are portable).
    policy_version: int32 scalar, bumped at every policy update; samplers stamp
      every token with the version that produced it.
    critic_params: optional critic parameter pytree (PPO path).
    critic_opt_state: optional optax state of the critic optimizer.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array
  policy_version: jax.Array
  critic_params: Optional[Any] = None
  critic_opt_state: Optional[Any] = None


def create_train_state(params: Any, optimizer: optax.GradientTransformation, seed: int,
                       critic_params: Any = None,
                       critic_optimizer: Optional[optax.GradientTransformation] = None) -> TrainState:
  """Fresh state at step 0, version 0."""
  return TrainState(
      step=jnp.zeros((), jnp.int32),
      params=params,
      opt_state=optimizer.init(params),
      rng=jax.random.key_data(jax.random.PRNGKey(seed)),
      policy_version=jnp.zeros((), jnp.int32),
      critic_params=critic_params,
      critic_opt_state=(critic_optimizer.init(critic_params)
                        if critic_params is not None and critic_optimizer is not None else None),
  )


def split_rng(state: TrainState) -> tuple[TrainState, jax.Array]:
  """Returns (state with advanced rng, a fresh key)."""
  key, sub = jax.random.split(jax.random.wrap_key_data(state.rng))
  return state.replace(rng=jax.random.key_data(key)), sub
