"""Differentiable views of the deterministic sums in :mod:`jaxrl_llm.reduce`.

The forward values are exactly those of :func:`jaxrl_llm.reduce.masked_row_sum`
and :func:`jaxrl_llm.reduce.batch_sum` (same bits). The derivative is supplied
by hand because ``reduce`` maps -0.0 to +0.0 with ``where(x == 0, 0, x)``, whose
derivative is 0 wherever a sum is exactly zero: differentiated directly, a loss
whose numerator happens to be exactly 0 (on-policy ratios of 1 and advantages
that cancel) would get an all-zero gradient. A sum is linear, so its tangent
is the plain sum of the tangents and its transpose the broadcast of the
cotangent; the order of the additions does not matter for the gradient, which
is why a plain ``jnp.sum`` is used for the tangent.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jaxrl_llm import reduce


@jax.custom_jvp
def row_sum(values_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """:func:`jaxrl_llm.reduce.masked_row_sum` with the derivative of a masked sum."""
  return reduce.masked_row_sum(values_bt, mask_bt)


@row_sum.defjvp
def _row_sum_jvp(primals, tangents):
  values, mask = primals
  d_values, _ = tangents
  d = jnp.where(mask.astype(bool), d_values.astype(jnp.float32), 0.0)
  return reduce.masked_row_sum(values, mask), jnp.sum(d, axis=-1)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def batch_sum(values_b: jax.Array, axis_name: Optional[str] = None) -> jax.Array:
  """:func:`jaxrl_llm.reduce.batch_sum` over axis 0 with the derivative of a sum."""
  return reduce.batch_sum(values_b, axis_name=axis_name)


@batch_sum.defjvp
def _batch_sum_jvp(axis_name, primals, tangents):
  (values,), (d_values,) = primals, tangents
  d = jnp.sum(jnp.asarray(d_values, jnp.float32), axis=0)
  if axis_name is not None:
    d = jax.lax.psum(d, axis_name)
  return reduce.batch_sum(values, axis_name=axis_name), d
