"""The two kinds of error that the command line shows as a paragraph instead of a traceback.

* :class:`ConfigError`: the user's input is wrong (a config field, a recipe or task name,
  a mesh larger than the machine, a task's arguments or data). ``jaxrl-train`` prints the
  message and exits with status 2, the usage-error convention.
* :class:`RunError`: the run was stopped deliberately, for a reason its message explains
  (non-finite updates, a reward that keeps failing, no readable checkpoint). ``jaxrl-train``
  prints the message and exits with status 1.

Both print their traceback too with ``--verbose`` or ``JAXRL_VERBOSE=1``. Any other
exception is a bug and keeps its traceback. This module imports nothing from the package,
so every layer may raise them.
"""

from __future__ import annotations

__all__ = ["ConfigError", "RunError"]


class ConfigError(ValueError):
  """A config field, name or input holds a value outside what it accepts; the message names it."""


class RunError(RuntimeError):
  """A run stopped on purpose; the message says why, and where the last good state is."""
