"""Tensor-at-a-time safetensors reading and writing for HF checkpoint folders.

Reading goes through ``safetensors.safe_open``: a checkpoint folder is indexed
(``model.safetensors`` or ``model-0000x-of-0000y.safetensors`` with
``model.safetensors.index.json``), and :meth:`SafetensorsCheckpoint.read`
returns one tensor, or one rectangular slice of it, as a host numpy array.
Files are memory-mapped, so a slice costs only its own bytes. Tensors are read
with safe_open's ``numpy`` framework, except bfloat16 ones (numpy has no
bfloat16), which go through the ``flax`` framework on the CPU backend and come
back as numpy arrays of ``ml_dtypes.bfloat16``; nothing touches an accelerator.

Writing (:func:`write_safetensors`) streams: the header is built from shapes
and dtypes alone, then each tensor is produced, written and dropped, so peak
host memory is one tensor, not one file. The byte layout is the safetensors
format (8-byte little-endian header length, JSON header padded with spaces to
a multiple of 8, then the raw little-endian tensor bytes in offset order).
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_CODE_OF_DTYPE = {
    np.dtype(np.float64): "F64",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(jnp.bfloat16): "BF16",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")

Index = tuple[slice, ...]


def dtype_code(dtype: Any) -> str:
  """The safetensors dtype code (``F32``, ``BF16``, ...) of a numpy/JAX dtype."""
  dt = np.dtype(dtype)
  if dt not in _CODE_OF_DTYPE:
    raise ValueError(f"dtype {dt} has no safetensors code; supported: "
                     f"{sorted(str(d) for d in _CODE_OF_DTYPE)}")
  return _CODE_OF_DTYPE[dt]


class SafetensorsCheckpoint:
  """Name -> file index over a HF checkpoint folder, with lazy per-tensor reads.

  Args:
    folder: folder holding ``model.safetensors`` or the sharded files plus
      ``model.safetensors.index.json``.
    filename: read this single file instead (e.g. a side file of heads).

  Use as a context manager (or call :meth:`close`) to release the file maps.
  """

  def __init__(self, folder: str | os.PathLike, filename: Optional[str] = None):
    self.folder = os.fspath(folder)
    self._handles: dict[tuple[str, str], Any] = {}
    self.file_of: dict[str, str] = {}
    if filename is not None:
      files = [filename]
    elif os.path.isfile(os.path.join(self.folder, INDEX_FILE)):
      with open(os.path.join(self.folder, INDEX_FILE), encoding="utf-8") as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, Mapping):
        raise ValueError(f"{os.path.join(self.folder, INDEX_FILE)} has no 'weight_map'")
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(self.folder, SINGLE_FILE)):
      files = [SINGLE_FILE]
    else:
      listing = sorted(os.listdir(self.folder)) if os.path.isdir(self.folder) else "not a folder"
      raise FileNotFoundError(f"{self.folder}: no {SINGLE_FILE} nor {INDEX_FILE} (found: {listing})")
    for name in files:
      path = os.path.join(self.folder, name)
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is listed by {INDEX_FILE} but does not exist")
      for key in self._handle(name).keys():
        self.file_of[key] = name
    self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for key, name in self.file_of.items():
      s = self._handle(name).get_slice(key)
      self.meta[key] = (tuple(int(d) for d in s.get_shape()), s.get_dtype())

  def _handle(self, name: str, framework: str = "numpy"):
    key = (name, framework)
    if key not in self._handles:
      self._handles[key] = safe_open(os.path.join(self.folder, name), framework=framework)
    return self._handles[key]

  def names(self) -> list[str]:
    return list(self.file_of)

  def path_of(self, name: str) -> str:
    return os.path.join(self.folder, self.file_of[name])

  def shape(self, name: str) -> tuple[int, ...]:
    return self.meta[name][0]

  def dtype_code(self, name: str) -> str:
    return self.meta[name][1]

  def read(self, name: str, index: Optional[Index] = None) -> np.ndarray:
    """Reads tensor ``name`` (or ``tensor[index]``) into a host numpy array.

    Args:
      name: tensor name in the checkpoint.
      index: optional tuple of slices, one per dimension.

    Returns:
      A numpy array in the stored dtype (bfloat16 as ``ml_dtypes.bfloat16``).
    """
    if name not in self.file_of:
      raise KeyError(f"{name!r} is not in the checkpoint at {self.folder}")
    framework = "flax" if self.dtype_code(name) == "BF16" else "numpy"
    handle = self._handle(self.file_of[name], framework)
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
      if index is None or 0 in self.shape(name):  # safetensors cannot slice empty tensors
        full = np.asarray(handle.get_tensor(name))
        return full if index is None else full[tuple(index)]
      return np.asarray(handle.get_slice(name)[tuple(index)])

  def close(self) -> None:
    self._handles.clear()

  def __enter__(self) -> "SafetensorsCheckpoint":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def write_safetensors(path: str | os.PathLike,
                      entries: Sequence[tuple[str, tuple[int, ...], Any]],
                      produce: Callable[[str], np.ndarray],
                      metadata: Optional[Mapping[str, str]] = None) -> int:
  """Writes one safetensors file, producing one tensor at a time.

  Args:
    path: output file.
    entries: (name, shape, dtype) of every tensor, in file order.
    produce: called once per name, in order; must return a numpy array of the
      declared shape and dtype. The array is written and released before the
      next call, so peak host memory is one tensor.
    metadata: string -> string header metadata (HF wants ``{"format": "pt"}``).

  Returns:
    The number of tensor bytes written.
  """
  header: dict[str, Any] = {}
  if metadata:
    header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
  offset = 0
  sizes = []
  for name, shape, dtype in entries:
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    header[name] = {"dtype": dtype_code(dtype), "shape": [int(d) for d in shape],
                    "data_offsets": [offset, offset + nbytes]}
    sizes.append(nbytes)
    offset += nbytes
  header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
  header_bytes += b" " * (-len(header_bytes) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header_bytes)))
    f.write(header_bytes)
    for (name, shape, dtype), nbytes in zip(entries, sizes):
      array = np.asarray(produce(name))
      if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
        raise ValueError(f"tensor {name!r} for {os.fspath(path)}: declared {tuple(shape)} {np.dtype(dtype)}, "
                         f"produced {tuple(array.shape)} {array.dtype}")
      array = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
      f.write(memoryview(array.reshape(-1).view(np.uint8)))
      del array
  return offset


def split_by_size(entries: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
  """Greedy, order-preserving split of (name, nbytes) into groups of <= max_bytes.

  A tensor larger than ``max_bytes`` gets a group of its own (as HF does).
  """
  groups: list[list[str]] = [[]]
  used = 0
  for name, nbytes in entries:
    if groups[-1] and used + nbytes > max_bytes:
      groups.append([])
      used = 0
    groups[-1].append(name)
    used += nbytes
  return groups if groups[0] else []
