"""Sampler actors on a real local Ray cluster: dispatch, killed actors, rejected chunks and rows, the pipeline.

One Ray cluster (started by the code on 127.0.0.1) serves the whole module.
"""

import dataclasses
import json
import sys
import time
import types

import jax
import numpy as np
import pytest

from jaxrl_llm import bridge, jobs, models
from jaxrl_llm.models import lora
from jaxrl_llm.rollout import SamplerPool, SamplerSpec, SamplerWorker, WorkItem, sources, validate_chunk
from jaxrl_llm.sampling import SamplerConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from rollout_checks import assert_same_chunk  # noqa: E402
from tiny_configs import tiny_config  # noqa: E402

CONFIG = models.tiny("qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
                     max_position_embeddings=32, pad_token_id=0, eos_token_id=1)
TOKENIZER = bridge.build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")
FINGERPRINT = bridge.make_fingerprint(TOKENIZER, CONFIG)
SAMPLING = SamplerConfig(max_new_tokens=4, stop_token_ids=(1,), seed=0)


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
  ray = pytest.importorskip("ray")
  yield
  ray.shutdown()


def items(pool, steps, per_step=2):
  out = []
  for s in range(steps):
    for c in range(per_step):
      out.append(WorkItem(request_id=pool.new_request_id(), step=s, chunk=c, prompts=((5 + c, 6), (7,)),
                          num_samples=2, rng=np.asarray(jax.random.PRNGKey(s), np.uint32), first_row=4 * c))
  return out


def drain(pool, expected, timeout_s=300):
  import time
  got, t0 = [], time.time()
  while len(got) < expected and time.time() - t0 < timeout_s:
    got += pool.poll(timeout_s=2.0)
  return got


def make_pool(params, fingerprint=FINGERPRINT, num_samplers=2, latest=lambda: 0, config=CONFIG, corrupt=None):
  """A pool validating against FINGERPRINT; ``corrupt(chunk)``, when given, first spoils an answer in place
  (as a faulty sampler would have returned it)."""
  spec = SamplerSpec(model_config=config, sampler_config=SAMPLING, fingerprint=fingerprint.to_dict())

  def validate(chunk):
    if corrupt is not None:
      corrupt(chunk)
    return validate_chunk(chunk, fingerprint=FINGERPRINT, latest_version=latest(), vocab_size=CONFIG.vocab_size)

  return SamplerPool(spec, params, 0, num_samplers=num_samplers, actor_cpus=0.5, max_attempts=2, validate=validate)


def record_submits(pool):
  """The WorkItems submitted to ``pool`` from now on (the caller's and the pool's own re-queues), in order."""
  seen, submit = [], pool.submit

  def recording(item, min_version=-1, front=False):
    seen.append(item)
    submit(item, min_version, front)

  pool.submit = recording
  return seen


def spoil(chunk, row, **arrays):
  """Writes ``value`` into ``chunk`` (in place) for each ``name=value``: behaviour log-probabilities on row
  ``row``'s response tokens, any other [B, T] field at ``[row, 0]`` (a prompt token)."""
  traj = chunk.trajectory
  changes = {}
  for name, value in arrays.items():
    a = np.array(getattr(traj, name))
    a[row, np.asarray(traj.response_mask_bt)[row] if name == "behaviour_logp_bt" else 0] = value
    changes[name] = a
  chunk.trajectory = traj.replace(**changes)


def test_killed_actor_is_replaced_and_no_work_is_lost_or_doubled(params):
  import ray
  pool = make_pool(params)
  try:
    work = items(pool, steps=3)
    for item in work:
      pool.submit(item)
    ray.kill(pool.actors()[0])  # it holds a dispatched item
    chunks = drain(pool, len(work))
    keys = sorted((c.step, c.chunk) for c in chunks)
    assert keys == sorted((w.step, w.chunk) for w in work)  # every item exactly once
    assert pool.stats.lost_items >= 1 and pool.stats.restarts >= 1
    assert pool.stats.delivered == len(work) and pool.num_samplers == 2
    # a re-dispatched item samples exactly what the lost one would have (same key, same rows)
    again = items(pool, steps=1)
    for item in again:
      pool.submit(item)
    repeat = {(c.step, c.chunk): c for c in drain(pool, len(again))}
    first = {(c.step, c.chunk): c for c in chunks}
    for key, chunk in repeat.items():
      assert chunk.response_tokens == first[key].response_tokens
    # weights: published versions are monotone and reach every actor
    pool.publish(jax.tree.map(lambda p: p * 0, params), 1)
    with pytest.raises(ValueError, match="not newer"):
      pool.publish(params, 1)
  finally:
    pool.shutdown()


def test_fingerprint_mismatch_and_future_versions_are_rejected_with_reasons(params):
  other = bridge.make_fingerprint(bridge.build_char_tokenizer("xyz"), CONFIG)
  pool = make_pool(params, fingerprint=other, num_samplers=1)
  try:
    submitted = record_submits(pool)
    item = items(pool, steps=1, per_step=1)[0]
    pool.submit(item)
    with pytest.raises(RuntimeError, match="step 0 chunk 0 was rejected 2 times: fingerprint.*tokenizer differs"):
      drain(pool, 1)
    assert pool.stats.rejected["fingerprint"] == 2 and pool.stats.rejected_rows == 8
    # a whole-chunk problem re-samples the whole chunk, never single rows
    assert [(w.prompts, w.num_samples, w.first_row) for w in submitted] == [(item.prompts, 2, item.first_row)] * 2
    assert len({w.request_id for w in submitted}) == 2
  finally:
    pool.shutdown()
  pool = make_pool(params, num_samplers=1, latest=lambda: -1)  # the learner claims no version yet
  try:
    pool.submit(items(pool, steps=1, per_step=1)[0])
    with pytest.raises(RuntimeError, match=r"step 0 chunk 0 row \d was rejected 2 times: policy version from the "
                                           r"future: 0 > the learner's latest -1"):
      drain(pool, 1)
  finally:
    pool.shutdown()


def test_a_bad_row_is_resampled_alone_and_the_chunk_delivered_as_a_good_sampler_gives_it(params):
  spoiled = []

  def corrupt(chunk):  # the first 4-row answer has NaN behaviour log-probabilities in row 2
    if chunk.num_rows == 4 and not spoiled:
      spoiled.append(chunk.request_id)
      spoil(chunk, 2, behaviour_logp_bt=np.nan)

  # batch-invariant kernels: a row sampled alone has the bits it has in a 4-row batch
  pool = make_pool(params, num_samplers=1, config=dataclasses.replace(CONFIG, batch_invariant=True), corrupt=corrupt)
  try:
    submitted = record_submits(pool)
    item = items(pool, steps=1, per_step=2)[1]  # rows 4..7 of step 0
    pool.submit(item)
    [repaired] = drain(pool, 1)
    assert spoiled == [item.request_id]
    [row] = submitted[1:]  # one re-sample, of local row 2 = prompt 1, sample 0, global row 6 (its own key)
    assert (row.prompts, row.num_samples, row.first_row, row.step, row.chunk) == (
        (item.prompts[1],), 1, item.first_row + 2, item.step, item.chunk)
    assert row.request_id != item.request_id and np.array_equal(row.rng, item.rng)
    assert (repaired.request_id, repaired.step, repaired.chunk) == (item.request_id, item.step, item.chunk)
    stats = pool.stats
    assert (stats.dispatched, stats.delivered, stats.rejected_rows, stats.duplicates) == (2, 1, 1, 0)
    assert dict(stats.rejected) == {"behaviour log-probabilities must be finite and <= 0 on response tokens": 1}
    assert stats.as_metrics()["pool/rejected_rows"] == 1 and stats.as_metrics()["pool/rejected"] == 1
    # the same item again, now from a sampler that spoils nothing
    pool.submit(dataclasses.replace(item, request_id=pool.new_request_id()))
    [good] = drain(pool, 1)
    assert pool.stats.dispatched == 3
    assert_same_chunk(repaired, good)
  finally:
    pool.shutdown()


def test_a_row_that_stays_bad_stops_the_run_naming_the_row_and_reason(params):
  def corrupt(chunk):  # the last row of every answer (row 3 of the item, then row 0 of its re-sample)
    spoil(chunk, chunk.num_rows - 1, tokens_bt=CONFIG.vocab_size + 1)

  pool = make_pool(params, num_samplers=1, corrupt=corrupt)
  try:
    submitted = record_submits(pool)
    item = items(pool, steps=1, per_step=1)[0]
    pool.submit(item)
    with pytest.raises(RuntimeError, match=r"step 0 chunk 0 row 3 was rejected 2 times: token ids outside \[0, 48\)"):
      drain(pool, 1)
    assert [(w.prompts, w.num_samples, w.first_row) for w in submitted] == [
        (item.prompts, 2, 0), ((item.prompts[1],), 1, 3)]
    assert dict(pool.stats.rejected) == {"token ids outside [0, 48)": 2} and pool.stats.rejected_rows == 2
    assert pool.stats.delivered == 0
  finally:
    pool.shutdown()


def test_pipeline_with_k0_reproduces_the_synchronous_run(tmp_path):
  """Two actors (the default), each step split into four chunks: the same samples and updates, bit for bit.

  Batch-invariant mode makes a row's sample independent of the rows it is batched with, and
  row r samples with the key of its global row id whatever chunk it lands in.
  """
  common = dict(rl__steps=2, rl__prompts_per_step=8, checkpoint__every=100, export__hf=False, eval__every=100,
                model__batch_invariant=True)
  sync = jobs.RLJob(tiny_config(tmp_path / "sync", **common))
  sync.train()
  pipe = jobs.RLJob(tiny_config(tmp_path / "pipe", rollout__mode="pipeline", rollout__num_samplers=2,
                              rollout__chunks_per_step=4, rollout__max_lag=0, rollout__actor_cpus=0.5, **common))
  pipe.train()
  rows = [json.loads(l) for l in open(tmp_path / "pipe" / "metrics.jsonl") if "pool/delivered" in l]
  assert rows[-1]["pool/delivered"] == 2 * 4  # every step came back as four chunks
  for a, b in zip(jax.tree.leaves(sync.params), jax.tree.leaves(pipe.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lora_actors_receive_only_the_adapters_and_sample_as_the_synchronous_run(tmp_path):
  """LoRA: after the first weights an actor gets only the adapters (megabytes, not the model), and the
  pipeline at k = 0 still gives the synchronous run's updates bit for bit."""
  common = dict(rl__steps=2, rl__prompts_per_step=8, checkpoint__every=100, export__hf=False, eval__every=100,
                model__batch_invariant=True, model__lora__rank=2, model__lora__targets=("q", "v", "down"))
  sync = jobs.RLJob(tiny_config(tmp_path / "sync", **common))
  sync.train()
  pipe = jobs.RLJob(tiny_config(tmp_path / "pipe", rollout__mode="pipeline", rollout__num_samplers=1,
                                rollout__max_lag=0, rollout__actor_cpus=0.5, **common))
  pipe.train()
  rows = [json.loads(l) for l in open(tmp_path / "pipe" / "metrics.jsonl") if "pool/publish_mb" in l]
  assert rows and rows[-1]["pool/publish_mb"] == lora.adapter_bytes(pipe.params) / 2**20
  assert lora.adapter_bytes(pipe.params) * 20 < sum(x.nbytes for x in jax.tree.leaves(pipe.params))
  for a, b in zip(jax.tree.leaves(sync.params), jax.tree.leaves(pipe.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_pipeline_with_lag_runs_ahead_within_the_bound(tmp_path):
  import json
  run = jobs.RLJob(tiny_config(tmp_path, rl__steps=4, checkpoint__every=100, export__hf=False, eval__every=100,
                             rollout__mode="pipeline", rollout__num_samplers=2, rollout__max_lag=2,
                             rollout__segment_tokens=2))
  run.train()
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in records if "pipeline/queued_steps" in r]
  assert len(rl) == 4
  assert max(r["data/lag_max"] for r in rl) <= 2 and rl[0]["data/lag_max"] == 0
  assert all(r["pool/lost_items"] == 0 and r["pool/rejected"] == 0 for r in rl)
  assert rl[0]["pipeline/queued_steps"] == 3  # steps 0..2 dispatched before the first update (k = 2)


# ----------------------------------------------------------------------------- exact versions, pipeline state


def version_params(params, v):
  """Distinct weights for each policy version (so a sample from the wrong version shows)."""
  return jax.tree.map(lambda p: p * (1.0 + 0.25 * v), params)


def test_worker_samples_an_exact_version_with_kept_weights_then_goes_back_to_the_newest(params):
  spec = SamplerSpec(model_config=CONFIG, sampler_config=SAMPLING, fingerprint=FINGERPRINT.to_dict(), keep_versions=3)
  worker = SamplerWorker(spec, version_params(params, 0), 0, "w")
  item = WorkItem(request_id=1, step=0, chunk=0, prompts=((5, 6), (7,)), num_samples=2,
                  rng=np.asarray(jax.random.PRNGKey(3), np.uint32), version=1)
  fresh = SamplerWorker(spec, version_params(params, 1), 1, "fresh").generate(item)
  worker.update_weights(version_params(params, 2), 2)  # arrives before version 1 (threaded actors: any order)
  worker.update_weights(version_params(params, 1), 1)
  assert worker.policy_version() == 2 and worker.kept_versions() == [0, 1, 2]
  chunk = worker.generate(item)
  for name in ("tokens_bt", "behaviour_logp_bt", "policy_version_bt"):
    np.testing.assert_array_equal(getattr(chunk.trajectory, name), getattr(fresh.trajectory, name))
  assert set(np.unique(chunk.trajectory.policy_version_bt[chunk.trajectory.response_mask_bt])) == {1}
  assert worker.policy_version() == 2  # the newest weights are back for items without a version
  worker.update_weights(version_params(params, 3), 3)
  assert worker.kept_versions() == [1, 2, 3]
  with pytest.raises(RuntimeError, match="exact policy version 0 is not kept"):
    worker.generate(dataclasses.replace(item, version=0))


class LetterStream:
  """A plain prompt stream (next_batch / get_state / set_state, like tasks.PromptSource)."""

  def __init__(self, per_batch=3):
    self.position, self.per_batch = 0, per_batch

  def next_batch(self):
    words = ["abc", "de", "fgh", "ij", "klmn", "op", "qrs"]
    examples = [types.SimpleNamespace(prompt=words[(self.position + i) % len(words)] * (1 + (self.position + i) % 2))
                for i in range(self.per_batch)]
    self.position += self.per_batch
    return types.SimpleNamespace(examples=examples)

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = int(state["position"])


def encode_letters(text):
  return [2 + ord(ch) - ord("a") for ch in text]


def exact_source(params, version, start_step, k):
  pool = sources.start_sampler_pool(model_config=CONFIG, sampler_config=SAMPLING, tokenizer=TOKENIZER,
                                    params=version_params(params, version), version=version, num_samplers=2,
                                    actor_cpus=0.5, keep_versions=k + 1)
  return sources.PipelineSource(pool, LetterStream(), encode_letters, 7, start_step=start_step, base_version=version,
                                group_size=2, max_lag=k, chunks_per_step=2, pad_id=0, exact_versions=True)


def run_exact_pipeline(params, steps, *, k, learner_s, resume_at=None):
  """RL steps 0..steps-1 of an exact-version pipeline whose learner takes ``learner_s`` seconds per update
  (then publishes version t + 1). With ``resume_at``: after step resume_at - 1 the pipeline's state goes
  through JSON, the actors are shut down and a new pool and source continue from the state.

  Returns ({step: Rollout}, the last pool's dispatched work items after a final drain, the resumed state).
  """
  source, out, state = exact_source(params, 0, 0, k), {}, None
  try:
    for t in range(steps):
      if t == resume_at:
        state = json.loads(json.dumps(source.get_state()))
        source.close()
        source = exact_source(params, t, t, k)  # a fresh stream and actors holding version t only
        source.set_state(state)
      out[t] = source.collect(t)
      time.sleep(learner_s)
      source.publish(version_params(params, t + 1), t + 1)
      source.prompt_state(t)
    source.feeder.drain()
    return out, source.pool.stats.dispatched, state
  finally:
    source.close()


def test_exact_versions_give_the_same_data_whatever_the_timing_and_across_a_resume(params):
  k, steps = 2, 6
  slow, slow_dispatched, _ = run_exact_pipeline(params, steps, k=k, learner_s=0.5)
  fast, resumed_dispatched, state = run_exact_pipeline(params, steps, k=k, learner_s=0.0, resume_at=3)
  for t in range(steps):
    a, b = slow[t].trajectory, fast[t].trajectory
    versions = a.policy_version_bt[a.response_mask_bt]
    assert versions.size and set(np.unique(versions)) == {max(0, t - k)}, (t, np.unique(versions))
    for name in ("tokens_bt", "response_mask_bt", "behaviour_logp_bt", "policy_version_bt"):
      np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=f"step {t} {name}")
    assert slow[t].response_tokens == fast[t].response_tokens
    assert [e.prompt for e in slow[t].examples] == [e.prompt for e in fast[t].examples]
  # the checkpoint held steps 3 and 4 (2 chunks each) with their exact versions; after the resume
  # only steps 5..7 were sampled (nothing twice), against steps 0..7 in the uninterrupted run
  assert state["steps"] == [3, 4] and state["feeder"]["next_step"] == 5 and len(state["feeder"]["chunks"]) == 4
  assert [i["__fields__"]["version"] for i in state["feeder"]["items"]] == [1, 1, 2, 2]
  assert slow_dispatched == (steps + k) * 2, slow_dispatched
  assert resumed_dispatched == (steps - 3) * 2, resumed_dispatched
