"""Small generic helpers for the benchmarks: repeated timing and peak memory.

(JSON output, load averages, timing statistics and subprocess workers live in
``bench.learner`` and are imported from there.)
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Callable


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
