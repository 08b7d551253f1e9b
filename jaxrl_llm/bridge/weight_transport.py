"""Learner -> vLLM weight publishing: the sender side of ``third_party.vllm_weight_sync``.

A transport turns the learner's Flax params into the tensors a vLLM engine
loads, hands them to the engine's workers through an ``rpc`` callable
(``rpc(method, args) -> list of per-worker results``, e.g.
``lambda m, a: llm.collective_rpc(m, args=a)``, or the same through a Ray
actor), and measures what one publish cost (bytes, seconds).

  transport      data path                                  needs
  object_store   numpy buckets as RPC arguments (through    nothing (CPU-safe;
                 Ray's object store when the engine lives   the default)
                 in a Ray actor, then vLLM's RPC broadcast)
  nccl           one NCCL broadcast per tensor from the     torch + vllm on the
                 learner (rank 0) to every worker           learner, its own GPU
  ipc            one packed CUDA buffer per bucket and      torch in the sender,
                 engine GPU, shared by CUDA IPC handles     the engine's GPUs visible

Tensor names and layouts come from :mod:`jaxrl_llm.bridge.reshard`: at
tensor-parallel size 1 (and for ``nccl`` / ``ipc`` at any size) the stream is
:func:`~jaxrl_llm.bridge.reshard.iter_hf_tensors` (HF names, full tensors;
vLLM's ``load_weights`` fuses and slices); ``object_store`` at size P > 1
sends :func:`~jaxrl_llm.bridge.reshard.iter_vllm_shards` (vLLM names, one
pre-sliced tensor per rank, copied straight into the parameters). The wire
format of one tensor is documented in ``third_party/vllm_weight_sync/wire.py``.

Host memory: tensors are gathered one at a time and grouped into buckets of
about ``bucket_bytes``; a bucket is sent before the next is gathered.

Nothing here imports torch or vllm at module import; the ``nccl`` and
``ipc`` transports import them when they first run.
"""

from __future__ import annotations

import abc
import dataclasses
import pickle
import time
from concurrent import futures
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np

from jaxrl_llm.bridge.reshard import iter_hf_tensors, iter_vllm_shards, make_reshard_plan
from jaxrl_llm.models.config import ModelConfig

RpcFn = Callable[[str, tuple], Any]
TRANSPORTS = ("object_store", "nccl", "ipc")
DEFAULT_BUCKET_BYTES = 256 * 2**20
_WIRE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
_IPC_ALIGN = 256


# ----------------------------------------------------------------- wire format
def encode_entry(name: str, array: np.ndarray) -> tuple[str, str, tuple[int, ...], np.ndarray]:
  """One host tensor -> the wire entry ``(name, dtype, shape, data)``.

  bfloat16 (ml_dtypes) travels as its uint16 bit pattern; float32 / float16 as is.

  Raises:
    ValueError: naming the tensor when its dtype is not float32/float16/bfloat16.
  """
  array = np.ascontiguousarray(array)
  dtype = array.dtype.name
  if dtype not in _WIRE:
    raise ValueError(f"{name}: dtype {dtype} cannot be sent to vLLM (expected one of {sorted(_WIRE)})")
  data = array.view(_WIRE[dtype]) if dtype == "bfloat16" else array
  return name, dtype, tuple(int(s) for s in array.shape), data


def hf_entries(params: Mapping[str, Any], config: ModelConfig, dtype: Optional[str] = None
               ) -> Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]:
  """Wire entries of :func:`iter_hf_tensors` (HF names, full tensors), one tensor at a time."""
  for name, array in iter_hf_tensors(params, config, dtype):
    yield encode_entry(name, array)


def rank_entries(params: Mapping[str, Any], config: ModelConfig, tp_size: int, dtype: Optional[str] = None
                 ) -> Iterator[list[tuple[str, str, tuple[int, ...], np.ndarray]]]:
  """Per vLLM parameter, the P per-rank wire entries (index = tensor-parallel rank)."""
  plan = make_reshard_plan(config, tp_size)
  for name, shards in iter_vllm_shards(params, plan, dtype):
    yield [encode_entry(name, shard) for shard in shards]


def _nbytes(item: Any) -> int:
  if isinstance(item, list):
    return sum(_nbytes(x) for x in item)
  return int(item[3].nbytes)


def buckets(items: Iterable[Any], bucket_bytes: int) -> Iterator[list[Any]]:
  """Groups a stream of entries (or per-rank lists of entries) into lists of about ``bucket_bytes``.

  A single item larger than ``bucket_bytes`` forms its own bucket.
  """
  if int(bucket_bytes) <= 0:
    raise ValueError(f"bucket_bytes={bucket_bytes}: expected > 0")
  bucket, size = [], 0
  for item in items:
    n = _nbytes(item)
    if bucket and size + n > bucket_bytes:
      yield bucket
      bucket, size = [], 0
    bucket.append(item)
    size += n
  if bucket:
    yield bucket


def expected_checksums(params: Mapping[str, Any], config: ModelConfig, tp_size: int = 1,
                       dtype: Optional[str] = None) -> list[dict[str, float]]:
  """Per rank, {vLLM parameter name: float64 sum of its values} after casting to ``dtype``.

  What ``WeightSyncExtension.report_weight_checksum`` reports once the engine
  holds ``params`` (padded vocabulary rows are zeros and add nothing).
  """
  plan = make_reshard_plan(config, tp_size)
  out: list[dict[str, float]] = [{} for _ in range(plan.tp_size)]
  for name, shards in iter_vllm_shards(params, plan, dtype):
    for rank, shard in enumerate(shards):
      out[rank][name] = float(np.asarray(shard, np.float64).sum())
  return out


def next_version(current: int, new: int) -> int:
  """Returns ``new`` when it is a later policy version than ``current``.

  Raises:
    ValueError: when ``new <= current`` (versions are strictly increasing; an
      equal or older version would relabel tokens with the wrong policy).
  """
  if isinstance(new, bool) or not isinstance(new, (int, np.integer)):
    raise ValueError(f"update_weights: version must be an int, got {new!r}")
  if int(new) <= int(current):
    raise ValueError(f"update_weights: version {int(new)} is not newer than the current version {int(current)}; "
                     "policy versions must increase strictly (a stale or repeated publish is refused)")
  return int(new)


# ----------------------------------------------------------------- transports
@dataclasses.dataclass(frozen=True)
class PublishStats:
  """What one publish cost.

  Attributes:
    transport: the transport's name.
    num_tensors: tensors sent (per-rank shards counted once per rank).
    bytes: payload bytes sent (all ranks).
    seconds: wall time of the whole publish (gather to host, send, load).
    calls: RPC calls made to the engine.
  """

  transport: str
  num_tensors: int
  bytes: int
  seconds: float
  calls: int

  @property
  def gb_per_second(self) -> float:
    return self.bytes / max(self.seconds, 1e-12) / 1e9

  def to_dict(self) -> dict[str, Any]:
    return dict(dataclasses.asdict(self), gb_per_second=self.gb_per_second)


def _check_counts(method: str, results: Any, expected: int) -> None:
  counts = list(results) if isinstance(results, (list, tuple)) else [results]
  bad = [c for c in counts if c != expected]
  if bad or not counts:
    raise RuntimeError(f"{method}: workers loaded {counts} tensors, expected {expected} each")


class WeightTransport(abc.ABC):
  """Sends learner params to a vLLM engine's workers."""

  name = "abstract"

  @abc.abstractmethod
  def publish(self, params: Mapping[str, Any], config: ModelConfig, rpc: RpcFn) -> PublishStats:
    """Sends every tensor of ``params`` and returns what it cost.

    Args:
      params: the learner's Flax params (any sharding; gathered per tensor).
      config: their ModelConfig.
      rpc: ``rpc(method, args)`` runs a ``WeightSyncExtension`` method on every
        worker and returns their results (blocking).
    """

  def close(self) -> None:
    """Releases what the transport holds (threads, communicators)."""


class ObjectStoreTransport(WeightTransport):
  """Numpy buckets as RPC arguments (HF names at P = 1, per-rank shards at P > 1)."""

  name = "object_store"

  def __init__(self, *, tp_size: int = 1, dtype: Optional[str] = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Args:
      tp_size: the engine's tensor-parallel size P.
      dtype: cast to this dtype before sending (the engine's, e.g. "bfloat16").
      bucket_bytes: about this many bytes per RPC call.
    """
    if int(tp_size) < 1:
      raise ValueError(f"tp_size={tp_size}: expected >= 1")
    self.tp_size, self.dtype, self.bucket_bytes = int(tp_size), dtype, int(bucket_bytes)

  def publish(self, params: Mapping[str, Any], config: ModelConfig, rpc: RpcFn) -> PublishStats:
    start = time.perf_counter()
    tensors = nbytes = calls = 0
    if self.tp_size == 1:
      for bucket in buckets(hf_entries(params, config, self.dtype), self.bucket_bytes):
        _check_counts("load_named_tensors", rpc("load_named_tensors", (bucket,)), len(bucket))
        tensors, nbytes, calls = tensors + len(bucket), nbytes + _nbytes(bucket), calls + 1
    else:
      for bucket in buckets(rank_entries(params, config, self.tp_size, self.dtype), self.bucket_bytes):
        by_rank = [[item[r] for item in bucket] for r in range(self.tp_size)]
        _check_counts("load_rank_shards", rpc("load_rank_shards", (by_rank,)), len(bucket))
        tensors, nbytes, calls = tensors + len(bucket) * self.tp_size, nbytes + _nbytes(bucket), calls + 1
    return PublishStats(self.name, tensors, nbytes, time.perf_counter() - start, calls)


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("the nccl and ipc weight transports need torch with CUDA in the sending process: install "
                      "the [vllm] extra (pip install 'jaxrl_llm[vllm]')") from e
  if not torch.cuda.is_available():
    raise RuntimeError("the nccl and ipc weight transports need a CUDA GPU in the sending process; use "
                       "transport='object_store' on machines without one")
  return torch


def _entry_tensor(torch, entry, device):
  name, dtype, shape, data = entry
  tensor = torch.from_numpy(np.array(data, copy=True).reshape(shape)).view(getattr(torch, dtype))
  return name, tensor.to(device)


class NcclTransport(WeightTransport):
  """NCCL broadcast from the learner (rank 0 of a group it forms with the engine's workers).

  Call :meth:`connect` once, then :meth:`publish` after each update. The
  learner must own a GPU that none of the engine's workers uses (NCCL refuses
  two ranks on one device).
  """

  name = "nccl"

  def __init__(self, host: str, port: int, *, device: Any = "cuda:0", dtype: Optional[str] = None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Args:
      host / port: rendezvous address reachable by the engine's workers.
      device: the learner's CUDA device for the broadcast buffers.
      dtype: cast to this dtype before sending.
      bucket_bytes: tensors per ``receive_weights`` call are grouped to about this size.
    """
    self.host, self.port, self.device = str(host), int(port), device
    self.dtype, self.bucket_bytes = dtype, int(bucket_bytes)
    self._comm = None
    self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nccl-weight-rpc")

  def connect(self, rpc: RpcFn, num_workers: int) -> None:
    """Forms the group: the learner (rank 0) and ``num_workers`` engine workers (ranks 1..)."""
    torch = _torch()
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # pylint: disable=import-outside-toplevel
    from vllm.distributed.utils import StatelessProcessGroup  # pylint: disable=import-outside-toplevel
    world = 1 + int(num_workers)
    pending = self._pool.submit(rpc, "init_weight_transport", (self.host, self.port, 1, world))
    group = StatelessProcessGroup.create(host=self.host, port=self.port, rank=0, world_size=world)
    comm = PyNcclCommunicator(group, device=torch.device(self.device))
    if not getattr(comm, "available", True):
      raise RuntimeError(f"NcclTransport: NCCL is not available on the learner (world_size={world}, "
                         f"num_workers={num_workers})")
    comm.disabled = False  # some vLLM versions create it disabled, and a disabled broadcast silently does nothing
    self._comm = comm
    pending.result()

  def publish(self, params: Mapping[str, Any], config: ModelConfig, rpc: RpcFn) -> PublishStats:
    if self._comm is None:
      raise RuntimeError("NcclTransport.publish: call connect(rpc, num_workers) first")
    torch = _torch()
    device = torch.device(self.device)
    start = time.perf_counter()
    tensors = nbytes = calls = 0
    for bucket in buckets(hf_entries(params, config, self.dtype), self.bucket_bytes):
      meta = ([e[0] for e in bucket], [e[1] for e in bucket], [list(e[2]) for e in bucket])
      pending = self._pool.submit(rpc, "receive_weights", meta)
      stream = torch.cuda.current_stream(device)
      for entry in bucket:
        _, tensor = _entry_tensor(torch, entry, device)
        self._comm.broadcast(tensor, src=0, stream=stream)
      stream.synchronize()
      _check_counts("receive_weights", pending.result(), len(bucket))
      tensors, nbytes, calls = tensors + len(bucket), nbytes + _nbytes(bucket), calls + 1
    return PublishStats(self.name, tensors, nbytes, time.perf_counter() - start, calls)

  def close(self) -> None:
    self._pool.shutdown(wait=True)
    self._comm = None


class IpcTransport(WeightTransport):
  """CUDA IPC: each bucket packed into one uint8 buffer per engine GPU, shared by handle.

  Every worker of the engine finds the buffer on its own GPU by the GPU's uuid, so the
  sender needs all the engine's GPUs visible (a sampler actor holding them, or a
  learner colocated with the engine).
  """

  name = "ipc"

  def __init__(self, *, device: Any = "cuda:0", devices: Sequence[Any] = (), dtype: Optional[str] = None,
               bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    """Args:
      device: the CUDA device of a single-GPU engine.
      devices: the CUDA devices of every worker of the engine (overrides ``device``; one
        per tensor-parallel rank).
      dtype: cast to this dtype before sending.
      bucket_bytes: bytes per shared buffer (about).
    """
    self.devices = tuple(devices) or (device,)
    self.device = self.devices[0]
    self.dtype, self.bucket_bytes = dtype, int(bucket_bytes)

  def publish(self, params: Mapping[str, Any], config: ModelConfig, rpc: RpcFn) -> PublishStats:
    torch = _torch()
    from torch.multiprocessing.reductions import reduce_tensor  # pylint: disable=import-outside-toplevel
    devices = [torch.device(d) for d in self.devices]
    uuids = [str(torch.cuda.get_device_properties(d).uuid) for d in devices]
    start = time.perf_counter()
    tensors = nbytes = calls = 0
    for bucket in buckets(hf_entries(params, config, self.dtype), self.bucket_bytes):
      offsets, total = [], 0
      for entry in bucket:
        offsets.append(total)
        total += -(-entry[3].nbytes // _IPC_ALIGN) * _IPC_ALIGN
      host = np.zeros((total,), np.uint8)
      for entry, offset in zip(bucket, offsets):
        host[offset:offset + entry[3].nbytes] = np.ascontiguousarray(entry[3]).reshape(-1).view(np.uint8)
      staged = torch.from_numpy(host)
      shared = [staged.to(d) for d in devices]
      for d in devices:
        torch.cuda.synchronize(d)
      metadata = [(e[0], e[1], list(e[2]), off) for e, off in zip(bucket, offsets)]
      handles = {uuid: (pickle.dumps(reduce_tensor(buffer)), metadata) for uuid, buffer in zip(uuids, shared)}
      _check_counts("load_weights_from_ipc", rpc("load_weights_from_ipc", (handles,)), len(bucket))
      del shared
      tensors, nbytes, calls = tensors + len(bucket), nbytes + _nbytes(bucket), calls + 1
    return PublishStats(self.name, tensors, nbytes, time.perf_counter() - start, calls)


def make_transport(kind: str = "object_store", **kwargs: Any) -> WeightTransport:
  """``object_store`` (default), ``nccl`` or ``ipc``; ``kwargs`` go to the transport's constructor."""
  classes = {"object_store": ObjectStoreTransport, "nccl": NcclTransport, "ipc": IpcTransport}
  if kind not in classes:
    raise ValueError(f"transport={kind!r}: expected one of {TRANSPORTS}")
  return classes[kind](**kwargs)


__all__ = ["DEFAULT_BUCKET_BYTES", "IpcTransport", "NcclTransport", "ObjectStoreTransport", "PublishStats",
           "TRANSPORTS", "WeightTransport", "buckets", "encode_entry", "expected_checksums", "hf_entries",
           "make_transport", "next_version", "rank_entries"]
