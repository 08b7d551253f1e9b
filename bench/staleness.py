"""Staleness ablation: which off-policy corrections help when the data is k versions old.

The default job (``configs/grpo_addition.py``: 2-digit addition, 64 prompts x 8
samples per step) is trained from one shared warm start with simulated lag
``rollout.simulated_lag = k`` (each step sampled by the policy k versions
older than the learner; deterministic, no Ray) under five objectives:

* ``ppo_mu``     PPO clip against the sampler, pi_k := mu (``objective.proximal='behaviour'``):
                 what the library trained before pi_k reached the step;
* ``decoupled``  decoupled PPO (Hilton et al., arXiv:2110.00641): clip pi_theta / pi_k,
                 weight pi_k / mu;
* ``geppo``      GePPO's clip window [rho_k - eps, rho_k + eps] around rho_k = pi_k / mu
                 (Queeney et al., arXiv:2111.00072);
* ``cispo``      CISPO (arXiv:2506.13585): REINFORCE weighted by the clipped, stop-gradient
                 ratio to the sampling policy (pi_k := mu, as in PipelineRL / ScaleRL);
* ``ppo_tis``    PPO clip against pi_k plus token-level truncated IS min(pi_k / mu, 2)
                 (the recomputed-old-log-prob + TIS recipe of verl).

The warm start (``sft.steps`` supervised steps) is trained once and exported as
a Hugging Face folder; every run starts from it with ``sft.steps=0``, so the
runs differ only in lag, objective and seed. Each run is its own worker
process, one at a time. Per run: held-out greedy accuracy at every
evaluation, steps to ``--target``, the seed diagnostics averaged over the run
(update drift U_k = ``offpolicy/drift_tv``, staleness S_k =
``offpolicy/staleness_tv``, ESS rate of pi_k / mu), and whether it collapsed
(final accuracy below the warm start by more than 0.1, or non-finite updates).

``--pipeline decoupled:4`` adds real PipelineRL runs (``rollout.mode='pipeline'``, Ray
sampler actors, ``rollout.max_lag=4``) from the same warm start, to compare with the
synchronous run of the same objective.

Usage::

  python -m bench.staleness --pipeline decoupled:4     # k = 0, 2, 8; five objectives; seed 0; one pipeline run
  python -m bench.staleness --lags 0,8 --seeds 0,1 --steps 150 --variants decoupled,ppo_mu

Writes ``bench/staleness.png`` (accuracy against step, one panel per lag) unless
``--plot ''``. The last line printed is one JSON object with every figure.
Accuracy figures do not depend on machine load (the runs are deterministic
given the seed); the wall-clock figures do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from typing import Optional, Sequence

from bench.common import default_job_config, dispatch_worker, emit, load_average, run_worker

VARIANTS = {
    "ppo_mu": {"objective.recipe": "grpo", "objective.proximal": "behaviour"},
    "decoupled": {"objective.recipe": "decoupled_ppo"},
    "geppo": {"objective.recipe": "geppo"},
    "cispo": {"objective.recipe": "cispo", "objective.proximal": "behaviour"},
    "ppo_tis": {"objective.recipe": "grpo", "objective.corrections": (("truncated_is", {"cap": 2.0}),)},
}
DIAGNOSTICS = {"drift_tv": "offpolicy/drift_tv", "staleness_tv": "offpolicy/staleness_tv",
               "ess_rate": "offpolicy/ess_rate", "lag_mean": "data/lag_mean"}


def _warm_worker(a: argparse.Namespace) -> dict:
  """Trains the shared warm start (SFT only) and exports it to ``a.warm``."""
  from jaxrl_llm import jobs

  with tempfile.TemporaryDirectory() as tmp:
    c = default_job_config(tmp, 0, 1)
    c.export.hf = True
    summary = jobs.run(c)
    export = summary["outputs"]["hf_export"]
    os.makedirs(a.warm, exist_ok=True)
    for name in os.listdir(export):
      os.replace(os.path.join(export, name), os.path.join(a.warm, name))
  return {"warm": a.warm, "warm_start_accuracy": summary["warm_start_accuracy"]}


def _run_worker(a: argparse.Namespace) -> dict:
  """One (variant, lag, seed) run from the shared warm start."""
  import ml_collections

  from jaxrl_llm import configuration, jobs

  with tempfile.TemporaryDirectory() as tmp:
    c = default_job_config(tmp, a.steps, a.eval_every, a.seed)
    c.init.hf_checkpoint = a.warm
    c.sft.steps = 0
    c.export.hf = False
    if a.rollout == "pipeline":  # real PipelineRL: Ray sampler actors up to k versions ahead
      c.rollout.mode = "pipeline"
      c.rollout.max_lag = a.lag
    else:
      c.rollout.simulated_lag = a.lag
    c.objective.kwargs = ml_collections.ConfigDict({"kl_coef": 0.0} if VARIANTS[a.variant]["objective.recipe"] == "grpo"
                                                   else {})  # the default job's GRPO has no KL term
    for path, value in VARIANTS[a.variant].items():
      configuration.override(c, path, value)
    t0 = time.perf_counter()
    summary = jobs.run(c)
    wall = time.perf_counter() - t0
    records = [json.loads(l) for l in open(os.path.join(tmp, "metrics.jsonl"))]
  return summarize(records, summary, a.target) | {"variant": a.variant, "lag": a.lag, "seed": a.seed, "wall_s": wall,
                                                  "rollout": a.rollout}


def _mean(values: Sequence[float]) -> Optional[float]:
  values = [v for v in values if v is not None and math.isfinite(v)]
  return sum(values) / len(values) if values else None


def summarize(records: list[dict], summary: dict, target: float) -> dict:
  """Accuracy curve, steps to ``target``, mean diagnostics and the collapse flag of one run.

  Args:
    records: the run's metrics.jsonl rows (RL steps have step >= 1).
    summary: the run's summary.
    target: held-out greedy accuracy to reach.
  """
  rl = sorted((r for r in records if r.get("step", 0) >= 1 and "time/step_s" in r), key=lambda r: r["step"])
  evals = [(r["step"], r["eval/accuracy"]) for r in rl if "eval/accuracy" in r]
  reached = next((s for s, acc in evals if acc >= target), None)
  warm = summary["warm_start_accuracy"]
  final = summary["final_accuracy"]
  diag = {name: _mean([r.get(key) for r in rl]) for name, key in DIAGNOSTICS.items()}
  collapsed = bool(final < warm - 0.1 or summary.get("skipped_updates", 0) > 0)
  return {"warm_start_accuracy": warm, "final_accuracy": final, "best_accuracy": max(a for _, a in evals),
          "steps_to_target": reached, "evaluations": evals, "collapsed": collapsed, **diag}


def plot(results: list[dict], path: str) -> None:
  """Accuracy against RL step, one panel per lag, one line per variant (seed means)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  lags = sorted({r["lag"] for r in results})
  fig, axes = plt.subplots(1, len(lags), figsize=(5 * len(lags), 4), sharey=True, squeeze=False)
  for ax, lag in zip(axes[0], lags):
    for variant in VARIANTS:
      runs = [r for r in results if r["lag"] == lag and r["variant"] == variant]
      if not runs:
        continue
      steps = [s for s, _ in runs[0]["evaluations"]]
      acc = [sum(dict(r["evaluations"])[s] for r in runs) / len(runs) for s in steps]
      ax.plot([0] + steps, [runs[0]["warm_start_accuracy"]] + acc, marker="o", ms=3, label=variant)
    ax.set_title(f"simulated lag k = {lag}")
    ax.set_xlabel("RL step")
    ax.grid(alpha=0.3)
  axes[0][0].set_ylabel("held-out greedy accuracy")
  axes[0][-1].legend(loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=200, help="RL steps per run")
  p.add_argument("--eval_every", type=int, default=25)
  p.add_argument("--target", type=float, default=0.9, help="held-out greedy accuracy to reach")
  p.add_argument("--lags", default="0,2,8")
  p.add_argument("--seeds", default="0")
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--plot", default="bench/staleness.png", help="figure path ('' for none)")
  p.add_argument("--warm", default="", help="warm-start HF folder to reuse (default: train one)")
  p.add_argument("--pipeline", default="", help="also real PipelineRL runs, e.g. 'decoupled:4' (variant:max_lag, "
                 "comma-separated), compared with the same variant's simulated k=0 run")
  p.add_argument("--rollout", choices=("simulated", "pipeline"), default="simulated", help=argparse.SUPPRESS)
  p.add_argument("--worker", choices=("warm", "run"), help=argparse.SUPPRESS)
  p.add_argument("--variant", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
  p.add_argument("--lag", type=int, default=0, help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  worker_result = dispatch_worker(a.worker, a, warm=_warm_worker, run=_run_worker)
  if worker_result is not None:
    return worker_result
  variants = [v for v in a.variants.split(",") if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    raise SystemExit(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
  lags = [int(k) for k in a.lags.split(",")]
  seeds = [int(s) for s in a.seeds.split(",")]
  start, t0 = load_average(), time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    warm = a.warm or os.path.join(tmp, "warm")
    if not a.warm:
      w = run_worker("bench.staleness", ["--worker", "warm", "--warm", warm], timeout_s=3600)
      if "error" in w:
        raise SystemExit(f"warm start failed: {w}")
      print(f"warm start: held-out accuracy {w['warm_start_accuracy']:.3f}", flush=True)
    runs = [(variant, lag, seed, "simulated") for seed in seeds for lag in lags for variant in variants]
    runs += [(spec.split(":")[0], int(spec.split(":")[1]), seeds[0], "pipeline") for spec in a.pipeline.split(",")
             if spec]
    results = []
    for variant, lag, seed, rollout in runs:
      r = run_worker("bench.staleness", ["--worker", "run", "--warm", warm, "--variant", variant, "--lag", str(lag),
                                         "--seed", str(seed), "--steps", str(a.steps), "--rollout", rollout,
                                         "--eval_every", str(a.eval_every), "--target", str(a.target)],
                     timeout_s=3600)
      r.update(variant=variant, lag=lag, seed=seed, rollout=rollout)
      results.append(r)
      head = f"{rollout} k={lag} {variant:10s} seed {seed}"
      if "error" in r:
        print(f"{head}: ERROR {r['error']}\n{r.get('tail', '')}", flush=True)
        continue
      print(f"{head}: final {r['final_accuracy']:.3f} best {r['best_accuracy']:.3f} "
            f"to {a.target}: {r['steps_to_target']} steps  U_k {r['drift_tv'] or 0:.4f} "
            f"S_k {r['staleness_tv'] or 0:.4f} ESS {r['ess_rate'] or 0:.3f} collapsed {r['collapsed']} "
            f"({r['wall_s']:.0f} s)", flush=True)
  ok = [r for r in results if "error" not in r and r["rollout"] == "simulated"]
  if a.plot and ok:
    plot(ok, a.plot)
  summary = {"benchmark": "staleness", "steps": a.steps, "target": a.target, "lags": lags, "seeds": seeds,
             "variants": variants, "results": results, "load_average_start": start,
             "load_average_end": load_average(), "wall_s": time.perf_counter() - t0}
  emit(summary)
  return summary


if __name__ == "__main__":
  main()
