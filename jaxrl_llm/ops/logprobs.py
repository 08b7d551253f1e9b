"""Token log-probabilities (and entropy) from FP32 logits, optionally batch invariant.

For logits ``z`` of one position, temperature ``tau`` and target token ``y``::

  u        = z / tau
  logp(y)  = (u_y - max u) - log sum_v exp(u_v - max u)
  entropy  = log sum_v exp(u_v - max u) - sum_v softmax(u)_v (u_v - max u)

Entries of ``z`` equal to ``-inf`` (tokens removed by top-k / top-p) get
probability 0, so the same function gives the renormalised log-probability of
a truncated sampling distribution. The learner (``sequence_logprobs``) and the
sampler (behaviour log-probabilities) both call this function; in invariant
mode it runs on fixed row tiles so that both produce identical bits.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from jaxrl_llm.ops.tiling import map_tokens, opaque


def token_logprobs(logits_nv: jax.Array, targets_n: jax.Array, temperature: float | jax.Array = 1.0,
                   *, invariant: bool = False, with_entropy: bool = False):
  """Log-probability of ``targets`` under ``softmax(logits / temperature)``.

  Args:
    logits_nv: [..., V] logits (cast to float32).
    targets_n: int [...] target token ids.
    temperature: positive scalar tau (Python float or traced scalar).
    invariant: run on fixed row tiles (bitwise independent of the other rows).
    with_entropy: also return the entropy of the tempered distribution.

  Returns:
    float32 [...] log-probabilities, or ``(logp, entropy)`` when ``with_entropy``.
  """
  chex.assert_equal(logits_nv.shape[:-1], targets_n.shape)
  lead = targets_n.ndim
  # Opaque scalar: a constant on one side and a traced value on the other must
  # compile to the same division.
  tau = opaque(jnp.asarray(temperature, jnp.float32))

  def fn(tree):
    z, y = tree
    u = z.astype(jnp.float32) / tau
    u_max = jnp.max(u, axis=-1, keepdims=True)
    shifted = u - jnp.where(jnp.isfinite(u_max), u_max, 0.0)
    exp = jnp.exp(shifted)
    sum_exp = jnp.sum(exp, axis=-1)
    log_norm = jnp.log(sum_exp)
    picked = jnp.take_along_axis(shifted, y[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = picked - log_norm
    if not with_entropy:
      return logp
    safe = jnp.where(exp > 0, shifted, 0.0)
    entropy = log_norm - jnp.sum(exp * safe, axis=-1) / sum_exp
    return logp, entropy

  if lead == 0:
    out = fn((logits_nv[None], targets_n[None]))
    return jax.tree.map(lambda a: a[0], out)
  return map_tokens(fn, (logits_nv, targets_n), lead=lead, invariant=invariant)
