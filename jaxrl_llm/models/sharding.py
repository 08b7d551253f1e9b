"""The one table that maps the model's logical axis names to mesh axes.

Model code names logical axes only (``nn.with_logical_partitioning`` on
parameters, ``nn.with_logical_constraint`` on activations); this module maps
them to the mesh axes ``('data', 'fsdp', 'tensor')``. Override the table by
passing ``rules=`` or by entering ``flax.linen.logical_axis_rules(...)``.

Parameters: vocab, embed, mlp, heads, kv_heads, head_dim, norm.
Activations: batch, length, act_embed, act_mlp, act_heads, act_vocab.

References: MaxText ``logical_axis_rules``; flax ``linen.spmd``.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models.config import ModelConfig

LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_vocab", "tensor"),
)

Rules = Sequence[tuple[str, Any]]


def rules_for_mesh(mesh: Mesh, rules: Optional[Rules] = None) -> tuple[tuple[str, Any], ...]:
  """Drops mesh axes that ``mesh`` does not have (a 1-axis mesh still works).

  Args:
    mesh: the target mesh.
    rules: logical rules (default ``LOGICAL_AXIS_RULES``).

  Returns:
    The rules with every mesh axis absent from ``mesh.axis_names`` removed.
  """
  rules = LOGICAL_AXIS_RULES if rules is None else tuple(rules)
  names = set(mesh.axis_names)
  out = []
  for logical, axes in rules:
    if axes is None:
      out.append((logical, None))
      continue
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in names)
    out.append((logical, None if not kept else (kept[0] if len(kept) == 1 else kept)))
  return tuple(out)


def current_rules() -> tuple[tuple[str, Any], ...]:
  """The rules in force: a ``nn.logical_axis_rules`` context, else the default table."""
  rules = nn.get_logical_axis_rules()
  return tuple(rules) if rules else LOGICAL_AXIS_RULES


def constrain(x: jax.Array, axes: tuple[Optional[str], ...]) -> jax.Array:
  """Activation sharding constraint by logical names; a no-op without a mesh."""
  mesh = _ambient_mesh()
  if mesh is None:
    return x
  return nn.with_logical_constraint(x, axes, rules=rules_for_mesh(mesh, current_rules()))


def _ambient_mesh():
  """The mesh of an enclosing ``jax.set_mesh(mesh)`` block, if any."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return None
  return mesh


def logical_axes(config: ModelConfig) -> Any:
  """Pytree (same structure as the params) of logical ``PartitionSpec``s."""
  from jaxrl_llm.models.transformer import abstract_boxed_params

  return nn.get_partition_spec(abstract_boxed_params(config))


def param_shardings(config: ModelConfig, mesh: Mesh, rules: Optional[Rules] = None) -> Any:
  """``NamedSharding`` for every parameter, by logical name and ``rules``.

  A dimension that the mapped mesh axes do not divide evenly is replicated
  instead (e.g. a vocabulary of 151936 on a 3-way tensor axis).

  Args:
    config: the model config.
    mesh: the target mesh (axes a subset of ``('data', 'fsdp', 'tensor')``).
    rules: logical-to-mesh rules, default ``LOGICAL_AXIS_RULES``.

  Returns:
    Pytree of ``jax.sharding.NamedSharding`` with the structure of
    ``init_params(config, rng)``.
  """
  from jaxrl_llm.models.transformer import abstract_boxed_params

  boxed = abstract_boxed_params(config)
  shapes = nn.meta.unbox(boxed)
  logical = nn.get_partition_spec(boxed)
  mesh_rules = rules_for_mesh(mesh, rules)

  def one(spec: PartitionSpec, shape: jax.ShapeDtypeStruct) -> NamedSharding:
    mesh_spec = nn.logical_to_mesh_axes(tuple(spec), mesh_rules)
    dims = []
    for size, axes in zip(shape.shape, tuple(mesh_spec) + (None,) * (len(shape.shape) - len(mesh_spec))):
      if axes is None:
        dims.append(None)
        continue
      names = (axes,) if isinstance(axes, str) else tuple(axes)
      ways = math.prod(mesh.shape[a] for a in names)
      dims.append(axes if size % ways == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*dims))

  return jax.tree.map(one, logical, shapes, is_leaf=lambda x: isinstance(x, PartitionSpec))


def batch_sharding(mesh: Mesh, rank: int = 2, rules: Optional[Rules] = None) -> NamedSharding:
  """Sharding of a ``[B, ...]`` activation/batch array: 'batch' on dim 0, rest replicated."""
  mesh_rules = rules_for_mesh(mesh, rules)
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (rank - 1), mesh_rules)
  return NamedSharding(mesh, PartitionSpec(*spec))


__all__ = [
    "LOGICAL_AXIS_RULES",
    "batch_sharding",
    "constrain",
    "current_rules",
    "logical_axes",
    "param_shardings",
    "rules_for_mesh",
]
