"""``jaxrl-eval``: a run's checkpoint, step folder and HF export reproduce the run's own held-out figures;
the unbiased pass@k against brute-force enumeration; the intervals' coverage; --data; a bad --source.

One tiny run (module fixture: 20 SFT steps, 2 RL steps, 16 held-out prompts, checkpoints only at the phase
ends) is evaluated several ways; every figure of the run is compared exactly (==), not within a tolerance.
"""

import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from jaxrl_llm import jobs
from jaxrl_llm.diagnostics import estimates
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.jobs import eval_command
from jaxrl_llm.jobs.eval_command import EvalRequest

from tiny_configs import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  folder = tmp_path_factory.mktemp("eval_run")
  job = jobs.RLJob(tiny_config(folder, sft__steps=20, sft__lr=2e-2, sft__batch_size=16, task__eval_size=16,
                               checkpoint__every=1000))
  summary = job.train()
  _, greedy = job.evaluator.greedy(job.eval_set.examples)  # the trained policy's own answers, in this process
  records = [json.loads(line) for line in open(folder / "metrics.jsonl")]
  last = [r for r in records if "eval/accuracy" in r][-1]
  return {"dir": str(folder), "summary": summary, "last": last, "greedy": greedy,
          "step": job.progress.sft_step + job.progress.step}


def _rows(path):
  return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("where", ["run", "step"])
def test_checkpoint_reproduces_the_runs_final_evaluation_exactly(run, where):
  source = run["dir"] if where == "run" else os.path.join(run["dir"], "checkpoints", str(run["step"]))
  figures = eval_command.evaluate(EvalRequest(source=source, ks=(1, 2), samples=2, progress=False))
  s, last = run["summary"], run["last"]
  assert figures["kind"] == ("run" if where == "run" else "checkpoint")
  assert figures["checkpoint_step"] == figures["sampling_step"] == run["step"]
  assert figures["examples"] == 16
  assert figures["accuracy"] == s["final_accuracy"] == last["eval/accuracy"]
  assert figures["pass@2"] == s["final_pass@2"] == last["eval/pass@2"]  # n = k = eval.pass_k
  assert figures["sample_accuracy"] == last["eval/sample_accuracy"] == figures["pass@1"]
  rows = _rows(figures["output"])
  assert figures["output"] == os.path.join(run["dir"], "eval", f"addition_step{run['step']}.jsonl")
  assert [r["greedy"] for r in rows] == run["greedy"]  # the very answers of the trained policy
  assert np.mean([r["correct"] for r in rows]) == figures["accuracy"]
  assert all(len(r["samples"]) == 2 and r["pass@k"]["2"] == float(any(r["samples_correct"])) for r in rows)
  lo, hi = figures["accuracy_ci95"]
  assert lo <= figures["accuracy"] <= hi


def test_hf_export_gives_the_same_greedy_accuracy(run):
  figures = eval_command.evaluate(EvalRequest(source=os.path.join(run["dir"], "hf_export"), ks=(), progress=False))
  assert figures["kind"] == "hf" and figures["samples_per_example"] == 0
  assert figures["accuracy"] == run["summary"]["final_accuracy"]
  assert [r["greedy"] for r in _rows(figures["output"])] == run["greedy"]


def test_data_file_with_field_mapping_writes_every_example(run, tmp_path):
  data = tmp_path / "sums.jsonl"
  data.write_text("".join(json.dumps({"q": f"{a}+{b}", "sum": a + b}) + "\n" for a in range(3) for b in range(2)))
  out = tmp_path / "answers.jsonl"
  figures = eval_command.evaluate(EvalRequest(
      source=run["dir"], data=str(data), limit=5, ks=(1, 2), samples=3, batch_size=2, output=str(out),
      fields={"prompt_field": "q", "answer_field": "sum", "prompt_template": "{prompt}=", "verifier": "exact"},
      progress=False))
  rows = _rows(out)
  assert figures["examples"] == len(rows) == 5 and figures["samples_per_example"] == 3
  assert [r["prompt"] for r in rows] == ["0+0=", "0+1=", "1+0=", "1+1=", "2+0="]
  assert [r["answer"] for r in rows] == ["0", "1", "1", "2", "2"]
  assert [r["correct"] for r in rows] == [r["greedy"].strip() == r["answer"] for r in rows]
  for r in rows:
    assert r["samples_correct"] == [t.strip() == r["answer"] for t in r["samples"]]
    assert r["pass@k"]["2"] == estimates.pass_at_k(3, sum(r["samples_correct"]), 2)
  assert figures["pass@1"] == pytest.approx(np.mean([np.mean(r["samples_correct"]) for r in rows]), abs=1e-12)


def test_unbiased_pass_at_k_equals_brute_force_enumeration():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
        brute = np.float64(sum(any(i < c for i in s) for s in subsets)) / np.float64(len(subsets))
        assert abs(estimates.pass_at_k(n, c, k) - brute) < 1e-12, (n, c, k)
  # large n: the product form stays finite and exact where C(n, k) overflows float64
  exact = 1 - Fraction(math.comb(997, 300), math.comb(1000, 300))
  assert estimates.pass_at_k(1000, 3, 300) == pytest.approx(float(exact), rel=1e-12)
  hits = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(estimates.pass_at_k_per_problem(hits, 4), hits.any(1))  # n = k: any correct
  with pytest.raises(ValueError, match="expected 1 <= k <= n"):
    estimates.pass_at_k(4, 1, 8)


def test_intervals_cover_the_true_value():
  rng = np.random.default_rng(0)
  # Wilson: the greedy accuracy of 100 problems each solved with probability 0.3
  lo, hi = estimates.wilson_interval(int((rng.random(100) < 0.3).sum()), 100)
  assert lo < 0.3 < hi
  wilson = [estimates.wilson_interval(int((rng.random(100) < 0.3).sum()), 100) for _ in range(400)]
  assert 0.9 <= np.mean([lo < 0.3 < hi for lo, hi in wilson]) <= 0.99
  assert estimates.wilson_interval(0, 20)[0] == 0.0 < estimates.wilson_interval(0, 20)[1]  # not a point at 0
  # pass@k: problems with solve rates p ~ Beta(2, 3), n = 8 samples each; true pass@4 = 1 - E[(1-p)^4]
  a, b, k, n = 2.0, 3.0, 4, 8
  log_beta = lambda x, y: math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)  # noqa: E731
  truth = 1 - math.exp(log_beta(a, b + k) - log_beta(a, b))
  covered = []
  for _ in range(300):
    p = rng.beta(a, b, size=200)
    hits = rng.random((200, n)) < p[:, None]
    lo, hi = estimates.mean_interval(estimates.pass_at_k_per_problem(hits, k))
    covered.append(lo < truth < hi)
  assert covered[0] and 0.9 <= np.mean(covered) <= 0.99


def test_a_bad_source_is_a_usage_error_naming_it(tmp_path):
  (tmp_path / "notes.txt").write_text("not a model")
  with pytest.raises(ConfigError, match=r"holds: notes.txt\). Expected a run folder"):
    eval_command.detect_source(str(tmp_path))
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(ConfigError, match="a run folder without a checkpoint"):
    eval_command.detect_source(str(tmp_path))
  missing = tmp_path / "no_such_run"
  proc = subprocess.run([sys.executable, "-m", "launch.evaluate", f"--source={missing}"], cwd=ROOT,
                        env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert f"--source={missing}: no such file or folder. Expected a run folder" in proc.stderr
  assert "Traceback" not in proc.stderr
