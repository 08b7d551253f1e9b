"""The sampler-vs-learner consistency check, run on demand against a run's checkpoint.

Each RL step already compares the learner's log-probabilities with the
behaviour log-probabilities the sampler recorded (:mod:`jaxrl_llm.jobs.update`). This
module runs the same check outside training, for a checkpoint and a sampler:
sample a batch of training prompts with the run's sampler (the in-process JAX
sampler, or a Ray sampler actor exactly as PipelineRL uses it), recompute the
learner's log-probabilities of the sampled tokens with the checkpoint's
parameters, and report :func:`jaxrl_llm.diagnostics.offpolicy.consistency_stats`
and the alerts against the run's thresholds. ``launch/check_consistency.py`` is
the command-line wrapper.

Healthy values: on-policy with ``model.batch_invariant=True`` every ratio is
exactly 1 (bitwise equal log-probabilities); in the default mode, ratios within
about 1e-5 of 1. Anything else means the sampler and the learner disagree about
the distribution (temperature, top-k / top-p, dtype, weights or tokenizer out
of sync); see docs/off_policy.md.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm.diagnostics import offpolicy
from jaxrl_llm.rollout import sources
from jaxrl_llm.tasks import PromptSource

__all__ = ["SAMPLERS", "check", "sample_batch"]

SAMPLERS = ("jax", "actor")


def sample_batch(run: Any, num_prompts: int, sampler: str = "jax", seed_offset: int = 0):
  """Samples ``num_prompts`` training prompts x ``rl.samples_per_prompt`` with the chosen sampler.

  Args:
    run: a :class:`jaxrl_llm.jobs.RLJob` (restored from its checkpoint).
    num_prompts: G prompts (>= 1).
    sampler: "jax" (in-process) or "actor" (one Ray sampler actor, as the pipeline runs it).
    seed_offset: picks another prompt stream / sampling key.

  Returns:
    (Trajectory (numpy, trimmed), seconds spent sampling).
  """
  if sampler not in SAMPLERS:
    raise ValueError(f"sampler={sampler!r}: expected one of {SAMPLERS}")
  if num_prompts < 1:
    raise ValueError(f"num_prompts={num_prompts}: expected >= 1")
  c = run.config
  source = PromptSource(run.task, num_prompts, seed=c.seed + 5000 + seed_offset,
                        samples_per_prompt=c.rl.samples_per_prompt)
  prompts = [run.encode_prompt(e.prompt) for e in source.next_batch().examples]
  key = jax.random.fold_in(jax.random.PRNGKey(c.seed + 5000), seed_offset)
  t0 = time.perf_counter()
  if sampler == "jax":
    run.publish_local()
    traj = run.sampler.generate(prompts, rng=key).trajectory
  else:
    traj = _sample_with_actor(run, prompts, key)
  return traj.trimmed(multiple=8), time.perf_counter() - t0


def _sample_with_actor(run: Any, prompts, key) -> Any:
  from jaxrl_llm import rollout

  version = int(run.state.train.policy_version)
  c = run.config
  pool = sources.start_sampler_pool(model_config=run.model_config, sampler_config=run.sampler_config,
                                    tokenizer=run.tokenizer, params=run.params, version=version, num_samplers=1,
                                    address=c.rollout.address, actor_cpus=c.rollout.actor_cpus,
                                    latest_version=lambda: version, platform=c.sampler.platform,
                                    local_gpus=c.rollout.local_gpus, actor_gpus=c.rollout.actor_gpus)
  try:
    item = rollout.WorkItem(request_id=pool.new_request_id(), step=0, chunk=0,
                            prompts=tuple(tuple(int(t) for t in p) for p in prompts),
                            num_samples=run.config.rl.samples_per_prompt, rng=np.asarray(key, np.uint32), first_row=0)
    pool.submit(item, version)
    chunks = []
    deadline = time.perf_counter() + 600
    while not chunks:
      if time.perf_counter() > deadline:
        raise TimeoutError("check_consistency: the sampler actor returned nothing in 600 s")
      chunks = pool.poll(timeout_s=1.0)
    traj, _ = rollout.concat_chunks(chunks, run.model_config.pad_token_id)
    return traj
  finally:
    pool.shutdown()


def check(run: Any, num_prompts: int = 32, sampler: str = "jax", seed_offset: int = 0) -> dict:
  """Samples a batch and compares the learner's recomputed log-probabilities with the sampler's.

  Returns:
    ``{"stats": consistency_stats, "alerts": [messages], "rows": B,
    "tokens": response tokens, "sample_s": seconds, "sampler": sampler,
    "policy_version": checkpoint version}``.
  """
  traj, seconds = sample_batch(run, num_prompts, sampler, seed_offset)
  tokens = np.asarray(traj.tokens_bt)
  seq = np.asarray(traj.sequence_mask_bt)
  logp = np.asarray(run.policy_logp(run.params, tokens, seq))
  mask = np.asarray(traj.response_mask_bt)
  stats = offpolicy.consistency_stats(logp, np.asarray(traj.behaviour_logp_bt), mask)
  return {"stats": stats, "alerts": offpolicy.consistency_alerts(stats, run.thresholds),
          "rows": int(tokens.shape[0]), "tokens": int(mask.sum()), "sample_s": seconds, "sampler": sampler,
          "policy_version": int(run.state.train.policy_version)}
