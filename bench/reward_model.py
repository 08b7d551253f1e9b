"""Reward model on the built-in preference task, then PPO whose only reward is that model.

Two runs, in this process, with the shipped configs (no download, CPU):

1. ``configs/rm_addition.py``: the addition decoder with a reward head, an SFT warm
   start, then Bradley-Terry training on the built-in addition pairs (the correct sum
   preferred to a wrong or zero-padded one). Reported: held-out pairwise accuracy
   before and after reward training, per kind of wrong answer, and the mean margin.
2. ``configs/ppo_rm_addition.py``: PPO + GAE from the policy's SFT warm start, critic
   initialised from the reward model (trunk and head) with a critic warm-up (actor
   frozen), reward = the reward model's score only (running z-score, clipped), with a
   token-level KL penalty against the warm start. The task's verifier never enters the
   reward; it measures held-out greedy accuracy (256 held-out problems) at the start,
   every ``eval.every`` steps and at the end.

Usage (from the repository root)::

  python -m bench.reward_model                         # the shipped settings
  python -m bench.reward_model --rm-steps 50 --rl-steps 10 --sft-steps 100   # quick check

Run folders: ``<root>/rm`` and ``<root>/ppo`` (default root ``runs/bench_reward_model``,
removed first unless ``--keep``). The last line printed is one JSON object with every
figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Optional, Sequence

from bench.common import finish, load_average


def _accuracy_curve(metrics_path: str) -> dict[int, float]:
  out = {}
  with open(metrics_path) as f:
    for line in f:
      r = json.loads(line)
      if "eval/accuracy" in r and r["step"] >= 0:
        out[int(r["step"])] = float(r["eval/accuracy"])
  return out


def _mean_of(metrics_path: str, key: str) -> Optional[float]:
  values = []
  with open(metrics_path) as f:
    for line in f:
      r = json.loads(line)
      if isinstance(r.get(key), (int, float)):
        values.append(float(r[key]))
  return sum(values) / len(values) if values else None


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--root", default="runs/bench_reward_model", help="parent of the two run folders")
  p.add_argument("--keep", action="store_true", help="resume existing run folders instead of starting over")
  p.add_argument("--sft-steps", type=int, default=None, help="SFT warm-start steps of both runs (config default)")
  p.add_argument("--rm-steps", type=int, default=None, help="reward-model steps (config default)")
  p.add_argument("--rl-steps", type=int, default=None, help="PPO steps (config default)")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args(argv)

  from configs import ppo_rm_addition, rm_addition
  from jaxrl_llm import jobs

  t_start, load_start = time.perf_counter(), load_average()
  root = os.path.abspath(a.root)
  if not a.keep and os.path.isdir(root):
    shutil.rmtree(root)

  rm = rm_addition.get_config()
  rm.run_dir, rm.seed, rm.log.progress = os.path.join(root, "rm"), a.seed, False
  if a.sft_steps is not None:
    rm.sft.steps = a.sft_steps
  if a.rm_steps is not None:
    rm.reward_model.steps = a.rm_steps
  t0 = time.perf_counter()
  rm_summary = jobs.run(rm)
  rm_seconds = time.perf_counter() - t0
  export = rm_summary["outputs"]["hf_export"]
  print(f"reward model: held-out pairwise accuracy {rm_summary['initial_pairwise_accuracy']:.3f} -> "
        f"{rm_summary['heldout_pairwise_accuracy']:.3f} ({rm_summary['heldout_pairs']} pairs; by kind "
        + ", ".join(f"{k} {v:.3f}" for k, v in sorted(rm_summary["heldout_accuracy_by_kind"].items()))
        + f"), mean margin {rm_summary['heldout_mean_margin']:.2f}, {rm_seconds:.0f} s", flush=True)

  ppo = ppo_rm_addition.get_config()
  ppo.run_dir, ppo.seed, ppo.log.progress = os.path.join(root, "ppo"), a.seed, False
  ppo.reward_model.path = export
  ppo.critic.init_from = export
  if a.rl_steps is not None:
    ppo.rl.steps = a.rl_steps
  t0 = time.perf_counter()
  rl_summary = jobs.run(ppo)
  rl_seconds = time.perf_counter() - t0
  metrics = rl_summary["outputs"]["metrics"]
  curve = _accuracy_curve(metrics)
  print(f"PPO with the learned reward only: held-out greedy accuracy {rl_summary['warm_start_accuracy']:.3f} "
        f"(warm start) -> {rl_summary['final_accuracy']:.3f} after {rl_summary['rl_steps']} steps; curve "
        + ", ".join(f"{s}: {v:.3f}" for s, v in sorted(curve.items())) + f"; {rl_seconds:.0f} s", flush=True)

  result = {
      "rm_heldout_pairwise_accuracy": rm_summary["heldout_pairwise_accuracy"],
      "rm_initial_pairwise_accuracy": rm_summary["initial_pairwise_accuracy"],
      "rm_heldout_accuracy_by_kind": rm_summary["heldout_accuracy_by_kind"],
      "rm_heldout_mean_margin": rm_summary["heldout_mean_margin"],
      "rm_heldout_pairs": rm_summary["heldout_pairs"],
      "rm_sft_steps": rm_summary["sft_steps"], "rm_steps": rm_summary["rm_steps"], "rm_seconds": rm_seconds,
      "rl_start_accuracy": rl_summary["warm_start_accuracy"],
      "rl_final_accuracy": rl_summary["final_accuracy"],
      "rl_accuracy_curve": {str(k): v for k, v in sorted(curve.items())},
      "rl_best_accuracy": max(curve.values()) if curve else None,
      "rl_steps": rl_summary["rl_steps"], "rl_seconds": rl_seconds,
      "rl_mean_rm_rule_corr": _mean_of(metrics, "reward/rm_rule_corr"),
      "rl_mean_rm_pair_agreement": _mean_of(metrics, "reward/rm_rule_pair_agreement"),
      "rl_reward_is_rm_only": ppo.reward_model.rule_weight == 0.0,
      "improved": rl_summary["final_accuracy"] > (rl_summary["warm_start_accuracy"] or 0.0),
  }
  return finish(result, load_start, t_start)


if __name__ == "__main__":
  main()
