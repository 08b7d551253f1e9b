"""Decoder configuration shared by the model, the sampler and the weight bridge.

One ``ModelConfig`` describes every supported family:

  family   attention bias   q/k norm   notes
  llama    no               no         Llama 3 RoPE scaling optional
  qwen2    q, k, v bias     no         Qwen2 / Qwen2.5
  qwen3    no               yes        RMSNorm over head_dim on q and k
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

FAMILIES = ("llama", "qwen2", "qwen3")
# Projections that can carry LoRA adapters (attention q/k/v/o, SwiGLU gate/up/down), as PEFT names them less "_proj".
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3 frequency-dependent RoPE scaling (``rope_type: llama3`` in HF configs)."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of a decoder-only transformer.

  Attributes:
    family: one of ``FAMILIES``.
    vocab_size: V.
    hidden_size: D.
    intermediate_size: F, the SwiGLU width.
    num_layers: number of decoder blocks.
    num_heads: H query heads.
    num_kv_heads: K key/value heads (grouped-query attention; H % K == 0).
    head_dim: per-head width (HF default D // H).
    rope_theta: RoPE base.
    rope_scaling: optional Llama 3 scaling.
    rms_norm_eps: epsilon of every RMSNorm.
    max_position_embeddings: longest supported sequence (prompt + response).
    tie_word_embeddings: LM head shares the embedding matrix.
    attention_bias: q/k/v projections carry a bias (Qwen2).
    qk_norm: RMSNorm over head_dim on queries and keys (Qwen3).
    param_dtype: dtype parameters are stored in ("bfloat16" or "float32").
    dtype: activation dtype.
    logits_dtype: dtype of the LM-head matmul and everything after it; float32
      by default so log-probabilities are computed in full precision.
    remat: rematerialise each block in the backward pass.
    value_head: add a scalar value head (PPO critic) reading every position.
    reward_head: add a scalar reward head read at the EOS (last non-pad) token.
    batch_invariant: use fixed-shape kernels so that a sequence's outputs do not
      depend on the rest of the batch (and sampler == learner bit for bit).
    pad_token_id / eos_token_id / bos_token_id: special ids (pad != eos).
    lora_rank: r of the LoRA adapters (Hu et al. 2021, arXiv:2106.09685) on the
      projections named in ``lora_targets``; 0: no adapters (see models/lora.py).
    lora_alpha: adapters add ``(lora_alpha / lora_rank) * x @ A @ B``.
    lora_targets: projections carrying adapters, among ``LORA_TARGETS``.
  """

  family: str = "qwen2"
  vocab_size: int = 256
  hidden_size: int = 128
  intermediate_size: int = 512
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: Optional[int] = None
  rope_theta: float = 10000.0
  rope_scaling: Optional[RopeScaling] = None
  rms_norm_eps: float = 1e-6
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  attention_bias: bool = True
  qk_norm: bool = False
  param_dtype: str = "bfloat16"
  dtype: str = "bfloat16"
  logits_dtype: str = "float32"
  remat: bool = False
  value_head: bool = False
  reward_head: bool = False
  batch_invariant: bool = False
  pad_token_id: int = 0
  eos_token_id: int = 1
  bos_token_id: Optional[int] = None
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()

  def __post_init__(self):
    errors = []
    if self.family not in FAMILIES:
      errors.append(f"family={self.family!r}: expected one of {FAMILIES}")
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "max_position_embeddings"):
      if int(getattr(self, name)) <= 0:
        errors.append(f"{name}={getattr(self, name)!r}: expected a positive integer")
    if self.num_heads > 0 and self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
      errors.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
    if self.head_dim is None and self.num_heads > 0 and self.hidden_size % self.num_heads:
      errors.append(f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; set head_dim")
    for name in ("param_dtype", "dtype", "logits_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        errors.append(f"{name}={getattr(self, name)!r}: expected float32, bfloat16 or float16")
    if self.pad_token_id == self.eos_token_id:
      errors.append(f"pad_token_id == eos_token_id == {self.pad_token_id}: the stop token must stay trainable, give padding its own id")
    if self.lora_rank < 0:
      errors.append(f"lora_rank={self.lora_rank}: expected >= 0 (0: no adapters)")
    if self.lora_rank and not self.lora_targets:
      errors.append(f"lora_rank={self.lora_rank} with no lora_targets: expected some of {LORA_TARGETS}")
    if unknown := [t for t in self.lora_targets if t not in LORA_TARGETS]:
      errors.append(f"lora_targets={tuple(self.lora_targets)}: {unknown} are not projections of this model; "
                    f"expected some of {LORA_TARGETS}")
    if errors:
      raise ValueError("Invalid ModelConfig: " + "; ".join(errors))

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

  @property
  def lora_scale(self) -> float:
    """The adapters' output scale ``lora_alpha / lora_rank`` (PEFT's ``scaling``); 0 without adapters."""
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  def lora_on(self, projection: str) -> int:
    """The adapter rank of ``projection`` (one of ``LORA_TARGETS``): ``lora_rank`` or 0."""
    return self.lora_rank if projection in self.lora_targets else 0

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)


def tiny(family: str = "qwen2", **overrides: Any) -> ModelConfig:
  """The ~1M-parameter test/benchmark preset (hidden 128, 4 layers, 4 heads, 2 KV heads, F 512)."""
  base = dict(
      family=family,
      vocab_size=256,
      hidden_size=128,
      intermediate_size=512,
      num_layers=4,
      num_heads=4,
      num_kv_heads=2,
      attention_bias=(family == "qwen2"),
      qk_norm=(family == "qwen3"),
      param_dtype="float32",
      dtype="float32",
  )
  base.update(overrides)
  return ModelConfig(**base)
