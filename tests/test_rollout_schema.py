"""The queue boundary (validation, concatenation), row-keyed chunking and segmented generation. No Ray."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm import bridge, models
from jaxrl_llm.rollout import (SCHEMA_VERSION, RolloutChunk, concat_chunks, generate_in_segments,
                               validate_chunk)
from jaxrl_llm.sampling import JaxSampler, SamplerConfig

CONFIG = models.tiny("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     max_position_embeddings=64, pad_token_id=0, eos_token_id=1, batch_invariant=True)
SAMPLING = SamplerConfig(max_new_tokens=6, stop_token_ids=(1, 2, 3, 4), seed=3)
PROMPTS = [[10, 11, 12], [13], [14, 15, 16, 17], [18, 19]]
TOKENIZER = bridge.build_char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789")
FINGERPRINT = bridge.make_fingerprint(TOKENIZER, CONFIG)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def sampler(params):
  return JaxSampler(CONFIG, params, SAMPLING, version=7)


def make_chunk(result, **changes):
  chunk = RolloutChunk(schema_version=SCHEMA_VERSION, request_id=1, step=0, chunk=0, sampler_id="s0",
                       fingerprint=FINGERPRINT.to_dict(), trajectory=result.trajectory,
                       response_tokens=result.response_tokens)
  return dataclasses.replace(chunk, **changes)


def check(chunk, latest=7):
  return validate_chunk(chunk, fingerprint=FINGERPRINT, latest_version=latest, vocab_size=CONFIG.vocab_size,
                        expected_rows=len(PROMPTS) * 2)


def test_a_real_chunk_is_valid_and_each_defect_is_named(sampler):
  result = sampler.generate(PROMPTS, num_samples=2, rng=jax.random.PRNGKey(1))
  good = make_chunk(result)
  assert check(good) == []
  traj = result.trajectory

  assert "from the future" in " ".join(check(good, latest=6))
  other = bridge.make_fingerprint(bridge.build_char_tokenizer("xyz"), CONFIG)
  reasons = check(make_chunk(result, fingerprint=other.to_dict()))
  assert any("fingerprint" in r and "tokenizer" in r and "sampler 's0'" in r for r in reasons), reasons
  assert "schema_version=0" in " ".join(check(make_chunk(result, schema_version=0)))
  assert "expected a RolloutChunk" in check({"tokens": 1})[0]

  bad_logp = np.array(traj.behaviour_logp_bt)
  bad_logp[traj.response_mask_bt] = np.nan
  assert "finite" in " ".join(check(make_chunk(result, trajectory=traj.replace(behaviour_logp_bt=bad_logp))))
  overlap = np.array(traj.prompt_mask_bt) | np.array(traj.response_mask_bt)
  assert "overlap" in " ".join(check(make_chunk(result, trajectory=traj.replace(prompt_mask_bt=overlap))))
  ids = np.array(traj.tokens_bt)
  ids[0, 0] = CONFIG.vocab_size + 5
  assert "outside [0, 64)" in " ".join(check(make_chunk(result, trajectory=traj.replace(tokens_bt=ids))))
  short = traj.replace(tokens_bt=np.array(traj.tokens_bt)[:, :-1])
  assert "share one [B, T] shape" in " ".join(check(make_chunk(result, trajectory=short)))
  assert "rows: expected" in " ".join(check(make_chunk(result, trajectory=jax.tree.map(lambda a: a[:2], traj),
                                                       response_tokens=result.response_tokens[:2])))
  wrong = [list(r) for r in result.response_tokens]
  wrong[3] = wrong[3][:-1] + [63]
  assert "row 3: response_tokens disagree" in " ".join(check(make_chunk(result, response_tokens=wrong)))


def test_chunks_with_global_row_ids_equal_one_call(sampler):
  """Splitting a step over samplers changes nothing (batch-invariant mode: bit for bit)."""
  rng = jax.random.PRNGKey(5)
  whole = sampler.generate(PROMPTS, num_samples=2, rng=rng)
  first = sampler.generate(PROMPTS[:1], num_samples=2, rng=rng, row_ids=[0, 1])
  rest = sampler.generate(PROMPTS[1:], num_samples=2, rng=rng, row_ids=list(range(2, 8)))
  traj, responses = concat_chunks([make_chunk(first), make_chunk(rest, chunk=1)], CONFIG.pad_token_id)
  assert responses == whole.response_tokens
  width = traj.tokens_bt.shape[1]
  for name in ("tokens_bt", "prompt_mask_bt", "response_mask_bt", "behaviour_logp_bt", "policy_version_bt"):
    np.testing.assert_array_equal(getattr(traj, name), np.asarray(getattr(whole.trajectory, name))[:, :width],
                                  err_msg=name)
  np.testing.assert_array_equal(traj.group_id_b, whole.trajectory.group_id_b)
  with pytest.raises(ValueError, match="one id per row"):
    sampler.generate(PROMPTS[:1], num_samples=2, rng=rng, row_ids=[0])


def test_segments_switch_versions_mid_response_and_record_them(params):
  new_params = jax.tree.map(lambda p: p * 1.5, params)
  sampler = JaxSampler(CONFIG, params, SAMPLING.replace(stop_token_ids=()), version=3)
  calls = []

  def segment(prompts, **kwargs):
    if calls:  # weights change after the first segment
      sampler.update_weights(new_params, 4)
    calls.append(kwargs["max_new_tokens"])
    return sampler.generate(prompts, **kwargs)

  out = generate_in_segments(segment, PROMPTS, num_samples=2, rng=jax.random.PRNGKey(2), row_ids=np.arange(8),
                             segment_tokens=4, max_new_tokens=6, pad_id=0)
  assert calls == [4, 2]
  traj = out.trajectory
  assert all(len(r) == 6 for r in out.response_tokens)
  for b in range(8):
    versions = traj.policy_version_bt[b][traj.response_mask_bt[b]]
    assert versions.tolist() == [3] * 4 + [4] * 2
  assert out.policy_version == 3
  # each token's behaviour log-probability is that of the weights that sampled it
  seq = traj.prompt_mask_bt | traj.response_mask_bt
  for p, version in ((params, 3), (new_params, 4)):
    learner = np.asarray(models.sequence_logprobs(p, CONFIG, traj.tokens_bt, seq, SAMPLING.temperature))
    mine = traj.response_mask_bt & (traj.policy_version_bt == version)
    np.testing.assert_allclose(traj.behaviour_logp_bt[mine], learner[mine], atol=1e-5)
