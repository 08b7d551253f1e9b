"""Fixed-shape loops: the building blocks of batch-invariant execution.

Why. XLA picks a different kernel (and so a different floating-point summation
order) for ``[N, D] @ [D, F]`` depending on ``N``, and a different reduction
strategy for ``sum(x, -1)`` depending on the leading dims. Measured on XLA:CPU
(jax 0.10): the same row in a 1-row and a 2-row matmul differs in the last
bits, and a row reduction over 1000 features differs between 2 and 7 rows.
Reshaping to ``[C, M0, D]`` does not help (XLA folds it back into one big dot).
XLA:CPU also contracts ``a * b + c`` into FMAs, and whether it does depends on
how the surrounding ops are fused, so even elementwise code is only
reproducible when its fusion context is.

How. ``map_row_tiles`` pads the rows to a multiple of a fixed tile ``M0`` and
runs the row-wise function once per tile in a loop. The loop body sees static
``[M0, ...]`` shapes, so XLA compiles it to the same code whatever ``N`` is,
and a row's result depends only on that row. Three details make "the same
code" hold in practice (each was needed, measured):

* the trip count is hidden from XLA (``opaque``), so it never unrolls or
  specialises the loop;
* there are always at least two tiles: with one tile the per-tile slice is a
  constant, the body gets hoisted out of the loop and fused with its
  neighbours;
* under ``jax.grad`` the forward pass still runs this primal loop (a custom
  VJP recomputes it for the backward pass); a differentiated loop body also
  emits residuals, is fused differently and its values change in the last bits.

``fixed_fori_loop`` applies the same treatment to a loop with a carry (the key
blocks of attention).

References:
  He et al., "Defeating Nondeterminism in LLM Inference" (Thinking Machines
  blog, 2025): batch-invariant matmul, reduction and attention kernels.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

ROW_TILE = 32
"""M0: rows per tile. Every batch-invariant token-wise op runs on [ROW_TILE, ...]."""

MIN_TILES = 2
"""Loops always run at least this many steps (see the module docstring)."""


def opaque(x: Any) -> Any:
  """Hides a (possibly constant) value from XLA's constant folding and loop analysis.

  Used for loop trip counts and for scalars such as the sampling temperature, so
  that a Python constant on one side (learner) and a traced value on the other
  (sampler) compile to the same code.
  """
  return lax.optimization_barrier(x)


def _hoist_closure(fn: Callable, *example: Any) -> tuple[Callable, tuple]:
  """Rewrites ``fn(*args)`` as ``fn2(*args, *consts)`` with every closed-over value explicit.

  Weights, caches and masks (any dtype, traced or not) become arguments, so the
  custom VJPs below never capture a tracer of an enclosing transformation (jit,
  remat, grad).
  """
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*example)
  out_tree = jax.tree.structure(out_shape)

  def hoisted(*args):
    leaves = jax.tree.leaves(args[:len(example)])
    consts = args[len(example):]
    return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(closed.jaxpr, consts, *leaves))

  return hoisted, tuple(closed.consts)


# --------------------------------------------------------------------------- tiles


def map_row_tiles(fn: Callable[[Any], Any], rows: Any, *, tile: int = ROW_TILE) -> Any:
  """Applies a row-wise ``fn`` to fixed-size tiles of rows, one tile per loop step.

  Args:
    fn: maps a pytree of arrays with leading dim ``tile`` to a pytree of arrays
      with leading dim ``tile``. Row ``i`` of every output must depend only on
      row ``i`` of the inputs (and on closed-over values such as weights).
    rows: pytree of arrays sharing the leading dim N (any dtype; padding rows
      are zeros).
    tile: M0, the fixed tile height.

  Returns:
    ``fn`` applied to all N rows: a pytree of arrays with leading dim N.
  """
  leaves = jax.tree.leaves(rows)
  if not leaves:
    raise ValueError("map_row_tiles: `rows` has no arrays")
  n = int(leaves[0].shape[0])
  for leaf in leaves:
    if leaf.ndim == 0 or int(leaf.shape[0]) != n:
      raise ValueError(
          f"map_row_tiles: every input needs the same leading (row) dim {n}; got shape {leaf.shape}")
  num_tiles = max(MIN_TILES, -(-n // tile))
  padded = num_tiles * tile

  def to_tiles(a):
    a = jnp.pad(a, [(0, padded - n)] + [(0, 0)] * (a.ndim - 1))
    return a.reshape((num_tiles, tile) + a.shape[1:])

  tiles = jax.tree.map(to_tiles, rows)
  hoisted, consts = _hoist_closure(fn, jax.tree.map(lambda a: a[0], tiles))
  out = _map_tiles(hoisted, tiles, consts)
  return jax.tree.map(lambda a: a.reshape((padded,) + a.shape[2:])[:n], out)


def _map_tiles_primal(fn, tiles, consts):
  """One opaque-trip-count ``fori_loop`` step per tile (see the module docstring)."""
  num_tiles = jax.tree.leaves(tiles)[0].shape[0]
  out_shape = jax.eval_shape(lambda t: fn(t, *consts), jax.tree.map(lambda a: a[0], tiles))
  outs = jax.tree.map(lambda s: jnp.zeros((num_tiles,) + s.shape, s.dtype), out_shape)

  def body(i, outs):
    tile = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), tiles)
    result = fn(tile, *consts)
    return jax.tree.map(lambda buf, r: lax.dynamic_update_index_in_dim(buf, r, i, axis=0), outs, result)

  return lax.fori_loop(0, opaque(jnp.int32(num_tiles)), body, outs)


def _map_tiles_differentiable(fn, tiles, consts):
  return lax.map(lambda t: fn(t, *consts), tiles)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _map_tiles(fn, tiles, consts):
  return _map_tiles_primal(fn, tiles, consts)


def _map_tiles_fwd(fn, tiles, consts):
  return _map_tiles_primal(fn, tiles, consts), (tiles, consts)


def _map_tiles_bwd(fn, residuals, cotangent):
  tiles, consts = residuals
  _, vjp = jax.vjp(functools.partial(_map_tiles_differentiable, fn), tiles, consts)
  return vjp(cotangent)


_map_tiles.defvjp(_map_tiles_fwd, _map_tiles_bwd)


def map_tokens(fn: Callable[[Any], Any], tree: Any, *, lead: int, invariant: bool,
               tile: int = ROW_TILE) -> Any:
  """Applies a token-wise ``fn`` to arrays with ``lead`` leading token dims (e.g. [B, T, ...]).

  Both modes first flatten the ``lead`` leading dims into one row dim and
  restore them afterwards. Default mode then calls ``fn`` once on all rows
  (fast; XLA chooses kernels by shape). Flattening matters for speed: with
  [B, T, ...] operands XLA:CPU fuses the weight-gradient transposes of the
  backward pass into strided elementwise loops (measured: 31 % of the kernel
  time of a learner step; 13 % after flattening, +60 % tokens/s). Invariant
  mode runs ``map_row_tiles`` over the rows, so every token is computed by the
  same fixed-shape code.

  Args:
    fn: token-wise function accepting any leading shape (written with ``...``).
    tree: pytree of arrays whose first ``lead`` dims are equal.
    lead: number of leading token dims (1 for [B, ...], 2 for [B, T, ...]).
    invariant: select the tiled, batch-invariant path.
    tile: M0.

  Returns:
    ``fn``'s outputs, each with the same ``lead`` leading dims.
  """
  leaves = jax.tree.leaves(tree)
  lead_shape = tuple(leaves[0].shape[:lead])
  n = 1
  for d in lead_shape:
    n *= int(d)
  flat = jax.tree.map(lambda a: a.reshape((n,) + a.shape[lead:]), tree)
  out = map_row_tiles(fn, flat, tile=tile) if invariant else fn(flat)
  return jax.tree.map(lambda a: a.reshape(lead_shape + a.shape[1:]), out)


# --------------------------------------------------------------------------- carried loop


def fixed_fori_loop(num_steps: int, body: Callable[[jax.Array, Any], Any], init: Any) -> Any:
  """``lax.fori_loop(0, num_steps, body, init)`` compiled independently of ``num_steps``.

  The trip count is opaque to XLA in the forward pass; ``num_steps`` must be at
  least ``MIN_TILES`` (callers pad). Reverse-mode differentiation recomputes
  the loop as a ``lax.scan`` (same maths; its bits do not matter).

  Args:
    num_steps: static trip count (>= MIN_TILES).
    body: ``body(i, carry) -> carry``; may close over arrays.
    init: initial carry pytree.

  Returns:
    The final carry.
  """
  if num_steps < MIN_TILES:
    raise ValueError(f"fixed_fori_loop: num_steps={num_steps} < {MIN_TILES}; pad the loop")
  hoisted, consts = _hoist_closure(body, jnp.int32(0), init)
  return _fixed_loop(hoisted, num_steps, init, consts)


def _fixed_loop_primal(body, num_steps, init, consts):
  return lax.fori_loop(0, opaque(jnp.int32(num_steps)), lambda i, c: body(i, c, *consts), init)


def _fixed_loop_differentiable(body, num_steps, init, consts):
  def step(carry, i):
    return body(i, carry, *consts), None

  return lax.scan(step, init, jnp.arange(num_steps, dtype=jnp.int32))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fixed_loop(body, num_steps, init, consts):
  return _fixed_loop_primal(body, num_steps, init, consts)


def _fixed_loop_fwd(body, num_steps, init, consts):
  return _fixed_loop_primal(body, num_steps, init, consts), (init, consts)


def _fixed_loop_bwd(body, num_steps, residuals, cotangent):
  init, consts = residuals
  _, vjp = jax.vjp(functools.partial(_fixed_loop_differentiable, body, num_steps), init, consts)
  return vjp(cotangent)


_fixed_loop.defvjp(_fixed_loop_fwd, _fixed_loop_bwd)
