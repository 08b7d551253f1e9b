"""Import a Hugging Face checkpoint folder into the Flax params pytree.

Tensor by tensor, shard by shard: every parameter is built with
``jax.make_array_from_callback`` on its target sharding, and the callback reads
only the rectangle of the safetensors file that the requested device shard
covers (``safe_open(...).get_slice``, memory-mapped), transposes Linear weights
from torch's ``[out, in]`` to the kernel layout ``[in, out]`` and casts to
``config.param_dtype``. Distinct shards of one tensor are cached for the
duration of that tensor only (replicated axes read once), so the peak host
memory of an import is about one tensor (its addressable shards, in the stored
and the target dtype), never a host copy of the model.

Validation happens before anything is read: missing tensors, unexpected
tensors and mis-shaped tensors are all collected and raised together in one
:class:`CheckpointMismatchError` whose message lists each (name, expected shape,
got shape, file). Buffers that old checkpoints carry
(``*.rotary_emb.inv_freq``) are ignored.

Tied embeddings: when ``config.tie_word_embeddings`` the Flax tree has no
``lm_head``. A checkpoint that nevertheless stores ``lm_head.weight`` is
accepted (transformers re-ties it to the embedding on load, ignoring the stored
values); the stored matrix is compared with the embedding in row blocks and a
warning is logged when they differ. It is never imported.

Value / reward heads are not in HF checkpoints: when the config asks for them
they are read from the side file ``jaxrl_llm_extra/heads.safetensors`` (a
sub-folder, so that vLLM's ``*.safetensors`` glob never sees it) written by
:func:`jaxrl_llm.bridge.hf_export.export_hf_checkpoint` if present; otherwise
they are left out of the result (``require_heads=False``, merge with freshly
initialised heads: ``{**init_params(config, rng), **params}``) or reported as
missing (``require_heads=True``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bridge import hf_config
from jaxrl_llm.bridge.layout import TensorSpec, backbone_specs, get_path, head_specs, set_path
from jaxrl_llm.bridge.safetensors_io import FLOAT_CODES, SafetensorsCheckpoint
from jaxrl_llm.models.config import ModelConfig

HEADS_FILE = os.path.join("jaxrl_llm_extra", "heads.safetensors")
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_TIE_CHECK_ROWS = 4096

ShardingsArg = Union[None, jax.sharding.Sharding, Any, Callable[[ModelConfig], Any]]


@dataclasses.dataclass(frozen=True)
class Problem:
  """One checkpoint mismatch: kind is 'missing', 'unexpected', 'mis-shaped' or 'dtype'."""

  kind: str
  name: str
  expected_shape: Optional[tuple[int, ...]]
  got_shape: Optional[tuple[int, ...]]
  file: str
  detail: str = ""

  def __str__(self) -> str:
    return (f"{self.kind}: {self.name} expected shape {self.expected_shape}, got shape "
            f"{self.got_shape} (file: {self.file}){' ' + self.detail if self.detail else ''}")


class CheckpointMismatchError(ValueError):
  """Raised with every missing / unexpected / mis-shaped tensor at once."""

  def __init__(self, folder: str, problems: Sequence[Problem]):
    self.problems = list(problems)
    lines = "\n  ".join(str(p) for p in self.problems)
    super().__init__(f"checkpoint {folder} does not match the ModelConfig "
                     f"({len(self.problems)} problem(s)):\n  {lines}")


def _validate(reader: SafetensorsCheckpoint, specs: Sequence[TensorSpec], where: str,
              allowed_extra: Sequence[str]) -> list[Problem]:
  problems = []
  expected = {s.hf_name: s for s in specs}
  for name, spec in expected.items():
    if name not in reader.file_of:
      problems.append(Problem("missing", name, spec.hf_shape, None, where))
      continue
    got = reader.shape(name)
    if got != spec.hf_shape:
      problems.append(Problem("mis-shaped", name, spec.hf_shape, got, reader.path_of(name)))
    elif reader.dtype_code(name) not in FLOAT_CODES:
      problems.append(Problem("dtype", name, spec.hf_shape, got, reader.path_of(name),
                              f"dtype {reader.dtype_code(name)} is not a float type"))
  for name in reader.names():
    if name in expected or name in allowed_extra or name.endswith(IGNORED_SUFFIXES):
      continue
    problems.append(Problem("unexpected", name, None, reader.shape(name), reader.path_of(name)))
  return problems


def _sharding_for(shardings: Any, spec: TensorSpec) -> jax.sharding.Sharding:
  if shardings is None:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(shardings, jax.sharding.Sharding):
    return shardings
  sharding = get_path(shardings, spec.path, "shardings")
  if not isinstance(sharding, jax.sharding.Sharding):
    raise TypeError(f"shardings[{spec.flax_name!r}] is {type(sharding).__name__}, expected a "
                    "jax.sharding.Sharding")
  return sharding


def _index_key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def _load_tensor(reader: SafetensorsCheckpoint, spec: TensorSpec, sharding: jax.sharding.Sharding,
                 target_dtype: np.dtype) -> jax.Array:
  """Builds one sharded jax.Array, reading only the shards it needs."""
  cache: dict[tuple, np.ndarray] = {}

  def callback(index: tuple[slice, ...]) -> np.ndarray:
    index = tuple(index) + (slice(None),) * (len(spec.shape) - len(index))
    key = _index_key(index)
    if key not in cache:
      src_index = tuple(reversed(index)) if spec.transpose else index
      block = reader.read(spec.hf_name, src_index)
      if spec.transpose:
        block = block.T
      cache[key] = np.ascontiguousarray(block.astype(target_dtype, copy=False))
    return cache[key]

  array = jax.make_array_from_callback(spec.shape, sharding, callback)
  cache.clear()
  return array


def _check_tied_copy(reader: SafetensorsCheckpoint, vocab_size: int) -> None:
  for start in range(0, vocab_size, _TIE_CHECK_ROWS):
    rows = (slice(start, min(start + _TIE_CHECK_ROWS, vocab_size)), slice(None))
    if not np.array_equal(reader.read("lm_head.weight", rows), reader.read("model.embed_tokens.weight", rows)):
      logging.warning("%s: tie_word_embeddings=True but the stored lm_head.weight differs from "
                      "model.embed_tokens.weight; it is ignored (transformers re-ties it to the "
                      "embedding as well)", reader.path_of("lm_head.weight"))
      return


def load_hf_params(folder: str | os.PathLike, config: Optional[ModelConfig] = None, *,
                   shardings: Any = None, param_dtype: Optional[str] = None,
                   require_heads: bool = False) -> dict:
  """Imports the tensors of a HF checkpoint folder into a Flax params pytree.

  Args:
    folder: checkpoint folder (config.json + model.safetensors, or sharded
      files + model.safetensors.index.json).
    config: the ModelConfig to import into; default
      ``hf_config.config_from_hf(folder)``.
    shardings: target placement: a pytree of ``jax.sharding.Sharding`` with the
      params' structure (e.g. ``jaxrl_llm.models.sharding.param_shardings(config,
      mesh)``), one Sharding for every tensor, or None (first device).
    param_dtype: dtype to cast to; default ``config.param_dtype``.
    require_heads: report value/reward heads absent from the side file as
      missing instead of leaving them out.

  Returns:
    Nested dict of jax.Arrays laid out as in the model spec (kernels [in, out]).

  Raises:
    CheckpointMismatchError: listing every missing, unexpected and mis-shaped
      tensor.
  """
  folder = os.fspath(folder)
  if config is None:
    config = hf_config.config_from_hf(folder)
  target_dtype = np.dtype(jnp.dtype(param_dtype or config.param_dtype))
  specs = backbone_specs(config)
  tied_extra = ("lm_head.weight",) if config.tie_word_embeddings else ()
  params: dict = {}
  with SafetensorsCheckpoint(folder) as reader:
    problems = _validate(reader, specs, folder, tied_extra)
    heads = head_specs(config)
    heads_reader = None
    heads_path = os.path.join(folder, HEADS_FILE)
    if heads and os.path.isfile(heads_path):
      heads_reader = SafetensorsCheckpoint(folder, filename=HEADS_FILE)
      problems += _validate(heads_reader, heads, heads_path, ())
    elif heads and require_heads:
      problems += [Problem("missing", s.hf_name, s.hf_shape, None, heads_path) for s in heads]
    if problems:
      raise CheckpointMismatchError(folder, problems)
    if tied_extra and "lm_head.weight" in reader.file_of:
      _check_tied_copy(reader, config.vocab_size)
    for spec in specs:
      set_path(params, spec.path, _load_tensor(reader, spec, _sharding_for(shardings, spec), target_dtype))
    if heads_reader is not None:
      with heads_reader:
        for spec in heads:
          set_path(params, spec.path,
                   _load_tensor(heads_reader, spec, _sharding_for(shardings, spec), target_dtype))
  return params


def load_hf_checkpoint(folder: str | os.PathLike, *, shardings: ShardingsArg = None,
                       mesh: Optional[jax.sharding.Mesh] = None, require_heads: bool = False,
                       **config_kwargs: Any) -> tuple[dict, ModelConfig]:
  """Reads config.json and the tensors of a HF folder.

  Args:
    folder: checkpoint folder.
    shardings: as in :func:`load_hf_params`, or a callable ``config ->
      shardings`` (called once the config is known).
    mesh: when given (and ``shardings`` is None), place parameters with
      ``jaxrl_llm.models.sharding.param_shardings(config, mesh)``.
    require_heads: see :func:`load_hf_params`.
    **config_kwargs: forwarded to :func:`hf_config.config_from_hf`
      (param_dtype, dtype, pad_token_id, value_head=True, ...).

  Returns:
    (params, config).
  """
  config = hf_config.config_from_hf(folder, **config_kwargs)
  if callable(shardings) and not isinstance(shardings, jax.sharding.Sharding):
    shardings = shardings(config)
  elif shardings is None and mesh is not None:
    from jaxrl_llm.models.sharding import param_shardings  # pylint: disable=import-outside-toplevel
    shardings = param_shardings(config, mesh)
  return load_hf_params(folder, config, shardings=shardings, require_heads=require_heads), config
