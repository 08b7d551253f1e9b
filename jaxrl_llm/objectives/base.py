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

A hyper-parameter may also be :class:`Controlled`: its value is ``base *
scale`` where ``scale`` lives in the transform's state (a
:class:`ControlledState`) and is set from outside between optimiser steps by
:func:`set_control` (the off-policy controller of
:mod:`jaxrl_llm.diagnostics.control` tightens the clip range this way). Because
the scale is state, a controlled run neither recompiles when it changes nor
loses it on resume: it is checkpointed with the objective state.

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

class Controlled(NamedTuple):
  """A hyper-parameter whose value is ``base * scale[key]``, the scale set between steps.

  Attributes:
    base: the value at scale 1 (what the recipe would use uncontrolled).
    key: name of the scale in the state, shared by every hyper-parameter that
      uses it (e.g. ``"clip"`` for eps_low and eps_high together).
  """
  base: float
  key: str


Hyper = Union[float, Controlled, Callable[[jax.Array], Any]]


class ObjectiveTransform(NamedTuple):
  """A pure (init, update) pair; see the module docstring."""
  init: Callable[[Any], Any]
  update: Callable[[Any, Any], tuple[Any, Any]]


class EmptyState(NamedTuple):
  """State of a stateless transform."""


class CountState(NamedTuple):
  """Number of updates applied so far (int32 scalar)."""
  count: jax.Array


class ControlledState(NamedTuple):
  """State of a transform with :class:`Controlled` hyper-parameters.

  Attributes:
    count: int32 scalar, updates applied so far (for schedules).
    scales: dict key -> float32 scalar, the current scale of each controlled key.
  """
  count: jax.Array
  scales: dict


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

  With neither a schedule nor a :class:`Controlled` value among ``hypers`` the
  transform is stateless. With schedules only, its state is a
  :class:`CountState`; each update evaluates the schedules at the current
  count, then increments it. With a :class:`Controlled` value the state is a
  :class:`ControlledState` holding the count and the scale of each controlled
  key (1.0 at init).
  """
  controlled = sorted({h.key for h in hypers.values() if isinstance(h, Controlled)})
  if not controlled and not any(callable(h) for h in hypers.values()):
    return stateless(lambda record: fn(record, **hypers))

  def value(h, state):
    if isinstance(h, Controlled):
      return h.base * state.scales[h.key]
    return h(state.count) if callable(h) else h

  def init(params):
    del params
    count = jnp.zeros([], jnp.int32)
    if controlled:
      return ControlledState(count, {k: jnp.ones([], jnp.float32) for k in controlled})
    return CountState(count)

  def update(record, state):
    values = {k: value(h, state) for k, h in hypers.items()}
    return fn(record, **values), state._replace(count=state.count + 1)

  return ObjectiveTransform(init, update)


def _is_controlled_state(x: Any) -> bool:
  return isinstance(x, ControlledState)


def control_keys(state: Any) -> set[str]:
  """The controlled keys present anywhere in an objective state."""
  found: set[str] = set()
  for leaf in jax.tree.leaves(state, is_leaf=_is_controlled_state):
    if isinstance(leaf, ControlledState):
      found.update(leaf.scales)
  return found


def get_control(state: Any, key: str) -> float:
  """The current scale of controlled ``key`` (host float); KeyError naming it if absent."""
  for leaf in jax.tree.leaves(state, is_leaf=_is_controlled_state):
    if isinstance(leaf, ControlledState) and key in leaf.scales:
      return float(np.asarray(leaf.scales[key]))
  raise KeyError(f"objective state has no controlled hyper-parameter {key!r} "
                 f"(controlled keys: {sorted(control_keys(state))})")


def set_control(state: Any, key: str, scale: float) -> Any:
  """Returns ``state`` with the scale of controlled ``key`` set everywhere it appears.

  The new leaf keeps the old leaf's dtype and sharding, so a jitted step does
  not recompile. KeyError naming ``key`` if no transform is controlled by it.
  """
  if key not in control_keys(state):
    raise KeyError(f"objective state has no controlled hyper-parameter {key!r} "
                   f"(controlled keys: {sorted(control_keys(state))})")
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"set_control: scale for {key!r} must be finite and > 0; got {scale}")

  def replace(leaf):
    if not isinstance(leaf, ControlledState) or key not in leaf.scales:
      return leaf
    old = leaf.scales[key]
    new = jnp.asarray(scale, old.dtype)
    sharding = getattr(old, "sharding", None)
    if sharding is not None:
      new = jax.device_put(new, sharding)
    return leaf._replace(scales={**leaf.scales, key: new})

  return jax.tree.map(replace, state, is_leaf=_is_controlled_state)


# ----------------------------------------------------------------------------- validation


def value_at_zero(h: Hyper) -> float:
  """The float value of a hyper-parameter (a schedule is evaluated at count 0)."""
  if isinstance(h, Controlled):
    return float(h.base)
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
