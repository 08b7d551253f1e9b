"""The built-in JAX sampler: trajectory layout, stop tokens, groups, seeds, weights, limits, HF greedy parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm import models
from jaxrl_llm.sampling import JaxSampler, SamplerConfig, generate_trace_count
from test_models_hf_util import hf_model, params_from_hf

CONFIG = models.tiny("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     max_position_embeddings=128, pad_token_id=0, eos_token_id=1)
STOPS = (1, 2, 3, 4, 5, 6, 7, 8)  # 1/8 of the vocabulary: most responses stop early, some do not
SAMPLING = SamplerConfig(max_new_tokens=12, temperature=1.0, stop_token_ids=STOPS, seed=3,
                         min_batch_bucket=16)  # one compiled program for all calls of <= 16 rows
PROMPTS = [[10, 11, 12], [13], [14, 15, 16, 17, 18, 19]]


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def result(params):
  return JaxSampler(CONFIG, params, SAMPLING, version=5).generate(PROMPTS, num_samples=3)


def test_trajectory_layout_stop_tokens_and_groups(result):
  traj = result.trajectory
  assert traj.tokens_bt.shape[0] == 9 and traj.tokens_bt.dtype == np.int32
  np.testing.assert_array_equal(traj.group_id_b, [0, 0, 0, 1, 1, 1, 2, 2, 2])
  np.testing.assert_array_equal(traj.rewards_b, np.zeros(9))
  assert result.policy_version == 5
  for b in range(9):
    prompt = PROMPTS[b // 3]
    n_prompt, response = len(prompt), result.response_tokens[b]
    n_resp = len(response)
    assert result.prompt_tokens[b] == prompt
    assert traj.tokens_bt[b, :n_prompt].tolist() == prompt
    assert traj.prompt_mask_bt[b].tolist() == [t < n_prompt for t in range(traj.tokens_bt.shape[1])]
    resp_idx = np.flatnonzero(traj.response_mask_bt[b])
    assert resp_idx.tolist() == list(range(n_prompt, n_prompt + n_resp))
    assert traj.tokens_bt[b, resp_idx].tolist() == response
    assert (traj.tokens_bt[b, n_prompt + n_resp:] == CONFIG.pad_token_id).all()
    assert (traj.behaviour_logp_bt[b, resp_idx] < 0).all()
    assert (traj.behaviour_logp_bt[b][~traj.response_mask_bt[b]] == 0).all()
    assert (traj.policy_version_bt[b, resp_idx] == 5).all()
    assert (traj.policy_version_bt[b][~traj.response_mask_bt[b]] == -1).all()
    # the stop token ends the response, is part of it, and appears nowhere before
    assert not any(t in STOPS for t in response[:-1])
    if traj.finished_b[b]:
      assert response[-1] in STOPS and traj.response_mask_bt[b, n_prompt + n_resp - 1]
    else:
      assert n_resp == SAMPLING.max_new_tokens and response[-1] not in STOPS
  assert traj.finished_b.any() and not traj.finished_b.all()
  # samples of a group differ (they are independent draws)
  assert len({tuple(r) for r in result.response_tokens[:3]}) > 1


def test_behaviour_logprobs_match_learner_in_default_mode(params, result):
  traj = result.trajectory
  mask = traj.prompt_mask_bt | traj.response_mask_bt
  logp = np.asarray(models.sequence_logprobs(params, CONFIG, traj.tokens_bt, mask, 1.0))
  err = np.abs(logp - traj.behaviour_logp_bt)[traj.response_mask_bt].max()
  print(f"default mode: max |sampler logp - sequence_logprobs| = {err:.2e}")
  assert err < 1e-4


def test_top_k_top_p_logprobs_are_those_of_the_truncated_distribution(params):
  sampler = JaxSampler(CONFIG, params, SAMPLING.replace(top_k=6, top_p=0.8, temperature=0.8, stop_token_ids=(1,)))
  traj = sampler.generate(PROMPTS[:2], num_samples=2).trajectory
  mask = traj.prompt_mask_bt | traj.response_mask_bt
  logits = np.asarray(models.forward(params, CONFIG, traj.tokens_bt, models.positions_from_mask(mask),
                                     mask)["logits_btv"], np.float64)
  checked = 0
  for b, t in zip(*np.nonzero(traj.response_mask_bt)):
    z = logits[b, t - 1] / 0.8
    order = np.argsort(-z)[:6]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    kept = order[:max(int(((np.cumsum(p) - p) < 0.8).sum()), 1)]
    token = traj.tokens_bt[b, t]
    assert token in kept
    expected = z[token] - np.log(np.exp(z[kept] - z[kept].max()).sum()) - z[kept].max()
    assert abs(traj.behaviour_logp_bt[b, t] - expected) < 1e-4
    checked += 1
  assert checked >= 10


def test_same_seed_same_output_different_seed_different(params, result):
  again = JaxSampler(CONFIG, params, SAMPLING, version=5).generate(PROMPTS, num_samples=3)
  np.testing.assert_array_equal(again.trajectory.tokens_bt, result.trajectory.tokens_bt)
  np.testing.assert_array_equal(again.trajectory.behaviour_logp_bt, result.trajectory.behaviour_logp_bt)
  other = JaxSampler(CONFIG, params, SAMPLING.replace(seed=4)).generate(PROMPTS, num_samples=3)
  assert other.response_tokens != result.response_tokens
  sampler = JaxSampler(CONFIG, params, SAMPLING)
  first, second = (sampler.generate(PROMPTS, num_samples=3) for _ in range(2))
  assert first.response_tokens == result.response_tokens  # call 0 of a seed-3 sampler
  assert second.response_tokens != first.response_tokens  # the call counter moves the key
  key = jax.random.PRNGKey(42)
  a = sampler.generate(PROMPTS, num_samples=3, rng=key)
  b = sampler.generate(PROMPTS, num_samples=3, rng=key)
  assert a.response_tokens == b.response_tokens


def test_update_weights_swaps_weights_without_recompiling(params, result):
  sampler = JaxSampler(CONFIG, params, SAMPLING, version=5)
  sampler.generate(PROMPTS, num_samples=3)
  traces = generate_trace_count()
  new_params = jax.tree.map(lambda a: a * 1.5, params)
  sampler.update_weights(new_params, version=6)
  out = sampler.generate(PROMPTS, num_samples=3, rng=jax.random.PRNGKey(0))
  assert generate_trace_count() == traces, "update_weights caused a recompilation"
  assert sampler.policy_version == 6
  traj = out.trajectory
  assert (traj.policy_version_bt[traj.response_mask_bt] == 6).all()
  mask = traj.prompt_mask_bt | traj.response_mask_bt
  logp_new = np.asarray(models.sequence_logprobs(new_params, CONFIG, traj.tokens_bt, mask, 1.0))
  np.testing.assert_allclose(traj.behaviour_logp_bt[traj.response_mask_bt], logp_new[traj.response_mask_bt],
                             atol=1e-4)
  bad = jax.tree.map(lambda a: a, new_params)
  bad["lm_head"]["kernel"] = jnp.zeros((32, 65))
  with pytest.raises(ValueError, match=r"lm_head.*kernel.*\(32, 65\)"):
    sampler.update_weights(bad, version=7)
  with pytest.raises(ValueError, match="structure"):
    sampler.update_weights({"embed": new_params["embed"]}, version=7)
  with pytest.raises(ValueError, match="dtype"):
    sampler.update_weights(jax.tree.map(lambda a: a.astype(jnp.bfloat16), new_params), version=7)
  assert sampler.policy_version == 6


def test_prompt_longer_than_the_context_is_an_error_or_truncated(params):
  config = SAMPLING.replace(max_length=16)  # 16 - 12 new tokens = 4 prompt tokens at most
  sampler = JaxSampler(CONFIG, params, config)
  with pytest.raises(ValueError, match=r"prompt 1 has 6 tokens.*18 > max length 16"):
    sampler.generate([[10, 11], [10, 11, 12, 13, 14, 15]])
  out = JaxSampler(CONFIG, params, config.replace(truncate_prompts=True)).generate([[10, 11], [10, 11, 12, 13, 14, 15]])
  assert out.prompt_tokens == [[10, 11], [12, 13, 14, 15]]
  assert out.prompt_truncated_b.tolist() == [False, True]
  assert out.trajectory.tokens_bt[1, :4].tolist() == [12, 13, 14, 15]
  with pytest.raises(ValueError, match="prompt 0 is empty"):
    sampler.generate([[]])
  with pytest.raises(ValueError, match=r"prompt 0 has token ids outside \[0, 64\)"):
    sampler.generate([[3, 64]])
  with pytest.raises(ValueError, match="pad id"):
    JaxSampler(CONFIG, params, SAMPLING.replace(stop_token_ids=(0, 1))).generate([[3]])


def test_greedy_matches_transformers_generate():
  config = CONFIG.replace(vocab_size=96)
  hf = hf_model(config, seed=9)
  params = params_from_hf(hf, config)
  prompts = [[5, 9, 30, 2, 17], [40, 41]]
  sampler = JaxSampler(config, params, SamplerConfig(max_new_tokens=10, greedy=True, stop_token_ids=(1,)))
  out = sampler.generate(prompts)
  for prompt, response in zip(prompts, out.response_tokens):
    with torch.no_grad():
      generated = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=1,
                              pad_token_id=0)
    expected = generated[0, len(prompt):].tolist()
    if 1 in expected:
      expected = expected[:expected.index(1) + 1]
    assert response == expected
  assert len(set(out.response_tokens[0])) > 2  # not a degenerate repetition


def test_trimmed_trajectory_drops_only_padding_columns(result):
  traj = result.trajectory  # 16-token prompt bucket + 12 new tokens = 28 columns
  used = traj.prompt_mask_bt | traj.response_mask_bt
  last = int(np.flatnonzero(used.any(0))[-1]) + 1
  trimmed = traj.trimmed(multiple=8)
  width = trimmed.tokens_bt.shape[1]
  assert width % 8 == 0 and last <= width < last + 8 and width < traj.tokens_bt.shape[1]
  for name in ("tokens_bt", "prompt_mask_bt", "response_mask_bt", "behaviour_logp_bt", "policy_version_bt"):
    full, cut = getattr(traj, name), getattr(trimmed, name)
    np.testing.assert_array_equal(cut, full[:, :width], err_msg=name)
  assert not traj.response_mask_bt[:, width:].any() and not traj.prompt_mask_bt[:, width:].any()
  np.testing.assert_array_equal(trimmed.finished_b, traj.finished_b)
  assert traj.trimmed(multiple=1000) is traj  # rounding past the full width keeps it
  # long rows (multi-turn episodes) round geometrically: few widths, at most a third of padding
  from jaxrl_llm.types import width_bucket
  widths = [width_bucket(n) for n in range(1, 1025)]
  assert sorted(set(widths)) == [8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]
  assert all(n <= w and (w <= 32 and w - n < 8 or w <= 1.5 * n) for n, w in zip(range(1, 1025), widths))
  with pytest.raises(ValueError, match="multiple=0"):
    traj.trimmed(multiple=0)
