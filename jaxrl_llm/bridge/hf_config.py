"""Hugging Face ``config.json`` <-> :class:`jaxrl_llm.models.config.ModelConfig`.

Supported architectures and what decides each ModelConfig field:

  architecture        family  attention_bias                  qk_norm
  LlamaForCausalLM    llama   False (``attention_bias`` must   no
                              be false, see below)
  Qwen2ForCausalLM    qwen2   always True (q, k, v bias)       no
  Qwen3ForCausalLM    qwen3   False (as Llama)                 yes

In transformers, ``attention_bias: true`` on Llama and Qwen3 also gives o_proj
a bias; the decoder (model spec) has no o_proj bias, so such configs are
refused by name rather than imported wrongly. Likewise ``mlp_bias: true``,
sliding-window attention and activations other than silu.

RoPE: transformers 5 writes ``rope_parameters`` ({rope_theta, rope_type, ...});
older files write ``rope_theta`` and ``rope_scaling`` ({rope_type|type, ...}).
Both are read. ``rope_type`` ``default`` (or no scaling) and ``llama3`` are
supported; anything else (linear, dynamic, yarn, ...) is refused by name.

Special ids:
  * ``eos_token_id`` may be a list in HF (Llama 3.1 Instruct:
    [128001, 128008, 128009]); ModelConfig keeps one id, the first, and
    :func:`hf_eos_token_ids` returns them all (stop ids for a sampler). When
    config.json has none, ``generation_config.json`` beside it is read.
  * ``pad_token_id`` is often absent (Llama 3) or equal to EOS (Qwen2.5 base
    models pad with ``<|endoftext|>``, their EOS). Padding must never be
    conflated with the stop token, so :func:`resolve_pad_token_id` picks the
    highest id below ``vocab_size`` that is neither an EOS id nor BOS (for Qwen
    that is an unused embedding row past the tokenizer's vocabulary; for Llama 3
    a reserved special token). Pad positions are masked everywhere, so any
    distinct in-range id is safe. Pass ``pad_token_id=`` (e.g. the tokenizer's
    :attr:`~jaxrl_llm.bridge.tokenizer.Tokenizer.pad_id`) to choose it yourself.

The reverse, :func:`config_to_hf`, writes both the transformers-5 keys
(``rope_parameters``, ``dtype``) and the legacy ones (``rope_theta``,
``rope_scaling``, ``torch_dtype``) so that transformers 4.x stacks (vLLM) and
5.x both read the file.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Sequence, Union

from jaxrl_llm.models.config import ModelConfig, RopeScaling

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_ARCH_OF_FAMILY = {family: arch for arch, family in ARCHITECTURES.items()}
_DTYPES = ("float32", "bfloat16", "float16")

ConfigSource = Union[Mapping[str, Any], str, os.PathLike]


def read_hf_config(source: ConfigSource) -> dict[str, Any]:
  """Returns the HF config as a dict (from a dict, a folder or a config.json path).

  Args:
    source: a mapping, a folder holding ``config.json``, or the file itself.

  Returns:
    A fresh dict (a shallow copy when ``source`` is a mapping).
  """
  if isinstance(source, Mapping):
    return dict(source)
  path = os.fspath(source)
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"HF config not found: {path} (expected a folder with config.json "
                            "or the config.json file)")
  with open(path, encoding="utf-8") as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path} is not valid JSON: {e}") from e


def hf_family(hf: Mapping[str, Any], where: str = "config") -> str:
  """The ModelConfig family of a HF config, from ``architectures`` (or ``model_type``)."""
  archs = hf.get("architectures")
  if archs:
    if isinstance(archs, str):
      archs = [archs]
    unsupported = [a for a in archs if a not in ARCHITECTURES]
    if unsupported:
      raise ValueError(f"{where}: unsupported architectures {unsupported}; supported: "
                       f"{list(SUPPORTED_ARCHITECTURES)}")
    families = {ARCHITECTURES[a] for a in archs}
    if len(families) > 1:
      raise ValueError(f"{where}: architectures {archs} name more than one family")
    return families.pop()
  model_type = hf.get("model_type")
  if model_type in _MODEL_TYPE:
    return _MODEL_TYPE[model_type]
  raise ValueError(f"{where}: no supported 'architectures' entry and model_type={model_type!r}; "
                   f"supported architectures: {list(SUPPORTED_ARCHITECTURES)}")


def _rope(hf: Mapping[str, Any], where: str) -> tuple[float, Optional[RopeScaling]]:
  params = hf.get("rope_parameters")
  if isinstance(params, Mapping) and "rope_theta" in params:
    theta = params["rope_theta"]
    scaling = params
  else:
    theta = hf.get("rope_theta", 10000.0)
    scaling = hf.get("rope_scaling")
  if scaling is None:
    return float(theta), None
  rope_type = scaling.get("rope_type", scaling.get("type", "default"))
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(f"{where}: rope_type={rope_type!r} is not supported; supported: "
                     "'default' (no scaling) and 'llama3'")
  missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings") if k not in scaling]
  if missing:
    raise ValueError(f"{where}: llama3 rope scaling lacks {missing}")
  return float(theta), RopeScaling(
      factor=float(scaling["factor"]),
      low_freq_factor=float(scaling["low_freq_factor"]),
      high_freq_factor=float(scaling["high_freq_factor"]),
      original_max_position_embeddings=int(scaling["original_max_position_embeddings"]))


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, (list, tuple)):
    return [int(v) for v in value]
  return [int(value)]


def _generation_config(source: ConfigSource) -> dict[str, Any]:
  if isinstance(source, Mapping):
    return {}
  folder = os.fspath(source)
  if not os.path.isdir(folder):
    folder = os.path.dirname(folder)
  path = os.path.join(folder, "generation_config.json")
  if os.path.isfile(path):
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  return {}


def hf_eos_token_ids(source: ConfigSource) -> tuple[int, ...]:
  """All EOS ids of a HF config (config.json, else generation_config.json)."""
  ids = _as_id_list(read_hf_config(source).get("eos_token_id"))
  if not ids:
    ids = _as_id_list(_generation_config(source).get("eos_token_id"))
  return tuple(ids)


def resolve_pad_token_id(pad_token_id: Optional[int], eos_token_ids: Sequence[int],
                         bos_token_id: Optional[int], vocab_size: int) -> int:
  """Returns a padding id that is never an EOS id.

  Args:
    pad_token_id: the declared pad id, or None.
    eos_token_ids: every stop id.
    bos_token_id: the BOS id, or None (avoided too).
    vocab_size: V; the result is in [0, V).

  Returns:
    ``pad_token_id`` when given and not an EOS id, else the highest id below
    ``vocab_size`` that is neither EOS nor BOS.
  """
  eos = set(int(e) for e in eos_token_ids)
  if pad_token_id is not None and int(pad_token_id) not in eos:
    if not 0 <= int(pad_token_id) < vocab_size:
      raise ValueError(f"pad_token_id={pad_token_id} is outside [0, vocab_size={vocab_size})")
    return int(pad_token_id)
  avoid = eos | ({int(bos_token_id)} if bos_token_id is not None else set())
  for candidate in range(vocab_size - 1, -1, -1):
    if candidate not in avoid:
      return candidate
  raise ValueError(f"no id in [0, {vocab_size}) is free for padding (eos={sorted(eos)}, bos={bos_token_id})")


def config_from_hf(source: ConfigSource, *, param_dtype: Optional[str] = None,
                   dtype: Optional[str] = None, pad_token_id: Optional[int] = None,
                   eos_token_id: Optional[int] = None, **overrides: Any) -> ModelConfig:
  """Builds a ModelConfig from a HF config (dict, folder or config.json path).

  Args:
    source: the HF config.
    param_dtype: parameter dtype; default the checkpoint's ``dtype`` /
      ``torch_dtype`` when it is float32/bfloat16/float16, else float32.
    dtype: activation dtype; default ``param_dtype``.
    pad_token_id: padding id; default see :func:`resolve_pad_token_id`.
    eos_token_id: stop id; default the first HF EOS id.
    **overrides: any other ModelConfig field (e.g. ``value_head=True``).

  Returns:
    The ModelConfig.
  """
  where = source if not isinstance(source, Mapping) else "HF config dict"
  hf = read_hf_config(source)
  family = hf_family(hf, str(where))
  required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads")
  missing = [k for k in required if hf.get(k) is None]
  if missing:
    raise ValueError(f"{where}: missing required field(s) {missing}")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise ValueError(f"{where}: hidden_act={act!r} is not supported (the decoder uses SwiGLU with silu)")
  if family == "llama" and hf.get("mlp_bias", False):
    raise ValueError(f"{where}: mlp_bias=True is not supported (the decoder's MLP has no bias)")
  if family in ("llama", "qwen3") and hf.get("attention_bias", False):
    raise ValueError(f"{where}: attention_bias=True is not supported for {family} (transformers then "
                     "also gives o_proj a bias, which the decoder does not have)")
  if family in ("qwen2", "qwen3"):
    layer_types = hf.get("layer_types") or []
    if hf.get("use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
      raise ValueError(f"{where}: sliding-window attention (use_sliding_window / layer_types) is not "
                       "supported; only full attention")
  theta, scaling = _rope(hf, str(where))
  eos_ids = [eos_token_id] if eos_token_id is not None else list(hf_eos_token_ids(source))
  if not eos_ids:
    raise ValueError(f"{where}: no eos_token_id in config.json nor generation_config.json; "
                     "pass eos_token_id=")
  bos = hf.get("bos_token_id")
  if isinstance(bos, (list, tuple)):
    bos = bos[0] if bos else None
  vocab = int(hf["vocab_size"])
  pad = resolve_pad_token_id(pad_token_id if pad_token_id is not None else hf.get("pad_token_id"),
                             eos_ids, bos, vocab)
  if param_dtype is None:
    src_dtype = hf.get("dtype", hf.get("torch_dtype"))
    param_dtype = src_dtype if src_dtype in _DTYPES else "float32"
  head_dim = hf.get("head_dim")
  if head_dim is not None and int(head_dim) * int(hf["num_attention_heads"]) == int(hf["hidden_size"]):
    head_dim = None  # canonical form: None means hidden_size // num_heads
  fields = dict(
      family=family,
      vocab_size=vocab,
      hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]),
      num_heads=int(hf["num_attention_heads"]),
      num_kv_heads=int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
      head_dim=int(head_dim) if head_dim is not None else None,
      rope_theta=theta,
      rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
      tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
      attention_bias=family == "qwen2",
      qk_norm=family == "qwen3",
      param_dtype=param_dtype,
      dtype=dtype or param_dtype,
      pad_token_id=pad,
      eos_token_id=int(eos_ids[0]),
      bos_token_id=int(bos) if bos is not None else None,
  )
  unknown = [k for k in overrides if k not in ModelConfig.__dataclass_fields__]
  if unknown:
    raise TypeError(f"unknown ModelConfig field(s) in overrides: {unknown}")
  fields.update(overrides)
  return ModelConfig(**fields)


def config_to_hf(config: ModelConfig, *, eos_token_ids: Optional[Sequence[int]] = None) -> dict[str, Any]:
  """The HF ``config.json`` dict of a ModelConfig (for export).

  Args:
    config: the model configuration.
    eos_token_ids: all stop ids to write (default ``[config.eos_token_id]``
      written as a single int).

  Returns:
    A JSON-serialisable dict loadable by ``transformers.AutoConfig``.
  """
  family = config.family
  rope_parameters: dict[str, Any] = {"rope_theta": float(config.rope_theta), "rope_type": "default"}
  rope_scaling = None
  if config.rope_scaling is not None:
    rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling.factor,
                    "low_freq_factor": config.rope_scaling.low_freq_factor,
                    "high_freq_factor": config.rope_scaling.high_freq_factor,
                    "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings}
    rope_parameters = dict(rope_scaling, rope_theta=float(config.rope_theta))
  eos: Any = config.eos_token_id
  if eos_token_ids is not None:
    if config.eos_token_id not in [int(e) for e in eos_token_ids]:
      raise ValueError(f"eos_token_ids={list(eos_token_ids)} does not contain ModelConfig.eos_token_id="
                       f"{config.eos_token_id}")
    if len(eos_token_ids) > 1:
      eos = [int(e) for e in eos_token_ids]
  hf: dict[str, Any] = {
      "architectures": [_ARCH_OF_FAMILY[family]],
      "model_type": _MODEL_TYPE[family],
      "vocab_size": config.vocab_size,
      "hidden_size": config.hidden_size,
      "intermediate_size": config.intermediate_size,
      "num_hidden_layers": config.num_layers,
      "num_attention_heads": config.num_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.resolved_head_dim,
      "hidden_act": "silu",
      "max_position_embeddings": config.max_position_embeddings,
      "rms_norm_eps": config.rms_norm_eps,
      "rope_theta": float(config.rope_theta),
      "rope_scaling": rope_scaling,
      "rope_parameters": rope_parameters,
      "tie_word_embeddings": config.tie_word_embeddings,
      "bos_token_id": config.bos_token_id,
      "eos_token_id": eos,
      "pad_token_id": config.pad_token_id,
      "dtype": config.param_dtype,
      "torch_dtype": config.param_dtype,
      "attention_dropout": 0.0,
      "initializer_range": 0.02,
      "use_cache": True,
  }
  want_bias, want_norm = family == "qwen2", family == "qwen3"
  if config.attention_bias != want_bias or config.qk_norm != want_norm:
    raise ValueError(f"family={family!r} with attention_bias={config.attention_bias}, qk_norm={config.qk_norm} "
                     f"has no HF equivalent ({_ARCH_OF_FAMILY[family]} needs attention_bias={want_bias}, "
                     f"qk_norm={want_norm})")
  if family == "llama":
    hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  elif family == "qwen3":
    hf.update(attention_bias=False)
  if family in ("qwen2", "qwen3"):
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers,
              layer_types=["full_attention"] * config.num_layers)
  return hf
