"""The one table that maps the model's logical axis names to mesh axes.

Model code names logical axes only (``nn.with_logical_partitioning`` on
parameters, :func:`constrain` on activations); this module maps them to the
mesh axes ``('data', 'fsdp', 'tensor')``. Override the table by passing
``rules=`` or by entering ``flax.linen.logical_axis_rules(...)``.

Parameters: vocab, embed, mlp, heads, kv_heads, head_dim, norm.
Activations: batch, length, act_embed, act_mlp, act_heads, act_vocab.

This module knows no model: the transformer imports it to constrain
activations, and :mod:`jaxrl_llm.models.sharding` imports both to lay out
parameters and batches (so the imports point one way).

References: MaxText ``logical_axis_rules``; flax ``linen.spmd``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh

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
  """Activation sharding constraint by logical names; a no-op without a mesh.

  Args:
    x: an activation of rank ``len(axes)``.
    axes: one logical name (or None) per dimension, e.g. ``("batch", "length", "act_embed")``.
  """
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


__all__ = ["LOGICAL_AXIS_RULES", "Rules", "constrain", "current_rules", "rules_for_mesh"]
