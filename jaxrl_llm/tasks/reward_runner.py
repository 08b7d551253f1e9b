"""Runs reward functions under a guard: errors, timeouts and NaN/inf score 0 and are counted.

A reward function is any Python callable ``fn(example, response_text) -> float``.
``RewardRunner(fn, timeout_s=..., name=...)`` scores a list of ``(example, response)``
pairs and keeps counters (``metrics``). A call that raises, exceeds ``timeout_s``,
returns something that is not a number, or returns NaN/inf scores 0.0 and the run goes
on; the first traceback (and the first timeout) is logged in full through ``logging``
(absl picks it up), later ones are only counted. A runner is used from one thread.

Design (three modes; the per-call timeout is exact in all of them):

* ``"thread"`` (default). The whole batch runs in ONE worker thread, call after call,
  while the caller sleeps on an ``Event`` until the batch is done or the current call's
  deadline (``start of that call + timeout_s``) passes. There is one thread hand-off per
  batch, not per call, so thousands of cheap verifier calls per second cost about a
  microsecond each on top of the function itself. When a call overruns, the caller
  records a timeout, marks the worker cancelled and continues the rest of the batch on a
  fresh thread. Python cannot kill a thread: the hung one is abandoned (daemon) and exits
  after its call returns. That is fine for calls that are slow but finish, and wrong for
  calls that never return (or that hold the GIL in C code): after ``max_hung_threads``
  abandoned threads are still alive the runner escalates itself to ``"process"`` mode
  (with a warning) when ``fn`` can be pickled, and raises otherwise.
* ``"process"``. Calls run in a worker process started with the ``spawn`` method
  (``fork`` is unsafe once JAX has started threads), which a timeout or a crash kills
  and replaces. Use it for slow or untrusted verifiers (e.g. executing generated code).
  ``fn``, examples and responses must be picklable and ``fn`` importable by the child.
  Each call costs a pipe round trip (tens of microseconds) and a restart costs the
  child's start-up (about a second), which is excluded from the call deadlines.
* ``"inline"``. Calls run in the caller's thread; an overrun is detected only after the
  call returns (scored 0 and counted as a timeout). Fastest, for trusted verifiers.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import threading
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

MODES = ("thread", "process", "inline")
RewardFn = Callable[[Any, str], float]

_OK, _ERROR, _TIMEOUT = "ok", "error", "timeout"


def _call_one(fn: RewardFn, example: Any, response: str) -> tuple[str, Any]:
  """Runs one call; returns ``("ok", float)`` or ``("error", traceback text)``."""
  try:
    return _OK, float(fn(example, response))
  except (Exception, SystemExit):  # pylint: disable=broad-except
    return _ERROR, traceback.format_exc()


class _ThreadBatch:
  """Runs ``items[start:]`` in order on a worker thread, publishing progress."""

  def __init__(self, fn: RewardFn, items: Sequence[tuple[Any, str]], start: int):
    self.fn, self.items = fn, items
    self.results: list[Optional[tuple[str, Any]]] = [None] * len(items)
    self.current = (start, time.monotonic())
    self.start = start
    self.done = threading.Event()
    self.cancelled = False

  def run(self) -> None:
    for j in range(self.start, len(self.items)):
      if self.cancelled:
        return
      self.current = (j, time.monotonic())
      example, response = self.items[j]
      self.results[j] = _call_one(self.fn, example, response)
    self.done.set()


def _process_main(conn, fn: RewardFn) -> None:
  """Worker process loop: receives batches, sends ``(index, status, payload)`` per call."""
  conn.send(("ready",))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return
    if message[0] == "stop":
      return
    for j, (example, response) in message[1]:
      conn.send((j, *_call_one(fn, example, response)))


class RewardRunner:
  """Scores ``(example, response)`` pairs with a guarded reward function.

  Args:
    fn: ``fn(example, response_text) -> float``.
    timeout_s: per-call time limit in seconds (> 0).
    name: label used in logs and metric names (defaults to ``fn``'s name).
    mode: ``"thread"`` (default), ``"process"`` or ``"inline"`` (see module docstring).
    max_hung_threads: abandoned threads still running before thread mode escalates.
    start_timeout_s: how long a worker process may take to start.

  Example:
    >>> runner = RewardRunner(task.reward, timeout_s=1.0, name="addition")
    >>> rewards_b = runner.score(list(zip(examples, responses)))  # float32 [B]
    >>> runner.metrics["reward/addition/failures"]
  """

  def __init__(self, fn: RewardFn, *, timeout_s: float = 5.0, name: Optional[str] = None,
               mode: str = "thread", max_hung_threads: int = 16, start_timeout_s: float = 120.0):
    if not callable(fn):
      raise TypeError(f"RewardRunner: fn must be callable, got {fn!r}")
    if not timeout_s > 0:
      raise ValueError(f"RewardRunner.timeout_s must be > 0, got {timeout_s!r}")
    if mode not in MODES:
      raise ValueError(f"RewardRunner.mode must be one of {MODES}, got {mode!r}")
    if max_hung_threads < 1:
      raise ValueError(f"RewardRunner.max_hung_threads must be >= 1, got {max_hung_threads!r}")
    self.fn = fn
    self.timeout_s = float(timeout_s)
    self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    self.mode = mode
    self.max_hung_threads = max_hung_threads
    self.start_timeout_s = start_timeout_s
    self.calls = self.failures = self.timeouts = self.nonfinite = 0
    self.worker_restarts = 0
    self.seconds = 0.0
    self._hung: list[threading.Thread] = []
    self._process = None
    self._conn = None
    if mode == "process":
      self._check_picklable()

  # Public API.

  def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
    """Scores every pair; never raises because of ``fn``.

    Args:
      pairs: B ``(example, response_text)`` pairs.

    Returns:
      float32 [B] rewards, 0.0 where the call failed, timed out or was not finite.
    """
    items = list(pairs)
    for j, item in enumerate(items):
      if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(
            f"RewardRunner.score: pairs[{j}] must be (example, response), got {item!r}")
    started = time.monotonic()
    if self.mode == "thread":
      outcomes = self._run_threads(items)
    elif self.mode == "process":
      outcomes = self._run_process(items)
    else:
      outcomes = self._run_inline(items)
    rewards_b = self._record(items, outcomes)
    self.seconds += time.monotonic() - started
    return rewards_b

  __call__ = score

  @property
  def metrics(self) -> dict[str, float]:
    """Counters since construction, under ``reward/<name>/``."""
    prefix = f"reward/{self.name}/"
    self._hung = [t for t in self._hung if t.is_alive()]
    return {
        prefix + "calls": float(self.calls),
        prefix + "failures": float(self.failures),
        prefix + "timeouts": float(self.timeouts),
        prefix + "nonfinite": float(self.nonfinite),
        prefix + "worker_restarts": float(self.worker_restarts),
        prefix + "hung_threads": float(len(self._hung)),
        prefix + "seconds": self.seconds,
    }

  def close(self) -> None:
    """Stops the worker process, if any."""
    if self._process is not None:
      try:
        self._conn.send(("stop",))
      except (OSError, BrokenPipeError):
        pass
      self._process.join(timeout=1.0)
      self._kill_process()

  def __enter__(self) -> "RewardRunner":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # Outcome bookkeeping.

  def _record(self, items, outcomes: list[tuple[str, Any]]) -> np.ndarray:
    rewards_b = np.zeros(len(items), np.float32)
    bad = []
    for j, (status, payload) in enumerate(outcomes):
      self.calls += 1
      if status == _OK:
        value = np.float32(payload)
        if np.isfinite(value):
          rewards_b[j] = value
        else:
          self.nonfinite += 1
          bad.append((j, payload))
      elif status == _TIMEOUT:
        self.timeouts += 1
        if self.timeouts == 1:
          logger.warning("Reward %r timed out after %.3g s on item %d (first timeout; later ones"
                         " are only counted); prompt=%r", self.name, self.timeout_s, j,
                         getattr(items[j][0], "prompt", items[j][0]))
      else:
        self.failures += 1
        if self.failures == 1:
          logger.error("Reward %r raised on item %d (first failure; later ones are only"
                       " counted); prompt=%r\n%s", self.name, j,
                       getattr(items[j][0], "prompt", items[j][0]), payload)
    if bad:
      logger.warning("Reward %r returned %d non-finite value(s) (e.g. %r at item %d);"
                     " replaced by 0.0", self.name, len(bad), bad[0][1], bad[0][0])
    return rewards_b

  # Inline mode.

  def _run_inline(self, items) -> list[tuple[str, Any]]:
    outcomes = []
    for example, response in items:
      started = time.monotonic()
      outcome = _call_one(self.fn, example, response)
      if time.monotonic() - started > self.timeout_s:
        outcome = (_TIMEOUT, None)
      outcomes.append(outcome)
    return outcomes

  # Thread mode.

  def _run_threads(self, items) -> list[tuple[str, Any]]:
    outcomes: list[Any] = [None] * len(items)
    start = 0
    while start < len(items):
      batch = _ThreadBatch(self.fn, items, start)
      thread = threading.Thread(target=batch.run, daemon=True, name=f"reward-{self.name}")
      thread.start()
      timed_out = None
      while not batch.done.is_set():
        j, t0 = batch.current
        remaining = t0 + self.timeout_s - time.monotonic()
        if remaining <= 0:
          timed_out = j
          break
        batch.done.wait(remaining)
      end = len(items) if timed_out is None else timed_out
      outcomes[start:end] = batch.results[start:end]
      if timed_out is None:
        break
      batch.cancelled = True
      outcomes[timed_out] = (_TIMEOUT, None)
      self.worker_restarts += 1
      self._hung = [t for t in self._hung if t.is_alive()] + [thread]
      start = timed_out + 1
      if len(self._hung) >= self.max_hung_threads and start < len(items):
        self._escalate()
        outcomes[start:] = self._run_process(items[start:])
        break
    return outcomes

  def _escalate(self) -> None:
    try:
      self._check_picklable()
    except TypeError as e:
      raise RuntimeError(
          f"Reward {self.name!r}: {len(self._hung)} reward threads are hung (calls that never"
          " return cannot be stopped in a thread) and fn cannot run in a worker process;"
          " make fn picklable and use mode='process'") from e
    logger.warning("Reward %r: %d hung reward threads; switching to mode='process'",
                   self.name, len(self._hung))
    self.mode = "process"

  # Process mode.

  def _check_picklable(self) -> None:
    try:
      pickle.dumps(self.fn)
    except Exception as e:  # pylint: disable=broad-except
      raise TypeError(f"RewardRunner {self.name!r}: mode='process' needs a picklable fn"
                      f" (a module-level function or a bound method of a picklable"
                      f" object), got {self.fn!r}: {e}") from e

  def _ensure_process(self):
    if self._process is not None and self._process.is_alive():
      return self._conn
    self._kill_process()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=True)
    process = ctx.Process(target=_process_main, args=(child, self.fn), daemon=True,
                          name=f"reward-{self.name}")
    process.start()
    child.close()
    if not parent.poll(self.start_timeout_s):
      process.kill()
      raise RuntimeError(f"Reward {self.name!r}: worker process did not start within"
                         f" {self.start_timeout_s} s")
    try:
      parent.recv()
    except (EOFError, OSError) as e:
      raise RuntimeError(f"Reward {self.name!r}: worker process died at start-up (exit code"
                         f" {process.exitcode}); is fn importable in a fresh interpreter?") from e
    self._process, self._conn = process, parent
    return parent

  def _kill_process(self) -> None:
    if self._process is None:
      return
    if self._process.is_alive():
      self._process.kill()
    self._process.join(timeout=5.0)
    self._conn.close()
    self._process = self._conn = None

  def _run_process(self, items) -> list[tuple[str, Any]]:
    outcomes: list[Any] = [None] * len(items)
    start = 0
    while start < len(items):
      conn = self._ensure_process()
      conn.send(("batch", [(j, items[j]) for j in range(start, len(items))]))
      last = time.monotonic()
      j = start
      while j < len(items):
        remaining = last + self.timeout_s - time.monotonic()
        if remaining > 0 and conn.poll(remaining):
          try:
            index, status, payload = conn.recv()
          except (EOFError, OSError):
            self._process.join(timeout=1.0)
            outcomes[j] = (_ERROR, f"reward worker process died during this call (exit code"
                                   f" {self._process.exitcode})")
            break
          outcomes[index] = (status, payload)
          j = index + 1
          last = time.monotonic()
        else:
          outcomes[j] = (_TIMEOUT, None)
          break
      if j >= len(items):
        break
      self._kill_process()
      self.worker_restarts += 1
      start = j + 1
    return outcomes
