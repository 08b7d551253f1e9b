"""Gradient accumulation over micro-batches and the guarded optimizer update.

Both the SFT step and the RL step are ``loss -> grads -> optax`` with the same
two mechanics, kept here once:

* :func:`accumulate` splits a batch pytree into ``m`` micro-batches along axis
  0 and sums the micro-batch gradients with a ``lax.scan`` in micro-batch order
  (a fixed order, so a given ``m`` always gives the same bits). The loss of a
  micro-batch must already be divided by the *global* normaliser (the whole
  batch's token count, sequence count, ...), so the micro-batch losses add up to
  the full-batch loss.
* :func:`guarded_apply` applies the optimizer only when the loss, the gradients
  and the updated parameters and optimizer state are all finite. A non-finite step leaves params and optimizer state untouched, does
  not bump the policy version, and reports ``update/skipped_nonfinite = 1``; the
  loop counts consecutive skips and stops the run after too many.

Batch-invariant mode (``model.batch_invariant=True``) replaces the scan with
:func:`accumulate_atoms`, whose gradient has the same bits for any micro-batch
count, data-parallel size, FSDP layout and number of processes:

* the global batch is cut into ``learner.grad_atoms`` equal **atoms** of
  ``B / atoms`` rows, in row order; every device holds whole atoms;
* each atom's gradient is computed alone, by the same fixed-shape program,
  inside a loop whose trip count XLA cannot see (``ops.opaque``); the model's
  batch-invariant kernels make that gradient a function of the atom only;
* the per-atom gradients are summed by the fixed pairwise tree of
  :mod:`jaxrl_llm.reduce` over the global atom index: the lower levels on each
  device (as a running binary counter, so at most ``log2(atoms) + 1``
  gradient-sized buffers are live), the upper levels across devices in device
  order (an exact gather, then the same tree);
* everything else of the step (normalisers, metrics, the optimizer) runs
  through :func:`replicated`: every device executes the single-device program
  on whole arrays, so GSPMD never splits a reduction.

Micro-batches then only group atoms: the learner always differentiates one atom
at a time per device, so ``learner.micro_batches`` has to divide the atom count
and changes nothing else. Cost: an FSDP mesh gathers the parameters and the
optimizer state for the step (the invariant path trades FSDP's memory saving
for reproducibility), and the tensor axis, if any, computes replicas.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm import reduce
from jaxrl_llm.learner.mesh import BATCH_AXES, check_grad_atoms
from jaxrl_llm.learner.state import TrainState
from jaxrl_llm.models import axes, lora
from jaxrl_llm.ops import opaque


def split_micro(batch: Any, micro_batches: int) -> Any:
  """Reshapes every leaf [B, ...] -> [m, B/m, ...]."""
  def split(x):
    if x.shape[0] % micro_batches:
      raise ValueError(f"batch of {x.shape[0]} rows cannot be split into learner.micro_batches={micro_batches}")
    return x.reshape((micro_batches, x.shape[0] // micro_batches) + x.shape[1:])
  return jax.tree.map(split, batch)


class TrainablePart:
  """The leaves of a parameter tree that train, and the way back to the whole tree.

  With LoRA adapters (:mod:`jaxrl_llm.models.lora`) only the adapters and the scalar
  heads train: the gradient is taken with respect to those leaves alone (the frozen
  kernels enter the loss as constants, so no [in, out] weight gradient is ever
  formed), and :meth:`expand` gives the optimizer a full tree with zeros at the frozen
  leaves, which :func:`jaxrl_llm.learner.optim.train_only` ignores.
  """

  def __init__(self, params: Any):
    leaves, self.treedef = jax.tree.flatten(params)
    self.mask = jax.tree.leaves(lora.trainable_mask(params))
    self.train = [x for x, m in zip(leaves, self.mask) if m]
    self.frozen = [x for x, m in zip(leaves, self.mask) if not m]

  def rebuild(self, train: Sequence[Any], frozen: Sequence[Any]) -> Any:
    it_t, it_f = iter(train), iter(frozen)
    return jax.tree.unflatten(self.treedef, [next(it_t) if m else next(it_f) for m in self.mask])

  def expand(self, grads: Sequence[Any]) -> Any:
    """The whole tree's gradients: ``grads`` at the trainable leaves, zeros elsewhere."""
    return self.rebuild(grads, [jnp.zeros_like(x) for x in self.frozen])

  def loss(self, loss_fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """``loss_fn(params, mb, *args)`` as ``f(train, mb, frozen, *args)`` (frozen leaves passed as data)."""
    return lambda train, mb, frozen, *args: loss_fn(self.rebuild(train, frozen), mb, *args)


def accumulate(loss_fn: Callable[..., tuple[jax.Array, Any]], params: Any, batch: Any,
               micro_batches: int, *args: Any, adapters_only: bool = False) -> tuple[jax.Array, Any, Any]:
  """Sums loss and gradients of ``loss_fn(params, micro_batch, *args)`` over micro-batches.

  Args:
    loss_fn: returns ``(loss, aux)``; ``aux`` is a pytree of per-micro-batch
      values (metrics) that are stacked along a new leading axis of size m.
    params: differentiated argument.
    batch: pytree of [B, ...] arrays.
    micro_batches: m (divides B).
    *args: passed unchanged (global normalisers, frozen reference params, ...).
    adapters_only: differentiate only the LoRA adapters and scalar heads
      (:class:`TrainablePart`); the frozen leaves' gradients are zeros.

  Returns:
    (loss, grads, aux_stacked) with aux leaves of shape [m, ...].
  """
  if adapters_only:
    part = TrainablePart(params)
    loss, grads, aux = accumulate(part.loss(loss_fn), part.train, batch, micro_batches, part.frozen, *args)
    return loss, part.expand(grads), aux
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


def check_atoms(num_rows: int, atoms: int, mesh: Mesh, micro_batches: int = 1,
                batch_axes: Sequence[str] = BATCH_AXES) -> int:
  """Validates an atom layout for a batch of ``num_rows`` rows; returns the atoms per device.

  Args:
    num_rows: B, rows of the global batch.
    atoms: number of atoms (``learner.grad_atoms``).
    mesh: the learner mesh.
    micro_batches: ``learner.micro_batches`` (must group whole atoms).
    batch_axes: mesh axes the atoms are split over.

  Raises:
    ValueError: naming ``learner.grad_atoms`` and what it must divide or be.
  """
  local = check_grad_atoms(mesh, atoms, batch_axes)
  if atoms % micro_batches:
    raise ValueError(f"learner.grad_atoms={atoms}: expected a multiple of learner.micro_batches={micro_batches}")
  if num_rows % atoms:
    raise ValueError(f"batch of {num_rows} rows cannot be cut into learner.grad_atoms={atoms} equal atoms")
  return local


def replicated(fn: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
  """``fn`` run whole on every device of ``mesh``: the single-device program, for any mesh.

  Inputs are gathered (an exact data movement) and outputs are replicated.
  Under plain GSPMD a reduction over a sharded operand becomes per-shard sums
  plus an all-reduce, whose bits depend on the layout; inside this wrapper no
  operation is partitioned, so a step's normalisers, metrics and optimizer
  update have the same bits on 1 device, a data-parallel mesh, an FSDP mesh or
  several processes, provided XLA cannot fuse them with mesh-dependent code
  (run them as their own executable, see :func:`invariant_step`).

  Args:
    fn: any function of pytrees of arrays.
    mesh: the mesh to run on.

  Returns:
    A function with ``fn``'s signature (to be called inside ``jit``).
  """
  def body(*args):
    with manual_rules():
      return fn(*args)

  def call(*args):
    return jax.shard_map(body, mesh=mesh, in_specs=(P(),) * len(args), out_specs=P(), check_vma=False)(*args)
  return call


def manual_rules():
  """Logical-axis rules that map every axis to "not sharded", for code inside ``shard_map``.

  Model code constrains activations by logical names against the ambient mesh;
  inside ``shard_map`` that mesh's axes are manual and each device already
  holds its own block, so the constraints must name no mesh axis.
  """
  return nn.logical_axis_rules(tuple((name, None) for name, _ in axes.current_rules()))


def jit_keeping_state_sharding(fn: Callable[..., tuple], mesh: Mesh) -> Callable[..., tuple]:
  """``jax.jit(fn)`` whose first output keeps the shardings of the first argument.

  For steps ``fn(state, ...) -> (state, *rest)`` built with :func:`replicated`,
  whose outputs would otherwise come back replicated: the new state is put
  back into the layout the old one had (an FSDP-sharded state stays sharded;
  a slice of a replicated array is exact). ``rest`` is replicated. Leaves that
  are not laid out on ``mesh`` are replicated on it.

  Args:
    fn: the step; its first argument and first output have the same structure.
    mesh: the learner mesh.

  Returns:
    The jitted step (one compilation per state structure).
  """
  rep = NamedSharding(mesh, P())
  compiled: dict = {}

  def layout(x):
    s = getattr(x, "sharding", None)
    return s if isinstance(s, NamedSharding) and s.mesh == mesh else rep

  def call(state, *args):
    # One jit per state structure; the layout is the first state's. Later states come back in
    # equivalent shardings (e.g. P() for P('fsdp') on a 1-wide axis), which jit does not recompile for.
    key = jax.tree.structure(state)
    if key not in compiled:
      shardings = jax.tree.map(layout, state)
      compiled[key] = jax.jit(lambda st, *a: _constrain_first(fn(st, *a), shardings, rep))
    return compiled[key](state, *args)

  return call


def invariant_step(gradients: Callable[..., tuple], finish: Callable[..., tuple], mesh: Mesh) -> Callable[..., tuple]:
  """A batch-invariant step as two executables: the gradient, then the replicated update.

  ``step(state, *args) = finish(state, *gradients(state, *args))``, with
  ``gradients`` jitted on its own (it runs :func:`accumulate_atoms`) and
  ``finish`` (metrics, optimizer) run through :func:`replicated` in a second
  executable. Two executables, not one: inside one program XLA fuses the
  update's reductions (the global gradient norm of the clipping) with the
  mesh-dependent end of the gradient computation, and their bits then depend
  on the mesh (measured: 1 vs 4 devices; optimization barriers did not stop
  it). Apart from the device count, the second executable is the same
  program on every mesh.

  Args:
    gradients: ``(state, *args) -> tuple`` (gradients, losses, partials, ...).
    finish: ``(state, *gradients_outputs) -> (new_state, *rest)``.
    mesh: the learner mesh.

  Returns:
    ``step(state, *args) -> (new_state, *rest)``; the new state keeps the
    shardings of ``state``.
  """
  grad_jit = jax.jit(gradients)
  apply = jit_keeping_state_sharding(replicated(finish, mesh), mesh)

  def step(state, *args):
    return apply(state, *grad_jit(state, *args))

  return step


def _constrain_first(out: tuple, shardings: Any, rep: NamedSharding) -> tuple:
  first = jax.tree.map(jax.lax.with_sharding_constraint, out[0], shardings)
  return (first,) + tuple(jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, rep), o) for o in out[1:])


def _canonical(tree: Any) -> Any:
  """-0.0 -> +0.0 everywhere, so an exact gather-by-sum cannot flip the sign of a zero."""
  return jax.tree.map(lambda g: jnp.where(g == 0, jnp.zeros_like(g), g), tree)


def _tree_push(stack: list, count: jax.Array, grads: Any) -> list:
  """Adds the next leaf ``grads`` to a running pairwise tree (a binary counter).

  ``stack[l]`` holds the sum of the last complete, still unpaired, aligned
  block of ``2**l`` leaves. Leaf number ``count`` climbs while bit ``l`` of
  ``count`` is set (pairing with ``stack[l]`` as its left sibling) and settles
  at the first clear bit. After ``2**L`` leaves, ``stack[L]`` is exactly
  :func:`jaxrl_llm.reduce.tree_sum` of them (same pairs, same order).
  """
  active = jnp.bool_(True)
  out = []
  for level, held in enumerate(stack):
    bit = (count >> level) & 1
    pair = active & (bit == 1)
    settle = active & (bit == 0)
    out.append(jax.tree.map(lambda h, g: jnp.where(settle, g, h), held, grads))
    grads = jax.tree.map(lambda h, g: jnp.where(pair, h + g, g), held, grads)
    active = pair
  return out


def accumulate_atoms(loss_fn: Callable[..., tuple[jax.Array, Any]], params: Any, batch: Any, atoms: int,
                     mesh: Mesh, *args: Any, batch_axes: Sequence[str] = BATCH_AXES,
                     adapters_only: bool = False) -> tuple[jax.Array, Any, Any]:
  """Batch-invariant :func:`accumulate`: per-atom gradients summed by a fixed tree.

  The result has the same bits for any mesh whose batch shards divide
  ``atoms`` (1, 2, 4, 8 data-parallel devices; an FSDP mesh; several
  processes), provided ``loss_fn`` is itself batch invariant (the model in
  ``batch_invariant`` mode, losses through :mod:`jaxrl_llm.reduce`).

  Formula, with A = ``atoms`` and atom a holding rows ``[a B/A, (a+1) B/A)``::

    grads = tree_a( grad_params loss_fn(params, atom_a, *args) )
    loss  = tree_a( loss_fn(params, atom_a, *args) )

  where ``tree_a`` is the pairwise tree of :func:`jaxrl_llm.reduce.tree_sum`
  over the global atom index.

  Args:
    loss_fn: returns ``(loss, aux)``; the loss of an atom must already be
      divided by the *global* normaliser, so the atom losses add up to the
      batch loss.
    params: differentiated argument (any sharding; gathered for the step).
    batch: pytree of [B, ...] arrays, B divisible by ``atoms``.
    atoms: A, a power of two, a multiple of the mesh's batch shards.
    mesh: the learner mesh.
    *args: passed unchanged to every atom (replicated).
    batch_axes: mesh axes the atoms are split over, in device order.
    adapters_only: as in :func:`accumulate`.

  Returns:
    (loss, grads, aux_stacked): replicated scalar loss and gradients, and
    ``aux`` stacked over atoms in global order (leaves [A, ...]).
  """
  if adapters_only:
    part = TrainablePart(params)
    loss, grads, aux = accumulate_atoms(part.loss(loss_fn), part.train, batch, atoms, mesh, part.frozen, *args,
                                        batch_axes=batch_axes)
    return loss, part.expand(grads), aux
  axes = tuple(a for a in batch_axes if a in mesh.axis_names)
  num_rows = jax.tree.leaves(batch)[0].shape[0]
  local_atoms = check_atoms(num_rows, atoms, mesh, batch_axes=axes)
  levels = local_atoms.bit_length()  # log2(local_atoms) + 1 slots
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def per_device(params, batch, *args):
    with manual_rules():
      return _per_device(params, batch, *args)

  def _per_device(params, batch, *args):
    def split(x):
      x = x.reshape((local_atoms, x.shape[0] // local_atoms) + x.shape[1:])
      # At least two atoms in the buffer: with one, the slice below would be
      # loop-invariant and XLA would hoist and re-fuse the whole gradient.
      return jnp.concatenate([x, jnp.zeros_like(x[:1])]) if local_atoms == 1 else x

    stacked = jax.tree.map(split, batch)
    first = jax.tree.map(lambda x: x[0], stacked)
    shapes = jax.eval_shape(lambda p, b: grad_fn(p, b, *args), params, first)
    (loss_shape, aux_shape), _ = shapes
    zeros_like = lambda s, lead=(): jnp.zeros(lead + s.shape, s.dtype)
    init = ([jax.tree.map(jnp.zeros_like, params) for _ in range(levels)],
            jnp.zeros((local_atoms,), loss_shape.dtype),
            jax.tree.map(lambda s: zeros_like(s, (local_atoms,)), aux_shape))

    def body(i, carry):
      stack, losses, aux_buf = carry
      atom = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), stacked)
      (loss, aux), grads = grad_fn(params, atom, *args)
      # The barrier separates the atom's gradient from the tree additions that follow it.
      grads = jax.lax.optimization_barrier(_canonical(grads))
      stack = _tree_push(stack, i, grads)
      losses = jax.lax.dynamic_update_index_in_dim(losses, loss, i, 0)
      aux_buf = jax.tree.map(lambda buf, a: jax.lax.dynamic_update_index_in_dim(buf, a, i, 0), aux_buf, aux)
      return stack, losses, aux_buf

    stack, losses, aux_buf = jax.lax.fori_loop(0, opaque(jnp.int32(local_atoms)), body, init)
    local = stack[-1]
    if axes:
      grads = jax.tree.map(lambda g: reduce.tree_sum(g[None], axis_name=axes), local)
    else:
      grads = jax.tree.map(lambda g: reduce.tree_sum(g[None]), local)
    return grads, losses, aux_buf

  spec = P(axes) if axes else P()
  grads, losses, aux = jax.shard_map(
      per_device, mesh=mesh, in_specs=(P(), spec) + (P(),) * len(args),
      out_specs=(P(), spec, spec), check_vma=False)(params, batch, *args)
  loss = replicated(reduce.tree_sum, mesh)(losses)
  return loss, grads, aux


def all_finite(*trees: Any) -> jax.Array:
  leaves = [x for t in trees for x in jax.tree.leaves(t)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def guarded_apply(params: Any, opt_state: Any, grads: Any, loss: jax.Array,
                  optimizer: optax.GradientTransformation) -> tuple[Any, Any, jax.Array, dict]:
  """One optimizer step, skipped (state unchanged) if the loss, the gradients or the new state are not finite.

  Returns:
    (params, opt_state, applied bool scalar, metrics) with metrics
    ``grad_norm``, ``update/skipped_nonfinite`` and ``update/param_norm``.
  """
  finite_inputs = all_finite(grads, loss)
  safe_grads = jax.tree.map(lambda g: jnp.where(finite_inputs, g, 0.0), grads)
  updates, new_opt = optimizer.update(safe_grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  # Finite gradients can still give non-finite weights (an infinite learning rate, an overflow in
  # the optimizer's moments): the new state is accepted only when it is finite too.
  finite = finite_inputs & all_finite(new_params, new_opt)
  keep = lambda new, old: jnp.where(finite, new, old)
  params = jax.tree.map(keep, new_params, params)
  opt_state = jax.tree.map(keep, new_opt, opt_state)
  metrics = {
      "grad_norm": jnp.where(finite_inputs, optax.tree.norm(grads), jnp.nan),
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
