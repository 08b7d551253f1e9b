"""Gradient accumulation over micro-batches and the guarded optimizer update.

Both the SFT step and the RL step are ``loss -> grads -> optax`` with the same
two mechanics, kept here once:

* :func:`accumulate` splits a batch pytree into ``m`` micro-batches along axis
  0 and sums the micro-batch gradients with a ``lax.scan`` in micro-batch order
  (a fixed order, so a given ``m`` always gives the same bits). The loss of a
  micro-batch must already be divided by the *global* normaliser (the whole
  batch's token count, sequence count, ...), so the micro-batch losses add up to
  the full-batch loss.
* :func:`guarded_apply` applies the optimizer only when loss and gradients are
  finite. A non-finite step leaves params and optimizer state untouched, does
  not bump the policy version, and reports ``update/skipped_nonfinite = 1``; the
  loop counts consecutive skips and stops the run after too many.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm.learner.state import TrainState


def split_micro(batch: Any, micro_batches: int) -> Any:
  """Reshapes every leaf [B, ...] -> [m, B/m, ...]."""
  def split(x):
    if x.shape[0] % micro_batches:
      raise ValueError(f"batch of {x.shape[0]} rows cannot be split into learner.micro_batches={micro_batches}")
    return x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])
  return jax.tree.map(split, batch)


def accumulate(loss_fn: Callable[..., tuple[jax.Array, Any]], params: Any, batch: Any,
               micro_batches: int, *args: Any) -> tuple[jax.Array, Any, Any]:
  """Sums loss and gradients of ``loss_fn(params, micro_batch, *args)`` over micro-batches.

  Args:
    loss_fn: returns ``(loss, aux)``; ``aux`` is a pytree of per-micro-batch
      values (metrics) that are stacked along a new leading axis of size m.
    params: differentiated argument.
    batch: pytree of [B, ...] arrays.
    micro_batches: m (divides B).
    *args: passed unchanged (global normalisers, frozen reference params, ...).

  Returns:
    (loss, grads, aux_stacked) with aux leaves of shape [m, ...].
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if micro_batches == 1:
    (loss, aux), grads = grad_fn(params, batch, *args)
    return loss, grads, jax.tree.map(lambda x: x[None], aux)
  micro = split_micro(batch, micro_batches)
  zeros = jax.tree.map(jnp.zeros_like, params)

  def body(carry, mb):
    loss_acc, grad_acc = carry
    (loss, aux), grads = grad_fn(params, mb, *args)
    return (loss_acc + loss, jax.tree.map(jnp.add, grad_acc, grads)), aux

  (loss, grads), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), micro)
  return loss, grads, aux


def all_finite(*trees: Any) -> jax.Array:
  leaves = [x for t in trees for x in jax.tree.leaves(t)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def guarded_apply(params: Any, opt_state: Any, grads: Any, loss: jax.Array,
                  optimizer: optax.GradientTransformation) -> tuple[Any, Any, jax.Array, dict]:
  """One optimizer step, skipped (state unchanged) if loss or grads are not finite.

  Returns:
    (params, opt_state, applied bool scalar, metrics) with metrics
    ``grad_norm``, ``update/skipped_nonfinite`` and ``update/param_norm``.
  """
  finite = all_finite(grads, loss)
  safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
  updates, new_opt = optimizer.update(safe_grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jnp.where(finite, new, old)
  params = jax.tree.map(keep, new_params, params)
  opt_state = jax.tree.map(keep, new_opt, opt_state)
  metrics = {
      "grad_norm": jnp.where(finite, optax.tree.norm(grads), jnp.nan),
      "update/skipped_nonfinite": 1.0 - finite.astype(jnp.float32),
      "update/param_norm": optax.tree.norm(params),
  }
  return params, opt_state, finite, metrics


def apply_policy_update(state: TrainState, grads: Any, loss: jax.Array,
                        optimizer: optax.GradientTransformation) -> tuple[TrainState, dict]:
  """Guarded update of the policy; bumps ``step`` and ``policy_version`` when applied."""
  params, opt_state, applied, metrics = guarded_apply(state.params, state.opt_state, grads, loss, optimizer)
  inc = applied.astype(jnp.int32)
  return state.replace(params=params, opt_state=opt_state, step=state.step + inc,
                       policy_version=state.policy_version + inc), metrics
