"""Runs reward functions under a guard: a reward that fails is a wrong answer, counted.

A reward function is any Python callable ``fn(example, response_text) -> float``.
``RewardRunner(fn, timeout_s=..., name=...)`` scores a list of ``(example, response)``
pairs and keeps counters (``metrics``). A call that raises, overruns ``timeout_s``,
crashes its process, hits the memory limit, returns something that is not a number, or
returns NaN/inf scores 0.0 and the run goes on; the first failure of each cause is
logged in full through ``logging`` (absl picks it up), later ones are only counted.
Training and evaluation score through runners alike (one code path); a runner is used
from one thread.

Modes (``config.reward.mode``):

* ``"process"`` (default). Calls run in a :class:`~jaxrl_llm.tasks.workers.WorkerPool`
  of ``workers`` processes: a batch is spread over them, each call has its own deadline,
  results keep the input order. A call that overruns is cut by killing its process, so
  even a reward that holds the GIL in C code for ever (``Fraction("1e99999999999")``)
  costs at most ``timeout_s``; a worker that times out, crashes (segfault, ``os._exit``)
  or runs out of memory is replaced. Workers run under ``memory_mb`` of address space
  and ``cpu_seconds`` of CPU time per call (``resource.setrlimit``). ``fn`` must be
  picklable (a module-level function, or a bound method of a picklable object such as
  a task: ``task.reward``). Cost (``python -m bench.reward_pool``, quiet 2-core machine):
  ~19 ms for the default job's batch of 512 addition rewards over 2 workers, against ~4 ms
  inline; a replaced worker starts in ~0.35 s (importing NumPy), which no call's deadline pays.
* ``"inline"``. Calls run in the caller's thread: fastest, for trusted rewards only; an
  overrun is detected after the call returns (scored 0, counted as a timeout) and a
  call that never returns hangs the run.

Failure-rate stop. :meth:`RewardRunner.end_step` (the RL job calls it once per step)
looks at the calls since the last step: when more than ``max_failure_share`` of them
failed (raised, timed out, crashed, ran out of memory, or returned a non-number or
NaN/inf) for ``failure_steps`` consecutive steps it raises :class:`RewardFailureError`
with the first failure's traceback: a broken verifier stops the run instead of training
on all-zero rewards. Runners that never call ``end_step`` (evaluation) count their
failures as wrong answers and never stop the run on their own.

Example:
  >>> runner = RewardRunner(task.reward, timeout_s=1.0, name="task")
  >>> rewards_b = runner.score(list(zip(examples, responses)))  # float32 [B]
  >>> runner.end_step()                                          # once per RL step
  >>> runner.metrics["reward/task/timeouts"]
  >>> runner.close()                                             # stops the workers
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxrl_llm.errors import ConfigError, RunError
from jaxrl_llm.tasks import workers as W

logger = logging.getLogger(__name__)

MODES = ("process", "inline")
RewardFn = Callable[[Any, str], float]
# Measured: a worker after loading a task's reward peaks at ~250 MiB of address space (36 MiB resident);
# the default leaves room for heavier verifiers and still stops a runaway call at 2 GiB.
DEFAULT_MEMORY_MB = 2048
DEFAULT_CPU_SECONDS = 60.0  # per call: a backstop behind the wall-clock timeout (a worker whose parent is gone)
# Counters saved in checkpoints (cumulative over the run); causes are disjoint: each failed call counts once.
COUNTERS = ("calls", "failures", "timeouts", "nonfinite", "crashes", "memory_errors", "worker_restarts", "seconds")
_CAUSE = {W.ERROR: "failures", W.TIMEOUT: "timeouts", W.CRASH: "crashes", W.MEMORY: "memory_errors"}
_WORDS = {"failures": "raised", "timeouts": "timed out", "crashes": "crashed its worker process",
          "memory_errors": "ran out of memory", "nonfinite": "returned a non-finite value"}


class UnpicklableRewardError(TypeError, ConfigError):
  """The reward function cannot be sent to a worker process (``jaxrl-train``: a usage error, exit 2)."""


class RewardFailureError(RunError):
  """A reward failed on too many of its calls for too many consecutive steps (``jaxrl-train``: a paragraph, exit 1)."""


def _number(value: Any) -> tuple[str, Any]:
  """``("ok", float)``, or ``("error", text)`` for a value that is not a number."""
  try:
    return W.OK, float(value)
  except (TypeError, ValueError, OverflowError):
    return W.ERROR, f"the reward returned {value!r} ({type(value).__name__}), not a number"


class RewardRunner:
  """Scores ``(example, response)`` pairs with a guarded reward function.

  Args:
    fn: ``fn(example, response_text) -> float``.
    timeout_s: per-call time limit in seconds (> 0).
    name: label used in logs and metric names (defaults to ``fn``'s name).
    mode: ``"process"`` (default) or ``"inline"`` (see the module docstring).
    workers: worker processes (``"process"`` mode).
    memory_mb: address-space limit per worker in MiB; 0: none.
    cpu_seconds: CPU-time limit per call in seconds; 0: none.
    max_failure_share: :meth:`end_step` counts a step as failing above this share of failed calls.
    failure_steps: consecutive failing steps before :meth:`end_step` raises.
    launcher_prefix: argv put before the worker's ``python -m ...`` (a sandbox, e.g. bwrap).
    start_timeout_s: how long a worker process may take to start.
  """

  def __init__(self, fn: RewardFn, *, timeout_s: float = 5.0, name: Optional[str] = None, mode: str = "process",
               workers: int = 2, memory_mb: int = DEFAULT_MEMORY_MB, cpu_seconds: float = DEFAULT_CPU_SECONDS,
               max_failure_share: float = 0.5, failure_steps: int = 3, launcher_prefix: Sequence[str] = (),
               start_timeout_s: float = 60.0):
    if not callable(fn):
      raise TypeError(f"RewardRunner: fn must be callable, got {fn!r}")
    if not 0 < timeout_s < float("inf"):
      raise ValueError(f"RewardRunner.timeout_s must be a finite number > 0, got {timeout_s!r}")
    if mode not in MODES:
      raise ValueError(f"RewardRunner.mode must be one of {MODES}, got {mode!r}")
    if not 0 <= max_failure_share <= 1 or failure_steps < 1:
      raise ValueError(f"RewardRunner: max_failure_share must be in [0, 1] and failure_steps >= 1, got "
                       f"{max_failure_share!r} and {failure_steps!r}")
    self.fn = fn
    self.timeout_s = float(timeout_s)
    self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
    self.mode = mode
    self.max_failure_share = float(max_failure_share)
    self.failure_steps = int(failure_steps)
    self.pool: Optional[W.WorkerPool] = None
    self._owns_pool = mode == "process"
    if mode == "process":
      try:
        self.pool = W.WorkerPool(fn, workers=workers, memory_mb=memory_mb, cpu_seconds=cpu_seconds,
                                 launcher_prefix=launcher_prefix, start_timeout_s=start_timeout_s,
                                 on_start_error="Check that the reward function can be imported in a fresh "
                                                "interpreter, or raise reward.memory_mb.")
      except TypeError as e:
        raise UnpicklableRewardError(f"Reward {self.name!r} runs in worker processes (reward.mode='process'): {e}; "
                                     "or set reward.mode='inline' for a trusted reward") from e
    self.calls = self.failures = self.timeouts = self.nonfinite = 0
    self.crashes = self.memory_errors = self.worker_restarts = 0
    self.seconds = 0.0
    self.failing_steps = 0  # consecutive steps above max_failure_share
    self.first_error: Optional[str] = None  # the first failure of the current failing streak
    self._step_calls = self._step_failed = 0
    self._step_error: Optional[str] = None

  def sharing(self, name: str) -> "RewardRunner":
    """A runner with its own counters on this runner's worker processes (evaluation next to training)."""
    other = RewardRunner.__new__(RewardRunner)
    other.__dict__.update(self.__dict__)
    other.name, other._owns_pool = name, False
    for counter in COUNTERS:
      setattr(other, counter, type(getattr(self, counter))(0))
    other.failing_steps, other.first_error = 0, None
    other._step_calls = other._step_failed = 0
    other._step_error = None
    return other

  # ------------------------------------------------------------------ public API

  def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
    """Scores every pair; never raises because of ``fn``.

    Args:
      pairs: B ``(example, response_text)`` pairs.

    Returns:
      float32 [B] rewards, 0.0 where the call failed, timed out, crashed or was not finite.

    Raises:
      WorkerStartError: a worker process could not start (a set-up error, not a reward failure).
    """
    items = list(pairs)
    for j, item in enumerate(items):
      if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError(f"RewardRunner.score: pairs[{j}] must be (example, response), got {item!r}")
    started = time.monotonic()
    if self.pool is not None:
      restarts = self.pool.restarts
      outcomes = self.pool.map([tuple(item) for item in items], self.timeout_s)
      self.worker_restarts += self.pool.restarts - restarts
    else:
      outcomes = [self._call_inline(example, response) for example, response in items]
    rewards_b = self._record(items, outcomes)
    self.seconds += time.monotonic() - started
    return rewards_b

  __call__ = score

  def end_step(self) -> None:
    """Closes one RL step's window of calls; raises after ``failure_steps`` failing steps in a row.

    Raises:
      RewardFailureError: naming the share, the causes, the config fields and the first traceback.
    """
    calls, failed = self._step_calls, self._step_failed
    if calls and failed / calls > self.max_failure_share:
      self.failing_steps += 1
      self.first_error = self.first_error or self._step_error
    else:
      self.failing_steps, self.first_error = 0, None
    self._step_calls = self._step_failed = 0
    self._step_error = None
    if self.failing_steps >= self.failure_steps:
      causes = ", ".join(f"{k}={getattr(self, k)}" for k in ("failures", "timeouts", "crashes", "memory_errors",
                                                              "nonfinite"))
      raise RewardFailureError(
          f"Reward {self.name!r} failed on more than reward.max_failure_share={self.max_failure_share:g} of its "
          f"calls for {self.failing_steps} consecutive steps (reward.failure_steps={self.failure_steps}; last "
          f"step: {failed} of {calls} calls failed); stopping instead of training on zero rewards. Counts so far: "
          f"{causes} of {self.calls} calls. Fix the reward function, or raise reward.timeout_s / reward.memory_mb "
          f"if it needs more; reward.max_failure_share=1 never stops. First failure of this streak:\n"
          f"{self.first_error}")

  def step_metrics(self) -> dict[str, float]:
    """Per-batch figures of the last ``score`` (none here; a weighted combination reports its parts)."""
    return {}

  @property
  def metrics(self) -> dict[str, float]:
    """Counters since the start of the run, under ``reward/<name>/``."""
    prefix = f"reward/{self.name}/"
    return {**{prefix + k: float(getattr(self, k)) for k in COUNTERS},
            prefix + "failing_steps": float(self.failing_steps)}

  def get_state(self) -> dict:
    """The counters and the failure streak (saved with checkpoints)."""
    return {**{k: getattr(self, k) for k in COUNTERS}, "failing_steps": self.failing_steps,
            "first_error": self.first_error}

  def set_state(self, state: dict) -> None:
    """Restores :meth:`get_state`; counters a checkpoint lacks (an older version) stay 0."""
    for k in (*COUNTERS, "failing_steps", "first_error"):
      if k in state:
        setattr(self, k, state[k])

  def close(self) -> None:
    """Stops the worker processes (a later ``score`` starts new ones)."""
    if self.pool is not None and self._owns_pool:
      self.pool.close()

  def __enter__(self) -> "RewardRunner":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ------------------------------------------------------------------ internals

  def _call_inline(self, example: Any, response: str) -> W.Outcome:
    started = time.monotonic()
    try:
      status, value = W.OK, self.fn(example, response)
    except MemoryError:
      status, value = W.MEMORY, traceback.format_exc()
    except (Exception, SystemExit):  # pylint: disable=broad-except
      status, value = W.ERROR, traceback.format_exc()
    if time.monotonic() - started > self.timeout_s:
      status, value = W.TIMEOUT, f"the call took {time.monotonic() - started:.3g} s (inline mode: not stopped)"
    return W.Outcome(status, value)

  def _record(self, items: list, outcomes: Sequence[W.Outcome]) -> np.ndarray:
    rewards_b = np.zeros(len(items), np.float32)
    for j, (status, value) in enumerate(outcomes):
      self.calls += 1
      self._step_calls += 1
      if status == W.OK:
        status, value = _number(value)
      if status == W.OK:
        reward = np.float32(value)
        if np.isfinite(reward):
          rewards_b[j] = reward
          continue
        cause, value = "nonfinite", f"the reward returned {value!r}"
      else:
        cause = _CAUSE[status]
      setattr(self, cause, getattr(self, cause) + 1)
      self._step_failed += 1
      prompt = getattr(items[j][0], "prompt", items[j][0])
      if self._step_error is None:
        self._step_error = f"item {j} (prompt={prompt!r}): {value}"
      if getattr(self, cause) == 1:  # the first of each cause in full, later ones are only counted
        level = logging.WARNING if cause in ("timeouts", "nonfinite") else logging.ERROR
        logger.log(level, "Reward %r %s on item %d (the first time; later ones are only counted); prompt=%r\n%s",
                   self.name, _WORDS[cause], j, prompt, value)
    return rewards_b
