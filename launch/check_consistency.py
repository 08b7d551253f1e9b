"""``jaxrl-check-consistency``: sampler-vs-learner log-probability check on a checkpoint.

Loads the run of ``--config`` (its latest checkpoint in ``--run_dir`` when one
exists, else the freshly initialised model), samples a batch of training
prompts with the chosen sampler and compares the learner's recomputed
log-probabilities with the sampler's recorded ones: ratio mean, quantiles,
max, k1/k3 KL, share outside [0.8, 1.25], effective sample rate. Exit status 1
when a threshold (``config.diagnostics.*``) is crossed.

  python launch/check_consistency.py --config=configs/grpo_addition.py --run_dir=runs/grpo_addition
  python launch/check_consistency.py --run_dir=runs/x --sampler=actor --prompts=64
  python launch/check_consistency.py --config.model.batch_invariant=true   # expect ratios exactly 1

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags, logging
from ml_collections import config_flags

import configs
from launch import cli

_DEFAULT = os.path.join(os.path.dirname(configs.__file__), "grpo_addition.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Path to a configs/*.py file.", lock_config=False,
                                          accept_new_attributes=True)  # as launch/train.py
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Run folder whose checkpoint to load (overrides config.run_dir).")
_SAMPLER = flags.DEFINE_enum("sampler", "jax", ["jax", "actor"],
                             "jax: the in-process sampler; actor: a Ray sampler actor as in the pipeline.")
_PROMPTS = flags.DEFINE_integer("prompts", 32, "Prompts to sample (x rl.samples_per_prompt rows).")


def main(argv):
  del argv
  from jaxrl_llm import configuration
  from jaxrl_llm import jobs
  from jaxrl_llm.jobs import consistency
  config = cli.load_config(_CONFIG)
  if _RUN_DIR.value:
    config.run_dir = _RUN_DIR.value
  config.log.progress = False
  logging.set_verbosity(logging.WARNING)
  with cli.user_errors():
    configuration.validate(config)
    run = jobs.RLJob(config)
  report = consistency.check(run, num_prompts=_PROMPTS.value, sampler=_SAMPLER.value)
  print(f"consistency check: {report['rows']} rows, {report['tokens']} response tokens, "
        f"policy version {report['policy_version']}, sampler {report['sampler']}")
  for key, value in sorted(report["stats"].items()):
    print(f"  {key:32s} {value:.6g}")
  for msg in report["alerts"]:
    print(f"ALERT: {msg}")
  print("OK: sampler and learner agree" if not report["alerts"] else "FAILED: see the alerts above")
  print(json.dumps({**report, "stats": {k: float(v) for k, v in report["stats"].items()}}))
  run.close()
  sys.exit(1 if report["alerts"] else 0)


def run():
  """Console-script entry point."""
  cli.run(main)


if __name__ == "__main__":
  run()
