"""Declared settings: every setting's default, meaning and check, written once.

A *settings dataclass* describes one section of a run config (``config.control``,
``config.guard``, ``config.data``, ...). Each field is declared with
:func:`setting`, which stores the default on the dataclass field and the
one-line meaning and the check in the field's metadata. Everything else is
derived from that one declaration:

* ``jaxrl_llm.configuration.base_config`` builds the config section from the
  fields (:func:`config_fields`);
* ``jaxrl_llm.configuration.validate`` and the dataclass's own construction run
  the same checks (:func:`field_errors`, :func:`check`), so an error names the
  field and what was expected wherever the value came from;
* ``docs/config.md`` is generated from the same metadata.

Example::

  @dataclasses.dataclass(frozen=True)
  class GuardSettings:
    every: int = setting(25, "RL steps between two guard checks", POSITIVE_INT)

    def __post_init__(self):
      check(self, "guard")

  GuardSettings(every=0)   # ValueError: guard.every=0: expected a positive integer

A check that relates two fields of one dataclass goes in ``__post_init__`` after
:func:`check`, as ``require(self, section, ok, field, expected)``; ``validate``
builds every settings dataclass and reports what it rejects. A mapping whose keys
are the user's (``task.kwargs``) is declared with ``free=True``.

This module sits at the bottom of the layer order: it imports only jaxrl_llm.errors from the
package, so any layer may declare its settings with it.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from jaxrl_llm.errors import ConfigError

__all__ = [
    "ConfigError", "Check", "setting", "config_fields", "field_errors", "check", "from_section", "one_of", "optional",
    "in_range", "POSITIVE_INT", "NONNEG_INT", "POSITIVE", "NONNEG", "UNIT", "NUMBER", "BOOL", "STRING",
    "NONEMPTY_STRING", "POWER_OF_TWO", "MAPPING", "default_of", "doc_of", "is_free", "greater_than", "at_least",
    "require", "closest_name", "did_you_mean",
]


@dataclasses.dataclass(frozen=True)
class Check:
  """A predicate on one value and the words for what it accepts ("a positive integer")."""

  test: Callable[[Any], bool]
  expected: str
  names: Optional[Callable[[], Sequence[str]]] = None  # the valid names, for "did you mean ...?"

  def __call__(self, value: Any) -> bool:
    try:
      return bool(self.test(value))
    except (TypeError, ValueError):
      return False


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_finite_num(v: Any) -> bool:
  """A number that is not NaN or infinite: every setting that a number check accepts."""
  return _is_num(v) and math.isfinite(v)


POSITIVE_INT = Check(lambda v: _is_int(v) and v > 0, "a positive integer")
NONNEG_INT = Check(lambda v: _is_int(v) and v >= 0, "an integer >= 0")
POSITIVE = Check(lambda v: _is_finite_num(v) and v > 0, "a finite number > 0")
NONNEG = Check(lambda v: _is_finite_num(v) and v >= 0, "a finite number >= 0")
UNIT = Check(lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]")
NUMBER = Check(_is_finite_num, "a finite number")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")
STRING = Check(lambda v: isinstance(v, str), "a string")
NONEMPTY_STRING = Check(lambda v: isinstance(v, str) and bool(v), "a non-empty string")
POWER_OF_TWO = Check(lambda v: _is_int(v) and v > 0 and v & (v - 1) == 0, "a power of two")
MAPPING = Check(lambda v: callable(getattr(v, "keys", None)) and callable(getattr(v, "items", None)),
                "a mapping of names to values")


def one_of(options: Iterable[Any]) -> Check:
  """Accepts exactly the listed values (names taken from the package that owns them)."""
  options = tuple(options)
  return Check(lambda v: v in options, f"one of {options}", names=lambda: [o for o in options if isinstance(o, str)])


def closest_name(value: Any, names: Iterable[str]) -> Optional[str]:
  """The valid name nearest to a misspelt ``value`` (difflib's ratio >= 0.6), or None."""
  if not isinstance(value, str):
    return None
  found = difflib.get_close_matches(value, list(names), n=1)
  return found[0] if found else None


def did_you_mean(value: Any, names: Iterable[str]) -> str:
  """``"; did you mean 'grpo'?"`` for a near miss, else ``""``."""
  near = closest_name(value, names)
  return f"; did you mean {near!r}?" if near is not None else ""


def optional(inner: Check, meaning: str = "unset") -> Check:
  """``inner`` or None (None meaning ``meaning``, e.g. "the recipe's default")."""
  return Check(lambda v: v is None or inner(v), f"{inner.expected} or None ({meaning})")


def greater_than(low: float) -> Check:
  """A number > ``low``."""
  return Check(lambda v: _is_finite_num(v) and v > low, f"a finite number > {low:g}")


def at_least(low: float) -> Check:
  """A number >= ``low``."""
  return Check(lambda v: _is_finite_num(v) and v >= low, f"a finite number >= {low:g}")


def in_range(low: float, high: float, low_open: bool = False, high_open: bool = False, integer: bool = False) -> Check:
  """A number (an integer when ``integer``) between ``low`` and ``high``, ends open or closed."""

  def test(v):
    if not (_is_int(v) if integer else _is_num(v)):
      return False
    return (v > low if low_open else v >= low) and (v < high if high_open else v <= high)

  kind = "an integer" if integer else "a number"
  return Check(test, f"{kind} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")


def setting(default: Any, doc: str, check: Optional[Check] = None, *, choices: Optional[Sequence[Any]] = None,
            config: bool = True, free: bool = False) -> Any:
  """Declares one field of a settings dataclass.

  Args:
    default: the default value (the only place it is written). Lists and dicts
      are copied per instance; prefer tuples.
    doc: one line saying what the setting means (shown in docs/config.md).
    check: what the value must satisfy; None accepts anything.
    choices: shorthand for ``check=one_of(choices)``.
    config: False for a field filled in by the run from other settings (not a
      config field of its own, e.g. the controller's largest lag, which is
      ``rollout.max_lag``).
    free: for a mapping default: its keys are free (the config holds an
      unlocked ConfigDict to which a config file or a command-line flag may add
      keys, e.g. ``task.kwargs``); a mapping that is not free has fixed keys.

  Returns:
    a ``dataclasses.field`` carrying ``{"doc", "check", "config", "free"}`` metadata.
  """
  if choices is not None:
    if check is not None:
      raise ValueError("setting(): give check= or choices=, not both")
    check = one_of(choices)
  meta = {"doc": doc, "check": check, "config": config, "free": free}
  if isinstance(default, (list, dict, set)):
    return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def config_fields(cls: type) -> list[dataclasses.Field]:
  """The fields of a settings dataclass that are config fields (declared with ``config=True``)."""
  return [f for f in dataclasses.fields(cls) if f.metadata.get("config", True)]


def default_of(f: dataclasses.Field) -> Any:
  """The declared default of a dataclass field (calls its default factory)."""
  if f.default is not dataclasses.MISSING:
    return f.default
  if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
    return f.default_factory()  # type: ignore[misc]
  raise ValueError(f"field {f.name!r} has no default")


def doc_of(f: dataclasses.Field) -> str:
  """The declared one-line meaning of a field ("" for a field not declared with :func:`setting`)."""
  return f.metadata.get("doc", "")


def is_free(f: dataclasses.Field) -> bool:
  """Whether a field is a mapping with free keys (``setting(..., free=True)``)."""
  return bool(f.metadata.get("free", False))


def field_errors(cls: type, values: Mapping[str, Any], section: str) -> list[str]:
  """Errors of ``values`` against the declared checks of ``cls``: ``"section.field=value: expected ..."``.

  Only keys present in ``values`` are checked; a missing config field is reported.
  An empty ``section`` names the fields alone (the top level of a config).
  """
  prefix = f"{section}." if section else ""
  errors = []
  for f in dataclasses.fields(cls):
    if f.name not in values:
      if f.metadata.get("config", True):
        errors.append(f"{prefix}{f.name}: missing")
      continue
    chk = f.metadata.get("check")
    if chk is not None and not chk(values[f.name]):
      hint = did_you_mean(values[f.name], chk.names()) if chk.names is not None else ""
      errors.append(f"{prefix}{f.name}={values[f.name]!r}: expected {chk.expected}{hint}")
  return errors


def check(instance: Any, section: str) -> None:
  """Raises ValueError listing every field of ``instance`` that fails its declared check.

  Call it from a settings dataclass's ``__post_init__``.
  """
  values = {f.name: getattr(instance, f.name) for f in dataclasses.fields(instance)}
  errors = field_errors(type(instance), values, section)
  if errors:
    raise ValueError("; ".join(errors))


def require(instance: Any, section: str, ok: bool, name: str, expected: str) -> None:
  """A cross-field check in ``__post_init__``: unless ``ok``, ValueError ``"section.name=value: expected ..."``."""
  if not ok:
    prefix = f"{section}." if section else ""
    raise ValueError(f"{prefix}{name}={getattr(instance, name)!r}: expected {expected}")


def from_section(cls: type, section: Mapping[str, Any], **derived: Any) -> Any:
  """Builds ``cls`` from a config section: its config fields from ``section``, the rest from ``derived``.

  Keys of ``section`` that ``cls`` does not declare are ignored (a config section
  may feed several settings dataclasses); a declared config field missing from
  ``section`` keeps its default.
  """
  kwargs = {f.name: section[f.name] for f in config_fields(cls) if f.name in section}
  kwargs.update(derived)
  return cls(**kwargs)
