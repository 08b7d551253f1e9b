"""PipelineRL scheduling: keep samplers busy within a staleness bound k.

Data step ``s`` (the prompts of the learner's ``s``-th update) is split into
``chunks_per_step`` work items. With the learner at version ``base + t``
(after ``t`` RL updates):

* step ``s`` may be dispatched once ``s <= t + k``, and its work items ask for
  weights of version ``>= base + max(0, s - k)``. So the data of step ``s``
  is at most ``k`` versions behind the learner that consumes it at ``t = s``,
  and at most ``k + 1`` steps of data are queued or running: memory stays
  bounded and a slow learner holds the samplers back (backpressure);
* the learner takes step ``t``'s chunks as soon as they are all there: with
  ``k >= 1`` it trains on data sampled by older weights instead of waiting for
  fresh samples;
* a chunk whose oldest token is more than ``k`` versions behind (possible only
  after faults) is dropped, counted (``pipeline/stale_dropped``) and
  re-sampled with current weights;
* ``k = 0`` is the synchronous loop: step ``t`` is dispatched after update
  ``t`` is published and sampled with exactly those weights, with the same
  keys as the synchronous loop, so the same seed gives the same trajectories
  and the same updates (tested).

Reference: Piché et al., "PipelineRL" (arXiv:2509.19128); ScaleRL (Khatri et
al., arXiv:2510.13786) uses PipelineRL with k = 8.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np

from jaxrl_llm.rollout.pool import SamplerPool
from jaxrl_llm.rollout.schema import RolloutChunk, WorkItem


class PipelineFeeder:
  """Dispatches data steps ahead of the learner and hands them back whole.

  Args:
    pool: the sampler pool.
    step_prompts: ``step_prompts(s) -> (prompts, rng)``: the G prompts and the
      raw sampling key of data step ``s`` (called once per step, in order).
    num_samples: n responses per prompt.
    max_lag: k >= 0, the staleness bound in policy versions.
    base_version: the learner's policy version before the first RL update.
    chunks_per_step: work items per step (prompt groups are split evenly).
  """

  def __init__(self, pool: SamplerPool, step_prompts: Callable[[int], tuple[Sequence[Sequence[int]], np.ndarray]],
               *, num_samples: int, max_lag: int, base_version: int, chunks_per_step: int = 1):
    if max_lag < 0:
      raise ValueError(f"rollout.max_lag={max_lag}: expected >= 0")
    if chunks_per_step < 1:
      raise ValueError(f"rollout.chunks_per_step={chunks_per_step}: expected >= 1")
    self.pool = pool
    self._step_prompts = step_prompts
    self.num_samples = num_samples
    self.max_lag = max_lag
    self.base_version = base_version
    self.chunks_per_step = chunks_per_step
    self._next_step = 0
    self._items: dict[tuple[int, int], WorkItem] = {}
    self._ready: dict[tuple[int, int], RolloutChunk] = {}
    self.stale_dropped = 0
    self.wait_seconds = 0.0

  def _dispatch_until(self, learner_step: int) -> None:
    while self._next_step <= learner_step + self.max_lag:
      s = self._next_step
      prompts, rng = self._step_prompts(s)
      min_version = self.base_version + max(0, s - self.max_lag)
      bounds = np.linspace(0, len(prompts), min(self.chunks_per_step, len(prompts)) + 1).astype(int)
      for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        item = WorkItem(request_id=self.pool.new_request_id(), step=s, chunk=c,
                        prompts=tuple(tuple(int(t) for t in p) for p in prompts[lo:hi]),
                        num_samples=self.num_samples, rng=np.asarray(rng, np.uint32), first_row=int(lo) * self.num_samples)
        self._items[(s, c)] = item
        self.pool.submit(item, min_version)
      self._next_step += 1

  def take(self, learner_step: int, timeout_s: float = 1800.0) -> list[RolloutChunk]:
    """Blocks until every chunk of data step ``learner_step`` is ready; returns them in chunk order.

    Also dispatches further steps up to ``learner_step + k``.
    """
    self._dispatch_until(learner_step)
    version = self.base_version + learner_step
    keys = [k for k in self._items if k[0] == learner_step]
    t0 = time.perf_counter()
    while any(k not in self._ready for k in keys):
      if time.perf_counter() - t0 > timeout_s:
        missing = [k for k in keys if k not in self._ready]
        raise TimeoutError(f"no samples for step {learner_step} chunks {missing} after {timeout_s:.0f} s "
                           f"(pool: {self.pool.stats.as_metrics()})")
      for chunk in self.pool.poll(timeout_s=1.0):
        key = (chunk.step, chunk.chunk)
        if key in self._ready or key not in self._items:
          self.pool.stats.duplicates += 1
          continue
        if chunk.step == learner_step and version - chunk.oldest_version() > self.max_lag:
          self.stale_dropped += 1
          item = self._items[key]
          self.pool.submit(dataclasses.replace(item, request_id=self.pool.new_request_id()), version, front=True)
          continue
        self._ready[key] = chunk
    self.wait_seconds += time.perf_counter() - t0
    chunks = [self._ready.pop(k) for k in sorted(keys)]
    for k in keys:
      del self._items[k]
    return chunks

  def metrics(self) -> dict[str, float]:
    return {"pipeline/stale_dropped": float(self.stale_dropped), "pipeline/wait_s": self.wait_seconds,
            "pipeline/queued_steps": float(self._next_step), **{k: float(v) for k, v in
                                                                self.pool.stats.as_metrics().items()}}
