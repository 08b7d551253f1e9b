"""Ends a local Ray cluster's processes when the driver that started it dies (Linux).

``ensure_ray`` starts this file as its own small process (standard library only, so it
starts in milliseconds and imports neither Ray nor JAX)::

  python reaper.py DRIVER HEAD [HEAD ...]      # each an identity "pid:start_ticks"

Every second it records the processes descending from the HEAD processes (GCS, raylet,
monitor, ...: what ``ray.init`` started), so that it still knows the workers, sampler
actors and agents after a dead raylet's children have been re-parented. When DRIVER is
gone (SIGKILL, OOM, a crash: no ``ray.shutdown`` ran), it SIGKILLs every recorded process
still alive and exits. When the recorded processes are all gone while the driver lives
(``ray.shutdown``), it exits too. Identities carry the process start time, so a reused
pid is never signalled.

Why: Ray ties GCS and raylet to the driver (``PR_SET_PDEATHSIG``) and workers exit when
their raylet dies, but its dashboard and runtime-env agents wait ~60 s on the dead GCS
before exiting, listening the while. The helpers below (identities from ``/proc``) are
also used by :mod:`jaxrl_llm.rollout.cluster`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Iterable, Optional

POLL_S = 1.0


def stat_fields(pid: int) -> Optional[list[str]]:
  """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      text = f.read().decode("ascii", "replace")
  except OSError:
    return None
  return text[text.rfind(")") + 2:].split()


def identity(pid: int) -> Optional[str]:
  """``"pid:start_ticks"`` of a live (not zombie) process, or None."""
  fields = stat_fields(pid)
  if fields is None or fields[0] in ("Z", "X"):
    return None
  return f"{pid}:{fields[19]}"


def alive(ident: str) -> bool:
  """Whether the process of ``ident`` (from :func:`identity`) still runs."""
  return identity(int(ident.split(":")[0])) == ident


def children_map() -> dict[int, list[int]]:
  """ppid -> pids of every process visible in ``/proc``."""
  out: dict[int, list[int]] = {}
  for name in os.listdir("/proc"):
    if name.isdigit():
      fields = stat_fields(int(name))
      if fields is not None:
        out.setdefault(int(fields[1]), []).append(int(name))
  return out


def descendants(roots: Iterable[int]) -> list[int]:
  """The pids below ``roots`` (not the roots themselves)."""
  tree, out, todo = children_map(), [], list(roots)
  while todo:
    for child in tree.get(todo.pop(), []):
      out.append(child)
      todo.append(child)
  return out


def _kill(idents: Iterable[str]) -> None:
  for ident in idents:
    if alive(ident):
      try:
        os.kill(int(ident.split(":")[0]), signal.SIGKILL)
      except OSError:
        pass


def watch(driver: str, heads: list[str], poll_s: float = POLL_S) -> None:
  """The reaper's loop (see the module docstring)."""
  known = set(heads)
  while True:
    if not alive(driver):
      _kill(known)
      return
    known = {i for i in known if alive(i)}
    if not known:
      return
    for pid in descendants(int(i.split(":")[0]) for i in known):
      ident = identity(pid)
      if ident is not None:
        known.add(ident)
    time.sleep(poll_s)


def main(argv: list[str]) -> int:
  if len(argv) < 3:
    sys.stderr.write("usage: reaper.py DRIVER_PID:START HEAD_PID:START [...]\n")
    return 2
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the driver's to handle
  watch(argv[1], argv[2:])
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
