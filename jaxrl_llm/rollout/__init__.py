"""Sampler actors on Ray, the trajectory queue and PipelineRL scheduling.

  schema     WorkItem / RolloutChunk (versioned); validate_chunk / validate_rows at the queue boundary
  actor      SamplerWorker: a Ray actor wrapping any Sampler; staged, monotone weight updates
  segments   generation in segments, so weights can change mid-response (PipelineRL)
  pool       SamplerPool: N actors, FIFO dispatch, validation, fault handling, weight publishing
  repair     RepairBook: hold a chunk with bad rows, re-sample each row alone, merge them back
  pipeline   PipelineFeeder: dispatch ahead of the learner within a staleness bound k
  cluster    ensure_ray: join a cluster or start one on loopback; the actors' driver watchdog
  reaper     ends a local cluster's processes when its driver dies (a stdlib-only process)

Ray is imported lazily (inside the pool and actor factories), so importing this
package does not start or require a cluster.
"""

from jaxrl_llm.rollout.actor import SamplerSpec, SamplerWorker
from jaxrl_llm.rollout.cluster import ensure_ray
from jaxrl_llm.rollout.pipeline import PipelineFeeder
from jaxrl_llm.rollout.pool import PoolStats, SamplerPool
from jaxrl_llm.rollout.repair import RepairBook, merge_rows, row_item
from jaxrl_llm.rollout.schema import (SCHEMA_VERSION, ChunkReasons, RolloutChunk, WorkItem, concat_chunks,
                                      concat_episode_fields,
                                      validate_chunk, validate_rows)
from jaxrl_llm.rollout.segments import generate_in_segments

__all__ = ["SCHEMA_VERSION", "ChunkReasons", "PipelineFeeder", "PoolStats", "RepairBook", "RolloutChunk",
           "SamplerPool", "SamplerSpec", "SamplerWorker", "WorkItem", "concat_chunks", "concat_episode_fields", "ensure_ray",
           "generate_in_segments", "merge_rows", "row_item", "validate_chunk", "validate_rows"]
