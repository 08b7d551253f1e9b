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
* a chunk whose oldest token is more than ``k`` versions behind the learner
  when its step is taken (possible after faults, or when the off-policy
  controller narrows ``k``) is dropped, counted (``pipeline/stale_dropped``)
  and re-sampled with the current version;
* ``k = 0`` is the synchronous loop: step ``t`` is dispatched after update
  ``t`` is published and sampled with exactly those weights, with the same
  keys as the synchronous loop, so the same seed gives the same trajectories
  and the same updates (tested).

Exact versions (``exact_versions=True``, ``rollout.exact_versions``): with
``k >= 1`` which version samples step ``s`` depends on timing (an actor takes
the newest weights it holds, at least ``base + max(0, s - k)``). In exact mode
step ``s`` is sampled by exactly version ``base + max(0, s - k)``, never a newer
one (``WorkItem.version``; the actors keep the last ``k + 1`` versions, see
:mod:`jaxrl_llm.rollout.actor`): PipelineRL with a fixed lag, and a run that
gives the same data, hence (in batch-invariant mode) the same parameters,
whatever the timing.

Checkpoints (:meth:`PipelineFeeder.get_state` / :meth:`PipelineFeeder.set_state`):
the state holds the next step to dispatch, every dispatched work item not yet
trained on (request id, step, chunk, prompts, sampling key, target version),
the chunks sampled for them (trajectory arrays and response tokens), ``k``
(the controller's current window), the base version and the counters. To get
there the feeder *drains* first: it waits until every dispatched item has come
back, so the pipeline has a bubble at each checkpoint (the samplers idle
from the end of the drain until the next step is dispatched). Draining is what
makes the resume exact: an item still queued or running would have to be
sampled again after the restart with a weight version the restarted actors no
longer hold. A resumed feeder starts with those chunks ready and dispatches
from the saved next step, so nothing sampled before the checkpoint is sampled
again.

Reference: Piché et al., "PipelineRL" (arXiv:2509.19128); ScaleRL (Khatri et
al., arXiv:2510.13786) uses PipelineRL with k = 8.
"""

from __future__ import annotations

import base64
import dataclasses
import time
import zlib
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxrl_llm.rollout.pool import SamplerPool
from jaxrl_llm.rollout.schema import RolloutChunk, WorkItem
from jaxrl_llm.types import Trajectory

STATE_FORMAT = 1
"""Version of :meth:`PipelineFeeder.get_state`'s layout."""


class PipelineFeeder:
  """Dispatches data steps ahead of the learner and hands them back whole.

  Args:
    pool: the sampler pool.
    step_prompts: ``step_prompts(s) -> (prompts, rng)`` or ``(prompts, rng, examples)``: the
      G prompts and the raw sampling key of data step ``s`` (called once per step, in order),
      and for multi-turn episodes the G task examples (they travel in the work items).
    num_samples: n responses per prompt.
    max_lag: k >= 0, the staleness bound in policy versions.
    base_version: the learner's policy version before the first RL update.
    chunks_per_step: work items per step (prompt groups are split evenly).
    exact_versions: sample step ``s`` with exactly version ``base + max(0, s - k)``
      (the pool's actors must keep ``k + 1`` versions: ``SamplerSpec.keep_versions``).
    timeout_s: how long :meth:`take` and :meth:`drain` wait for samples.
  """

  def __init__(self, pool: SamplerPool, step_prompts: Callable[[int], tuple[Sequence[Sequence[int]], np.ndarray]],
               *, num_samples: int, max_lag: int, base_version: int, chunks_per_step: int = 1,
               exact_versions: bool = False, timeout_s: float = 1800.0):
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
    self.exact_versions = bool(exact_versions)
    self.timeout_s = timeout_s
    self._next_step = 0
    self._items: dict[tuple[int, int], WorkItem] = {}
    self._ready: dict[tuple[int, int], RolloutChunk] = {}
    self.stale_dropped = 0
    self.submitted = 0  # work items handed to the pool by this feeder (and the runs it resumes)
    self.restored = 0  # chunks this feeder started with, from a checkpoint
    self.wait_seconds = 0.0

  # ------------------------------------------------------------------ dispatch

  def target_version(self, step: int) -> int:
    """The policy version data step ``step`` asks for (exactly, in exact mode; at least, otherwise)."""
    return self.base_version + max(0, step - self.max_lag)

  def _submit(self, item: WorkItem, min_version: int, front: bool = False) -> None:
    self._items[(item.step, item.chunk)] = item
    self.submitted += 1
    self.pool.submit(item, min_version, front=front)

  def _dispatch_until(self, learner_step: int) -> None:
    while self._next_step <= learner_step + self.max_lag:
      s = self._next_step
      prompts, rng, *examples = self._step_prompts(s)  # (ids, key[, examples]): examples for episodes
      examples = list(examples[0]) if examples else []
      min_version = self.target_version(s)
      bounds = np.linspace(0, len(prompts), min(self.chunks_per_step, len(prompts)) + 1).astype(int)
      for c, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        item = WorkItem(request_id=self.pool.new_request_id(), step=s, chunk=c,
                        prompts=tuple(tuple(int(t) for t in p) for p in prompts[lo:hi]),
                        num_samples=self.num_samples, rng=np.asarray(rng, np.uint32),
                        first_row=int(lo) * self.num_samples, version=min_version if self.exact_versions else -1,
                        examples=tuple(examples[lo:hi]))
        self._submit(item, min_version)
      self._next_step += 1

  def _receive(self, chunks: Sequence[RolloutChunk]) -> None:
    for chunk in chunks:
      key = (chunk.step, chunk.chunk)
      if key in self._ready or key not in self._items:
        self.pool.stats.duplicates += 1
        continue
      self._ready[key] = chunk

  def _wait_for(self, keys: Sequence[tuple[int, int]], what: str, timeout_s: float) -> None:
    t0 = time.perf_counter()
    while any(k not in self._ready for k in keys):
      if time.perf_counter() - t0 > timeout_s:
        missing = [k for k in keys if k not in self._ready]
        raise TimeoutError(f"no samples for {what} (step, chunk) {missing} after {timeout_s:.0f} s "
                           f"(pool: {self.pool.stats.as_metrics()})")
      self._receive(self.pool.poll(timeout_s=1.0))
    self.wait_seconds += time.perf_counter() - t0

  def take(self, learner_step: int, timeout_s: Optional[float] = None) -> list[RolloutChunk]:
    """Blocks until every chunk of data step ``learner_step`` is ready; returns them in chunk order.

    Also dispatches further steps up to ``learner_step + k``. A chunk more than
    ``k`` versions behind the learner is dropped and sampled again with the
    learner's version (exactly that version in exact mode).
    """
    timeout_s = self.timeout_s if timeout_s is None else timeout_s
    self._dispatch_until(learner_step)
    version = self.base_version + learner_step
    keys = sorted(k for k in self._items if k[0] == learner_step)
    while True:
      self._wait_for(keys, f"step {learner_step}", timeout_s)
      stale = [k for k in keys if 0 <= self._ready[k].oldest_version() < version - self.max_lag]
      if not stale:
        break
      for k in stale:
        self.stale_dropped += 1
        del self._ready[k]
        item = self._items[k]
        self._submit(dataclasses.replace(item, request_id=self.pool.new_request_id(),
                                         version=version if self.exact_versions else -1), version, front=True)
    chunks = [self._ready.pop(k) for k in keys]
    for k in keys:
      del self._items[k]
    return chunks

  def drain(self, timeout_s: Optional[float] = None) -> None:
    """Waits until every dispatched work item has come back (nothing queued or running)."""
    self._wait_for(sorted(self._items), "the drain before a checkpoint", self.timeout_s if timeout_s is None
                   else timeout_s)

  def step_items(self, step: int) -> list[WorkItem]:
    """The dispatched, not yet taken work items of data step ``step``, in chunk order."""
    return [self._items[k] for k in sorted(self._items) if k[0] == step]

  def pending_steps(self) -> list[int]:
    """Data steps dispatched and not yet taken, in order."""
    return sorted({s for s, _ in self._items})

  def metrics(self) -> dict[str, float]:
    return {"pipeline/stale_dropped": float(self.stale_dropped), "pipeline/wait_s": self.wait_seconds,
            "pipeline/queued_steps": float(self._next_step), "pipeline/submitted": float(self.submitted),
            **{k: float(v) for k, v in self.pool.stats.as_metrics().items()}}

  # ------------------------------------------------------------------ checkpoint state

  def get_state(self) -> dict:
    """Drains (see the module docstring), then the JSON-serialisable state of the pipeline.

    Keys: ``format``, ``next_step``, ``base_version``, ``max_lag``,
    ``exact_versions``, ``num_samples``, ``chunks_per_step``, ``stale_dropped``,
    ``submitted``, ``items`` (the WorkItems not yet taken) and ``chunks`` (their
    sampled chunks, same order). Arrays are stored as zlib-compressed base64
    bytes with their dtype and shape (:func:`to_json`), so they come back bit
    for bit.
    """
    self.drain()
    keys = sorted(self._items)
    return {"format": STATE_FORMAT, "next_step": self._next_step, "base_version": self.base_version,
            "max_lag": self.max_lag, "exact_versions": self.exact_versions, "num_samples": self.num_samples,
            "chunks_per_step": self.chunks_per_step, "stale_dropped": self.stale_dropped,
            "submitted": self.submitted, "items": [to_json(self._items[k]) for k in keys],
            "chunks": [to_json(self._ready[k]) for k in keys]}

  def set_state(self, state: dict) -> None:
    """Restores :meth:`get_state`'s output into a feeder that has dispatched nothing yet.

    The saved chunks are ready to be taken and dispatching continues at the
    saved next step; ``max_lag`` and ``base_version`` are the saved ones.

    Raises:
      ValueError: on an unknown format, a feeder that has already dispatched
        work, or a state that does not fit this feeder (samples per prompt).
    """
    if int(state.get("format", -1)) != STATE_FORMAT:
      raise ValueError(f"pipeline state format {state.get('format')!r}: expected {STATE_FORMAT}")
    if self._next_step or self._items:
      raise ValueError("PipelineFeeder.set_state: the feeder has already dispatched work")
    if int(state["num_samples"]) != self.num_samples:
      raise ValueError(f"pipeline state: {state['num_samples']} samples per prompt, this run has "
                       f"rl.samples_per_prompt={self.num_samples}")
    items = [work_item_from_json(x) for x in state["items"]]
    chunks = [chunk_from_json(x) for x in state["chunks"]]
    if len(items) != len(chunks) or any((i.step, i.chunk) != (c.step, c.chunk) for i, c in zip(items, chunks)):
      raise ValueError("pipeline state: its work items and chunks do not match one to one")
    self._next_step = int(state["next_step"])
    self.base_version = int(state["base_version"])
    self.max_lag = int(state["max_lag"])
    self.stale_dropped = int(state["stale_dropped"])
    self.submitted = int(state["submitted"])
    self._items = {(i.step, i.chunk): i for i in items}
    self._ready = {(c.step, c.chunk): c for c in chunks}
    self.restored = len(chunks)


# ---------------------------------------------------------------------- JSON form of work items and chunks


def to_json(value: Any) -> Any:
  """``value`` in a form ``json`` can hold, exactly: arrays become ``{"__ndarray__": base64 of the
  zlib-compressed bytes, "dtype", "shape"}``, dataclasses (WorkItem, RolloutChunk, Trajectory)
  ``{"__fields__": {name: value}}``, tuples lists."""
  if isinstance(value, (np.ndarray, np.generic)) or (hasattr(value, "__array__") and hasattr(value, "dtype")):
    a = np.ascontiguousarray(np.asarray(value))
    return {"__ndarray__": base64.b64encode(zlib.compress(a.tobytes(), 1)).decode("ascii"), "dtype": a.dtype.str,
            "shape": list(a.shape)}
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {"__fields__": {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}}
  if isinstance(value, dict):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  return value


def from_json(value: Any) -> Any:
  """Inverse of :func:`to_json` (dataclasses come back as dicts of their fields)."""
  if isinstance(value, dict):
    if "__ndarray__" in value:
      raw = zlib.decompress(base64.b64decode(value["__ndarray__"]))
      return np.frombuffer(raw, np.dtype(value["dtype"])).reshape(value["shape"]).copy()
    if "__fields__" in value:
      return {k: from_json(v) for k, v in value["__fields__"].items()}
    return {k: from_json(v) for k, v in value.items()}
  if isinstance(value, list):
    return [from_json(v) for v in value]
  return value


def _fields_of(cls: type, saved: dict) -> dict:
  names = {f.name for f in dataclasses.fields(cls)}
  return {k: v for k, v in saved.items() if k in names}


def work_item_from_json(value: Any) -> WorkItem:
  fields = _fields_of(WorkItem, from_json(value))
  fields["prompts"] = tuple(tuple(int(t) for t in p) for p in fields["prompts"])
  fields["rng"] = np.asarray(fields["rng"], np.uint32)
  fields["examples"] = tuple(_example(e) for e in fields.get("examples", ()))
  return WorkItem(**fields)


def _example(saved: dict) -> Any:
  from jaxrl_llm.tasks.base import Example  # pylint: disable=import-outside-toplevel
  return Example(**_fields_of(Example, saved))


def chunk_from_json(value: Any) -> RolloutChunk:
  fields = _fields_of(RolloutChunk, from_json(value))
  saved = _fields_of(Trajectory, fields["trajectory"])
  # checkpoints written before multi-turn rows existed have no observation mask: single-turn rows
  saved.setdefault("observation_mask_bt", np.zeros_like(np.asarray(saved["response_mask_bt"])))
  fields["trajectory"] = Trajectory(**saved)
  fields["response_tokens"] = [[int(t) for t in r] for r in fields["response_tokens"]]
  return RolloutChunk(**fields)
