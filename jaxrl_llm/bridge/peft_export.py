"""LoRA adapters as a PEFT folder: ``adapter_config.json`` + ``adapter_model.safetensors``.

The folder the ``peft`` package (huggingface/peft) loads onto the Hugging Face base
model with ``PeftModel.from_pretrained(base, folder)``; its logits then equal the
merged export's (tests/test_lora.py). Conventions (PEFT's ``LoraConfig`` defaults):

  tensor names   base_model.model.<HF module>.lora_A.weight  [r, in]   (= A^T)
                 base_model.model.<HF module>.lora_B.weight  [out, r]  (= B^T)
  scaling        lora_alpha / r  (``use_rslora`` false), no dropout, no bias

with ``<HF module>`` the projection's name in the base checkpoint
(``model.layers.0.self_attn.q_proj``), from :func:`jaxrl_llm.bridge.layout.backbone_specs`.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from jaxrl_llm.bridge.host import to_host
from jaxrl_llm.bridge.layout import backbone_specs, get_path
from jaxrl_llm.bridge.safetensors_io import write_safetensors
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "export_peft_adapter", "peft_config"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_config(config: ModelConfig, base_model: str) -> dict:
  """The ``adapter_config.json`` of ``config``'s adapters (a PEFT ``LoraConfig``)."""
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
          "r": config.lora_rank, "lora_alpha": config.lora_alpha,
          "target_modules": sorted(f"{t}_proj" for t in config.lora_targets), "lora_dropout": 0.0,
          "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}


def export_peft_adapter(params: Mapping[str, Any], config: ModelConfig, folder: str, *, base_model: str = "") -> str:
  """Writes ``params``' adapters as a PEFT folder; returns the folder.

  Args:
    params: the parameter tree with adapters (``config.lora_rank`` > 0).
    config: its ModelConfig.
    folder: output folder (created; its adapter files replaced).
    base_model: ``base_model_name_or_path``: the base checkpoint the adapters apply to.

  Raises:
    ValueError: when ``params`` has no adapters.
  """
  if not lora.has_adapters(params):
    raise ValueError("export_peft_adapter: the parameters carry no LoRA adapters (model.lora.rank = 0?)")
  tensors: dict[str, tuple[tuple[str, ...], str]] = {}
  for spec in backbone_specs(config):
    holder_path = spec.path[:-1]
    if spec.path[-1] != "kernel" or "lora_a" not in get_path(params, holder_path):
      continue
    module = PREFIX + spec.hf_name.removesuffix(".weight")
    tensors[f"{module}.lora_A.weight"] = (holder_path + ("lora_a",), "A")
    tensors[f"{module}.lora_B.weight"] = (holder_path + ("lora_b",), "B")

  def produce(name: str) -> np.ndarray:
    path, _ = tensors[name]
    return np.ascontiguousarray(to_host(get_path(params, path)).T.astype(np.float32))

  entries = []
  for name, (path, _) in tensors.items():
    shape = tuple(get_path(params, path).shape)
    entries.append((name, shape[::-1], np.dtype(np.float32)))
  os.makedirs(folder, exist_ok=True)
  write_safetensors(os.path.join(folder, ADAPTER_WEIGHTS), entries, produce, {"format": "pt"})
  with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(peft_config(config, base_model), f, indent=2)
  return folder
