"""The reward model as the RL reward: scoring on the mesh (token and text paths), combination with
the rule reward, running z-score, clipping, reference baseline, no-EOS penalty, KL shaping, and a
whole tiny PPO run whose reward and critic come from a reward-model export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A, bridge, configuration as C, models
from jaxrl_llm import jobs
from jaxrl_llm.learner import builders, mesh as mesh_lib
from jaxrl_llm.reward_model import scorer as S, shaping
from jaxrl_llm.tasks import AdditionTask

import tiny_configs
from jaxrl_llm.types import Trajectory

ALPHABET = AdditionTask().alphabet


def tiny_config(run_dir, **overrides):
  """The shared tiny RL config with 4 samples per prompt on one device (fast); the scorer
  tests below shard over all eight."""
  defaults = dict(sft__steps=2, rl__samples_per_prompt=4, learner__mesh__data=1, log__tensorboard=False)
  return tiny_configs.tiny_config(run_dir, **{**defaults, **overrides})


@pytest.fixture(scope="module")
def rm_export(tmp_path_factory):
  """A (randomly initialised) reward model of the tiny config, exported like a reward-model run does."""
  folder = tmp_path_factory.mktemp("rm") / "hf_export"
  c = tiny_config(folder.parent)
  tok = bridge.build_char_tokenizer(ALPHABET)
  config = builders.build_model_config(c, tok, reward_head=True)
  params = models.init_params(config, jax.random.PRNGKey(3))
  bridge.export_hf_checkpoint(params, config, folder, tokenizer=tok)
  return str(folder), params, config, tok


def trajectory(tok, prompts, responses, finished, width=16):
  rows, pmask, rmask = [], [], []
  for p, r, f in zip(prompts, responses, finished):
    pid = tok.encode(p, add_special_tokens=False)
    rid = tok.encode(r, add_special_tokens=False) + ([tok.eos_id] if f else [])
    rows.append(pid + rid)
    pmask.append([True] * len(pid) + [False] * len(rid))
    rmask.append([False] * len(pid) + [True] * len(rid))
  b = len(rows)
  tokens = np.full((b, width), tok.pad_id, np.int32)
  pm, rm = np.zeros((b, width), bool), np.zeros((b, width), bool)
  for i, (row, p, r) in enumerate(zip(rows, pmask, rmask)):
    tokens[i, :len(row)], pm[i, :len(row)], rm[i, :len(row)] = row, p, r
  return Trajectory(tokens_bt=tokens, prompt_mask_bt=pm, response_mask_bt=rm, observation_mask_bt=np.zeros_like(rm), behaviour_logp_bt=np.zeros((b, width),
                    np.float32), policy_version_bt=np.zeros((b, width), np.int32), group_id_b=np.arange(b),
                    rewards_b=np.zeros(b, np.float32), finished_b=np.asarray(finished))


PROMPTS = ["3+4=", "3+4=", "9+9=", "9+9="]
RESPONSES = ["7", "8", "81", "811"]
FINISHED = [True, True, True, False]


def test_scorer_token_path_equals_text_path_and_the_model(rm_export):
  folder, params, config, tok = rm_export
  mesh = mesh_lib.make_mesh({"data": -1})
  scorer = S.RewardModelScorer(folder, mesh, policy_tokenizer=tok, chunk_rows=8)
  assert scorer.same_tokenizer
  traj = trajectory(tok, PROMPTS, RESPONSES, FINISHED)
  scores, has_eos = scorer.score_trajectory(traj, PROMPTS, RESPONSES)
  np.testing.assert_array_equal(has_eos, FINISHED)
  texts = scorer.score_texts(PROMPTS, RESPONSES, FINISHED)
  np.testing.assert_allclose(scores, texts, rtol=1e-5, atol=1e-6)
  mask = traj.prompt_mask_bt | traj.response_mask_bt
  direct = models.reward_scores(params, config, jnp.asarray(traj.tokens_bt), jnp.asarray(mask))
  np.testing.assert_allclose(scores, direct, rtol=1e-5, atol=1e-6)
  # another policy tokenizer (different ids): rows are re-encoded from their texts
  other = bridge.build_char_tokenizer(ALPHABET[::-1])
  re_encoded = S.RewardModelScorer(folder, mesh, policy_tokenizer=other)
  assert not re_encoded.same_tokenizer
  other_traj = trajectory(other, PROMPTS, RESPONSES, FINISHED)
  np.testing.assert_allclose(re_encoded.score_trajectory(other_traj, PROMPTS, RESPONSES)[0], scores, rtol=1e-5,
                             atol=1e-6)


def test_scorer_errors_name_the_field(tmp_path, rm_export):
  mesh = mesh_lib.make_mesh({"data": 1})
  with pytest.raises(FileNotFoundError, match="reward_model.path='.*nowhere': no such folder"):
    S.RewardModelScorer(str(tmp_path / "nowhere"), mesh)
  folder, params, config, tok = rm_export
  policy_export = tmp_path / "policy"
  bridge.export_hf_checkpoint({k: v for k, v in params.items() if k != "reward_head"},
                              config.replace(reward_head=False), policy_export, tokenizer=tok)
  with pytest.raises(ValueError, match="no reward head in jaxrl_llm_extra/heads.safetensors"):
    S.RewardModelScorer(str(policy_export), mesh)


class FakeScorer:
  """Returns preset scores: rows by response text."""

  def __init__(self, table):
    self.table = table

  def score_trajectory(self, trajectory, prompts, responses):
    return np.array([self.table[r] for r in responses], np.float32), np.asarray(trajectory.finished_b, bool)

  def score_texts(self, prompts, responses, finished):
    return np.array([self.table[r] for r in responses], np.float32)


def rm_section(**fields):
  c = C.base_config().reward_model
  c.unlock()
  c.update(fields)
  return c


def test_combination_normalisation_clip_baseline_by_hand():
  table = {"7": 2.0, "8": -1.0, "18": 4.0, "81": 0.5, "811": 3.0}
  task = AdditionTask(max_digits=2, reverse_answer=True)
  examples = [task.make_example(3, 4), task.make_example(9, 9)]  # gold answers "7" and "81"
  responses = ["7", "8", "81", "811"]
  pairs = [(examples[i // 2], r) for i, r in enumerate(responses)]
  traj = trajectory(bridge.build_char_tokenizer(ALPHABET), PROMPTS, responses, FINISHED)
  rule = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
  rewards = S.SequenceRewards(rm_section(rm_weight=0.5, rule_weight=2.0, normalize="running", clip=1.0,
                                         baseline="answer", no_eos_penalty=0.25), FakeScorer(table), task)
  # raw 2, -1, 0.5, 3; the last row has no EOS: 3 - 0.25; baseline: minus the gold answer's score per prompt
  s1 = np.array([2.0, -1.0, 0.5, 2.75]) - np.array([2.0, 2.0, 0.5, 0.5])
  out1, metrics = rewards(examples, pairs, traj, rule)
  z1 = (s1 - s1.mean()) / (s1.std() + 1e-8)
  np.testing.assert_allclose(out1, 0.5 * np.clip(z1, -1, 1) + 2.0 * rule, rtol=1e-5)
  assert metrics["reward/rule_mean"] == 0.5 and metrics["reward/no_eos_share"] == 0.25
  np.testing.assert_allclose(metrics["reward/rm_raw_mean"], np.mean([2.0, -1.0, 0.5, 3.0]))
  np.testing.assert_allclose(metrics["reward/rm_baseline_mean"], 1.25)
  # a second batch is normalised with the moments of both batches (running z-score)
  out2, _ = rewards(examples, pairs, traj, rule)
  both = np.concatenate([s1, s1])
  np.testing.assert_allclose(out2, 0.5 * np.clip((s1 - both.mean()) / (both.std() + 1e-8), -1, 1) + 2.0 * rule,
                             rtol=1e-5)
  assert rewards.get_state()["count"] == 8
  # the state round-trips through JSON: a restored combiner continues bit for bit
  restored = S.SequenceRewards(rm_section(rm_weight=0.5, rule_weight=2.0, normalize="running", clip=1.0,
                                          baseline="answer", no_eos_penalty=0.25), FakeScorer(table), task)
  restored.set_state(json.loads(json.dumps(rewards.get_state())))
  np.testing.assert_array_equal(restored(examples, pairs, traj, rule)[0], rewards(examples, pairs, traj, rule)[0])
  # plain RM reward: the raw scores, nothing else
  plain, _ = S.SequenceRewards(rm_section(), FakeScorer(table), task)(examples, pairs, traj, rule)
  np.testing.assert_array_equal(plain, [2.0, -1.0, 0.5, 3.0])


def test_greedy_baseline_uses_the_policy_answers():
  table = {"7": 2.0, "8": -1.0, "81": 0.5, "811": 3.0, "1": 10.0}
  task = AdditionTask(max_digits=2, reverse_answer=True)
  examples = [task.make_example(3, 4), task.make_example(9, 9)]
  tok = bridge.build_char_tokenizer(ALPHABET)
  greedy = lambda exs: (trajectory(tok, [e.prompt for e in exs], ["8", "1"], [True, True]), ["8", "1"])
  rewards = S.SequenceRewards(rm_section(baseline="greedy"), FakeScorer(table), task, greedy)
  pairs = [(examples[i // 2], r) for i, r in enumerate(RESPONSES)]
  out, _ = rewards(examples, pairs, trajectory(tok, PROMPTS, RESPONSES, FINISHED), np.zeros(4))
  np.testing.assert_array_equal(out, [2.0 + 1.0, -1.0 + 1.0, 0.5 - 10.0, 3.0 - 10.0])
  with pytest.raises(ValueError, match="baseline='greedy' needs"):
    S.SequenceRewards(rm_section(baseline="greedy"), FakeScorer(table), task)


def test_kl_shaper_fixed_and_adaptive():
  mask = jnp.array([[0, 1, 1, 1], [0, 0, 1, 1]], bool)
  logp = jnp.array([[0, -1.0, -2.0, -0.5], [0, 0, -1.0, -1.0]])
  ref = jnp.array([[0, -1.5, -1.0, -0.5], [0, 0, -2.0, -0.5]])
  r = jnp.array([1.0, -1.0])
  fixed = shaping.KLRewardShaper(0.1)
  out, coef, m = fixed(r, logp, ref, mask)
  expected, kl = A.kl_penalized_rewards(r, logp, ref, mask, 0.1)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  assert coef == pytest.approx(0.1) and m["kl_reward/coef"] == pytest.approx(0.1)
  np.testing.assert_allclose(m["kl_reward/sequence_kl"], float(A.mean_sequence_kl(kl, mask)), rtol=1e-6)
  # adaptive: KL above target raises beta by error * n / horizon, error clipped to 0.2
  adaptive = shaping.KLRewardShaper(0.1, target=0.01, horizon=10.0)
  _, coef, m = adaptive(r, logp, logp - 0.5, mask, 0.1)  # KL 0.5 per token: 1.5 and 1.0 nats per sequence
  assert m["kl_reward/sequence_kl"] == pytest.approx(1.25)
  assert coef == pytest.approx(0.1 * (1 + 0.2 * 2 / 10.0), rel=1e-6)
  _, lower, _ = adaptive(r, logp, logp, mask, coef)  # KL 0 < target: beta shrinks by 0.2 * 2 / 10
  assert lower == pytest.approx(coef * (1 - 0.2 * 2 / 10.0), rel=1e-6)
  assert shaping.build_kl_shaper(C.base_config()) is None


def test_critic_init_from_a_reward_model_export_is_its_trunk_and_head(rm_export):
  folder, params, config, tok = rm_export
  c = tiny_config("/tmp/unused")
  mesh = mesh_lib.make_mesh({"data": -1})
  critic_config = builders.build_model_config(c, tok).replace(value_head=True)
  critic = builders.build_params(c, critic_config, mesh, seed=1, hf_folder=folder)
  assert set(critic) == set(params) - {"reward_head"} | {"value_head"}
  for key in set(params) - {"reward_head"}:
    for a, b in zip(jax.tree.leaves(critic[key]), jax.tree.leaves(params[key])):
      np.testing.assert_array_equal(a, b)
  for name in ("kernel", "bias"):
    np.testing.assert_array_equal(critic["value_head"][name], params["reward_head"][name])
  # a folder without heads (a policy export): trunk imported, value head fresh
  policy = os.path.join(os.path.dirname(folder), "policy")
  bridge.export_hf_checkpoint({k: v for k, v in params.items() if k != "reward_head"},
                              config.replace(reward_head=False), policy, tokenizer=tok)
  fresh = builders.build_params(c, critic_config, mesh, seed=1, hf_folder=policy)
  assert fresh["value_head"]["kernel"].shape == (32, 1) and float(jnp.abs(fresh["value_head"]["bias"]).max()) == 0
  np.testing.assert_array_equal(fresh["embed"]["embedding"], params["embed"]["embedding"])


def test_ppo_run_scores_with_the_reward_model_and_keeps_its_state(tmp_path, rm_export):
  """The RL job's data path (collect -> score -> KL shaping -> GAE advantages) with a
  reward-model reward and a critic from the reward model; the update step itself is the
  unchanged RL step (covered by the learner tests), so it is not compiled here."""
  folder, params, _, _ = rm_export
  c = tiny_config(tmp_path / "run", objective__recipe="ppo", advantage__estimator="gae", critic__enabled=True,
                  critic__init_from=folder, sft__steps=0, reward_model__path=folder,
                  reward_model__normalize="running", reward_model__baseline="greedy", reward_model__clip=3.0,
                  reward_model__no_eos_penalty=1.0, advantage__kl_reward_coef=0.05,
                  advantage__kl_reward_target=1.0, advantage__kl_reward_horizon=100.0)
  run = jobs.RLJob(c)
  critic = run.state.train.critic_params
  np.testing.assert_array_equal(critic["value_head"]["kernel"], params["reward_head"]["kernel"])
  np.testing.assert_array_equal(critic["embed"]["embedding"], params["embed"]["embedding"])
  assert run.uses_ref  # the KL penalty in the reward needs the frozen warm start
  run.state = run.state.replace(ref_params=run.state.train.params)  # as train() does after the warm start
  source = run.start_source()
  batch, m1 = run.prepare(source.collect(0))
  assert np.isfinite(np.asarray(batch.advantages_bt)).all() and np.isfinite(np.asarray(batch.returns_bt)).all()
  for key in ("reward/rm_mean", "reward/rm_raw_mean", "reward/rm_baseline_mean", "reward/rule_mean",
              "reward/rm_running_mean", "kl_reward/coef", "kl_reward/sequence_kl"):
    assert key in m1, key
  assert abs(m1["reward/rm_mean"]) <= 3.0
  assert m1["reward/mean"] == pytest.approx(m1["reward/rm_mean"], abs=1e-5)  # rm_weight 1, rule_weight 0
  # the policy is its own reference here, so the KL is ~0 < target: beta shrinks by 0.2 * B / horizon
  assert m1["kl_reward/coef"] == pytest.approx(0.05) and abs(m1["kl_reward/sequence_kl"]) < 1e-4
  assert run.kl_coef == pytest.approx(0.05 * (1 - 0.2 * 8 / 100), rel=1e-5)
  _, m2 = run.prepare(source.collect(1))
  assert m2["kl_reward/coef"] == pytest.approx(run.kl_coef / (1 - 0.2 * 8 / 100), rel=1e-5)
  reward_state = run.score.get_state()["reward_model"]
  assert reward_state["count"] == 2 * 8
  # the checkpointed progress (JSON) carries both, so a resumed run continues with them
  run.progress.phase = "rl"
  run.save(force=True)
  run.close()
  resumed = jobs.RLJob(c)
  assert resumed.score.get_state()["reward_model"] == reward_state
  assert resumed.kl_coef == run.kl_coef
  resumed.close()


def test_group_pair_agreement_by_hand():
  # group 0: right order; group 1: tie (1/2); group 2: equal rule rewards (not judged); group 3: wrong order
  scores = np.array([1.0, 0.0, 5.0, 5.0, 2.0, 3.0, 0.0, 1.0])
  rule = np.array([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.5])
  assert S.group_pair_agreement(scores, rule, 2) == pytest.approx((1.0 + 0.5 + 0.0) / 3)
  assert S.group_pair_agreement(scores, np.ones(8), 2) is None
