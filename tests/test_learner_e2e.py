"""A shortened version of the main job (SFT warm start, then GRPO): held-out accuracy must rise."""

import json

import ml_collections

from jaxrl_llm import configuration as C
from jaxrl_llm.learner import loop


def test_short_main_job_raises_held_out_accuracy(tmp_path):
  c = C.base_config()
  c.name = "e2e"
  c.run_dir = str(tmp_path)
  c.task.kwargs = ml_collections.ConfigDict({"max_digits": 2, "partial_credit": 0.5})
  c.task.eval_size = 64
  c.model.max_position_embeddings = 16
  c.sft.steps = 450
  c.sft.batch_size = 64
  c.rl.steps = 10
  c.rl.prompts_per_step = 16
  c.rl.max_new_tokens = 4
  c.optimizer.lr = 3e-4
  c.eval.every = 5
  c.log.progress = False
  c.export.hf = False
  run = loop.Run(c)
  before = run.evaluate()["eval/accuracy"]
  summary = run.train()
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_evals = [r["eval/accuracy"] for r in records if r["step"] > 0 and "eval/accuracy" in r]
  assert len(rl_evals) == 2
  assert before <= 0.05
  assert summary["warm_start_accuracy"] >= before + 0.1, (before, summary)
  assert summary["final_accuracy"] >= before + 0.1, (before, summary)
