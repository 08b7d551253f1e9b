"""The reward worker pool's cost: one step's batch scored in worker processes vs inline.

The default job scores 64 prompts x 8 samples = 512 addition rewards per step. This scores
that batch (the gold answers, so every call succeeds) ``--repeats`` times with
``reward.mode="inline"`` (the caller's thread) and ``"process"`` (``--workers`` worker
processes: the default, which can kill a hung call), interleaved round by round in one
process, and reports median and min milliseconds per batch and their ratio, with the
share of the machine other processes used during the timed section
(:class:`bench.common.QuietWindow`; the ratio is reported only from a quiet window).

Usage::

  python -m bench.reward_pool                 # 512 calls, 20 rounds, 2 workers

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import QuietWindow, emit
from jaxrl_llm.tasks import RewardRunner, get_task


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--calls", type=int, default=512)
  parser.add_argument("--repeats", type=int, default=20)
  parser.add_argument("--workers", type=int, default=2)
  args = parser.parse_args(argv)
  task = get_task("addition")
  stream = task.train_prompts(seed=0)
  examples = [next(stream) for _ in range(args.calls)]
  pairs = [(e, task.sft_target(e)) for e in examples]
  runners = {mode: RewardRunner(task.reward, mode=mode, name=mode, workers=args.workers)
             for mode in ("inline", "process")}
  times: dict[str, list[float]] = {mode: [] for mode in runners}
  try:
    for runner in runners.values():
      runner.score(pairs[:8])  # starts the workers
    with QuietWindow() as window:
      for _ in range(args.repeats):
        for mode, runner in runners.items():
          start = time.perf_counter()
          rewards = runner.score(pairs)
          times[mode].append(time.perf_counter() - start)
          assert float(rewards.min()) >= 1.0, f"{mode}: a gold answer did not score 1"
  finally:
    for runner in runners.values():
      runner.close()
  result = {"calls": args.calls, "workers": args.workers, **window.result()}
  for mode, seconds in times.items():
    result[f"{mode}_median_ms"] = 1e3 * statistics.median(seconds)
    result[f"{mode}_min_ms"] = 1e3 * min(seconds)
  ratio = result["process_median_ms"] / result["inline_median_ms"]
  result["process_over_inline"] = ratio if result["quiet"] else None
  emit(result)
  return result


if __name__ == "__main__":
  main()
