"""Reward-model runs on a tiny model: held-out pairwise accuracy well above chance on the built-in
pairs, every output (HF export with the reward head in the side file), resume, JSONL data."""

import json
import os

import jax
import numpy as np
import pytest

from jaxrl_llm import configuration as C
from jaxrl_llm.learner import mesh as mesh_lib
from jaxrl_llm.jobs import RewardModelJob
from jaxrl_llm.tasks import AdditionTask
from jaxrl_llm.reward_model import preferences as P, scorer as S, step as T

from tiny_configs import tiny_rm_config


def test_reward_model_learns_the_builtin_pairs_and_writes_every_output(tmp_path):
  run = RewardModelJob(tiny_rm_config(tmp_path, sft__steps=2, sft__batch_size=8))
  summary = run.train()
  assert summary["initial_pairwise_accuracy"] is not None
  assert summary["heldout_pairwise_accuracy"] >= 0.85, summary
  assert summary["heldout_pairwise_accuracy"] > summary["initial_pairwise_accuracy"] + 0.2
  assert summary["heldout_mean_margin"] > 0
  assert set(summary["heldout_accuracy_by_kind"]) == {"padded", "extra_digit"}
  assert summary["heldout_pairs"] == 64 and summary["rm_steps"] == 40 and summary["sft_steps"] == 2
  assert summary["pairs_seen"] == 40 * 32
  for name in ("metrics.jsonl", "curves.png", "summary.json"):
    assert os.path.isfile(tmp_path / name), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  assert any("rm/loss" in r for r in records) and any("sft/loss" in r for r in records)
  assert [r["step"] for r in records if "eval/pairwise_accuracy" in r] == [0, 20, 40]
  export = summary["outputs"]["hf_export"]
  assert os.path.isfile(os.path.join(export, "jaxrl_llm_extra", "heads.safetensors"))
  # the export, loaded as an RL reward, gives the trained model's scores
  scorer = S.RewardModelScorer(export, mesh_lib.make_mesh({"data": -1}), policy_tokenizer=run.tokenizer)
  batch, kinds = run.eval_batches[0]
  chosen, _ = run.scores(run.params, batch)
  loaded = scorer.score_tokens(np.asarray(batch.chosen_bt), np.asarray(batch.chosen_mask_bt))
  np.testing.assert_allclose(loaded[:len(kinds)], np.asarray(chosen)[:len(kinds)], rtol=1e-5, atol=1e-5)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_is_bit_for_bit_and_jsonl_data(tmp_path):
  rows = []
  data = P.TaskPreferences(AdditionTask(max_digits=1, eval_fraction=0.3), seed=0, eval_prompts=4, eval_pairs=4,
                               kinds=["padded", "extra_digit"])
  for i in range(120):
    p = data.train_pair(i)
    rows.append({"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected, "margin": 0.5})
  rows.append({"prompt": "1+1=", "chosen": "2", "rejected": "2"})
  path = tmp_path / "prefs.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = dict(reward_model__data=str(path), reward_model__eval_fraction=0.2, reward_model__batch_size=8,
                reward_model__steps=4, eval__every=2, log__tensorboard=False, export__hf=False)
  straight = RewardModelJob(tiny_rm_config(tmp_path / "a", **common))
  summary = straight.train()
  assert summary["data"]["identical_skipped"] == 1 and summary["data"]["rows"] == 121
  assert summary["data"]["train_pairs"] + summary["data"]["eval_pairs"] == 120
  first = RewardModelJob(tiny_rm_config(tmp_path / "b", **dict(common, reward_model__steps=2)))
  first.train()
  resumed = RewardModelJob(tiny_rm_config(tmp_path / "b", **common))
  assert resumed.progress.step == 2 and resumed.pairs.position == 16
  resumed.progress.phase = "rm"  # asked for more steps than the finished run had
  resumed.train()
  assert resumed.progress.step == 4
  for a, b in zip(_leaves(straight.params), _leaves(resumed.params)):
    np.testing.assert_array_equal(a, b)


def test_config_errors_name_the_field(tmp_path):
  with pytest.raises(C.ConfigError, match="learner.micro_batches=3: expected a divisor of reward_model.batch_size=32"):
    RewardModelJob(tiny_rm_config(tmp_path, learner__micro_batches=3))
  with pytest.raises(C.ConfigError, match="reward_model.normalize='zscore': expected one of"):
    C.validate(tiny_rm_config(tmp_path, job="rl", reward_model__normalize="zscore"))
  with pytest.raises(C.ConfigError, match="advantage.kl_reward_coef=0.1 with advantage.estimator='grpo'"):
    C.validate(tiny_rm_config(tmp_path, job="rl", advantage__kl_reward_coef=0.1))
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "chosen": "3"}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: preference row is missing field 'rejected'"):
    RewardModelJob(tiny_rm_config(tmp_path / "run", reward_model__data=str(bad)))


def test_rm_step_micro_batching_and_language_model_term():
  from jaxrl_llm import bridge, models
  from jaxrl_llm.learner import optim
  from jaxrl_llm.learner.state import create_train_state
  from jaxrl_llm.models.config import ModelConfig
  from jaxrl_llm.reward_model import encoding

  tok = bridge.build_char_tokenizer("+0123456789=")
  config = ModelConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                       num_kv_heads=1, max_position_embeddings=32, param_dtype="float32", dtype="float32",
                       reward_head=True, pad_token_id=tok.pad_id, eos_token_id=tok.eos_id)
  enc = encoding.PairEncoder(tok, False, 32)
  data = P.TaskPreferences(AdditionTask(max_digits=2, eval_fraction=0.3), 0, 4, 4)
  pairs = [data.train_pair(i) for i in range(6)]
  batch = encoding.collate_pairs([enc.pair(p) for p in pairs], [0.5] * 6, tok.pad_id, 8, 32)
  params = models.init_params(config, jax.random.PRNGKey(0))
  opt = optim.make_optimizer(1e-3)
  state = create_train_state(params, opt, 0)
  # two micro-batches of 4 pairs (the second half has 2 padding pairs) give the whole batch's values
  new_state, out = T.make_rm_step(config, opt, micro_batches=2, lm_coef=0.5)(state, batch)
  assert int(new_state.step) == 1 and float(out["update/skipped_nonfinite"]) == 0.0
  chosen, rejected = (np.asarray(x, np.float64)[:6] for x in T.pair_scores(params, config, batch))
  bt = np.mean(np.logaddexp(0.0, -(chosen - rejected - 0.5)))  # -log sigmoid(r_c - r_r - m)
  logp = models.sequence_logprobs(params, config, batch.chosen_bt, batch.chosen_mask_bt)
  targets = np.asarray(batch.chosen_target_mask_bt) & np.asarray(batch.valid_b)[:, None]
  lm = -np.asarray(logp)[targets].mean()
  np.testing.assert_allclose(out["rm/bt_loss"], bt, rtol=1e-5)
  np.testing.assert_allclose(out["rm/lm_loss"], lm, rtol=1e-5)
  np.testing.assert_allclose(out["rm/loss"], bt + 0.5 * lm, rtol=1e-5)
  np.testing.assert_allclose(out["rm/accuracy"], np.mean(chosen > rejected))
  assert float(out["rm/pairs"]) == 6.0
