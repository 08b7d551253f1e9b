"""Chaos run: the default job with a reward that hangs or raises and a sampler actor killed.

Two runs of the default job (``configs/grpo_addition.py``) in PipelineRL mode
(``rollout.mode='pipeline'``, two Ray sampler actors), each in its own worker process,
one after the other, same seed and settings:

* ``clean``: the addition reward as shipped;
* ``chaos``: the same reward, except that on a random ``--hang`` share of its training
  calls it never returns (a sleep that no timeout inside the call can interrupt) and on
  ``--raise`` share it raises; and at RL step ``--kill-at`` one sampler actor is killed
  with ``ray.kill``.

The reward runner cuts each hung call at ``reward.timeout_s`` (``--timeout``) by killing
its worker process and scores it 0; a raising call scores 0; the pool replaces the killed
actor and re-queues its work. Held-out evaluation is left clean (faults are injected only
on training prompts), so the accuracies compare learning, not the measurement.

Reported per run: final held-out greedy accuracy, the reward counters and the sampler
pool's restarts (both also in the run's ``summary.json``), wall clock, and the share of
the machine other processes used during the run (:class:`bench.common.QuietWindow`; the
wall-clock ratio counts only when both windows were quiet). "Within noise" is judged
against the binomial standard error of the evaluation, sqrt(p (1 - p) / eval_size).

Usage::

  python -m bench.chaos                        # 60 RL steps, 2 % hangs, 2 % raises, kill at step 20
  python -m bench.chaos --steps 300 --timeout 1.0

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import bench.faulty_reward  # noqa: F401  # pylint: disable=unused-import  (registers the task "faulty_addition")
from bench.common import QuietWindow, default_job_config, dispatch_worker, emit, run_worker




def _kill_one_actor_at(step: int):
  """A job hook that kills the first sampler actor after RL step ``step``."""
  from jaxrl_llm.jobs import Hook  # pylint: disable=import-outside-toplevel

  class KillSampler(Hook):
    name = "kill_sampler"

    def due(self, s: int) -> bool:
      return s == step

    def __call__(self, job, s, metrics):
      import ray  # pylint: disable=import-outside-toplevel
      ray.kill(job.source.pool.actors()[0])
      return {}

  return KillSampler()


def worker(args) -> dict:
  """One run: ``args.worker`` is "clean" or "chaos"."""
  from jaxrl_llm import jobs  # pylint: disable=import-outside-toplevel

  chaos = args.worker == "chaos"
  c = default_job_config(os.path.join(args.out, args.worker), args.steps, args.eval_every, seed=args.seed)
  c.rollout.mode = "pipeline"
  c.reward.timeout_s = args.timeout
  c.task.name = "faulty_addition"
  c.task.kwargs.hang_rate = args.hang if chaos else 0.0
  c.task.kwargs.raise_rate = args.raise_ if chaos else 0.0
  job = jobs.make_job(c)
  if chaos:
    job.add_hook(_kill_one_actor_at(args.kill_at))
  with QuietWindow() as window:
    summary = job.train()
  with open(os.path.join(c.run_dir, "summary.json")) as f:
    on_disk = json.load(f)
  return {"final_accuracy": summary["final_accuracy"], "warm_start_accuracy": summary["warm_start_accuracy"],
          "rewards": on_disk["rewards"], "sampler_pool": on_disk.get("sampler_pool"),
          "eval_size": c.task.eval_size, "wall_s": window.seconds, **window.result()}


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--eval-every", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--timeout", type=float, default=0.25, help="reward.timeout_s of both runs")
  parser.add_argument("--hang", type=float, default=0.02)
  parser.add_argument("--raise", dest="raise_", type=float, default=0.02)
  parser.add_argument("--kill-at", type=int, default=20)
  parser.add_argument("--out", default="")
  parser.add_argument("--worker", default="")
  args = parser.parse_args(argv)
  done = dispatch_worker(args.worker or None, args, clean=worker, chaos=worker)
  if done is not None:
    return done
  out = args.out or tempfile.mkdtemp(prefix="chaos_")
  common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
            "--timeout", str(args.timeout), "--hang", str(args.hang), "--raise", str(args.raise_),
            "--kill-at", str(args.kill_at), "--out", out]
  runs = {side: run_worker("bench.chaos", common + ["--worker", side], timeout_s=7200) for side in ("clean", "chaos")}
  result = {"steps": args.steps, "hang": args.hang, "raise": args.raise_, "kill_at": args.kill_at,
            "timeout_s": args.timeout, "runs": runs}
  if all("error" not in r for r in runs.values()):
    p, n = runs["clean"]["final_accuracy"], runs["clean"]["eval_size"]
    se = math.sqrt(max(p * (1 - p), 1e-6) / n)
    gap = runs["chaos"]["final_accuracy"] - p
    result.update({"accuracy_gap": gap, "binomial_se": se, "within_2se": abs(gap) <= 2 * se,
                   "quiet": runs["clean"]["quiet"] and runs["chaos"]["quiet"]})
    ratio = runs["chaos"]["wall_s"] / runs["clean"]["wall_s"]
    result["wall_clock_ratio"] = ratio if result["quiet"] else None
    if not result["quiet"]:
      result["wall_clock_note"] = (f"not a result: other processes used {runs['clean']['others_share']:.0%} /"
                                   f" {runs['chaos']['others_share']:.0%} of the machine (ratio {ratio:.2f})")
  emit(result)
  return result


if __name__ == "__main__":
  main()
