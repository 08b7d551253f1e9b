"""The preference-optimisation job (job='dpo') on a tiny model: an end-to-end run on JSONL pairs (identical
pairs skipped and counted), the held-out preferred rate rising, the loss falling on a fixed batch, a resume
that continues exactly as the uninterrupted run, and config errors naming the field.

All runs share one shape of everything (model, 16-pair batches of width 16), so the step compiles once."""

import json
import os

import jax
import numpy as np
import pytest

from jaxrl_llm import configuration as C
from jaxrl_llm.jobs import JOBS, PreferenceOptimizationJob
from jaxrl_llm.reward_model import preferences as P
from jaxrl_llm.tasks import AdditionTask

from tiny_configs import tiny_config

STEPS = 24


def tiny_dpo_config(run_dir, **overrides):
  """A DPO run on JSONL pairs (one device, no warm start, evaluation at the middle and the end)."""
  base = dict(job="dpo", sft__steps=0, dpo__steps=STEPS, dpo__batch_size=16, dpo__lr=1e-2, dpo__beta=0.1,
              reward_model__eval_fraction=0.3, learner__mesh__data=1, task__eval_size=8, eval__every=STEPS // 2,
              eval__pass_k=1, rl__max_new_tokens=3, reward__mode="inline", checkpoint__every=1000,
              log__tensorboard=False, export__hf=False)
  return tiny_config(run_dir, **dict(base, **overrides))


def _records(path):
  skip = ("time",)  # the wall clock and timings
  return [{k: v for k, v in json.loads(line).items() if not k.startswith(skip)} for line in open(path)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("dpo")
  # pairs whose rejected answer has a digit changed or dropped: the untrained policy prefers the shorter one
  data = P.TaskPreferences(AdditionTask(max_digits=1, eval_fraction=0.3), seed=0, eval_prompts=4, eval_pairs=4,
                           kinds=["drop_digit", "wrong_digit"])
  rows = [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected}
          for p in (data.train_pair(i) for i in range(160))]
  rows.append({"prompt": "1+1=", "chosen": "2", "rejected": " 2 "})  # no preference: skipped and counted
  path = root / "prefs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = dict(reward_model__data=str(path))
  straight = PreferenceOptimizationJob(tiny_dpo_config(root / "a", **common))
  summary = straight.train()
  first = PreferenceOptimizationJob(tiny_dpo_config(root / "b", **dict(common, dpo__steps=STEPS // 2)))
  first.train()
  resumed = PreferenceOptimizationJob(tiny_dpo_config(root / "b", **common))
  return {"root": root, "straight": straight, "summary": summary, "resumed": resumed}


def test_dpo_runs_end_to_end_and_raises_the_held_out_preferred_rate(runs):
  s, root = runs["summary"], runs["root"]
  assert JOBS["dpo"] is PreferenceOptimizationJob
  assert s["job"] == "dpo" and s["loss"] == "dpo" and s["dpo_steps"] == STEPS and s["sft_steps"] == 0
  assert s["pairs_seen"] == STEPS * 16
  assert s["data"]["identical_skipped"] == 1 and s["data"]["rows"] == 161
  assert s["data"]["train_pairs"] + s["data"]["eval_pairs"] == 160
  assert s["heldout_pairs"] == s["data"]["eval_pairs"]
  # the preferred rate: measured before and after, and risen on held-out prompts
  assert s["initial_preferred_rate"] < 0.5 and s["heldout_preferred_rate"] > s["initial_preferred_rate"] + 0.2, s
  assert s["heldout_reward_accuracy"] > 0.6 and s["heldout_loss"] < s["initial_loss"], s
  np.testing.assert_allclose(s["initial_loss"], np.log(2.0), rtol=1e-5)  # the policy is its own reference
  for key in ("initial_greedy_accuracy", "heldout_greedy_accuracy"):
    assert 0.0 <= s[key] <= 1.0
  for name in ("metrics.jsonl", "curves.png", "summary.json"):
    assert os.path.isfile(root / "a" / name), name
  records = _records(root / "a" / "metrics.jsonl")
  assert [r["step"] for r in records if "eval/preferred_rate" in r] == [0, STEPS // 2, STEPS]
  assert all("eval/accuracy" in r for r in records if "eval/preferred_rate" in r)
  assert sum("dpo/loss" in r for r in records) == STEPS


def test_the_loss_falls_on_a_fixed_batch(runs):
  job = runs["straight"]
  batch = job.eval_batches[0][0]  # same shape as a training batch: no new compilation
  state, losses = job.state, []
  for _ in range(6):
    state, m = job.dpo_step(state, batch)
    losses.append(float(m["dpo/loss"]))
    assert float(m["update/skipped_nonfinite"]) == 0.0
  assert losses[-1] < losses[0] - 0.05, losses
  assert float(m["dpo/reward_accuracy"]) >= 0.5 and float(m["dpo/pairs"]) == float(np.asarray(batch.valid_b).sum())


def test_resume_continues_exactly_as_the_uninterrupted_run(runs):
  root, straight, resumed = runs["root"], runs["straight"], runs["resumed"]
  assert resumed.progress.step == STEPS // 2 and resumed.pairs.position == 16 * (STEPS // 2)
  assert resumed.state.ref_params is not None  # the reference came back from the checkpoint
  summary = resumed.train()
  assert resumed.progress.step == STEPS
  for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert _records(root / "a" / "metrics.jsonl") == _records(root / "b" / "metrics.jsonl")
  assert summary["heldout_preferred_rate"] == runs["summary"]["heldout_preferred_rate"]


def test_config_errors_name_the_field(tmp_path):
  with pytest.raises(C.ConfigError, match=r"dpo.loss='kto': expected one of \('dpo', 'ipo', 'simpo'\)"):
    C.validate(tiny_dpo_config(tmp_path, dpo__loss="kto"))
  with pytest.raises(C.ConfigError, match="learner.micro_batches=3: expected a divisor of dpo.batch_size=16"):
    C.validate(tiny_dpo_config(tmp_path, learner__micro_batches=3, rl__prompts_per_step=3, rl__samples_per_prompt=1))
  with pytest.raises(C.ConfigError, match=r"dpo.label_smoothing=0.1 with dpo.loss='simpo': expected 0"):
    C.validate(tiny_dpo_config(tmp_path, dpo__loss="simpo", dpo__label_smoothing=0.1))
  with pytest.raises(C.ConfigError, match="dpo.beta=0.0: expected a finite number > 0"):
    C.validate(tiny_dpo_config(tmp_path, dpo__beta=0))
  C.validate(tiny_dpo_config(tmp_path, dpo__loss="ipo"))


def test_nll_term_adds_the_chosen_per_token_nll():
  """RPO (dpo.nll_coef): the loss is the DPO loss plus coef x the chosen response's per-token NLL."""
  from jaxrl_llm.jobs.preference_optimization import PreferenceLoss
  logps = (np.array([-3.0, -8.0], np.float32), np.array([-5.0, -6.0], np.float32),
           np.array([3.0, 4.0], np.float32), np.array([3.0, 4.0], np.float32))
  refs = (np.array([-4.0, -7.0], np.float32), np.array([-4.0, -7.0], np.float32))
  plain, chosen, rejected = PreferenceLoss("dpo", beta=0.5)(logps, refs)
  with_nll, chosen2, rejected2 = PreferenceLoss("dpo", beta=0.5, nll_coef=0.25)(logps, refs)
  np.testing.assert_allclose(np.asarray(with_nll) - np.asarray(plain), 0.25 * np.array([1.0, 2.0]), rtol=1e-6)
  np.testing.assert_array_equal(chosen, chosen2)  # the implicit rewards do not change
