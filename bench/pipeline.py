"""Synchronous loop vs PipelineRL (k = 1, 4, 8) on the default task, measured in one run.

Each mode runs ``--steps`` RL steps of the default job's model and batch
(``configs/grpo_addition.py``, no warm start, no evaluation or checkpoints)
after ``--warmup`` steps that absorb compilation, and reports from the run's
``metrics.jsonl``:

* learner steps/s and generated tokens/s (response tokens of the batches trained on);
* learner idle share: the share of wall-clock the learner spends waiting for
  samples (sync: sampling time; pipeline: ``pipeline/wait_s``);
* weight publish time per step (pipeline: ``device_get`` + one ``ray.put`` +
  the actor calls; sync: swapping the in-process sampler's weights).

The pipeline runs ``--samplers`` Ray sampler actors (JAX on the CPU). On a
2-core machine the learner and the samplers share the same two cores, so the
gain is bounded by the cores, not by the schedule; ``docs/scaling.md`` models
what the same schedule gives when samplers have their own accelerators.

Usage::

  python -m bench.pipeline                       # sync, k = 1, 4, 8
  python -m bench.pipeline --lags 4 --steps 6    # quick

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Optional, Sequence

from bench.common import default_job_config, dispatch_worker, emit, load_average, run_worker


def _config(run_dir: str, mode: str, lag: int, samplers: int, steps: int):
  c = default_job_config(run_dir, steps, 10**6)
  c.sft.steps = 0
  c.task.eval_size = 8
  c.rollout.mode = mode
  c.rollout.max_lag = lag
  c.rollout.num_samplers = samplers
  return c


def _worker(a: argparse.Namespace) -> dict:
  from jaxrl_llm import jobs

  steps = a.warmup + a.steps
  with tempfile.TemporaryDirectory() as tmp:
    t0 = time.perf_counter()
    run = jobs.RLJob(_config(tmp, a.mode, a.lag, a.samplers, steps))
    t_build = time.perf_counter() - t0
    run.train()
    records = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))]
  rl = [r for r in records if r["step"] > a.warmup and "time/step_s" in r]
  wall = sum(r["time/step_s"] for r in rl)
  idle = sum(r["time/wait_s"] for r in rl)
  publish = [r["time/publish_s"] for r in rl]
  rows = run.config.rl.prompts_per_step * run.config.rl.samples_per_prompt
  tokens = sum(r["response/length_mean"] * rows for r in rl)
  return {"mode": a.mode, "lag": a.lag, "samplers": a.samplers, "steps": len(rl),
          "steps_per_s": len(rl) / wall, "generated_tokens_per_s": tokens / wall,
          "learner_idle_share": idle / wall, "publish_s_median": statistics.median(publish),
          "learn_s_median": statistics.median(r["time/learn_s"] for r in rl),
          "build_s": t_build, "max_lag_seen": max(r.get("data/lag_max", 0.0) for r in rl)}


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=12, help="timed RL steps per mode")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps (compilation) per mode")
  p.add_argument("--lags", default="1,4,8", help="comma-separated staleness bounds k")
  p.add_argument("--samplers", type=int, default=2)
  p.add_argument("--worker", choices=("sync", "pipeline"), help=argparse.SUPPRESS)
  p.add_argument("--lag", type=int, default=0, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  a.mode = a.worker
  worker_result = dispatch_worker(a.worker, a, sync=_worker, pipeline=_worker)
  if worker_result is not None:
    return worker_result
  start = load_average()
  common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--samplers", str(a.samplers)]
  results = {"sync": run_worker("bench.pipeline", ["--worker", "sync"] + common, timeout_s=1800)}
  for lag in [int(x) for x in a.lags.split(",") if x]:
    results[f"k={lag}"] = run_worker("bench.pipeline", ["--worker", "pipeline", "--lag", str(lag)] + common,
                                     timeout_s=1800)
  sync = results["sync"]
  summary = {"benchmark": "pipeline", "load_average_start": start, "load_average_end": load_average(),
             "cpu_count": os.cpu_count(), "results": results,
             "speedup_steps_per_s": {k: r["steps_per_s"] / sync["steps_per_s"] for k, r in results.items()}}
  for k, r in results.items():
    print(f"{k:6s} steps/s {r['steps_per_s']:.3f}  gen tok/s {r['generated_tokens_per_s']:.0f}  "
          f"learner idle {100 * r['learner_idle_share']:.0f} %  publish {1000 * r['publish_s_median']:.1f} ms  "
          f"max lag {r['max_lag_seen']:.0f}")
  emit(summary)
  return summary


if __name__ == "__main__":
  main()
