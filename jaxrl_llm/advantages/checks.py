"""Argument checks of array functions: shapes, ranges and choices, errors naming the argument.

Every public function of :mod:`jaxrl_llm.advantages` (and the reward-model
losses, :mod:`jaxrl_llm.reward_model.eos`, and the host-side diagnostics)
validates shapes and hyper-parameters first, with an error that names the
function, the offending array or argument and what was expected, e.g.
``gae: values_bt has shape (2, 4) but rewards_bt has shape (2, 5); they must be
equal``. The checks run in Python on static shapes, so they cost nothing under
``jit``; hyper-parameters that arrive as tracers are not range-checked.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import numpy as np


def shape_of(x: Any) -> tuple[int, ...]:
  """The static shape of ``x`` (array, tracer or nested list) as a tuple."""
  return tuple(np.shape(x))


def check_rank(who: str, name: str, x: Any, rank: int, dims: str) -> None:
  """Raises unless ``x`` has ``rank`` dimensions (``dims`` spells them, e.g. "[B, T]")."""
  if np.ndim(x) != rank:
    raise ValueError(f"{who}: {name} must be {dims} (rank {rank}); got shape {shape_of(x)}")


def check_same_shape(who: str, **arrays: Any) -> None:
  """Raises unless all non-None arrays have the shape of the first one."""
  items = [(n, a) for n, a in arrays.items() if a is not None]
  first_name, first = items[0]
  for name, a in items[1:]:
    if shape_of(a) != shape_of(first):
      raise ValueError(
          f"{who}: {name} has shape {shape_of(a)} but {first_name} has shape "
          f"{shape_of(first)}; they must be equal")


def check_bt(who: str, **arrays: Any) -> tuple[int, int]:
  """Checks that all non-None arrays are [B, T] with one shape; returns (B, T)."""
  for name, a in arrays.items():
    if a is not None:
      check_rank(who, name, a, 2, "[B, T]")
  check_same_shape(who, **arrays)
  first = next(a for a in arrays.values() if a is not None)
  return shape_of(first)  # type: ignore[return-value]


def check_b(who: str, name: str, x: Any, batch: int, batch_from: str) -> None:
  """Checks that ``x`` is a [B] vector whose length matches ``batch_from``'s B."""
  check_rank(who, name, x, 1, "[B]")
  if shape_of(x)[0] != batch:
    raise ValueError(
        f"{who}: {name} has {shape_of(x)[0]} rows but {batch_from} has {batch}; "
        "they must describe the same sequences")


def check_positive_int(who: str, name: str, value: Any) -> int:
  """Validates that ``value`` is a positive (static) int."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{who}: {name} must be a Python int; got {value!r}")
  if value <= 0:
    raise ValueError(f"{who}: {name} must be positive; got {value}")
  return int(value)


def check_group_size(who: str, batch: int, group_size: Any) -> int:
  """Validates that ``group_size`` is a positive int dividing the batch size."""
  check_positive_int(who, "group_size", group_size)
  if batch % group_size:
    raise ValueError(
        f"{who}: batch of {batch} rows is not a whole number of groups of "
        f"group_size={group_size}; the samples of a prompt must be contiguous")
  return int(group_size)


def is_concrete(x: Any) -> bool:
  """False for a ``jit`` tracer (whose value cannot be checked in Python)."""
  return not isinstance(x, jax.core.Tracer)


def check_in_unit_interval(who: str, name: str, value: Any) -> None:
  """Raises unless a concrete ``value`` lies in [0, 1] (tracers pass unchecked)."""
  if not is_concrete(value):
    return
  v = float(np.asarray(value))
  if math.isnan(v) or not 0.0 <= v <= 1.0:
    raise ValueError(f"{who}: {name} must lie in [0, 1]; got {v}")


def check_positive(who: str, name: str, value: Any, allow_zero: bool = False) -> None:
  """Raises unless a concrete ``value`` is > 0 (or >= 0 with ``allow_zero``)."""
  if not is_concrete(value):
    return
  v = float(np.asarray(value))
  ok = v >= 0.0 if allow_zero else v > 0.0
  if math.isnan(v) or math.isinf(v) or not ok:
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"{who}: {name} must be finite and {bound}; got {v}")


def check_choice(who: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
  """Returns ``value``; raises ValueError naming it and listing ``choices`` when it is not one."""
  if value not in choices:
    raise ValueError(f"{who}: unknown {name} {value!r}; expected one of {', '.join(choices)}")
  return value


def optional_valid(valid_b: Optional[Any], who: str, batch: int, batch_from: str) -> None:
  """:func:`check_b` of an optional bool [B] ``valid_b`` mask (None passes)."""
  if valid_b is not None:
    check_b(who, "valid_b", valid_b, batch, batch_from)


__all__ = [
    "check_b", "check_bt", "check_choice", "check_group_size", "check_in_unit_interval", "check_positive",
    "check_positive_int", "check_rank", "check_same_shape", "is_concrete", "optional_valid", "shape_of",
]
