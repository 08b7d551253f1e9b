"""Generic helpers of the benchmarks: timing, peak memory, load averages, the JSON
result line, and running each side of a comparison in its own worker subprocess."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional, Sequence

from jaxrl_llm.rollout import reaper


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
  """Wall-clock seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls.

  ``fn`` must block until its work is done (e.g. end with ``jax.block_until_ready``
  or return host data).
  """
  if repeats < 1:
    raise ValueError(f"time_calls: repeats={repeats}, expected >= 1")
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def peak_rss_mib() -> float:
  """Peak resident set size of this process so far, in MiB (``getrusage``)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  # Linux reports KiB, macOS bytes.
  return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def load_average() -> list[float]:
  """1, 5 and 15 minute load averages of the machine."""
  return [round(x, 2) for x in os.getloadavg()]


def timing_stats(seconds: Sequence[float]) -> dict[str, float]:
  """Median, mean, min and max of a list of durations (seconds), and their count."""
  if not seconds:
    raise ValueError("timing_stats: no timings (steps must be >= 1)")
  return {"median_s": statistics.median(seconds), "mean_s": statistics.fmean(seconds),
          "min_s": min(seconds), "max_s": max(seconds), "n": len(seconds)}


def own_tree_jiffies(root_pid: Optional[int] = None) -> int:
  """CPU time (clock ticks) of ``root_pid`` and every live descendant, counting the reaped children
  of each (cutime/cstime): the benchmark's own work, Ray workers and reward workers included."""
  root_pid = root_pid or os.getpid()
  total = 0
  for pid in [root_pid, *reaper.descendants([root_pid])]:
    fields = reaper.stat_fields(pid)  # after "pid (comm) ": state, ppid, ...
    if fields is not None:
      total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
  return total


def machine_busy_jiffies() -> int:
  """Busy CPU time of the whole machine (all cores, clock ticks) from ``/proc/stat``."""
  with open("/proc/stat") as f:
    fields = [int(x) for x in f.readline().split()[1:]]
  idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
  return sum(fields[:8]) - idle


class QuietWindow:
  """Measures what other processes used of the machine during a timed section.

  ``with QuietWindow() as w: ...`` then ``w.result()``: the share of all cores' time that
  processes outside this benchmark's process tree used during the section
  (``others_share``, from ``/proc/stat`` minus the tree's own CPU time), the load averages
  at both ends, and ``quiet = others_share < 0.05``. A figure timed in a window that was
  not quiet is not a result (other jobs' threads slow the two sides unequally).
  """

  LIMIT = 0.05

  def __enter__(self) -> "QuietWindow":
    self.load_start = load_average()
    self.t0 = time.perf_counter()
    self.busy0, self.own0 = machine_busy_jiffies(), own_tree_jiffies()
    return self

  def __exit__(self, *exc) -> None:
    self.busy1, self.own1 = machine_busy_jiffies(), own_tree_jiffies()
    self.seconds = time.perf_counter() - self.t0
    self.load_end = load_average()

  def result(self) -> dict:
    ticks = os.sysconf("SC_CLK_TCK")
    capacity = self.seconds * (os.cpu_count() or 1)
    others = max(0, (self.busy1 - self.busy0) - (self.own1 - self.own0)) / ticks
    share = others / capacity if capacity > 0 else 0.0
    return {"others_share": round(share, 4), "quiet": share < self.LIMIT, "window_s": round(self.seconds, 2),
            "load_average_start": self.load_start, "load_average_end": self.load_end}


def emit(result: dict) -> None:
  """Prints the benchmark's result as one JSON line (the last line of its output)."""
  print(json.dumps(result, sort_keys=True), flush=True)


def run_worker(module: str, args: Sequence[str], xla_flags: Optional[str] = None,
               timeout_s: float = 600.0) -> dict:
  """Runs ``python -m module args`` and returns the JSON object on its last stdout line.

  Args:
    module: e.g. ``"bench.learner"``.
    args: command-line arguments.
    xla_flags: XLA_FLAGS for the child (None: inherit; "" clears them).
    timeout_s: wall-clock limit.

  Returns:
    The parsed object, or ``{"error": ...}`` with the tail of the child's output
    when it failed, timed out or printed no JSON.
  """
  env = dict(os.environ)
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  try:
    proc = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout_s, env=env, cwd=root, check=False)
  except subprocess.TimeoutExpired as e:
    return {"error": f"timed out after {timeout_s:.0f} s", "tail": str(e.stdout or "")[-800:]}
  lines = [l for l in proc.stdout.splitlines() if l.strip()]
  if proc.returncode == 0 and lines:
    try:
      return json.loads(lines[-1])
    except json.JSONDecodeError:
      pass
  tail = (proc.stdout + proc.stderr)[-1500:]
  return {"error": f"exit code {proc.returncode}", "tail": tail}


def dispatch_worker(name: Optional[str], args: Any, **workers: Callable[[Any], dict]) -> Optional[dict]:
  """Runs ``workers[name](args)`` and emits its result when this process is a worker.

  Each benchmark re-invokes itself with ``--worker <side>`` (see :func:`run_worker`);
  ``main`` calls this first and returns its result when it is not None.
  """
  if not name:
    return None
  result = workers[name](args)
  emit(result)
  return result


def default_job_config(run_dir: str, steps: int, eval_every: int, seed: int = 0):
  """The default job (``configs/grpo_addition.py``) for a benchmark run: in ``run_dir``, ``steps`` RL
  steps, an evaluation every ``eval_every`` steps, no checkpoints, HF export, TensorBoard or progress bar."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if root not in sys.path:
    sys.path.insert(0, root)
  from configs import grpo_addition

  c = grpo_addition.get_config()
  c.run_dir = run_dir
  c.seed = seed
  c.rl.steps = steps
  c.eval.every = eval_every
  c.checkpoint.every = 10**6
  c.export.hf = False
  c.log.progress = False
  c.log.tensorboard = False
  return c


def finish(result: dict, load_start: Sequence[float], t_start: float) -> dict:
  """Adds the load averages around the run and its wall-clock to ``result``, emits it, returns it."""
  result.update({"load_average_start": list(load_start), "load_average_end": load_average(),
                 "wall_s": time.perf_counter() - t_start})
  emit(result)
  return result
