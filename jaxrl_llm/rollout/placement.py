"""Where sampler actors run: their GPUs, the GPUs a local cluster offers, and the checks made before any starts.

A sampler actor asks Ray for the GPUs its sampler uses (:func:`gpus_per_actor`):

  sampler                               GPUs per actor
  vLLM, weight transport object_store   P  (the engine's tensor-parallel size)
  vLLM, weight transport ipc            P  (the actor shares CUDA buffers with its engine)
  vLLM, weight transport nccl           P + 1 (the actor broadcasts from its own GPU, which
                                        NCCL needs apart from the engine's workers')
  JAX sampler on sampler.platform=gpu   1
  JAX sampler on the CPU                0
  (``rollout.actor_gpus`` >= 0 sets a JAX sampler actor's count: e.g. GPUs reserved for
  an actor that runs JAX on the CPU, as the CPU placement tests do)

An actor with GPUs is placed through a placement group of one bundle (``STRICT_PACK``;
an actor is one process, so its GPUs are on one node) reserved before the actor is
created: Ray then sets ``CUDA_VISIBLE_DEVICES`` of the actor's process to exactly its
GPUs, and vLLM's workers (``distributed_executor_backend="mp"`` at P > 1) inherit them.
A CPU actor gets ``CUDA_VISIBLE_DEVICES=""`` so it never opens a GPU.

The learner's GPUs are never offered. A local cluster (no ``rollout.address``) declares
the GPUs of :func:`local_sampler_gpus`: with ``rollout.local_gpus="auto"`` every GPU of the
machine that the learner's JAX process does not use, or an explicit list (which may not
name a learner GPU); Ray hands out only the GPUs its raylet was started with, so a
learner GPU cannot reach an actor. A joined cluster brings its own nodes; its learner
host should declare none of the learner's GPUs (``ray start --num-gpus=0`` there), which
:func:`check_capacity` cannot see and the docs say.

Before the first actor starts, :func:`check_capacity` compares what the pool needs with
what the cluster's nodes declare and raises :class:`~jaxrl_llm.errors.ConfigError`
naming the settings (a tensor-parallel size larger than any node's GPUs, more sampler
actors than the GPUs can hold), instead of actors waiting forever for resources.

Reference: Ray placement groups,
https://docs.ray.io/en/latest/ray-core/scheduling/placement-group.html.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Any, Iterable, Mapping, Optional, Sequence

from jaxrl_llm.errors import ConfigError

CUDA_VISIBLE = "CUDA_VISIBLE_DEVICES"
PLATFORMS = ("cpu", "gpu")  # where a JAX sampler actor runs (sampler.platform)
_ID = re.compile(r"^\d+$")


@dataclasses.dataclass(frozen=True)
class ActorResources:
  """What one sampler actor asks Ray for.

  Attributes:
    cpus: CPUs reserved (``rollout.actor_cpus``).
    gpus: GPUs (:func:`gpus_per_actor`); > 0 places the actor through a placement group.
  """

  cpus: float = 1.0
  gpus: float = 0.0

  def bundle(self) -> dict[str, float]:
    """The placement-group bundle of one actor."""
    out = {"CPU": float(self.cpus)}
    if self.gpus:
      out["GPU"] = float(self.gpus)  # a share < 1 lets several actors use one GPU
    return out


def gpus_per_actor(kind: str, *, platform: str = "cpu", tensor_parallel_size: int = 1,
                   weight_transport: str = "object_store", actor_gpus: float = -1) -> float:
  """GPUs one sampler actor asks Ray for (see the module's table).

  Args:
    kind: ``"jax"`` or ``"vllm"`` (``sampler.kind``).
    platform: where a JAX sampler runs (``sampler.platform``).
    tensor_parallel_size: P of a vLLM engine (``sampler.vllm.tensor_parallel_size``).
    weight_transport: ``rollout.weight_transport``.
    actor_gpus: ``rollout.actor_gpus``: -1 for the table's count. Otherwise a JAX sampler
      actor's reservation (>= 0; >= 1 on ``platform="gpu"``), or, for a vLLM engine of one
      GPU, its share of a GPU (``0.5``: two engines per GPU, each within
      ``sampler.vllm.gpu_memory_utilization``) or 1; a vLLM engine of several GPUs takes
      exactly the table's count.

  Raises:
    ConfigError: naming ``rollout.actor_gpus`` when it cannot hold the sampler.
  """
  actor_gpus = float(actor_gpus)
  if kind == "vllm":
    need = int(tensor_parallel_size) + (1 if weight_transport == "nccl" else 0)
    if actor_gpus < 0:
      return float(need)
    if need == 1 and 0 < actor_gpus <= 1:
      return actor_gpus
    raise ConfigError(f"rollout.actor_gpus={actor_gpus:g}: a vLLM sampler actor holds exactly {need} GPU(s) "
                      "(sampler.vllm.tensor_parallel_size" + (" + 1 for the NCCL sender" if weight_transport == "nccl"
                                                              else "") + ")" + (", or a share in (0, 1] of one"
                                                                                if need == 1 else "")
                      + "; -1 takes that count")
  if actor_gpus < 0:
    return 1.0 if platform == "gpu" else 0.0
  if platform == "gpu" and actor_gpus <= 0:
    raise ConfigError(f"rollout.actor_gpus={actor_gpus:g} with sampler.platform='gpu': a JAX sampler on a GPU needs "
                      "a GPU (or a share of one, > 0)")
  return actor_gpus


def parse_gpu_ids(value: str, field: str = "rollout.local_gpus") -> Optional[list[str]]:
  """``"auto"`` -> None (detect); ``"none"`` or "" -> []; ``"2,3"`` -> ``["2", "3"]``.

  Raises:
    ConfigError: naming ``field`` when an id is not a non-negative integer or repeats.
  """
  text = str(value).strip()
  if text == "auto":
    return None
  if text in ("", "none"):
    return []
  ids = [p.strip() for p in text.split(",")]
  bad = [p for p in ids if not _ID.match(p)]
  if bad:
    raise ConfigError(f"{field}={value!r}: {bad} are not GPU ids; expected 'auto', 'none' or comma-separated "
                      "non-negative integers such as '2,3'")
  if len(set(ids)) != len(ids):
    raise ConfigError(f"{field}={value!r}: a GPU id is listed twice")
  return ids


def visible_gpu_ids(env: Optional[Mapping[str, str]] = None) -> Optional[list[str]]:
  """The ids in ``CUDA_VISIBLE_DEVICES``, or None when it is unset (every GPU is visible)."""
  env = os.environ if env is None else env
  if CUDA_VISIBLE not in env:
    return None
  return [p.strip() for p in env[CUDA_VISIBLE].split(",") if p.strip() and p.strip() != "-1"]


def machine_gpu_ids(env: Optional[Mapping[str, str]] = None) -> list[str]:
  """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` when set, else those ``nvidia-smi -L`` lists."""
  visible = visible_gpu_ids(env)
  if visible is not None:
    return visible
  smi = shutil.which("nvidia-smi")
  if smi is None:
    return []
  try:
    out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
  except (OSError, subprocess.SubprocessError):
    return []
  return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


def learner_gpu_ids(devices: Optional[Iterable[Any]] = None, env: Optional[Mapping[str, str]] = None) -> list[str]:
  """The machine GPU ids of this process's JAX GPU devices (none when JAX runs on the CPU or a TPU).

  A device's ``local_hardware_id`` is its CUDA ordinal, an index into ``CUDA_VISIBLE_DEVICES``
  when that is set.
  """
  if devices is None:
    import jax  # pylint: disable=import-outside-toplevel
    devices = jax.local_devices()
  visible = visible_gpu_ids(env)
  out = []
  for device in devices:
    if getattr(device, "platform", "") not in ("gpu", "cuda", "rocm"):
      continue
    ordinal = int(getattr(device, "local_hardware_id", None) or 0)
    out.append(visible[ordinal] if visible is not None and ordinal < len(visible) else str(ordinal))
  return out


def local_sampler_gpus(setting: str, learner: Sequence[str], machine: Sequence[str]) -> list[str]:
  """The GPUs a local Ray cluster offers to sampler actors.

  Args:
    setting: ``rollout.local_gpus`` ("auto", "none" or a comma-separated list of ids).
    learner: the learner's GPU ids (:func:`learner_gpu_ids`).
    machine: the GPUs of this machine (:func:`machine_gpu_ids`).

  Raises:
    ConfigError: naming ``rollout.local_gpus`` when an explicit list names a learner GPU.
  """
  ids = parse_gpu_ids(setting)
  if ids is None:
    return [g for g in machine if g not in set(learner)]
  shared = [g for g in ids if g in set(learner)]
  if shared:
    raise ConfigError(f"rollout.local_gpus={setting!r}: GPU(s) {shared} are the learner's (its JAX devices are on "
                      f"GPUs {list(learner)}); a sampler may not share the learner's GPU (NCCL refuses two ranks "
                      "on one device, and the memory is the learner's): list other GPUs, or 'auto'")
  return ids


def check_capacity(need: ActorResources, num_actors: int, node_gpus: Sequence[float], *, cluster: str,
                   kind: str, weight_transport: str) -> None:
  """Raises ConfigError, before any actor starts, when the cluster cannot hold the sampler actors.

  Args:
    need: one actor's resources.
    num_actors: ``rollout.num_samplers``.
    node_gpus: GPUs each alive node of the cluster declares.
    cluster: the cluster, for the message (``"the local Ray cluster (rollout.local_gpus='auto': ...)"``).
    kind, weight_transport: ``sampler.kind`` and ``rollout.weight_transport``, for the message.
  """
  if not need.gpus:
    return
  where = cluster
  why = ("sampler.vllm.tensor_parallel_size" + (" + 1 for rollout.weight_transport='nccl'"
                                                  if weight_transport == "nccl" else "")
         if kind == "vllm" else "sampler.platform='gpu'")
  largest = max(node_gpus, default=0)
  if need.gpus > largest:
    raise ConfigError(f"each sampler actor needs {need.gpus:g} GPU(s) on one node ({why}), but the largest node of "
                      f"{where} declares {largest:g}: lower sampler.vllm.tensor_parallel_size or add GPUs")
  fits = sum(int(g / need.gpus + 1e-9) for g in node_gpus)
  if fits < num_actors:
    raise ConfigError(f"rollout.num_samplers={num_actors}: {where} has room for {fits} sampler actor(s) of "
                      f"{need.gpus:g} GPU(s) each ({why}; nodes declare {[f'{g:g}' for g in node_gpus]} GPUs)")


def node_gpus(ray: Any) -> list[float]:
  """GPUs declared by each alive node of the connected Ray cluster."""
  return [float(n.get("Resources", {}).get("GPU", 0.0)) for n in ray.nodes() if n.get("Alive", True)]


def learner_node_gpus(ray: Any) -> float:
  """GPUs that the Ray node on this (the learner's) host declares; 0 when it has no node in the cluster."""
  here = ray.util.get_node_ip_address()
  return sum(float(n.get("Resources", {}).get("GPU", 0.0)) for n in ray.nodes()
             if n.get("Alive", True) and n.get("NodeManagerAddress") == here)


class Placer:
  """Creates sampler actors with their resources, one placement group per GPU actor.

  Args:
    ray: the ``ray`` module (connected).
    resources: what each actor asks for.
    ready_timeout_s: how long a placement group may take to be reserved.
  """

  def __init__(self, ray: Any, resources: ActorResources, ready_timeout_s: float = 300.0):
    self._ray = ray
    self.resources = resources
    self._timeout = ready_timeout_s
    self._groups: dict[str, Any] = {}

  def options(self, name: str) -> dict[str, Any]:
    """``ActorClass.options(**...)`` of the actor ``name`` (reserves its placement group first)."""
    r = self.resources
    if not r.gpus:
      return {"num_cpus": r.cpus, "num_gpus": 0}
    from ray.util.placement_group import placement_group  # pylint: disable=import-outside-toplevel
    from ray.util import scheduling_strategies  # pylint: disable=import-outside-toplevel
    self.release(name)
    group = placement_group([r.bundle()], strategy="STRICT_PACK", name="")
    try:
      self._ray.get(group.ready(), timeout=self._timeout)
    except Exception as e:  # GetTimeoutError: nothing on the cluster can hold the bundle now
      self._ray.util.remove_placement_group(group)
      raise RuntimeError(f"sampler {name}: no node could reserve {r.bundle()} within {self._timeout:.0f} s "
                         f"(cluster resources now: {self._ray.available_resources()})") from e
    self._groups[name] = group
    return {"num_cpus": r.cpus, "num_gpus": r.gpus,
            "scheduling_strategy": scheduling_strategies.PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=0)}

  def release(self, name: str) -> None:
    """Frees the placement group of actor ``name`` (when it died or the pool shuts down)."""
    group = self._groups.pop(name, None)
    if group is not None:
      try:
        self._ray.util.remove_placement_group(group)
      except Exception:  # the cluster is already gone
        pass

  def release_all(self) -> None:
    for name in list(self._groups):
      self.release(name)


__all__ = ["ActorResources", "CUDA_VISIBLE", "PLATFORMS", "Placer", "check_capacity", "gpus_per_actor",
           "learner_gpu_ids", "learner_node_gpus", "local_sampler_gpus", "machine_gpu_ids", "node_gpus",
           "parse_gpu_ids",
           "visible_gpu_ids"]
