"""The queue boundary (validation, row repair, concatenation), row-keyed chunking and segmented generation. No Ray."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_llm import bridge, models
from jaxrl_llm.rollout import (SCHEMA_VERSION, ChunkReasons, RepairBook, RolloutChunk, WorkItem, concat_chunks,
                               generate_in_segments, merge_rows, validate_chunk, validate_rows)
from jaxrl_llm.sampling import JaxSampler, SamplerConfig
from rollout_checks import assert_same_chunk

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


def test_row_problems_are_named_per_row_apart_from_whole_chunk_problems(sampler):
  result = sampler.generate(PROMPTS, num_samples=2, rng=jax.random.PRNGKey(1))
  traj = result.trajectory
  ids, logp, versions = (np.array(a) for a in (traj.tokens_bt, traj.behaviour_logp_bt, traj.policy_version_bt))
  ids[1, 0] = CONFIG.vocab_size + 5  # a prompt token: response_tokens still agree
  logp[4][traj.response_mask_bt[4]] = np.nan
  versions[6][traj.response_mask_bt[6]] = 9
  bad = make_chunk(result, trajectory=traj.replace(tokens_bt=ids, behaviour_logp_bt=logp, policy_version_bt=versions))
  rows = validate_rows(bad, latest_version=7, vocab_size=CONFIG.vocab_size)
  assert rows == {1: ["token ids outside [0, 64)"],
                  4: ["behaviour log-probabilities must be finite and <= 0 on response tokens"],
                  6: ["policy version from the future: 9 > the learner's latest 7"]}
  reasons = check(bad)
  assert isinstance(reasons, ChunkReasons) and reasons.chunk == [] and reasons.rows == rows
  assert reasons[0] == "row 1: token ids outside [0, 64)" and len(reasons) == 3
  # a whole-chunk problem: the rows are not looked at
  other = bridge.make_fingerprint(bridge.build_char_tokenizer("xyz"), CONFIG)
  reasons = check(dataclasses.replace(bad, fingerprint=other.to_dict()))
  assert reasons.rows == {} and len(reasons.chunk) == 1 and reasons.chunk[0].startswith("fingerprint:")
  assert check(make_chunk(result)).rows == {} and validate_rows(make_chunk(result), latest_version=7,
                                                                 vocab_size=CONFIG.vocab_size) == {}
  with pytest.raises(ValueError, match="chunk-level problem.*2 response token lists for 8 rows"):
    validate_rows(make_chunk(result, response_tokens=result.response_tokens[:2]), latest_version=7,
                  vocab_size=CONFIG.vocab_size)


def test_bad_rows_resampled_alone_merge_back_bit_for_bit(sampler):
  """Rows re-sampled with their own keys and merged equal the chunk a good sampler gives (batch-invariant)."""
  rng = np.asarray(jax.random.PRNGKey(5), np.uint32)
  item = WorkItem(request_id=11, step=3, chunk=1, prompts=tuple(tuple(p) for p in PROMPTS[1:]), num_samples=2,
                  rng=rng, first_row=2)

  def answer(work):
    out = sampler.generate([list(p) for p in work.prompts], num_samples=work.num_samples, rng=work.rng,
                           row_ids=work.first_row + np.arange(len(work.prompts) * work.num_samples))
    return make_chunk(out, request_id=work.request_id, step=work.step, chunk=work.chunk)

  good = answer(item)
  logp = np.array(good.trajectory.behaviour_logp_bt)
  logp[[3, 4]] = np.where(good.trajectory.response_mask_bt[[3, 4]], np.nan, 0.0)
  bad = dataclasses.replace(good, trajectory=good.trajectory.replace(behaviour_logp_bt=logp))
  assert sorted(validate_rows(bad, latest_version=7, vocab_size=CONFIG.vocab_size)) == [3, 4]

  book, ids = RepairBook(CONFIG.pad_token_id), iter(range(100, 200))
  resample = book.hold(item, bad, [4, 3], lambda: next(ids))
  assert [(w.request_id, w.prompts, w.num_samples, w.first_row) for w in resample] == [
      (100, (item.prompts[1],), 1, 5), (101, (item.prompts[2],), 1, 6)]  # local row r: prompt r // n, row 2 + r
  assert all(w.rng is rng and (w.step, w.chunk) == (3, 1) for w in resample)
  assert book.origin(100) == (item, 3) and book.origin(item.request_id) is None and len(book) == 1
  book.renamed(101, 102)  # a re-queued row keeps its place
  assert book.put(100, answer(resample[0])) is None
  merged = book.put(102, answer(dataclasses.replace(resample[1], request_id=102)))
  assert len(book) == 0 and merged.request_id == 11 and (merged.step, merged.chunk) == (3, 1)
  assert_same_chunk(merged, good)

  # a wider re-sampled row right-pads the others (as concat_trajectories does)
  row = dataclasses.replace(answer(resample[0]), request_id=100)
  wide = row.trajectory.replace(**{n: np.pad(np.asarray(getattr(row.trajectory, n)), [(0, 0), (0, 3)],
                                             constant_values=f)
                                   for n, f in (("tokens_bt", CONFIG.pad_token_id), ("prompt_mask_bt", False),
                                                ("response_mask_bt", False), ("behaviour_logp_bt", 0.0),
                                                ("policy_version_bt", -1))})
  widened = merge_rows(bad, {3: dataclasses.replace(row, trajectory=wide)}, CONFIG.pad_token_id)
  width = good.trajectory.tokens_bt.shape[1]
  assert widened.trajectory.tokens_bt.shape == (6, width + 3)
  np.testing.assert_array_equal(widened.trajectory.tokens_bt[:, :width], good.trajectory.tokens_bt)
  assert (widened.trajectory.tokens_bt[:, width:] == CONFIG.pad_token_id).all()
  assert not widened.trajectory.response_mask_bt[:, width:].any()
  assert validate_rows(widened, latest_version=7, vocab_size=CONFIG.vocab_size) == {4: [
      "behaviour log-probabilities must be finite and <= 0 on response tokens"]}
  with pytest.raises(ValueError, match="one-row chunks"):
    merge_rows(bad, {3: good}, CONFIG.pad_token_id)


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
