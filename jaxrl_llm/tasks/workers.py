"""A pool of worker processes running one function, each call under a deadline.

``WorkerPool(fn, workers=2, memory_mb=..., cpu_seconds=...)`` starts ``workers``
processes (on first use), ships them ``fn`` once, and ``pool.map(calls, timeout_s)``
spreads the calls (argument tuples) over them: each worker has a few calls queued (sent
in one write; about 2 ms of work by the mean call time, at most ``depth``) and runs them
one after the other, each with its own deadline, ``timeout_s`` from when it starts (when
it is sent to an idle worker, or when the reply of the call before it arrives). The
result list keeps the input order; each entry is an :class:`Outcome` ``(status, value)``:

  ``ok``       ``value`` is what ``fn(*args)`` returned
  ``error``    ``fn`` raised; ``value`` is the traceback text
  ``memory``   ``fn`` hit the memory limit (``MemoryError``); the worker is replaced
  ``timeout``  the call overran its deadline or the CPU-time limit; the worker is killed
               and replaced; ``value`` says which
  ``crash``    the worker died during the call (segfault, ``os._exit``, a signal);
               ``value`` names the exit code or signal and ends with the worker's stderr

Nothing ``fn`` does can block the caller past the deadline: a call that holds the GIL
in C code for ever is cut by killing its process (``SIGKILL`` to its process group:
each worker is a session leader, so whatever it started dies with it); a fresh worker
then starts while the others go on, its start-up charged to no call, and the calls
queued behind the failed one go back to the queue. A worker that cannot start (``fn``
not importable, a memory limit too small) raises :class:`WorkerStartError` with its
stderr: a set-up error, not a failed call.

Launch. A worker is ``launcher_prefix + [sys.executable, "-m", WORKER_MODULE]`` started
by ``subprocess.Popen`` (fork + exec, safe with JAX's threads; no ``multiprocessing``,
no ``preexec_fn``), so a sandbox (``bwrap ... --``) can wrap the very same worker by
passing its argv as ``launcher_prefix``. It imports no JAX. Its stdin and stdout carry
the protocol (length-prefixed pickles; :mod:`jaxrl_llm.tasks.worker_main` describes the
messages and the limits the worker sets on itself); its stderr goes to a temporary file
the parent reads back for error messages.
"""

from __future__ import annotations

import collections
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence

from jaxrl_llm.errors import RunError

__all__ = ["WORKER_MODULE", "Outcome", "WorkerPool", "WorkerProcess", "WorkerStartError", "encode", "HEADER",
           "OK", "ERROR", "MEMORY", "TIMEOUT", "CRASH"]

WORKER_MODULE = "jaxrl_llm.tasks.worker_main"
OK, ERROR, MEMORY, TIMEOUT, CRASH = "ok", "error", "memory", "timeout", "crash"
HEADER = struct.Struct("!Q")
QUEUE_SECONDS = 0.002  # work queued in one worker (cheap verifiers: up to `depth` calls; slow ones: one)
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# One thread per numerical library: less address space (RLIMIT_AS) and no oversubscribed cores.
_CHILD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "PYTHONFAULTHANDLER": "1"}


class Outcome(NamedTuple):
  """One call's result: ``status`` (ok, error, memory, timeout, crash) and its value or description."""

  status: str
  value: Any


class WorkerStartError(RunError):
  """A worker process could not start or load the function (``jaxrl-train``: a paragraph, exit 1)."""


def encode(message: Any) -> bytes:
  payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
  return HEADER.pack(len(payload)) + payload


class _Reader:
  """Splits a byte stream into length-prefixed pickled messages."""

  def __init__(self):
    self.buffer = bytearray()

  def feed(self, data: bytes) -> list[Any]:
    self.buffer += data
    out = []
    while len(self.buffer) >= HEADER.size:
      (size,) = HEADER.unpack_from(self.buffer)
      if len(self.buffer) < HEADER.size + size:
        break
      out.append(pickle.loads(bytes(self.buffer[HEADER.size:HEADER.size + size])))
      del self.buffer[:HEADER.size + size]
    return out


def _describe_exit(code: Optional[int]) -> str:
  if code is None:
    return "did not exit"
  if code < 0:
    try:
      return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"was killed by signal {-code}"
  return f"exited with code {code}"


class WorkerProcess:
  """One worker process: started at construction, then ``send`` / ``read`` / ``kill``."""

  def __init__(self, argv: Sequence[str], init: bytes, *, env: dict, start_timeout_s: float):
    self.stderr = tempfile.TemporaryFile(prefix="jaxrl-worker-", suffix=".stderr")
    self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                 env=env, start_new_session=True, close_fds=True)
    self.fd = self.proc.stdout.fileno()
    os.set_blocking(self.fd, False)
    self.reader = _Reader()
    self.ready = False  # True once it has loaded the function
    self.inflight: collections.deque[int] = collections.deque()  # call indices sent, oldest (running) first
    self.deadline = time.monotonic() + start_timeout_s  # of its start-up, then of its running call
    self.send(init)

  def send(self, data: bytes) -> bool:
    """Writes one encoded message; False when the worker is gone."""
    try:
      self.proc.stdin.write(data)
      self.proc.stdin.flush()
      return True
    except (BrokenPipeError, OSError, ValueError):
      return False

  def read(self) -> Optional[list[Any]]:
    """The complete messages available now; None at end of stream (the worker died)."""
    try:
      data = os.read(self.fd, 1 << 20)
    except BlockingIOError:
      return []
    return None if not data else self.reader.feed(data)

  def stderr_tail(self, limit: int = 2000) -> str:
    try:
      self.stderr.seek(0, os.SEEK_END)
      size = self.stderr.tell()
      self.stderr.seek(max(0, size - limit))
      return self.stderr.read().decode("utf-8", "replace").strip()
    except (OSError, ValueError):
      return ""

  def trim_stderr(self, limit: int = 1 << 20) -> None:
    """Empties the stderr file past ``limit`` bytes (call while the worker is idle: it shares the offset)."""
    try:
      if os.fstat(self.stderr.fileno()).st_size > limit:
        self.stderr.truncate(0)
        self.stderr.seek(0)
    except (OSError, ValueError):
      pass

  def exit_code(self, wait_s: float = 5.0) -> Optional[int]:
    try:
      return self.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
      return None

  def kill(self) -> None:
    """SIGKILL to the worker's process group; reaps it and closes its pipes."""
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        self.proc.kill()
    self.exit_code()
    for f in (self.proc.stdin, self.proc.stdout, self.stderr):
      try:
        f.close()
      except (OSError, ValueError):
        pass


def _kill_all(workers: list[WorkerProcess]) -> None:
  for w in workers:
    w.kill()
  workers.clear()


class WorkerPool:
  """Runs ``fn(*args)`` for many argument tuples in ``workers`` processes (see the module docstring).

  Args:
    fn: a picklable callable (module-level function, or bound method of a picklable object).
    workers: processes in the pool.
    memory_mb: address-space limit per worker in MiB (``RLIMIT_AS``); 0: none.
    cpu_seconds: CPU-time limit per call in seconds (``RLIMIT_CPU``); 0: none.
    launcher_prefix: argv put before ``python -m WORKER_MODULE`` (a sandbox such as bwrap).
    start_timeout_s: how long a worker may take to start and load ``fn``.
    on_start_error: extra words for a :class:`WorkerStartError` (e.g. which setting to change).
    depth: most calls queued in a worker, so that its next call starts without waiting for a round
      trip through the parent (fewer system calls and context switches per call). A queue holds
      about ``QUEUE_SECONDS`` of work by the mean call time so far, so slow calls are not queued
      behind each other while another worker idles.

  Raises:
    TypeError: ``fn`` cannot be pickled.
  """

  def __init__(self, fn: Callable, *, workers: int = 2, memory_mb: int = 0, cpu_seconds: float = 0.0,
               launcher_prefix: Sequence[str] = (), start_timeout_s: float = 60.0, on_start_error: str = "",
               depth: int = 16):
    if workers < 1 or depth < 1:
      raise ValueError(f"WorkerPool: workers and depth must be >= 1, got {workers!r} and {depth!r}")
    try:
      fn_bytes = pickle.dumps(fn, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError(f"a worker process needs a picklable function (a module-level function or a bound method "
                      f"of a picklable object), got {fn!r}: {e}") from e
    owner = getattr(fn, "__self__", None)
    if "__main__" in (getattr(fn, "__module__", None), type(owner).__module__ if owner is not None else None):
      raise TypeError(f"a worker process cannot load {fn!r}: it is defined in the __main__ script; define it in an "
                      "importable module")
    self.size, self.depth = workers, depth
    self._call_s: Optional[float] = None  # running mean of a call's duration (sizes the queues)
    self.argv = [*launcher_prefix, sys.executable, "-m", WORKER_MODULE]
    self.start_timeout_s = start_timeout_s
    self.on_start_error = on_start_error
    self.restarts = 0
    self._init = encode(("init", {"fn": fn_bytes, "sys_path": list(sys.path), "memory_mb": int(memory_mb),
                                  "cpu_seconds": float(cpu_seconds)}))
    self._env = dict(os.environ, **_CHILD_ENV)
    self._env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    self._workers: list[WorkerProcess] = []
    self._selector = selectors.DefaultSelector()
    # Workers of a pool that is never closed die with it (or at interpreter exit), never later.
    weakref.finalize(self, _kill_all, self._workers)

  # ------------------------------------------------------------------ public

  def map(self, calls: Sequence[tuple], timeout_s: float) -> list[Outcome]:
    """``fn(*args)`` for every tuple of ``calls``, in input order, each within ``timeout_s``."""
    if not calls:
      return []
    try:
      return self._map(list(calls), float(timeout_s))
    except BaseException:
      self.close()  # interrupted mid-batch (or a start error): no half-busy workers are kept
      raise

  def close(self) -> None:
    """Stops every worker (asks, then kills what is left); the next ``map`` starts new ones."""
    for w in self._workers:
      w.send(encode(("stop",)))
    for w in self._workers:
      self._selector.unregister(w.fd)
      w.exit_code(0.5)
      w.kill()
    self._workers.clear()

  def __enter__(self) -> "WorkerPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ internals

  def _start(self) -> WorkerProcess:
    w = WorkerProcess(self.argv, self._init, env=self._env, start_timeout_s=self.start_timeout_s)
    self._selector.register(w.fd, selectors.EVENT_READ, w)
    return w

  def _replace(self, w: WorkerProcess) -> None:
    self._selector.unregister(w.fd)
    w.kill()
    self.restarts += 1
    self._workers[self._workers.index(w)] = self._start()

  def _start_error(self, w: WorkerProcess, what: str) -> WorkerStartError:
    tail = w.stderr_tail()
    self.close()
    return WorkerStartError(f"a worker process ({' '.join(self.argv)}) {what}\n{self.on_start_error}\n"
                            f"The worker's stderr: {tail or '(empty)'}")

  def _died(self, w: WorkerProcess) -> Outcome:
    """The outcome of the call a worker was running when it died."""
    code = w.exit_code()
    tail = w.stderr_tail()
    if code == -signal.SIGXCPU:
      return Outcome(TIMEOUT, "the call exceeded the CPU-time limit (RLIMIT_CPU) and the worker was killed")
    if "MemoryError" in tail:
      return Outcome(MEMORY, f"the worker ran out of memory and {_describe_exit(code)}:\n{tail}")
    return Outcome(CRASH, f"the worker process {_describe_exit(code)} during the call; its stderr:\n{tail}")

  def _queue_limit(self) -> int:
    """Calls to queue in a worker: about ``QUEUE_SECONDS`` of work (by the mean call time so far), 1 to ``depth``."""
    if self._call_s is None:
      return 1
    return max(1, min(self.depth, int(QUEUE_SECONDS / max(self._call_s, 1e-6))))

  def _lost(self, w: WorkerProcess, outcomes: list, pending: collections.deque) -> int:
    """A worker died: its running call gets the cause, its queued calls go back; returns calls finished."""
    finished = 0
    if w.inflight:
      outcomes[w.inflight.popleft()] = self._died(w)
      finished = 1
    self._retire(w, pending)
    return finished

  def _retire(self, w: WorkerProcess, pending: collections.deque) -> None:
    """Kills and replaces ``w``; the calls it had queued (not started) go back to the front of ``pending``."""
    pending.extendleft(reversed(w.inflight))
    w.inflight.clear()
    self._replace(w)

  def _map(self, calls: list[tuple], timeout_s: float) -> list[Outcome]:
    outcomes: list[Optional[Outcome]] = [None] * len(calls)
    pending = collections.deque(range(len(calls)))
    while len(self._workers) < self.size:
      self._workers.append(self._start())
    for w in self._workers:
      w.trim_stderr()
    done = 0
    while done < len(calls):
      ready = [w for w in self._workers if w.ready]
      for w in ready:  # top up each worker's queue, sharing what is left among the workers
        room = min(self._queue_limit() - len(w.inflight), -(-len(pending) // len(ready)))
        if room <= 0:
          continue
        busy = bool(w.inflight)
        if not busy:
          w.deadline = time.monotonic() + timeout_s
        batch = [pending.popleft() for _ in range(room)]
        w.inflight.extend(batch)
        if not w.send(b"".join(encode(("call", calls[j])) for j in batch)):
          if busy:
            done += self._lost(w, outcomes, pending)
          else:  # it died idle: none of these calls had started
            self._retire(w, pending)
      waiting = [w.deadline for w in self._workers if w.inflight or not w.ready]
      if not waiting:
        continue
      events = self._selector.select(max(0.0, min(waiting) - time.monotonic()))
      for key, _ in events:
        w = key.data
        messages = w.read()
        if messages is None:  # end of stream: the worker died
          if not w.ready:
            raise self._start_error(w, f"{_describe_exit(w.exit_code())} while starting")
          done += self._lost(w, outcomes, pending)
          continue
        for message in messages:
          if not w.ready:
            if message[0] != "ready":
              raise self._start_error(w, f"could not load the function:\n{str(message[1]).rstrip()}")
            w.ready = True
            continue
          outcomes[w.inflight.popleft()] = Outcome(message[0], message[1])
          done += 1
          took = message[2]  # the call's own duration, measured in the worker
          self._call_s = took if self._call_s is None else 0.9 * self._call_s + 0.1 * took
          w.deadline = time.monotonic() + timeout_s  # its next queued call started as it sent this reply
          if message[0] == MEMORY:  # its heap may be in a bad state
            self._retire(w, pending)
            break
      now = time.monotonic()
      for w in list(self._workers):
        if (w.inflight or not w.ready) and now >= w.deadline:
          if not w.ready:
            raise self._start_error(w, f"did not start within {self.start_timeout_s} s")
          outcomes[w.inflight.popleft()] = Outcome(
              TIMEOUT, f"the call did not return within {timeout_s:g} s; the worker was killed")
          done += 1
          self._retire(w, pending)
    return outcomes  # type: ignore[return-value]
