"""Sampler actors on a real local Ray cluster: dispatch, killed actors, rejected chunks, the pipeline.

One Ray cluster (started by the code on 127.0.0.1) serves the whole module.
"""

import sys

import jax
import numpy as np
import pytest

from jaxrl_llm import bridge, jobs, models
from jaxrl_llm.rollout import SamplerPool, SamplerSpec, WorkItem, validate_chunk
from jaxrl_llm.sampling import SamplerConfig

sys.path.insert(0, __file__.rsplit("/", 1)[0])
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


def make_pool(params, fingerprint=FINGERPRINT, num_samplers=2, latest=lambda: 0):
  spec = SamplerSpec(model_config=CONFIG, sampler_config=SAMPLING, fingerprint=fingerprint.to_dict())
  return SamplerPool(spec, params, 0, num_samplers=num_samplers, actor_cpus=0.5, max_attempts=2,
                     validate=lambda ch: validate_chunk(ch, fingerprint=FINGERPRINT, latest_version=latest(),
                                                        vocab_size=CONFIG.vocab_size))


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
    pool.submit(items(pool, steps=1, per_step=1)[0])
    with pytest.raises(RuntimeError, match="rejected 2 times: fingerprint.*tokenizer differs"):
      drain(pool, 1)
    assert pool.stats.rejected["fingerprint"] >= 2
  finally:
    pool.shutdown()
  pool = make_pool(params, num_samplers=1, latest=lambda: -1)  # the learner claims no version yet
  try:
    pool.submit(items(pool, steps=1, per_step=1)[0])
    with pytest.raises(RuntimeError, match="from the future"):
      drain(pool, 1)
  finally:
    pool.shutdown()


def test_pipeline_with_k0_reproduces_the_synchronous_run(tmp_path):
  common = dict(rl__steps=3, checkpoint__every=100, export__hf=False, eval__every=100)
  sync = jobs.RLJob(tiny_config(tmp_path / "sync", **common))
  sync.train()
  pipe = jobs.RLJob(tiny_config(tmp_path / "pipe", rollout__mode="pipeline", rollout__num_samplers=1,
                              rollout__max_lag=0, **common))
  pipe.train()
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
