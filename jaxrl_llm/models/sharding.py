"""Shardings of the model's parameters and of batches, from the logical axis table.

:func:`param_shardings` gives every parameter of a ``ModelConfig`` a
``NamedSharding`` by its logical axis names (declared on the parameters by
:mod:`jaxrl_llm.models.transformer`) and the table of
:mod:`jaxrl_llm.models.axes`; :func:`batch_sharding` shards the batch
dimension of a ``[B, ...]`` array the same way.

References: MaxText ``logical_axis_rules``; flax ``linen.spmd``.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_llm.models.axes import Rules, rules_for_mesh
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import abstract_boxed_params


def logical_axes(config: ModelConfig) -> Any:
  """Pytree (same structure as the params) of logical ``PartitionSpec``s."""
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


def batch_sharding(mesh: Mesh, ndim: int = 2, rules: Optional[Rules] = None) -> NamedSharding:
  """Sharding of a rank-``ndim`` ``[B, ...]`` batch array: dim 0 over the 'batch' axes, rest replicated.

  With the default table on the learner mesh the batch dimension is split over
  ``('data', 'fsdp')`` (data-parallel and FSDP both shard examples); mesh axes
  the mesh lacks are dropped.
  """
  mesh_rules = rules_for_mesh(mesh, rules)
  spec = nn.logical_to_mesh_axes(("batch",) + (None,) * (ndim - 1), mesh_rules)
  return NamedSharding(mesh, PartitionSpec(*spec))


__all__ = ["batch_sharding", "logical_axes", "param_shardings"]
