"""Sandbox throughput: calls per second of trivial snippets, warm pool vs cold sandbox vs no sandbox.

  python -m bench.sandbox [--calls 400] [--cold-calls 40] [--workers 2]

Three sides, timed in the same run, each in its own :class:`bench.common.QuietWindow`:

  warm        ``Sandbox(workers).run_many`` (fork per call inside warm bwrap sandboxes)
  cold        a fresh ``Sandbox(workers=1)`` per call: bwrap + Python start-up + the call
  unsandboxed ``subprocess.run([python, -I, -S, -c, code])`` per call (no isolation; the baseline
              of a fresh process)

The ratios (warm over cold, warm over unsandboxed) are reported only when every window was quiet
(other processes used < 5% of the cores); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

from bench.common import QuietWindow, emit, load_average
from jaxrl_llm.tasks.sandbox import Sandbox, SandboxLimits

SNIPPET = "print(sum(range(100)))"


def adopt_orphans() -> None:
  """Makes this process the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``).

  Closing a sandbox kills its bwrap process; the processes inside are then orphans, and
  without this they would be reaped by the host's init, their CPU time counted as another
  process's (the cold side's window would never be quiet). Here they are reaped by
  :func:`reap` and counted as the benchmark's own.
  """
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def reap() -> None:
  """Waits for every finished child, adopted orphans included."""
  while True:
    try:
      pid, _ = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
      return
    if pid == 0:
      return


def _timed(fn, calls: int) -> dict:
  with QuietWindow() as window:
    start = time.perf_counter()
    fn(calls)
    seconds = time.perf_counter() - start
  return {"calls": calls, "seconds": round(seconds, 4), "calls_per_s": round(calls / seconds, 1), **window.result()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=400)
  parser.add_argument("--cold-calls", type=int, default=40)
  parser.add_argument("--workers", type=int, default=2)
  args = parser.parse_args(argv)
  limits = SandboxLimits()
  adopt_orphans()
  load_start = load_average()

  with Sandbox(workers=args.workers, limits=limits) as box:
    assert all(r.ok for r in box.run_many([SNIPPET] * 8))  # warm-up: workers started

    def warm(n):
      results = box.run_many([SNIPPET] * n)
      assert all(r.ok and r.stdout == "4950\n" for r in results)

    def warm_serial(n):
      for _ in range(n):
        assert box.run(SNIPPET).ok

    warm_side = _timed(warm, args.calls)
    serial_side = _timed(warm_serial, args.calls)

  def cold(n):
    for _ in range(n):
      with Sandbox(workers=1, limits=limits) as one:
        assert one.run(SNIPPET).ok
      reap()

  def unsandboxed(n):
    for _ in range(n):
      out = subprocess.run([sys.executable, "-I", "-S", "-c", SNIPPET], capture_output=True, text=True, check=True)
      assert out.stdout == "4950\n"

  cold_side = _timed(cold, args.cold_calls)
  bare_side = _timed(unsandboxed, args.cold_calls)
  sides = {"warm_batch": warm_side, "warm_serial": serial_side, "cold": cold_side, "unsandboxed": bare_side}
  quiet = all(s["quiet"] for s in sides.values())
  result = {"bench": "sandbox", "workers": args.workers, "snippet": SNIPPET, "quiet": quiet, **sides,
            "load_average_start": load_start, "load_average_end": load_average()}
  if quiet:
    result["warm_over_cold"] = round(warm_side["calls_per_s"] / cold_side["calls_per_s"], 1)
    result["warm_over_unsandboxed"] = round(warm_side["calls_per_s"] / bare_side["calls_per_s"], 1)
  else:
    result["note"] = "not a result: other processes used >= 5% of the cores in at least one window"
  emit(result)
  return result


if __name__ == "__main__":
  main()
