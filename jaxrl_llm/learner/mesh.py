"""Device mesh for the learner: ('data', 'fsdp', 'tensor') axes built from config.

Model code names logical axes only (see :mod:`jaxrl_llm.models.axes`); the
mesh decides how many devices each mesh axis spans. One size may be -1 ("fill"):
it takes all remaining devices. ``batch_sharding(mesh, ndim)`` (from
:mod:`jaxrl_llm.models.sharding`) shards the batch dimension over ``BATCH_AXES``.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.models.sharding import batch_sharding  # the batch layout of the logical-axis table

MESH_AXES = ("data", "fsdp", "tensor")
# Axes the batch dimension is split over: both data-parallel and FSDP shard examples
# (the "batch" entry of models.axes.LOGICAL_AXIS_RULES).
BATCH_AXES = ("data", "fsdp")


def resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, int, int]:
  """Turns ``{'data': -1, 'fsdp': 1, 'tensor': 1}`` into concrete sizes.

  Raises:
    ConfigError (a ValueError): naming the field (``learner.mesh.<axis>``) when sizes are not
      positive or -1, more than one is -1, or the product exceeds the devices.
  """
  unknown = set(sizes) - set(MESH_AXES)
  if unknown:
    raise ConfigError(f"learner.mesh: unknown axes {sorted(unknown)}; expected {MESH_AXES}")
  shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
  for axis, n in zip(MESH_AXES, shape):
    if n == 0 or n < -1:
      raise ConfigError(f"learner.mesh.{axis}={n}: expected a positive size or -1 (fill)")
  if shape.count(-1) > 1:
    raise ConfigError(f"learner.mesh={dict(zip(MESH_AXES, shape))}: at most one axis may be -1")
  known = int(np.prod([n for n in shape if n != -1]))
  if -1 in shape:
    if num_devices % known:
      raise ConfigError(f"learner.mesh={dict(zip(MESH_AXES, shape))}: {num_devices} devices "
                       f"are not divisible by the fixed axes' product {known}")
    shape[shape.index(-1)] = num_devices // known
  if int(np.prod(shape)) > num_devices:
    raise ConfigError(f"learner.mesh={dict(zip(MESH_AXES, shape))}: product {int(np.prod(shape))} "
                     f"> number of devices {num_devices}")
  return tuple(shape)  # type: ignore[return-value]


def make_mesh(sizes: Mapping[str, int], devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds the learner mesh over ``devices`` (default: all of them).

  With fixed sizes whose product is smaller than the number of devices, the
  mesh takes the first ``product`` devices (e.g. ``{'data': 1}`` on a host
  with 8 virtual CPU devices runs on one).
  """
  devices = list(devices if devices is not None else jax.devices())
  shape = resolve_mesh_shape(sizes, len(devices))
  return Mesh(np.array(devices[:int(np.prod(shape))]).reshape(shape), MESH_AXES)


def replicated_sharding(mesh: Mesh) -> NamedSharding:
  """The sharding that puts a whole copy on every device of ``mesh``."""
  return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh) -> int:
  """Number of shards the batch axis is split into."""
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def check_grad_atoms(mesh: Mesh, atoms: int, batch_axes: Sequence[str] = BATCH_AXES) -> int:
  """Checks that every device of ``mesh`` can hold whole gradient atoms; returns atoms per device.

  Batch-invariant mode (``learner/update.py``) cuts the batch into ``atoms``
  equal atoms and sums their gradients by a pairwise tree, the lower levels
  on each device: so ``atoms`` must be a power of two and a multiple of the
  number of batch shards (``data * fsdp``).

  Raises:
    ConfigError (a ValueError): naming ``learner.grad_atoms`` and ``learner.mesh``.
  """
  shards = int(np.prod([mesh.shape[a] for a in batch_axes if a in mesh.axis_names]))
  if atoms < 1 or atoms & (atoms - 1):
    raise ConfigError(f"learner.grad_atoms={atoms}: expected a power of two (the gradient tree is pairwise)")
  if atoms % shards:
    raise ConfigError(f"learner.grad_atoms={atoms}: expected a multiple of the mesh's batch shards "
                     f"{'*'.join(batch_axes)}={shards} (learner.mesh={dict(mesh.shape)}); every device "
                     "holds whole atoms")
  return atoms // shards


__all__ = ["BATCH_AXES", "MESH_AXES", "batch_divisor", "batch_sharding", "check_grad_atoms", "make_mesh",
           "replicated_sharding", "resolve_mesh_shape"]
