"""The wire format of weight tensors sent to vLLM workers, and its decoder (numpy -> torch).

One tensor travels as a 4-tuple ``(name, dtype, shape, data)``:

  name   the parameter name the worker loads it under (HF name for
         ``model.load_weights``, vLLM parameter name for per-rank shards)
  dtype  "float32" | "float16" | "bfloat16"
  shape  tuple of ints (torch layout ``[out, in]``)
  data   C-contiguous numpy array holding the bytes: of dtype ``dtype`` for
         float32 / float16, of dtype uint16 (the bit pattern) for bfloat16,
         which numpy has no native type for, so the payload stays picklable and
         msgpack-serialisable without ml_dtypes on the receiving side.

The encoder is ``jaxrl_llm.bridge.weight_transport.encode_entry`` (learner
side, numpy only); this module is imported inside vLLM's worker processes and
needs only numpy and torch.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

WIRE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def check_entry(entry: Sequence[Any]) -> tuple[str, str, tuple[int, ...], np.ndarray]:
  """Validates one wire entry and returns it as a typed tuple.

  Raises:
    ValueError: naming the tensor when the dtype is unknown or the data does
      not hold ``prod(shape)`` elements of the wire dtype.
  """
  if len(entry) != 4:
    raise ValueError(f"weight entry must be (name, dtype, shape, data), got {len(entry)} fields")
  name, dtype, shape, data = entry
  if dtype not in WIRE_DTYPES:
    raise ValueError(f"{name}: dtype {dtype!r} is not one of {sorted(WIRE_DTYPES)}")
  data = np.asarray(data)
  shape = tuple(int(s) for s in shape)
  if data.dtype != np.dtype(WIRE_DTYPES[dtype]):
    raise ValueError(f"{name}: {dtype} travels as {np.dtype(WIRE_DTYPES[dtype]).name}, got {data.dtype.name}")
  if data.size != int(np.prod(shape, dtype=np.int64)):
    raise ValueError(f"{name}: shape {shape} needs {int(np.prod(shape))} elements, data has {data.size}")
  return str(name), dtype, shape, data


def entry_to_torch(entry: Sequence[Any], device: Any = None):
  """One wire entry -> ``(name, torch.Tensor)`` of the entry's dtype and shape.

  Args:
    entry: ``(name, dtype, shape, data)`` as in the module docstring.
    device: optional torch device to move the tensor to.

  Returns:
    ``(name, tensor)``; the tensor owns its memory (the numpy buffer may be
    read-only, as after unpickling).
  """
  import torch  # pylint: disable=import-outside-toplevel
  name, dtype, shape, data = check_entry(entry)
  host = torch.from_numpy(np.ascontiguousarray(data).reshape(shape).copy())
  tensor = host.view(getattr(torch, dtype))
  if device is not None:
    tensor = tensor.to(device, non_blocking=False)
  return name, tensor


def entries_nbytes(entries: Sequence[Sequence[Any]]) -> int:
  """Total bytes of the data arrays of ``entries``."""
  return int(sum(np.asarray(e[3]).nbytes for e in entries))
