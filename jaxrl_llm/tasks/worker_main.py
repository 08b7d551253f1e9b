"""Entry point of a worker process: ``python -m jaxrl_llm.tasks.worker_main``.

Started by :class:`jaxrl_llm.tasks.workers.WorkerPool` (optionally behind a sandbox's
argv prefix, e.g. bwrap) and not meant to be run by hand. It lives apart from
``workers.py`` so that ``-m`` runs a module the package has not imported already, and
it imports no JAX (``python -X importtime -m jaxrl_llm.tasks.worker_main``: NumPy and
the task modules only).

Protocol: messages are pickles, each preceded by its length (8 bytes, big-endian), over
the worker's stdin (requests) and stdout (replies)::

  parent -> worker   ("init", {"fn": <pickled fn>, "sys_path": [...], "memory_mb", "cpu_seconds"})
  worker -> parent   ("ready", pid)  or  ("failed", traceback)      # once, after init
  parent -> worker   ("call", args)                                 # a few may be queued
  worker -> parent   (status, value, seconds) with status "ok" | "error" | "memory"
  parent -> worker   ("stop",)  (or EOF on stdin: the worker exits)

:func:`serve` first moves the protocol off file descriptors 0 and 1 (stdin becomes
``/dev/null``, stdout goes to stderr), so a ``print`` or ``input`` in ``fn`` cannot
corrupt it.

Limits, set by the worker on itself with ``resource.setrlimit`` after ``init`` and
before unpickling ``fn``: ``RLIMIT_AS`` = ``memory_mb`` MiB of address space (0: none;
``MemoryError`` in a call is reported as "memory"), ``RLIMIT_CORE`` = 0, and a per-call
``RLIMIT_CPU``: before each call the soft limit is set to the CPU time used so far +
``cpu_seconds`` (0: none), so the kernel kills a call that burns more CPU than that
(``SIGXCPU``) even if the parent is gone. A worker also exits when its parent process
dies (a watchdog thread polls ``os.getppid()``).
"""

import os
import pickle
import resource
import sys
import threading
import time
import traceback
from typing import Any

from jaxrl_llm.tasks import workers as W

__all__ = ["serve"]


def _read_exactly(fd: int, n: int) -> bytes:
  chunks, left = [], n
  while left:
    chunk = os.read(fd, min(left, 1 << 20))
    if not chunk:
      raise EOFError
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]


def _set_limits(memory_mb: int) -> None:
  resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
  if memory_mb:
    size = int(memory_mb) << 20
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    resource.setrlimit(resource.RLIMIT_AS, (size if hard < 0 else min(size, hard), hard))


def _arm_cpu_limit(cpu_seconds: float) -> None:
  used = resource.getrusage(resource.RUSAGE_SELF)
  hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
  soft = int(used.ru_utime + used.ru_stime + cpu_seconds) + 1
  resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))


def _watch_parent(parent: int) -> None:
  def watch():
    while True:
      time.sleep(1.0)
      if os.getppid() != parent:
        os._exit(0)  # pylint: disable=protected-access
  threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def serve() -> int:
  """The worker's main loop (``python -m jaxrl_llm.tasks.worker_main``); returns the exit code."""
  proto_in, proto_out = os.dup(0), os.dup(1)
  null = os.open(os.devnull, os.O_RDONLY)
  os.dup2(null, 0)
  os.close(null)
  os.dup2(2, 1)  # print() in fn goes to stderr, never into the protocol

  def read() -> Any:
    (size,) = W.HEADER.unpack(_read_exactly(proto_in, W.HEADER.size))
    return pickle.loads(_read_exactly(proto_in, size))

  try:
    _, init = read()
  except EOFError:
    return 0
  _watch_parent(os.getppid())
  sys.path.extend(p for p in init["sys_path"] if p not in sys.path)
  try:
    _set_limits(init["memory_mb"])
    fn = pickle.loads(init["fn"])
  except BaseException:  # pylint: disable=broad-except
    _write_all(proto_out, W.encode(("failed", traceback.format_exc())))
    return 1
  _write_all(proto_out, W.encode(("ready", os.getpid())))
  while True:
    try:
      message = read()
    except EOFError:
      return 0
    if message[0] != "call":
      return 0
    if init["cpu_seconds"]:
      _arm_cpu_limit(init["cpu_seconds"])
    started = time.perf_counter()
    try:
      reply = W.encode((W.OK, fn(*message[1]), time.perf_counter() - started))
    except MemoryError:
      reply = W.encode((W.MEMORY, traceback.format_exc(), time.perf_counter() - started))
    except BaseException:  # pylint: disable=broad-except
      reply = W.encode((W.ERROR, traceback.format_exc(), time.perf_counter() - started))
    _write_all(proto_out, reply)


if __name__ == "__main__":
  sys.exit(serve())
