"""The optax-shaped transform type, ``chain`` and hyper-parameter handling.

An :class:`ObjectiveTransform` is a pair of pure functions, exactly like an
``optax.GradientTransformation``:

* ``init(params_or_none) -> state``;
* ``update(record, state) -> (record, state)`` reads and extends a
  :class:`~jaxrl_llm.objectives.record.TokenRecord`.

Factories close over hyper-parameters and validate them at construction, so a
bad value fails when the objective is built, not inside ``jit``. A float
hyper-parameter may instead be a schedule ``count -> value`` (e.g.
``optax.linear_schedule``); the transform then keeps a :class:`CountState`
that counts its updates, the analogue of ``optax.scale_by_schedule``. A
schedule is validated by its value at count 0.

Contract for state: a transform's new state may depend only on its old state
and hyper-parameters, never on batch statistics, so every micro-batch of an
optimiser step returns the same new state and micro-batching cannot change it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

Hyper = Union[float, Callable[[jax.Array], Any]]


class ObjectiveTransform(NamedTuple):
  """A pure (init, update) pair; see the module docstring."""
  init: Callable[[Any], Any]
  update: Callable[[Any, Any], tuple[Any, Any]]


class EmptyState(NamedTuple):
  """State of a stateless transform."""


class CountState(NamedTuple):
  """Number of updates applied so far (int32 scalar)."""
  count: jax.Array


def chain(*transforms: ObjectiveTransform) -> ObjectiveTransform:
  """Applies transforms left to right; the state is the tuple of their states.

  Example::

    objective = chain(truncated_is(cap=2.0), ppo_clip(eps=0.2),
                      kl_loss(coef=0.04), aggregate("token_mean"))

  Args:
    *transforms: :class:`ObjectiveTransform` s.

  Returns:
    An :class:`ObjectiveTransform`.
  """
  for i, t in enumerate(transforms):
    if not isinstance(t, ObjectiveTransform):
      raise TypeError(f"chain: argument {i} is {type(t).__name__}, not an ObjectiveTransform "
                      "(did you pass the factory instead of calling it?)")

  def init(params):
    return tuple(t.init(params) for t in transforms)

  def update(record, state):
    if not isinstance(state, tuple) or len(state) != len(transforms):
      raise ValueError(f"chain: state must be a tuple of {len(transforms)} states (from "
                       f"init); got {type(state).__name__} of length "
                       f"{len(state) if isinstance(state, tuple) else 'n/a'}")
    new_state = []
    for t, s in zip(transforms, state):
      record, s = t.update(record, s)
      new_state.append(s)
    return record, tuple(new_state)

  return ObjectiveTransform(init, update)


def stateless(fn: Callable[[Any], Any]) -> ObjectiveTransform:
  """Wraps ``record -> record`` as a transform with :class:`EmptyState`."""
  return ObjectiveTransform(lambda params: EmptyState(), lambda record, state: (fn(record), state))


def scheduled(fn: Callable[..., Any], **hypers: Hyper) -> ObjectiveTransform:
  """Wraps ``fn(record, **hypers) -> record``; callable hypers are schedules of the count.

  With no schedule among ``hypers`` the transform is stateless; otherwise its
  state is a :class:`CountState` and each update evaluates the schedules at the
  current count, then increments it.
  """
  if not any(callable(h) for h in hypers.values()):
    return stateless(lambda record: fn(record, **hypers))

  def init(params):
    del params
    return CountState(jnp.zeros([], jnp.int32))

  def update(record, state):
    values = {k: (h(state.count) if callable(h) else h) for k, h in hypers.items()}
    return fn(record, **values), CountState(state.count + 1)

  return ObjectiveTransform(init, update)


# ----------------------------------------------------------------------------- validation


def value_at_zero(h: Hyper) -> float:
  """The float value of a hyper-parameter (a schedule is evaluated at count 0)."""
  v = h(0) if callable(h) else h
  return float(np.asarray(v))


def check_hyper(who: str, name: str, h: Optional[Hyper], *, gt: Optional[float] = None,
                ge: Optional[float] = None, allow_none: bool = False) -> None:
  """Raises ValueError naming ``name`` unless ``h`` (or its value at count 0) is in range."""
  if h is None:
    if allow_none:
      return
    raise ValueError(f"{who}: {name} is required")
  if isinstance(h, bool):
    raise TypeError(f"{who}: {name} must be a number or a schedule; got {h!r}")
  try:
    v = value_at_zero(h)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{who}: {name} must be a number or a schedule count -> number; "
                    f"got {h!r}") from e
  if math.isnan(v) or math.isinf(v):
    raise ValueError(f"{who}: {name} must be finite; got {v}")
  if gt is not None and not v > gt:
    raise ValueError(f"{who}: {name} must be > {gt:g}; got {v:g}")
  if ge is not None and not v >= ge:
    raise ValueError(f"{who}: {name} must be >= {ge:g}; got {v:g}")


def check_choice(who: str, name: str, value: Any, choices: tuple) -> None:
  """Raises ValueError naming ``value`` and listing the valid ``choices``."""
  if value not in choices:
    raise ValueError(f"{who}: unknown {name} {value!r}; valid: {', '.join(map(repr, choices))}")
