"""``WeightSyncExtension``: methods vLLM mixes into every worker for in-flight weight updates.

vLLM (>= 0.10) builds its worker class with this one as an extra base when
``worker_extension_cls`` names it, so ``self`` is the worker: ``self.device``,
``self.model_runner.model`` (the ``nn.Module``) and the distributed state are
available. ``LLM.collective_rpc(method, args=...)`` runs a method on every
worker (each tensor-parallel rank) and returns the list of their results.

Four ways in, one way to apply: every path ends in
``self.model_runner.model.load_weights(weights=[(name, tensor), ...])`` (HF
names; vLLM fuses q/k/v and gate/up and slices for its rank itself), except
``load_rank_shards``, which copies pre-sliced per-rank tensors straight into
the named parameters (no fusion work on the worker).

  load_named_tensors      wire entries (numpy) through vLLM's RPC; entries may
                          be Ray ``ObjectRef`` s resolved here (Ray executor)
  load_rank_shards        per-rank wire entries; each rank takes its own
  init_weight_transport   NCCL group with the learner (vLLM's
  + receive_weights       ``StatelessProcessGroup`` + ``PyNcclCommunicator``;
                          learner is rank 0 and broadcasts each tensor)
  load_weights_from_ipc   CUDA IPC handle of one packed uint8 buffer per device
                          (learner colocated on the same GPU)

Only unquantised models are supported (no ``process_weights_after_loading``
is needed for them). Nothing here imports jaxrl_llm or jax: this module runs
inside vLLM's processes.
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

from third_party.vllm_weight_sync.wire import entry_to_torch


def _resolve(item: Any) -> Any:
  """Returns ``ray.get(item)`` for a Ray ObjectRef, else ``item``."""
  cls = type(item)
  if cls.__name__ == "ObjectRef" and cls.__module__.startswith("ray"):
    import ray  # pylint: disable=import-outside-toplevel
    return ray.get(item)
  return item


class WeightSyncExtension:
  """Worker-side receiver of learner weights (see the module docstring).

  vLLM refuses an extension whose attribute names clash with the worker's, so
  private helpers carry a ``_wsync_`` prefix.
  """

  # ------------------------------------------------------------------ helpers
  def _wsync_model(self):
    return self.model_runner.model

  def _wsync_tp_rank(self) -> int:
    from vllm.distributed import get_tensor_model_parallel_rank  # pylint: disable=import-outside-toplevel
    return int(get_tensor_model_parallel_rank())

  def _wsync_load(self, weights: list) -> int:
    self._wsync_model().load_weights(weights=weights)
    return len(weights)

  def weight_sync_device_uuid(self) -> str:
    """UUID of this worker's GPU (the key of IPC handles; stable across CUDA_VISIBLE_DEVICES)."""
    import torch  # pylint: disable=import-outside-toplevel
    return str(torch.cuda.get_device_properties(self.device).uuid)

  # ------------------------------------------------------------ object store
  def load_named_tensors(self, entries: Sequence[Any]) -> int:
    """Loads HF-named wire entries ``(name, dtype, shape, data)`` with ``load_weights``.

    Args:
      entries: wire entries, or one Ray ObjectRef of such a list, or a list
        whose items are ObjectRefs of entries.

    Returns:
      Number of tensors loaded.
    """
    entries = _resolve(entries)
    weights = [entry_to_torch(_resolve(e), self.device) for e in entries]
    return self._wsync_load(weights)

  def load_rank_shards(self, entries_by_rank: Sequence[Any]) -> int:
    """Copies this rank's per-rank wire entries (vLLM parameter names) into the parameters.

    Args:
      entries_by_rank: P lists (or Ray ObjectRefs of lists) of wire entries,
        index = tensor-parallel rank; names and shapes as in
        ``jaxrl_llm.bridge.reshard.make_reshard_plan``.

    Returns:
      Number of tensors copied.

    Raises:
      ValueError: naming a tensor that is not a parameter of the model or whose
        shape differs from the parameter's.
    """
    rank = self._wsync_tp_rank()
    if len(entries_by_rank) <= rank:
      raise ValueError(f"load_rank_shards: got shards for {len(entries_by_rank)} ranks, this is rank {rank}")
    params = dict(self._wsync_model().named_parameters())
    count = 0
    for entry in _resolve(entries_by_rank[rank]):
      name, tensor = entry_to_torch(_resolve(entry))
      if name not in params:
        raise ValueError(f"load_rank_shards: {name!r} is not a parameter of the vLLM model on rank {rank} "
                         f"(it has {len(params)} parameters, e.g. {sorted(params)[:3]})")
      param = params[name]
      if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"load_rank_shards: {name} on rank {rank} has shape {tuple(param.shape)}, "
                         f"the learner sent {tuple(tensor.shape)}")
      param.data.copy_(tensor.to(param.device), non_blocking=False)
      count += 1
    return count

  # -------------------------------------------------------------------- NCCL
  def init_weight_transport(self, host: str, port: int, rank_offset: int, world_size: int) -> int:
    """Joins the NCCL group whose rank 0 is the learner; returns this worker's rank in it.

    Args:
      host / port: the learner's rendezvous address (``StatelessProcessGroup``).
      rank_offset: rank of this engine's first worker (1 when one engine).
      world_size: learner + every worker of every engine in the group.
    """
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # pylint: disable=import-outside-toplevel
    from vllm.distributed.parallel_state import get_world_group  # pylint: disable=import-outside-toplevel
    from vllm.distributed.utils import StatelessProcessGroup  # pylint: disable=import-outside-toplevel
    rank = int(get_world_group().rank) + int(rank_offset)
    group = StatelessProcessGroup.create(host=host, port=int(port), rank=rank, world_size=int(world_size))
    comm = PyNcclCommunicator(group, device=self.device)
    if not getattr(comm, "available", True):
      raise RuntimeError(f"init_weight_transport: NCCL is not available on worker rank {rank} (no NCCL library, "
                         f"or a group of one: world_size={world_size})")
    comm.disabled = False  # some vLLM versions create it disabled, and a disabled broadcast silently does nothing
    self._wsync_comm = comm
    return rank

  def receive_weights(self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> int:
    """Receives ``len(names)`` tensors broadcast by the learner (rank 0), in order, and loads them.

    Returns:
      Number of tensors loaded.
    """
    import torch  # pylint: disable=import-outside-toplevel
    comm = getattr(self, "_wsync_comm", None)
    if comm is None:
      raise RuntimeError("receive_weights: call init_weight_transport first (no NCCL group with the learner)")
    if not len(names) == len(dtypes) == len(shapes):
      raise ValueError(f"receive_weights: {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes")
    stream = torch.cuda.current_stream()
    weights = []
    for name, dtype, shape in zip(names, dtypes, shapes):
      tensor = torch.empty(tuple(int(s) for s in shape), dtype=getattr(torch, dtype), device=self.device)
      comm.broadcast(tensor, src=0, stream=stream)
      weights.append((name, tensor))
    stream.synchronize()
    return self._wsync_load(weights)

  # ---------------------------------------------------------------- CUDA IPC
  def load_weights_from_ipc(self, handles: dict) -> int:
    """Loads tensors packed in one CUDA buffer shared by the learner through an IPC handle.

    Args:
      handles: device UUID -> ``(pickled handle, metadata)``; the handle is
        ``torch.multiprocessing.reductions.reduce_tensor(buffer)`` of a uint8
        CUDA buffer, the metadata a list of ``(name, dtype, shape, byte offset)``.

    Returns:
      Number of tensors loaded.
    """
    import torch  # pylint: disable=import-outside-toplevel
    uuid = self.weight_sync_device_uuid()
    if uuid not in handles:
      raise ValueError(f"load_weights_from_ipc: no handle for this worker's GPU {uuid} "
                       f"(handles for {sorted(handles)})")
    blob, metadata = handles[uuid]
    rebuild, args = pickle.loads(blob)
    args = list(args)
    args[6] = self.device.index  # the storage device, as numbered in this process
    buffer = rebuild(*args)
    if buffer.dtype != torch.uint8:
      raise ValueError(f"load_weights_from_ipc: expected a uint8 buffer, got {buffer.dtype}")
    weights = []
    for name, dtype, shape, offset in metadata:
      torch_dtype = getattr(torch, dtype)
      shape = tuple(int(s) for s in shape)
      count = 1
      for s in shape:
        count *= s
      size = count * torch_dtype.itemsize
      weights.append((name, buffer[offset:offset + size].view(torch_dtype).view(shape)))
    loaded = self._wsync_load(weights)
    torch.cuda.synchronize()
    del weights, buffer
    return loaded

  # ------------------------------------------------------------- diagnostics
  def report_weight_checksum(self) -> dict:
    """{"rank": tensor-parallel rank, "sums": {parameter name: float64 sum of its values}}.

    Comparable with ``jaxrl_llm.bridge.weight_transport.expected_checksums``
    (vLLM names, per rank; padded vocabulary rows are zero and add nothing).
    """
    import torch  # pylint: disable=import-outside-toplevel
    with torch.no_grad():
      sums = {name: float(p.detach().to(torch.float64).sum().item())
              for name, p in self._wsync_model().named_parameters()}
    return {"rank": self._wsync_tp_rank(), "sums": sums}

  def report_parameter_shapes(self) -> dict:
    """{"rank": tensor-parallel rank, "shapes": {parameter name: shape}} of this worker."""
    return {"rank": self._wsync_tp_rank(),
            "shapes": {name: tuple(int(s) for s in p.shape) for name, p in self._wsync_model().named_parameters()}}


__all__ = ["WeightSyncExtension"]
