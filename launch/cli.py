"""What every command-line entry point shares: flag parsing and errors shown as one paragraph.

An input error (a mistyped flag or config field, an unknown recipe or task, a mesh larger
than the machine, a missing file: :class:`jaxrl_llm.errors.ConfigError` or ``OSError``)
prints ``<program>: usage error: <message>`` and exits with status 2; a run that stopped
on purpose (:class:`jaxrl_llm.errors.RunError`) prints ``<program>: stopped: <message>``
and exits with status 1. ``--verbose`` (or ``JAXRL_VERBOSE=1``) prints the traceback too.
Any other exception is a bug and keeps its traceback.

  from launch import cli
  def main(argv):
    with cli.user_errors():
      ...
  cli.run(main)
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Callable, Iterator, NoReturn, Optional, Sequence

from absl import app, flags

_VERBOSE = flags.DEFINE_bool("verbose", False, "Print the traceback of a usage or run error too "
                             "(also: JAXRL_VERBOSE=1).")

USAGE_EXIT = 2  # the usage-error convention (argparse, absl's UsageError is 1): the input was wrong
RUN_EXIT = 1


def program() -> str:
  return os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "jaxrl"


def verbose(argv: Optional[Sequence[str]] = None) -> bool:
  """Whether errors show their traceback: ``--verbose`` (read from ``argv`` before the flags are
  parsed) or ``JAXRL_VERBOSE`` set to anything but empty/0/false/no."""
  if os.environ.get("JAXRL_VERBOSE", "").lower() not in ("", "0", "false", "no"):
    return True
  if argv is not None:
    return any(a in ("--verbose", "--verbose=true", "--verbose=1", "--verbose=True") for a in argv)
  return bool(flags.FLAGS.is_parsed() and _VERBOSE.value)


def fail(message: str, status: int, show_traceback: Optional[bool] = None) -> NoReturn:
  """Prints ``message`` as one paragraph on stderr (after the traceback when asked) and exits."""
  show = verbose() if show_traceback is None else show_traceback
  if show:
    traceback.print_exc()
  kind = "usage error" if status == USAGE_EXIT else "stopped"
  hint = "" if show else "(--verbose or JAXRL_VERBOSE=1 prints the traceback)\n"
  sys.stderr.write(f"{program()}: {kind}: {message.strip()}\n{hint}")
  sys.stderr.flush()
  sys.exit(status)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
  """Turns ConfigError / OSError into a usage error (exit 2) and RunError into exit 1."""
  from jaxrl_llm import errors  # pylint: disable=import-outside-toplevel
  try:
    yield
  except (errors.ConfigError, app.UsageError) as e:
    fail(str(e), USAGE_EXIT)
  except errors.RunError as e:
    fail(str(e), RUN_EXIT)


def override_error(argv: Sequence[str], error: Exception) -> str:
  """The paragraph for a ``--config...`` flag that could not be applied: the first override whose
  field does not exist, with the closest existing field, else the flag library's own message."""
  from jaxrl_llm import configuration  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.configuration import schema  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.settings import config_fields, did_you_mean  # pylint: disable=import-outside-toplevel
  base = configuration.base_config()
  free = tuple(p + "." for p in schema.free_paths())
  fields = [schema.field_path(part.section, f.name) for part in schema.parts() for f in config_fields(part.cls)]
  for arg in argv[1:]:
    if not arg.startswith("--config.") or "=" not in arg:
      continue
    path = arg[len("--config."):].split("=", 1)[0]
    if path.startswith(free):
      continue
    try:
      configuration.get_field(base, path)
    except (configuration.ConfigError, KeyError, AttributeError):
      return (f"--config.{path}: config field {path!r} does not exist{did_you_mean(path, fields) or '.'}"
              " docs/config.md lists every field; only task.kwargs and objective.kwargs accept new keys.")
  message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
  return f"could not apply the command-line flags: {message}"


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing, with a bad flag or config override shown as a usage error (exit 2)."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(f"{e}. Run with --helpfull for every flag.", USAGE_EXIT, verbose(argv))
  except (KeyError, AttributeError, TypeError, ValueError) as e:  # an override ml_collections rejected
    fail(override_error(argv, e), USAGE_EXIT, verbose(argv))


def load_config(config_flag: flags.FlagHolder):
  """The ConfigDict of a ``config_flags`` flag; a file that cannot be loaded is a usage error."""
  try:
    config = config_flag.value
    config.get("run_dir")  # a file that failed to load raises on first use
  except OSError as e:
    fail(str(e), USAGE_EXIT)
  return config


def run(main: Callable[[list[str]], None]) -> None:
  """``app.run(main)`` with :func:`parse_flags`."""
  app.run(main, flags_parser=parse_flags)
