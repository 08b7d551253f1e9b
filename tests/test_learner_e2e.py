"""A shortened version of the main job (the default config, fewer RL steps): held-out accuracy must rise."""

import json
import os
import sys

from jaxrl_llm import jobs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from configs import grpo_addition  # noqa: E402


def test_short_main_job_raises_held_out_accuracy(tmp_path):
  c = grpo_addition.get_config()  # the default job: 400 SFT steps, then GRPO, 64 prompts x 8 samples
  c.run_dir = str(tmp_path)
  c.learner.mesh.data = 1  # one device, as on a real CPU (the test process has 8 virtual ones)
  c.rl.steps = 30  # of 300
  c.eval.every = 15
  c.log.progress = False
  c.export.hf = False
  summary = jobs.run(c)
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_evals = [r["eval/accuracy"] for r in records if r["step"] > 0 and "eval/accuracy" in r]
  assert len(rl_evals) == 2
  warm = summary["warm_start_accuracy"]
  # measured (2026-12-01): 0.547 after the warm start on one device; the warm start depends
  # strongly on the initialisation (0.14-0.55 over seeds and vocabulary sizes), and on an
  # 8-device mesh it lands elsewhere (0.742)
  assert 0.2 <= warm <= 0.8, summary
  assert summary["final_accuracy"] >= warm + 0.12, summary
  assert summary["skipped_updates"] == 0
