"""A Ray actor that wraps any :class:`~jaxrl_llm.sampling.Sampler` and answers WorkItems.

The actor holds one sampler built in its own process from a picklable
:class:`SamplerSpec`. Weights arrive through Ray's object store
(``update_weights(params_ref, version)``): the learner ``ray.put``s one host
copy per publish and every actor reads it, so the transfer cost is one
serialisation per step, not one per actor.

Versions and in-flight updates (PipelineRL, arXiv:2509.19128):

* a new version is *staged* when it arrives and *applied* at the next segment
  boundary, under a lock that a segment's generation also holds, so no forward
  pass ever mixes two versions' weights;
* with ``segment_tokens`` set, a response is generated in segments of that
  many tokens; between segments the staged weights (if any) are applied and
  unfinished rows continue from their prompt + partial response with the new
  weights (their keys and values are recomputed, not reused from the old
  weights). Each token records the version that sampled it;
* versions are monotone: an update older than (or equal to) the current
  version is ignored and counted;
* ``WorkItem.min_version`` makes an actor wait until it holds at least that
  version before sampling, which is how a staleness bound of k = 0 reproduces
  the synchronous loop exactly;
* exact versions (``rollout.exact_versions``): an item with ``WorkItem.version
  >= 0`` is sampled by exactly that version, whatever the actor holds when it
  starts the item. The actor keeps the weights of the ``spec.keep_versions``
  newest versions it has received (the pipeline's lag window, k + 1), waits
  until the item's version is among them, swaps those weights in for the call
  (under the generation lock) and puts the newest ones back afterwards. The
  item is generated whole: staged updates never land inside it. Memory: the
  kept versions are the host copies the weights arrive as (Ray's object
  store, shared by the actors of a node), so a node holds up to k + 1
  parameter sets instead of one. An actor started after a fault has only the
  version it started with; an exact item of an older version fails there
  with a message saying so (the pool retries it on another actor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Any, Optional

import numpy as np

from jaxrl_llm.models import lora
from jaxrl_llm.rollout import placement
from jaxrl_llm.rollout.cluster import free_port, watch_driver
from jaxrl_llm.rollout.schema import SCHEMA_VERSION, RolloutChunk, WorkItem
from jaxrl_llm.rollout.segments import generate_in_segments


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
  """Everything an actor needs to build its sampler (picklable).

  Attributes:
    model_config: the decoder's ModelConfig.
    sampler_config: SamplerConfig (num_samples is overridden per WorkItem).
    fingerprint: the learner's tokenizer/model ``Fingerprint.to_dict()``; the
      actor reports it with every chunk so the learner can reject a mismatch.
    kind: ``"jax"`` (built-in) or ``"vllm"``.
    segment_tokens: tokens per generation segment (0: whole responses in one
      call; in-flight weight updates then land between calls).
    platform: JAX platform for the actor process (``"cpu"`` keeps actors off
      the learner's accelerators).
    model_path: HF folder of the initial weights (vLLM loads the model from it;
      the pipeline exports the learner's weights there before starting actors).
    keep_versions: weight versions each actor keeps for exact-version work items
      (``rollout.exact_versions``: the lag window, ``rollout.max_lag + 1``); 1:
      only the newest.
    engine: the vLLM engine's :class:`~jaxrl_llm.sampling.vllm_engine.VllmEngineConfig`
      (``sampler.vllm.*`` and ``rollout.weight_transport``); None: its defaults.
    actor_gpus: ``rollout.actor_gpus`` (-1: what the sampler needs; see :attr:`gpus`).
    episodes: for multi-turn episodes (``config.env``), a picklable ``() ->
      EpisodeRunner`` the actor calls once (:func:`jaxrl_llm.jobs.episodes.episode_runner_builder`);
      None: single-turn sampling.
  """

  model_config: Any
  sampler_config: Any
  fingerprint: dict
  kind: str = "jax"
  segment_tokens: int = 0
  platform: str = "cpu"
  model_path: str = ""
  keep_versions: int = 1
  engine: Any = None
  actor_gpus: float = -1.0
  episodes: Any = None

  @property
  def gpus(self) -> int:
    """GPUs the actor asks Ray for (:func:`jaxrl_llm.rollout.placement.gpus_per_actor`)."""
    engine = self.engine_config()
    return placement.gpus_per_actor(self.kind, platform=self.platform, tensor_parallel_size=engine.tensor_parallel_size,
                                    weight_transport=engine.transport, actor_gpus=self.actor_gpus)

  def engine_config(self) -> Any:
    """The vLLM engine settings (the defaults when none were given)."""
    from jaxrl_llm.sampling.vllm_engine import VllmEngineConfig  # no vLLM import: a dataclass
    return self.engine if self.engine is not None else VllmEngineConfig()

  def build(self, params: Any, version: int):
    """Constructs the sampler (in the actor's process)."""
    if self.kind == "jax":
      from jaxrl_llm.sampling import JaxSampler
      return JaxSampler(self.model_config, params, self.sampler_config, version=version)
    if self.kind == "vllm":
      from jaxrl_llm.bridge.fingerprint import Fingerprint
      from jaxrl_llm.sampling.vllm_sampler import VllmSampler
      if not self.model_path:
        raise ValueError("SamplerSpec.model_path: the vLLM sampler needs an HF folder of the initial weights")
      # params are the weights already saved in model_path (same version); vLLM loads them from there.
      # The actor holds exactly the engine's GPUs (and the NCCL sender's): see VllmEngineConfig.in_actor.
      engine = self.engine_config().in_actor(nccl_port=free_port())
      return VllmSampler(self.model_config, self.model_path, Fingerprint.from_dict(self.fingerprint),
                         self.sampler_config, version=version, engine=engine)
    raise ValueError(f"SamplerSpec.kind={self.kind!r}: expected 'jax' or 'vllm'")


@dataclasses.dataclass(frozen=True)
class AdapterUpdate:
  """New LoRA adapters for a sampler that holds the (frozen) base weights.

  With ``model.lora.rank`` > 0 only the adapters change during training, so the pool
  sends a JAX sampler actor these (:func:`jaxrl_llm.models.lora.adapters_only`, host
  numpy) instead of the whole model: megabytes per update instead of the model's size.
  """

  adapters: Any


class SamplerWorker:
  """The actor body (a plain class; :func:`remote_actor_class` wraps it for Ray).

  Args:
    spec: how to build the sampler.
    params: initial weights (host numpy pytree).
    version: their policy version.
    sampler_id: a name for logs and fault accounting.
    adapters: an :class:`AdapterUpdate` that replaces the adapters of ``params`` (a restarted
      actor of a LoRA run gets the base weights and the newest adapters).

  In an actor of the local cluster, a watchdog thread ends the process when the driver
  is gone (:func:`~jaxrl_llm.rollout.cluster.watch_driver`).
  """

  def __init__(self, spec: SamplerSpec, params: Any, version: int, sampler_id: str,
               adapters: Optional[AdapterUpdate] = None):
    watch_driver()
    _pin_devices(spec)
    self.spec = spec
    self.sampler_id = sampler_id
    self._base = lora.without_adapters(params) if lora.has_adapters(params) else None  # LoRA: frozen base
    if adapters is not None:
      params = self._with_adapters(adapters)
    self.sampler = spec.build(params, version)
    self.episodes = spec.episodes() if spec.episodes is not None else None
    self._lock = threading.Lock()  # held while generating a segment and while swapping weights
    self._staged: Optional[tuple[Any, int]] = None
    self._staged_cv = threading.Condition()
    self.ignored_updates = 0
    # exact versions: version -> host weights, the newest spec.keep_versions received (guarded by _staged_cv)
    self._kept: dict[int, Any] = {int(version): params}
    self._first_version = int(version)

  # ---------------------------------------------------------------- weights

  def _with_adapters(self, update: AdapterUpdate) -> Any:
    if self._base is None:
      raise ValueError(f"sampler {self.sampler_id}: received LoRA adapters but holds a model without adapters")
    return lora.with_adapters(self._base, update.adapters)

  def update_weights(self, params: Any, version: int) -> int:
    """Stages ``params`` (or an :class:`AdapterUpdate`) as ``version``; applied at the next segment boundary.

    Returns:
      The version now staged or held (monotone).
    """
    if isinstance(params, AdapterUpdate):
      params = self._with_adapters(params)
    with self._staged_cv:
      self._keep(params, int(version))
      self._staged_cv.notify_all()  # exact-version items may be waiting for this version
      newest = self._staged[1] if self._staged else self.sampler.policy_version
      if int(version) <= newest:
        self.ignored_updates += 1
        return newest
      self._staged = (params, int(version))
    if self._lock.acquire(blocking=False):  # idle: apply now rather than at the next call
      try:
        self._apply_staged()
      finally:
        self._lock.release()
    return int(version)

  def _keep(self, params: Any, version: int) -> None:
    """Remembers ``version``'s weights (even when it arrives after a newer one); the caller holds
    ``self._staged_cv``. Only the ``spec.keep_versions`` newest are kept."""
    self._kept.setdefault(version, params)
    for old in sorted(self._kept)[:max(0, len(self._kept) - max(1, self.spec.keep_versions))]:
      del self._kept[old]

  def kept_versions(self) -> list[int]:
    """The versions whose weights this actor keeps for exact-version items (oldest first)."""
    with self._staged_cv:
      return sorted(self._kept)

  def _wait_for_exact(self, version: int, timeout_s: float) -> Any:
    """The weights of exactly ``version``, once received (they may still be on their way)."""
    deadline = time.monotonic() + timeout_s
    with self._staged_cv:
      while version not in self._kept:
        kept = sorted(self._kept)
        full = len(kept) >= max(1, self.spec.keep_versions)
        if version < self._first_version or (full and version < kept[0]):
          raise RuntimeError(
              f"sampler {self.sampler_id}: exact policy version {version} is not kept (kept: {kept}, started at "
              f"version {self._first_version}, keep_versions={self.spec.keep_versions}); an actor started "
              "after a fault cannot sample older versions exactly. Resume the run from its last checkpoint "
              "(nothing sampled before it is lost) or set rollout.exact_versions=False")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise TimeoutError(f"sampler {self.sampler_id}: waited {timeout_s:.0f} s for the weights of policy "
                             f"version {version}, keeping {kept}")
        self._staged_cv.wait(min(remaining, 1.0))
      return self._kept[version]

  def _generate_exact(self, params: Any, version: int, prompts, **kwargs):
    """Generates with ``version``'s weights swapped in; the caller holds ``self._lock``."""
    if self.sampler.policy_version == version:
      return self.sampler.generate(prompts, **kwargs)
    self.sampler.update_weights(params, version)
    try:
      return self.sampler.generate(prompts, **kwargs)
    finally:  # back to the newest weights received (what applying the staged ones would give)
      with self._staged_cv:
        newest = max(self._kept)
        if self._staged is not None and self._staged[1] <= newest:
          self._staged = None
        newest_params = self._kept[newest]
      self.sampler.update_weights(newest_params, newest)

  def _apply_staged(self) -> None:
    """Swaps in staged weights; the caller holds ``self._lock``."""
    with self._staged_cv:
      staged, self._staged = self._staged, None
    if staged is not None:
      self.sampler.update_weights(*staged)

  def policy_version(self) -> int:
    return self.sampler.policy_version

  def _wait_for_version(self, min_version: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
      with self._lock:
        self._apply_staged()
        if self.sampler.policy_version >= min_version:
          return
      with self._staged_cv:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise TimeoutError(f"sampler {self.sampler_id}: waited {timeout_s:.0f} s for policy version "
                             f">= {min_version}, holding {self.sampler.policy_version}")
        if self._staged is None:
          self._staged_cv.wait(min(remaining, 1.0))

  # ---------------------------------------------------------------- work

  def generate(self, item: WorkItem, min_version: int = -1, wait_timeout_s: float = 600.0) -> RolloutChunk:
    """Samples ``item`` (after holding at least ``min_version``; with exactly ``item.version``'s
    weights when that is >= 0) and returns a RolloutChunk."""
    exact = int(getattr(item, "version", -1))
    if exact >= 0:
      params = self._wait_for_exact(exact, wait_timeout_s)
    else:
      self._wait_for_version(min_version, wait_timeout_s)
    t0 = time.perf_counter()
    rng = np.asarray(item.rng, np.uint32)  # a raw (legacy) jax.random key
    row_ids = item.first_row + np.arange(len(item.prompts) * item.num_samples)
    if self.episodes is not None:
      return self._play(item, rng, row_ids, exact, t0)

    def segment(prompts, **kwargs):
      with self._lock:
        if exact >= 0:  # every segment with the item's version: updates never land inside it
          return self._generate_exact(params, exact, prompts, **kwargs)
        self._apply_staged()
        return self.sampler.generate(prompts, **kwargs)

    result = generate_in_segments(segment, [list(p) for p in item.prompts], num_samples=item.num_samples,
                                  rng=rng, row_ids=row_ids, segment_tokens=self.spec.segment_tokens,
                                  max_new_tokens=self.spec.sampler_config.max_new_tokens,
                                  pad_id=self.spec.model_config.pad_token_id)
    return RolloutChunk(schema_version=SCHEMA_VERSION, request_id=item.request_id, step=item.step,
                        chunk=item.chunk, sampler_id=self.sampler_id, fingerprint=dict(self.spec.fingerprint),
                        trajectory=result.trajectory, response_tokens=result.response_tokens,
                        sample_seconds=time.perf_counter() - t0)

  @contextlib.contextmanager
  def _between_turns(self):
    """Held around each turn of an episode: weights received in flight land here, between turns."""
    with self._lock:
      self._apply_staged()
      yield

  def _play(self, item: WorkItem, rng: np.ndarray, row_ids: np.ndarray, exact: int, t0: float) -> RolloutChunk:
    """``item`` as multi-turn episodes (``spec.episodes``): rows come scored."""
    if exact >= 0:
      raise ValueError(f"sampler {self.sampler_id}: exact-version work items cannot be played as episodes "
                       "(rollout.exact_versions with env.name)")
    if len(item.examples) != len(item.prompts):
      raise ValueError(f"sampler {self.sampler_id}: a work item of {len(item.prompts)} prompts carries "
                       f"{len(item.examples)} examples; episodes need one per prompt")
    out = self.episodes.run(self.sampler, list(item.examples), item.num_samples, rng, row_ids=row_ids,
                            guard=self._between_turns)
    return RolloutChunk(schema_version=SCHEMA_VERSION, request_id=item.request_id, step=item.step,
                        chunk=item.chunk, sampler_id=self.sampler_id, fingerprint=dict(self.spec.fingerprint),
                        trajectory=out.trajectory, response_tokens=out.response_tokens,
                        sample_seconds=time.perf_counter() - t0, rewards=out.rewards, episode_stats=out.stats)

  def ping(self) -> str:
    return self.sampler_id

  def weight_report(self, min_version: int = -1, wait_timeout_s: float = 600.0, checksums: bool = False
                    ) -> dict[str, Any]:
    """The weights this actor's sampler holds, for checks that the learner's reached it.

    Args:
      min_version: first wait until the sampler holds at least this version (staged
        weights are applied); -1: report what it holds now.
      wait_timeout_s: how long to wait for it.
      checksums: also sum every parameter (float64), between generation segments: the
        vLLM engine's per-rank ``report_weight_checksum`` (compare with
        :func:`jaxrl_llm.bridge.weight_transport.expected_checksums`), or the JAX
        sampler's ``{keystr(path): sum}``.

    Returns:
      ``{"sampler_id", "policy_version", "last_publish"`` (the last load into a vLLM
      engine: :class:`~jaxrl_llm.bridge.weight_transport.PublishStats` as a dict, or None),
      ``"error"`` (a wait that timed out, or None) and, with ``checksums``, ``"checksums"``
      (``{"kind": "vllm", "ranks": [...]}`` or ``{"kind": "jax", "sums": {...}}``)``}``.
    """
    out: dict[str, Any] = {"sampler_id": self.sampler_id, "error": None}
    if min_version >= 0:
      try:
        self._wait_for_version(min_version, wait_timeout_s)
      except TimeoutError as e:
        out["error"] = str(e)
    if checksums:
      with self._lock:  # not while a segment generates
        out["checksums"] = _checksums(self.sampler)
        out["policy_version"] = int(self.sampler.policy_version)  # the version the sums are of
    else:
      out["policy_version"] = int(self.sampler.policy_version)
    stats = getattr(self.sampler, "last_publish", None)
    out["last_publish"] = stats.to_dict() if stats is not None else None
    return out

  def describe(self) -> dict[str, Any]:
    """Where this actor runs and what its sampler was built with (logged by the pool at start).

    ``gpu_ids``: the GPUs Ray assigned; ``cuda_visible_devices``: what the process (and a
    vLLM engine's workers) see; ``engine_kwargs``: the exact ``vllm.LLM`` arguments.
    """
    try:
      import ray  # pylint: disable=import-outside-toplevel
      gpu_ids = [str(g) for g in ray.get_gpu_ids()] if ray.is_initialized() else []
    except ImportError:
      gpu_ids = []
    transport = self.spec.engine_config().transport if self.spec.kind == "vllm" else "object_store"
    return {"sampler_id": self.sampler_id, "kind": self.spec.kind, "pid": os.getpid(), "gpu_ids": gpu_ids,
            "cuda_visible_devices": os.environ.get(placement.CUDA_VISIBLE),
            "jax_platforms": os.environ.get("JAX_PLATFORMS"),
            "engine_kwargs": dict(getattr(self.sampler, "llm_kwargs", None) or {}), "weight_transport": transport}


def tree_sums(params: Any) -> dict[str, float]:
  """``{keystr(path): float64 sum}`` of every leaf of a parameter pytree (weights compared by checksum)."""
  import jax  # pylint: disable=import-outside-toplevel
  leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
  return {jax.tree_util.keystr(k): float(np.asarray(v, np.float64).sum()) for k, v in leaves}


def _checksums(sampler: Any) -> dict[str, Any]:
  """Per-parameter float64 sums of what ``sampler`` holds (see :meth:`SamplerWorker.weight_report`)."""
  if hasattr(sampler, "collective_rpc"):
    return {"kind": "vllm", "ranks": sampler.collective_rpc("report_weight_checksum")}
  return {"kind": "jax", "sums": tree_sums(sampler.params)}


def _pin_devices(spec: SamplerSpec) -> None:
  """Keeps the actor's process on its own devices, before anything initialises a JAX backend.

  A JAX sampler runs on ``spec.platform``. In a vLLM actor JAX stays on the CPU: the GPUs
  are the engine's, and a JAX GPU backend would pre-allocate most of their memory. An actor
  without GPUs sees none (a Ray worker otherwise inherits its raylet's
  ``CUDA_VISIBLE_DEVICES``, every GPU of the node); Ray has already set
  ``CUDA_VISIBLE_DEVICES`` of an actor with GPUs to exactly its own.
  """
  if not _in_ray_actor():  # a worker built in a test's own process leaves that process alone
    return
  if spec.gpus == 0:
    os.environ[placement.CUDA_VISIBLE] = ""
  platform = "cuda" if spec.kind == "jax" and spec.platform == "gpu" else "cpu"
  os.environ["JAX_PLATFORMS"] = platform
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if xla_bridge.backends_are_initialized():
    raise RuntimeError(f"sampler actor: JAX was initialised before the actor could pin it to {platform!r}")
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_platforms", platform)


def _in_ray_actor() -> bool:
  try:
    import ray  # pylint: disable=import-outside-toplevel
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
  except Exception:  # no Ray, or no runtime context
    return False


def remote_actor_class(num_cpus: float = 1.0):
  """``SamplerWorker`` as a Ray actor class (threaded: weights can land while a call runs); the
  pool sets each actor's resources with ``.options`` (:class:`jaxrl_llm.rollout.placement.Placer`)."""
  import ray

  return ray.remote(num_cpus=num_cpus, max_concurrency=4, max_restarts=0)(SamplerWorker)
