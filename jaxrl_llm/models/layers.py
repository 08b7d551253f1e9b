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
from typing import Any, Callable, Optional

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
    kernel = self.param("kernel", nn.with_logical_partitioning(self.kernel_init, self.axes),
                        (self.in_features, self.out_features), self.param_dtype)
    bias = None
    if self.use_bias:
      bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), (self.axes[1],)),
                        (self.out_features,), self.param_dtype)
    return kernel, bias


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
