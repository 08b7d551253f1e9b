"""Export Flax params (+ ModelConfig, + tokenizer) to a Hugging Face folder.

The folder holds ``config.json`` (see :func:`hf_config.config_to_hf`),
``generation_config.json`` (bos / eos / pad ids), the weights as
``model.safetensors``, or as ``model-0000x-of-0000y.safetensors`` plus
``model.safetensors.index.json`` when they exceed ``max_shard_size``, and,
when given, the tokenizer files. ``transformers.AutoModelForCausalLM
.from_pretrained(folder)`` loads it with tensors identical to the params
(kernels transposed back to torch's ``[out, in]``).

Streaming: each tensor is gathered to the host (:func:`host.to_host`, one at a
time), transposed, cast and written before the next one is touched, so peak
host memory is about one tensor whatever the model size.

Value and reward heads are not HF tensors; with ``save_heads=True`` they go to
``jaxrl_llm_extra/heads.safetensors`` (Flax layout, names like
``value_head/kernel``), a sub-folder so that neither transformers nor vLLM's
``*.safetensors`` glob picks them up; :mod:`hf_import` reads them back.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Mapping, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bridge import hf_config
from jaxrl_llm.bridge.hf_import import HEADS_FILE
from jaxrl_llm.bridge.host import to_host
from jaxrl_llm.bridge.layout import (TensorSpec, backbone_specs, check_params_match,
                                     head_specs)
from jaxrl_llm.bridge.safetensors_io import INDEX_FILE, SINGLE_FILE, split_by_size, write_safetensors
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
  """Bytes of ``5GB`` (10^9 units, as HF), ``512MiB`` (2^20 units) or an int."""
  if isinstance(size, int):
    if size <= 0:
      raise ValueError(f"max_shard_size={size}: expected a positive number of bytes")
    return size
  match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
  if not match or match.group(2).upper() not in _UNITS:
    raise ValueError(f"max_shard_size={size!r}: expected an int or e.g. '5GB', '500MB', '2GiB'")
  return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def _write_group(folder: str, filename: str, specs: Sequence[TensorSpec], params: Mapping[str, Any],
                 dtype: np.dtype, flax_layout: bool, config: ModelConfig) -> int:
  by_name = {s.hf_name: s for s in specs}

  def produce(name: str) -> np.ndarray:
    spec = by_name[name]
    array = to_host(lora.merged_leaf(params, spec.path, config))  # LoRA adapters merged, one kernel at a time
    if spec.transpose and not flax_layout:
      array = array.T
    return array.astype(dtype, copy=False)

  entries = [(s.hf_name, s.shape if flax_layout else s.hf_shape, dtype) for s in specs]
  return write_safetensors(os.path.join(folder, filename), entries, produce, {"format": "pt"})


def save_tokenizer_files(tokenizer: Any, folder: str) -> None:
  """Writes the tokenizer into ``folder`` (a Tokenizer with ``save``, or a folder to copy from)."""
  if hasattr(tokenizer, "save") and not isinstance(tokenizer, (str, os.PathLike)):
    tokenizer.save(folder)
    return
  src = os.fspath(tokenizer)
  copied = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
  if "tokenizer.json" not in copied:
    raise FileNotFoundError(f"tokenizer folder {src} has no tokenizer.json")
  for name in copied:
    shutil.copyfile(os.path.join(src, name), os.path.join(folder, name))


def export_hf_checkpoint(params: Mapping[str, Any], config: ModelConfig, folder: str | os.PathLike, *,
                         tokenizer: Any = None, max_shard_size: Union[int, str] = "5GB",
                         dtype: Optional[str] = None, save_heads: bool = True,
                         eos_token_ids: Optional[Sequence[int]] = None) -> str:
  """Writes a HF checkpoint folder that transformers loads as-is.

  Args:
    params: Flax params pytree of ``config`` (any sharding).
    config: the ModelConfig.
    folder: output folder (created; existing weight files in it are replaced).
    tokenizer: optional :class:`~jaxrl_llm.bridge.tokenizer.Tokenizer` or a
      folder whose tokenizer files are copied.
    max_shard_size: above this many bytes the weights are split into several
      files with an index (int, or '5GB' / '500MB' / '2GiB').
    dtype: stored dtype; default ``config.param_dtype``.
    save_heads: write value/reward heads to the side file.
    eos_token_ids: all stop ids for config.json / generation_config.json
      (default ``[config.eos_token_id]``).

  Returns:
    The folder path.
  """
  folder = os.fspath(folder)
  specs = backbone_specs(config)
  heads = head_specs(config)
  check_params_match(lora.without_adapters(params), specs + heads, "params")
  out_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
  os.makedirs(folder, exist_ok=True)
  for name in os.listdir(folder):
    if name == SINGLE_FILE or name == INDEX_FILE or re.fullmatch(r"model-\d+-of-\d+\.safetensors", name):
      os.remove(os.path.join(folder, name))
  if os.path.isfile(os.path.join(folder, HEADS_FILE)):
    os.remove(os.path.join(folder, HEADS_FILE))

  groups = split_by_size(((s.hf_name, int(np.prod(s.shape)) * out_dtype.itemsize) for s in specs),
                         parse_size(max_shard_size))
  by_name = {s.hf_name: s for s in specs}
  if len(groups) == 1:
    _write_group(folder, SINGLE_FILE, specs, params, out_dtype, flax_layout=False, config=config)
  else:
    weight_map = {}
    total = 0
    for k, group in enumerate(groups):
      filename = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
      total += _write_group(folder, filename, [by_name[n] for n in group], params, out_dtype,
                            flax_layout=False, config=config)
      weight_map.update({n: filename for n in group})
    with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  if heads and save_heads:
    os.makedirs(os.path.dirname(os.path.join(folder, HEADS_FILE)), exist_ok=True)
    _write_group(folder, HEADS_FILE, heads, params, out_dtype, flax_layout=True, config=config)

  hf = hf_config.config_to_hf(config, eos_token_ids=eos_token_ids)
  hf["dtype"] = hf["torch_dtype"] = str(out_dtype)
  with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"],
                "pad_token_id": hf["pad_token_id"]}
  with open(os.path.join(folder, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump(generation, f, indent=2, sort_keys=True)
  if tokenizer is not None:
    save_tokenizer_files(tokenizer, folder)
  return folder
