"""Bitwise-deterministic, batch-invariant reductions.

Every quantity that crosses examples (loss aggregation, advantage statistics,
metrics, data-parallel combination) is computed here, so the bits of a result do
not depend on how the batch was split or padded:

* **micro-batch count**: per-example partials are computed row by row and then
  combined by one fixed pairwise tree over the global example index;
* **padding**: masked entries are replaced by exact zeros (``jnp.where``, never a
  multiplication, so NaN/inf in padding cannot leak) and the trees are invariant
  to trailing zeros: a tree over ``2n`` leaves whose second half is zero equals the
  tree over the first ``n`` leaves plus an exact ``+0``;
* **data-parallel size**: the tree is written as explicit element-wise additions
  of adjacent pairs. XLA neither reorders nor re-associates them, so the same
  bits come out whether the operand lives on one device or is sharded over 2, 4
  or 8 (GSPMD moves data but keeps the order of the additions). Inside
  ``shard_map`` pass ``axis_name``: each device reduces its contiguous block with
  the same tree and the per-device partials are combined by the upper levels of
  the tree in device order, giving the unsharded bits when the per-device block
  size is a power of two.

Plain ``jnp.sum`` does not have these properties on XLA:CPU: the same array sums
to different last bits when sharded 4 ways, and the per-row sum changes when a
row gains trailing padding (the reduction loop splits a different length).

Only element-wise additions are used, never XLA's own reduce, on purpose:
measured on XLA:CPU, a row's ``jnp.sum`` over a fixed-length axis gives
different bits in a batch of 8 rows than in a batch of 64 (the reduction loop is
vectorised differently), so even per-row sums must be trees.

Layout contract for grouped statistics: the N samples of a prompt are
contiguous, so a [B] vector reshapes to [G, N].

Shapes follow the package legend: B sequences, T tokens, G groups, N samples.
"""

from __future__ import annotations

from typing import Optional

import chex
import jax
import jax.numpy as jnp

def _next_pow2(n: int) -> int:
  return 1 if n <= 1 else 1 << (n - 1).bit_length()


@jax.custom_jvp
def _canonical_zero(x: jax.Array) -> jax.Array:
  """Maps -0.0 to +0.0 so that an all-zero subtree has one bit pattern.

  Its derivative is the identity (a plain ``where`` would have zero gradient
  wherever a sum is exactly 0, e.g. an on-policy batch whose advantages cancel).
  """
  return jnp.where(x == 0, jnp.zeros_like(x), x)


@_canonical_zero.defjvp
def _canonical_zero_jvp(primals, tangents):
  return _canonical_zero(primals[0]), tangents[0]


def _pairwise_leading(x: jax.Array) -> jax.Array:
  """Sums axis 0 of ``x`` with a pairwise tree over adjacent pairs.

  Axis 0 is zero-padded to a power of two. Level l adds leaves (2i, 2i+1), so any
  aligned power-of-two block [k*2^m, (k+1)*2^m) is a complete subtree.
  """
  n = x.shape[0]
  size = _next_pow2(n)
  if size != n:
    pad = [(0, size - n)] + [(0, 0)] * (x.ndim - 1)
    x = jnp.pad(x, pad)
  while x.shape[0] > 1:
    x = x.reshape((x.shape[0] // 2, 2) + x.shape[1:])
    x = x[:, 0] + x[:, 1]
  return x[0]


def tree_sum(x: jax.Array, axis: int = 0, axis_name: Optional[str] = None) -> jax.Array:
  """Deterministic pairwise sum of ``x`` along ``axis``.

  The result is invariant to trailing zeros along ``axis`` and to how ``x`` is
  sharded. With ``axis_name`` (inside ``shard_map``/``pmap``), ``x`` is this
  device's contiguous block of the global axis; the device partials are
  all-gathered and combined by the same tree, in device order.

  Args:
    x: array of any shape.
    axis: the axis to sum.
    axis_name: optional mapped axis over which the global array is split.

  Returns:
    ``x`` summed over ``axis`` (that axis removed), with -0.0 mapped to +0.0.
  """
  x = jnp.moveaxis(jnp.asarray(x), axis, 0)
  out = _pairwise_leading(x) if x.shape[0] else jnp.zeros(x.shape[1:], x.dtype)
  if axis_name is not None:
    out = _pairwise_leading(_gather_exact(out, axis_name))
  return _canonical_zero(out)


def _gather_exact(x: jax.Array, axis_name: str) -> jax.Array:
  """All devices' ``x`` stacked in device order, as a replicated value.

  Each device writes its partial into its own slot of a zero vector and the
  vectors are ``psum``-ed: every slot receives one value plus exact zeros, so the
  result is bit-exact whatever order the collective adds in, and (unlike
  ``all_gather``) it is known to be replicated, so ``shard_map`` can return it
  with ``out_specs=P()``.
  """
  size = jax.lax.axis_size(axis_name)
  slots = jnp.zeros((size,) + x.shape, x.dtype).at[jax.lax.axis_index(axis_name)].set(x)
  return jax.lax.psum(slots, axis_name)


def _check_bt(values_bt: jax.Array, mask_bt: jax.Array, who: str) -> None:
  if values_bt.ndim != 2 or values_bt.shape != mask_bt.shape:
    raise ValueError(
        f"{who}: values_bt and mask_bt must both be [B, T] with equal shapes; got "
        f"values_bt {tuple(values_bt.shape)} and mask_bt {tuple(mask_bt.shape)}")


def masked_row_sum(values_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """Per-sequence sum of the unmasked tokens, invariant to trailing padding.

  Args:
    values_bt: float [B, T].
    mask_bt: bool (or 0/1) [B, T]; False entries contribute an exact zero even if
      the value there is NaN or inf.

  Returns:
    float32 [B]: sum_t 1[mask_bt] * values_bt.
  """
  _check_bt(values_bt, mask_bt, "masked_row_sum")
  x = jnp.where(mask_bt.astype(bool), values_bt.astype(jnp.float32), 0.0)
  return tree_sum(x, axis=1)


def row_count(mask_bt: jax.Array) -> jax.Array:
  """Number of True tokens per row as float32 [B] (exact: integer counting)."""
  return jnp.sum(mask_bt.astype(jnp.int32), axis=-1).astype(jnp.float32)


def safe_div(num: jax.Array, den: jax.Array) -> jax.Array:
  """``num / den`` where ``den != 0``, else exactly 0 (no NaN from empty sets)."""
  ok = den != 0
  return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def batch_sum(values_b: jax.Array, valid_b: Optional[jax.Array] = None,
              axis_name: Optional[str] = None) -> jax.Array:
  """Deterministic sum over examples (pairwise tree keyed by example index).

  Args:
    values_b: float [B] per-example partials (or [B, ...]; summed over axis 0).
    valid_b: optional bool [B]; invalid rows contribute an exact zero.
    axis_name: see :func:`tree_sum`.

  Returns:
    float32 scalar (or [...]).
  """
  x = jnp.asarray(values_b, jnp.float32)
  if valid_b is not None:
    chex.assert_equal_shape_prefix([x, valid_b], 1)
    valid = valid_b.astype(bool).reshape(valid_b.shape + (1,) * (x.ndim - 1))
    x = jnp.where(valid, x, 0.0)
  return tree_sum(x, axis=0, axis_name=axis_name)


def batch_count(valid_b: jax.Array, axis_name: Optional[str] = None) -> jax.Array:
  """Number of valid rows (exact integer count, summed over ``axis_name``)."""
  n = jnp.sum(valid_b.astype(jnp.int32))
  if axis_name is not None:
    n = jax.lax.psum(n, axis_name)
  return n.astype(jnp.float32)


def batch_mean(values_b: jax.Array, valid_b: Optional[jax.Array] = None,
               axis_name: Optional[str] = None) -> jax.Array:
  """Mean over valid examples; 0 when there are none."""
  if valid_b is None:
    valid_b = jnp.ones(values_b.shape[:1], bool)
  return safe_div(batch_sum(values_b, valid_b, axis_name), batch_count(valid_b, axis_name))


def batch_moments(values_b: jax.Array, valid_b: Optional[jax.Array] = None,
                  axis_name: Optional[str] = None) -> tuple[jax.Array, jax.Array]:
  """Mean and (population) variance over valid examples, two-pass for accuracy.

  Returns:
    (mean, var) float32 scalars; both 0 when no example is valid.
  """
  if valid_b is None:
    valid_b = jnp.ones(values_b.shape[:1], bool)
  count = batch_count(valid_b, axis_name)
  mean = safe_div(batch_sum(values_b, valid_b, axis_name), count)
  dev = jnp.asarray(values_b, jnp.float32) - mean
  var = safe_div(batch_sum(dev * dev, valid_b, axis_name), count)
  return mean, var


def token_sum(values_bt: jax.Array, mask_bt: jax.Array,
              axis_name: Optional[str] = None) -> jax.Array:
  """Sum of all unmasked tokens in the batch: tree over rows of row sums."""
  return batch_sum(masked_row_sum(values_bt, mask_bt), axis_name=axis_name)


def token_count(mask_bt: jax.Array, axis_name: Optional[str] = None) -> jax.Array:
  """Number of unmasked tokens in the batch (exact)."""
  n = jnp.sum(mask_bt.astype(jnp.int32))
  if axis_name is not None:
    n = jax.lax.psum(n, axis_name)
  return n.astype(jnp.float32)


def token_mean(values_bt: jax.Array, mask_bt: jax.Array,
               axis_name: Optional[str] = None) -> jax.Array:
  """Mean over all unmasked tokens of the batch; 0 for an all-masked batch."""
  return safe_div(token_sum(values_bt, mask_bt, axis_name), token_count(mask_bt, axis_name))


def _groups(values_b: jax.Array, group_size: int, who: str) -> jax.Array:
  b = values_b.shape[0]
  if group_size <= 0 or b % group_size:
    raise ValueError(f"{who}: batch of {b} rows is not a whole number of groups of "
                     f"group_size={group_size}; samples of a prompt must be contiguous")
  return jnp.asarray(values_b, jnp.float32).reshape((b // group_size, group_size) + values_b.shape[1:])


def group_sum(values_b: jax.Array, group_size: int,
              valid_b: Optional[jax.Array] = None) -> jax.Array:
  """Per-prompt sums over contiguous groups: [B] -> [G] with G = B / group_size."""
  x = _groups(values_b, group_size, "group_sum")
  if valid_b is not None:
    x = jnp.where(_groups(valid_b, group_size, "group_sum").astype(bool), x, 0.0)
  return tree_sum(x, axis=1)


def group_moments(values_b: jax.Array, group_size: int,
                  valid_b: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-prompt mean, population variance and valid count, each [G].

  Args:
    values_b: float [B], groups of ``group_size`` contiguous samples.
    group_size: N.
    valid_b: optional bool [B]; invalid samples are left out of their group.
  """
  if valid_b is None:
    valid_b = jnp.ones(values_b.shape[:1], bool)
  count_g = jnp.sum(_groups(valid_b.astype(jnp.int32), group_size, "group_moments"), axis=1)
  count_g = count_g.astype(jnp.float32)
  mean_g = safe_div(group_sum(values_b, group_size, valid_b), count_g)
  dev_b = jnp.asarray(values_b, jnp.float32) - jnp.repeat(mean_g, group_size)
  var_g = safe_div(group_sum(dev_b * dev_b, group_size, valid_b), count_g)
  return mean_g, var_g, count_g
