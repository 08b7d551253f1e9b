"""Decoder building blocks: parameter holders and the pure token-wise maths.

Parameters are declared by tiny holder modules that only create and return
arrays (with logical axis names), so the arithmetic can live in pure functions
that run either on whole ``[B, T, ...]`` arrays (default mode) or inside the
fixed-shape tile loop of batch-invariant mode (``jaxrl_llm.ops``).

Maths (all match Hugging Face transformers' Llama / Qwen2 / Qwen3):

  RMSNorm(x)      = scale * cast(x32 * rsqrt(mean(x32^2) + eps))      (x32 = float32(x))
  RoPE(x, p)      = x * cos(p w) + rotate_half(x) * sin(p w),  w_i = theta^(-2i/hd)
  rotate_half(x)  = concat(-x[hd/2:], x[:hd/2])
  SwiGLU(x)       = W_down (silu(W_gate x) * (W_up x))

References:
  Zhang & Sennrich, "Root Mean Square Layer Normalization" (arXiv:1910.07467);
  Su et al., "RoFormer" (arXiv:2104.09864); Shazeer, "GLU Variants Improve
  Transformer" (arXiv:2002.05202); Llama 3 herd (arXiv:2407.21783) for the
  frequency-dependent RoPE scaling.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm.models.config import ModelConfig

INIT_STD = 0.02  # HF initializer_range for Llama / Qwen


def dtype(name: str) -> jnp.dtype:
  """Maps a config dtype name ("float32", "bfloat16", "float16") to a jnp dtype."""
  return jnp.dtype(name)


def _declare_linear(module: "Linear") -> tuple[jax.Array, Optional[jax.Array]]:
  kernel = module.param("kernel", nn.with_logical_partitioning(module.kernel_init, module.axes),
                        (module.in_features, module.out_features), module.param_dtype)
  bias = None
  if module.use_bias:
    bias = module.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (module.axes[1],)),
                        (module.out_features,), module.param_dtype)
  return kernel, bias


class Linear(nn.Module):
  """Holds ``kernel`` [in, out] (+ ``bias`` [out]); calling it returns ``(kernel, bias)``."""

  in_features: int
  out_features: int
  axes: tuple[Optional[str], Optional[str]]
  use_bias: bool = False
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.normal(INIT_STD)

  @nn.compact
  def __call__(self):
    return _declare_linear(self)


class Projection(NamedTuple):
  """A projection's arrays: ``kernel`` [in, out], ``bias`` [out] or None, and optional LoRA adapters
  ``lora_a`` [in, r], ``lora_b`` [r, out] with their output scale (see :func:`project`)."""

  kernel: jax.Array
  bias: Optional[jax.Array]
  lora_a: Optional[jax.Array] = None
  lora_b: Optional[jax.Array] = None
  lora_scale: float = 0.0


# PEFT's default initialiser of A [in, r]: uniform(+-1 / sqrt(in)), i.e. kaiming_uniform with a = sqrt(5).
LORA_A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform", in_axis=0, out_axis=1)


class Projected(Linear):
  """A :class:`Linear` that may carry LoRA adapters (Hu et al. 2021, arXiv:2106.09685).

  With ``lora_rank`` r > 0 it also declares ``lora_a`` [in, r] (sharded like the
  kernel's input axis; PEFT's uniform init) and ``lora_b`` [r, out] (sharded like
  its output axis; zeros, so a fresh adapter changes nothing), both float32
  master weights whatever ``param_dtype`` is. Calling it returns a :class:`Projection`.
  """

  lora_rank: int = 0
  lora_scale: float = 0.0

  @nn.compact
  def __call__(self) -> Projection:
    kernel, bias = _declare_linear(self)
    if not self.lora_rank:
      return Projection(kernel, bias)
    a = self.param("lora_a", nn.with_logical_partitioning(LORA_A_INIT, (self.axes[0], None)),
                   (self.in_features, self.lora_rank), jnp.float32)
    b = self.param("lora_b", nn.with_logical_partitioning(nn.initializers.zeros_init(), (None, self.axes[1])),
                   (self.lora_rank, self.out_features), jnp.float32)
    return Projection(kernel, bias, a, b, self.lora_scale)


class Scale(nn.Module):
  """Holds an RMSNorm ``scale`` [features] (initialised to ones)."""

  features: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    return self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("norm",)),
                      (self.features,), self.param_dtype)


class Embedding(nn.Module):
  """Holds the token ``embedding`` [V, D]."""

  num_embeddings: int
  features: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    return self.param("embedding",
                      nn.with_logical_partitioning(nn.initializers.normal(INIT_STD), ("vocab", "embed")),
                      (self.num_embeddings, self.features), self.param_dtype)


def linear(x: jax.Array, kernel: jax.Array, bias: Optional[jax.Array], compute_dtype) -> jax.Array:
  """``x @ kernel + bias`` in ``compute_dtype``; x [..., in], kernel [in, out]."""
  y = jnp.dot(x.astype(compute_dtype), kernel.astype(compute_dtype))
  if bias is not None:
    y = y + bias.astype(compute_dtype)
  return y


def project(x: jax.Array, p: Projection, compute_dtype) -> jax.Array:
  """``x @ kernel + bias (+ lora_scale * (x @ lora_a) @ lora_b)`` in ``compute_dtype``; x [..., in].

  The adapters stay unmerged, so their gradient never forms an [in, out] matrix:
  ``dA = x^T (dy B^T) s`` and ``dB = (x A)^T dy s`` cost O(r (in + out)) per token.
  """
  y = linear(x, p.kernel, p.bias, compute_dtype)
  if p.lora_a is None:
    return y
  h = jnp.dot(x.astype(compute_dtype), p.lora_a.astype(compute_dtype))
  return y + jnp.dot(h, p.lora_b.astype(compute_dtype)) * jnp.asarray(p.lora_scale, compute_dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """RMSNorm over the last axis, statistics in float32, result in ``x.dtype``.

  Args:
    x: [..., F] activations.
    scale: [F] weight.
    eps: variance epsilon.

  Returns:
    ``scale * cast(x32 * rsqrt(mean(x32^2) + eps))`` with the shape and dtype of x.
  """
  x32 = x.astype(jnp.float32)
  var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  y = (x32 * lax.rsqrt(var + eps)).astype(x.dtype)
  return scale.astype(x.dtype) * y


def rope_inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """RoPE inverse frequencies w [hd/2] (float32), with Llama 3 scaling when configured.

  ``w_i = 1 / theta^(2i / hd)``. With ``rope_scaling`` (Llama 3.1), wavelengths
  ``2 pi / w`` longer than ``L / low_freq_factor`` are divided by ``factor``,
  shorter than ``L / high_freq_factor`` are kept, and the band in between is
  interpolated with ``s = (L / wavelen - low) / (high - low)``:
  ``w' = (1 - s) w / factor + s w`` (L = original_max_position_embeddings).
  Computed in numpy float32 following transformers' ``_compute_llama3_parameters``.
  """
  hd = config.resolved_head_dim
  exponent = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
  inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponent)).astype(np.float32)
  scaling = config.rope_scaling
  if scaling is None:
    return inv_freq
  factor = np.float32(scaling.factor)
  low, high = np.float32(scaling.low_freq_factor), np.float32(scaling.high_freq_factor)
  old_len = np.float32(scaling.original_max_position_embeddings)
  low_freq_wavelen = old_len / low
  high_freq_wavelen = old_len / high
  wavelen = np.float32(2 * math.pi) / inv_freq
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
  smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
  smoothed = ((np.float32(1) - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, out_dtype) -> tuple[jax.Array, jax.Array]:
  """cos and sin of ``position * w`` duplicated over both halves: [..., hd] each."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
  angles = jnp.concatenate([angles, angles], axis=-1)
  return jnp.cos(angles).astype(out_dtype), jnp.sin(angles).astype(out_dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """HF rotate-half RoPE on x [..., heads, hd] with cos/sin [..., hd]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos[..., None, :] + rotated * sin[..., None, :]
