"""Time-to-accuracy of the default task with and without the data filters, measured in one run.

Variants of ``configs/grpo_addition.py`` (same seed, same warm start):

* ``filter``      the default: zero-variance groups dropped from the learner batch;
* ``no_filter``   every group trained (zero-variance groups cost a forward and
                  backward pass but add no gradient);
* ``filter+retire``  the filter plus no-positive resampling: a prompt whose pass
                  rate over its last ``data.window`` samples is >= 0.9 leaves the pool
                  (``data.curate=True``);
* ``dynamic``     DAPO dynamic sampling: extra sampling rounds until every group in
                  the batch is informative (optional, ``--variants``).

Each variant runs in its own worker process (the cores are not shared between
variants). Held-out greedy accuracy is evaluated every ``--eval_every`` RL steps;
time-to-accuracy is the RL wall-clock (sampling + learning + publishing, without
the evaluations themselves) up to the first evaluation at or above ``--target``,
and the steps to get there.

Usage::

  python -m bench.ablations                      # filter, no_filter, filter+retire
  python -m bench.ablations --steps 200 --target 0.9 --variants filter,no_filter,dynamic

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Optional, Sequence

from bench.common import default_job_config, dispatch_worker, emit, load_average, run_worker

VARIANTS = {
    "filter": {},
    "no_filter": {"rl.filter_zero_variance": False},
    "filter+retire": {"data.curate": True, "data.retire_solved": True, "data.drop_pass_rate": 0.9},
    "dynamic": {"data.dynamic_sampling": True},
}


def _config(run_dir: str, variant: str, steps: int, eval_every: int):
  from jaxrl_llm import configuration

  c = default_job_config(run_dir, steps, eval_every)
  for path, value in VARIANTS[variant].items():
    configuration.override(c, path, value)
  return c


def time_to_target(records: list[dict], target: float) -> dict:
  """RL seconds and steps until the first evaluation with accuracy >= target (None if never).

  Args:
    records: metrics.jsonl rows (RL steps have step >= 1 and ``time/step_s``).
    target: held-out greedy accuracy to reach.
  """
  rl = sorted((r for r in records if r["step"] >= 1 and "time/step_s" in r), key=lambda r: r["step"])
  seconds = 0.0
  for r in rl:
    seconds += r["time/step_s"]
    if r.get("eval/accuracy", -1.0) >= target:
      return {"seconds": seconds, "steps": r["step"]}
  return {"seconds": None, "steps": None}


def _worker(a: argparse.Namespace) -> dict:
  from jaxrl_llm import jobs

  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    summary = jobs.run(_config(tmp, a.worker, a.steps, a.eval_every))
    wall = time.perf_counter() - t0
    records = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))]
  rl = [r for r in records if r["step"] >= 1 and "time/step_s" in r]
  evals = [(r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r]
  return {"variant": a.worker, "target": a.target, **time_to_target(records, a.target),
          "rl_seconds": sum(r["time/step_s"] for r in rl), "wall_s": wall,
          "warm_start_accuracy": summary["warm_start_accuracy"], "final_accuracy": summary["final_accuracy"],
          "step_s_median": sorted(r["time/step_s"] for r in rl)[len(rl) // 2],
          "rows_trained_mean": sum(r.get("data/rows_trained", 512.0) for r in rl) / len(rl),
          "retired_total": max((r.get("curation/retired_total", 0.0) for r in rl), default=0.0),
          "evaluations": evals}


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=200, help="RL steps per variant")
  p.add_argument("--eval_every", type=int, default=10)
  p.add_argument("--target", type=float, default=0.9, help="held-out greedy accuracy to reach")
  p.add_argument("--variants", default="filter,no_filter,filter+retire")
  p.add_argument("--worker", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  worker_result = dispatch_worker(a.worker, a, **{k: _worker for k in VARIANTS})
  if worker_result is not None:
    return worker_result
  names = [v for v in a.variants.split(",") if v]
  unknown = [v for v in names if v not in VARIANTS]
  if unknown:
    raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
  start = load_average()
  common = ["--steps", str(a.steps), "--eval_every", str(a.eval_every), "--target", str(a.target)]
  results = {v: run_worker("bench.ablations", ["--worker", v] + common, timeout_s=3600) for v in names}
  base = results.get("no_filter", {})
  ratios = {}
  for v, r in results.items():
    if r.get("seconds") and base.get("seconds"):
      ratios[v] = {"time_to_target_vs_no_filter": r["seconds"] / base["seconds"],
                   "steps_to_target_vs_no_filter": r["steps"] / base["steps"]}
  for v, r in results.items():
    if "error" in r:
      print(f"{v:14s} ERROR {r['error']}")
      continue
    hit = f"{r['seconds']:.0f} s / {r['steps']} steps" if r["seconds"] else "not reached"
    print(f"{v:14s} to {a.target:.2f}: {hit}   final {r['final_accuracy']:.3f}   "
          f"median step {r['step_s_median']:.2f} s   rows trained {r['rows_trained_mean']:.0f}")
  summary = {"benchmark": "ablations", "load_average_start": start, "load_average_end": load_average(),
             "cpu_count": os.cpu_count(), "results": results, "ratios": ratios}
  emit(summary)
  return summary


if __name__ == "__main__":
  main()
