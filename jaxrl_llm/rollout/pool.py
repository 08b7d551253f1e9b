"""A pool of sampler actors on Ray: dispatch, weight publishing, fault handling.

The pool owns N :class:`~jaxrl_llm.rollout.actor.SamplerWorker` actors. Work
items wait in a FIFO and go to idle actors; :meth:`SamplerPool.poll` returns
finished chunks. Every chunk is validated at this boundary
(:func:`~jaxrl_llm.rollout.schema.validate_chunk`) and rejections are counted
by reason (``rejected``, ``rejected_rows``):

* a whole-chunk problem (fingerprint, schema, shapes, row counts) re-queues the
  whole work item;
* bad rows are dropped and each is re-sampled alone with its own key (a one-row
  WorkItem; :mod:`jaxrl_llm.rollout.repair`); the chunk is held and delivered,
  whole, under its original request id, once every row is good.

A work item (or one row of it) rejected ``max_attempts`` times stops the run
with the reasons.

Faults: when an actor dies (``ray.kill``, SIGKILL, OOM) its in-flight work is
counted as lost (``lost_items``) and re-queued under a new request id, the
actor is replaced by a fresh one holding the latest published weights
(``restarts``, up to ``max_restarts`` per slot; after that the pool shrinks),
and the answer to the old request id, should it ever arrive, is dropped as a
duplicate. A work item that fails ``max_attempts`` times with an exception
raised by the sampler itself stops the run with that exception.

Weights: :meth:`SamplerPool.publish` copies the learner's params to the host
once, ``ray.put`` s them once, and sends the reference to every actor; the
seconds and bytes of each publish are recorded.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from jaxrl_llm.models import lora
from jaxrl_llm.rollout import placement
from jaxrl_llm.rollout.actor import AdapterUpdate, SamplerSpec, remote_actor_class
from jaxrl_llm.rollout.cluster import ensure_ray
from jaxrl_llm.rollout.repair import RepairBook
from jaxrl_llm.rollout.schema import ChunkReasons, RolloutChunk, WorkItem

log = logging.getLogger("jaxrl_llm")


@dataclasses.dataclass
class PoolStats:
  """Counters of a pool's life (all cumulative)."""

  dispatched: int = 0
  delivered: int = 0
  lost_items: int = 0
  restarts: int = 0
  duplicates: int = 0
  rejected: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  rejected_rows: int = 0
  failures: int = 0
  publishes: int = 0
  publish_seconds: float = 0.0
  publish_bytes: int = 0

  def as_metrics(self) -> dict[str, float]:
    return {"pool/dispatched": self.dispatched, "pool/delivered": self.delivered,
            "pool/lost_items": self.lost_items, "pool/restarts": self.restarts,
            "pool/duplicates": self.duplicates, "pool/rejected": sum(self.rejected.values()),
            "pool/rejected_rows": self.rejected_rows,
            "pool/failures": self.failures,
            "pool/publish_s": self.publish_seconds / max(self.publishes, 1),
            "pool/publish_mb": self.publish_bytes / max(self.publishes, 1) / 2**20}


@dataclasses.dataclass
class _Slot:
  name: str
  actor: Any
  restarts: int = 0
  busy: bool = False


class SamplerPool:
  """N sampler actors fed from one FIFO of WorkItems.

  Args:
    spec: how each actor builds its sampler.
    params: initial policy weights (any pytree; copied to the host).
    version: their policy version.
    num_samplers: N >= 1.
    validate: ``validate(chunk) -> list of reasons`` run on every delivered chunk;
      a :class:`~jaxrl_llm.rollout.schema.ChunkReasons` (what ``validate_chunk``
      returns) names bad rows apart, and only those are re-sampled; any other
      non-empty list rejects the whole chunk.
    address: Ray cluster address ("" or None: start a local cluster on loopback).
    actor_cpus: CPUs reserved per actor (Ray scheduling).
    local_gpus: ``rollout.local_gpus``: the GPUs a local cluster started here offers to
      the actors ("auto": the machine's GPUs that the learner's JAX does not use).
      Each actor asks for ``spec.gpus`` of them (:mod:`jaxrl_llm.rollout.placement`).
    max_restarts: replacements per actor slot before the slot is given up.
    max_attempts: tries of one work item whose sampler call raises or whose
      answer is rejected, and of one row that is rejected.
  """

  def __init__(self, spec: SamplerSpec, params: Any, version: int, *, num_samplers: int,
               validate: Callable[[RolloutChunk], list[str]], address: Optional[str] = None,
               actor_cpus: float = 1.0, local_gpus: str = "auto", max_restarts: int = 3, max_attempts: int = 3):
    if num_samplers < 1:
      raise ValueError(f"rollout.num_samplers={num_samplers}: expected >= 1")
    import ray

    self._ray = ray
    resources = placement.ActorResources(cpus=actor_cpus, gpus=spec.gpus)
    if address:
      ensure_ray(address)
      cluster = f"the Ray cluster at rollout.address={address!r}"
      learner = placement.learner_gpu_ids()
      here = placement.learner_node_gpus(ray) if learner and resources.gpus else 0
      if here:
        log.warning("the learner runs on GPUs %s and this host's Ray node declares %g GPUs: Ray may place a sampler "
                    "actor on a learner GPU; start this host's node with `ray start --num-gpus=0` (docs/scaling.md)",
                    learner, here)
    else:
      gpu_ids = placement.local_sampler_gpus(local_gpus, placement.learner_gpu_ids(), placement.machine_gpu_ids())
      ensure_ray(None, gpu_ids=gpu_ids)
      cluster = f"the local Ray cluster (rollout.local_gpus={local_gpus!r} gave {gpu_ids or 'no GPUs'})"
    placement.check_capacity(resources, num_samplers, placement.node_gpus(ray), cluster=cluster, kind=spec.kind,
                             weight_transport=spec.engine_config().transport)
    self._placer = placement.Placer(ray, resources)
    self.placement: list[dict[str, Any]] = []  # each actor's describe() at start (start_sampler_pool sets it)
    self.spec = spec
    self.stats = PoolStats()
    self._validate = validate
    self._max_restarts = max_restarts
    self._max_attempts = max_attempts
    self._cls = remote_actor_class(actor_cpus)
    self._version = int(version)
    self._weights_ref = ray.put(_to_host(params))
    # LoRA with JAX actors: after the first weights, publish only the adapters (the base is frozen).
    self._adapters_only = spec.kind == "jax" and lora.has_adapters(params)
    self._adapters_ref = None  # the newest AdapterUpdate, for restarted actors
    self._slots = [self._start(f"sampler-{i}") for i in range(num_samplers)]
    self._pending: collections.deque[tuple[WorkItem, int]] = collections.deque()
    self._in_flight: dict[Any, tuple[_Slot, WorkItem, int]] = {}
    self._attempts: collections.Counter = collections.Counter()
    self._request_ids = itertools.count(1)
    self._live_requests: set[int] = set()
    self._repair = RepairBook(spec.model_config.pad_token_id)

  # ---------------------------------------------------------------- actors

  def _start(self, name: str, restarts: int = 0) -> _Slot:
    actor = self._cls.options(name=None, **self._placer.options(name)).remote(self.spec, self._weights_ref,
                                                                             self._version, name, self._adapters_ref)
    return _Slot(name=name, actor=actor, restarts=restarts)

  def describe(self, timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Each live actor's :meth:`~jaxrl_llm.rollout.actor.SamplerWorker.describe` (waits for them to start)."""
    return self._ray.get([s.actor.describe.remote() for s in self._slots], timeout=timeout_s)

  @property
  def num_samplers(self) -> int:
    return len(self._slots)

  def actors(self) -> list[Any]:
    """The live actor handles (for tests that kill one)."""
    return [s.actor for s in self._slots]

  def new_request_id(self) -> int:
    return next(self._request_ids)

  # ---------------------------------------------------------------- work

  def submit(self, item: WorkItem, min_version: int = -1, front: bool = False) -> None:
    """Queues ``item``; an actor starts it once it holds ``min_version`` or newer."""
    self._live_requests.add(item.request_id)
    (self._pending.appendleft if front else self._pending.append)((item, min_version))
    self._dispatch()

  @property
  def outstanding(self) -> int:
    """Work items queued or running."""
    return len(self._pending) + len(self._in_flight)

  def _dispatch(self) -> None:
    for slot in self._slots:
      if not self._pending:
        return
      if slot.busy:
        continue
      item, min_version = self._pending.popleft()
      ref = slot.actor.generate.remote(item, min_version)
      slot.busy = True
      self._in_flight[ref] = (slot, item, min_version)
      self.stats.dispatched += 1

  def poll(self, timeout_s: float = 1.0) -> list[RolloutChunk]:
    """Waits up to ``timeout_s`` for finished work; returns the valid chunks that arrived.

    Chunks are whole: a chunk with bad rows is returned (under its original
    request id) only once each of those rows has been re-sampled validly.
    """
    ray = self._ray
    self._dispatch()
    if not self._in_flight:
      return []
    refs = list(self._in_flight)
    ready, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
    if ready:  # then take everything else that is already done, without waiting
      ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    out = []
    for ref in ready:
      slot, item, min_version = self._in_flight.pop(ref)
      slot.busy = False
      try:
        chunk = ray.get(ref)
      except ray.exceptions.RayActorError as e:
        self._replace(slot, e)
        self._requeue(item, min_version, lost=True)
        continue
      except ray.exceptions.RayTaskError as e:
        self.stats.failures += 1
        self._attempts[(item.step, item.chunk)] += 1
        if self._attempts[(item.step, item.chunk)] >= self._max_attempts:
          raise RuntimeError(f"sampler {slot.name} failed step {item.step} chunk {item.chunk} "
                             f"{self._max_attempts} times; last error:\n{e}") from e
        log.warning("sampler %s failed on step %d chunk %d (retrying): %s", slot.name, item.step, item.chunk, e)
        self._requeue(item, min_version, lost=False)
        continue
      if chunk.request_id not in self._live_requests:
        self.stats.duplicates += 1
        continue
      whole = self._accept(chunk, item, min_version)
      if whole is not None:
        self.stats.delivered += 1
        out.append(whole)
    self._dispatch()
    return out

  def _accept(self, chunk: RolloutChunk, item: WorkItem, min_version: int) -> Optional[RolloutChunk]:
    """Validates the answer to ``item``: the whole chunk to deliver, or None (rejected, or rows missing)."""
    origin = self._repair.origin(item.request_id)  # (original item, its row) when ``item`` re-samples one row
    whole_reasons, row_reasons = self._check(chunk, item)
    where = f"step {item.step} chunk {item.chunk}"
    if whole_reasons:
      self._count_rejected(whole_reasons, rows=len(item.prompts) * item.num_samples)
      log.warning("rejected a chunk from %s (%s%s): %s", chunk.sampler_id, where,
                  f" row {origin[1]}" if origin else "", "; ".join(whole_reasons))
      self._count_attempt((item.step, item.chunk), f"{where} was rejected", whole_reasons)
      self._requeue(item, min_version, lost=False)
      return None
    if row_reasons:
      first = origin[1] if origin else 0  # a re-sample's row 0 is row ``first`` of the original item
      log.warning("rejected %d row(s) from %s (%s), re-sampling them alone: %s", len(row_reasons), chunk.sampler_id,
                  where, "; ".join(f"row {first + r}: {', '.join(v)}" for r, v in row_reasons.items()))
      for r, reasons in row_reasons.items():
        self._count_rejected(reasons, rows=1)
        self._count_attempt((item.step, item.chunk, first + r), f"{where} row {first + r} was rejected", reasons)
      if origin:
        self._requeue(item, min_version, lost=False)
      else:
        self._live_requests.discard(item.request_id)
        for row in self._repair.hold(item, chunk, row_reasons, self.new_request_id):
          self.submit(row, min_version, front=True)
      return None
    self._live_requests.discard(item.request_id)
    return self._repair.put(item.request_id, chunk) if origin else chunk

  def _check(self, chunk: RolloutChunk, item: WorkItem) -> tuple[list[str], dict[int, list[str]]]:
    """``(whole-chunk reasons, {local row: reasons})`` of the answer to ``item``."""
    reasons = self._validate(chunk)
    if not isinstance(reasons, ChunkReasons):  # a plain list: every reason is about the whole chunk
      reasons = ChunkReasons(reasons)
    expected = len(item.prompts) * item.num_samples
    if not reasons.chunk and chunk.num_rows != expected:
      return [f"{chunk.num_rows} rows: expected {expected} (prompts x samples)"], {}
    return reasons.chunk, reasons.rows

  def _count_rejected(self, reasons: list[str], rows: int) -> None:
    for reason in reasons:
      self.stats.rejected[reason.split(":")[0]] += 1
    self.stats.rejected_rows += rows

  def _count_attempt(self, key: tuple, what: str, reasons: list[str]) -> None:
    self._attempts[key] += 1
    if self._attempts[key] >= self._max_attempts:
      raise RuntimeError(f"{what} {self._max_attempts} times: " + "; ".join(reasons))

  def _requeue(self, item: WorkItem, min_version: int, *, lost: bool) -> None:
    self._live_requests.discard(item.request_id)
    if lost:
      self.stats.lost_items += 1
    again = dataclasses.replace(item, request_id=self.new_request_id())
    self._repair.renamed(item.request_id, again.request_id)
    self.submit(again, min_version, front=True)

  def _replace(self, slot: _Slot, error: Exception) -> None:
    """Replaces a dead actor (or gives its slot up after ``max_restarts``)."""
    log.warning("sampler %s died (%s); its in-flight work is re-queued", slot.name, type(error).__name__)
    self._slots.remove(slot)
    self._placer.release(slot.name)
    if slot.restarts < self._max_restarts:
      self._slots.append(self._start(slot.name, slot.restarts + 1))
      self.stats.restarts += 1
    if not self._slots:
      raise RuntimeError("every sampler actor died and none could be restarted "
                         f"(max_restarts={self._max_restarts}); see the actors' logs")

  # ---------------------------------------------------------------- weights

  def publish(self, params: Any, version: int) -> float:
    """Sends ``params`` (version ``version``) to every actor; returns the seconds spent.

    A LoRA run's JAX actors receive only the adapters (:class:`~jaxrl_llm.rollout.actor.AdapterUpdate`):
    the base weights they got at start never change. ``stats.publish_bytes`` counts what is sent.

    Raises:
      ValueError: when ``version`` is not newer than the last published one.
    """
    if int(version) <= self._version:
      raise ValueError(f"publish: version {version} is not newer than the published {self._version}")
    t0 = time.perf_counter()
    if self._adapters_only:
      host = AdapterUpdate(_to_host(lora.adapters_only(params)))
      ref = self._adapters_ref = self._ray.put(host)
    else:
      host = _to_host(params)
      ref = self._weights_ref = self._ray.put(host)
    self._version = int(version)
    for slot in self._slots:
      slot.actor.update_weights.remote(ref, self._version)
    seconds = time.perf_counter() - t0
    self.stats.publishes += 1
    self.stats.publish_seconds += seconds
    self.stats.publish_bytes += sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(
        host.adapters if isinstance(host, AdapterUpdate) else host))
    return seconds

  @property
  def published_version(self) -> int:
    return self._version

  def shutdown(self) -> None:
    for slot in self._slots:
      try:
        self._ray.kill(slot.actor)
      except Exception:  # already dead
        pass
    self._slots = []
    self._placer.release_all()


def _to_host(params: Any) -> Any:
  """A numpy copy of a (possibly sharded) pytree."""
  return jax.tree.map(np.asarray, jax.device_get(params))
