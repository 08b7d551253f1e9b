"""Flax (linen) decoder for the Llama 3 / Qwen2 / Qwen2.5 / Qwen3 families.

Each block is::

  q, k, v = RoPE(norm_qk(W_{q,k,v} RMSNorm(x) + b))          (token-wise stage 1)
  o       = causal GQA attention(q, k, v)                    (cross-token)
  x       = x + W_o o;   x = x + SwiGLU(RMSNorm(x))           (token-wise stage 2)

and the head is ``logits = float32(RMSNorm(x)) @ W_lm`` (or ``@ embedding.T``
when tied). The token-wise stages are pure functions run through
``ops.map_tokens``: on whole arrays by default, on fixed row tiles in
batch-invariant mode. Keys and values are returned (full-sequence mode) or
written into a KV cache at each query's index (decode mode), so the sampler and
the learner share every line of model code.

References:
  Touvron et al. / Llama 3 (arXiv:2407.21783); Qwen2 (arXiv:2407.10671);
  Qwen3 (arXiv:2505.09388).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_llm import ops
from jaxrl_llm.models.axes import constrain
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import (Embedding, Linear, Projected, Scale, apply_rope, dtype, linear, project,
                                     rms_norm, rope_cos_sin, rope_inverse_frequencies)

HEAD_OUTPUTS = ("hidden", "logits", "values", "rewards")


def _projection_factory(c: ModelConfig):
  """``make(name, in, out, axes, bias)``: the holder of projection ``name`` (with its LoRA rank, if targeted)."""
  pd = dtype(c.param_dtype)

  def make(name: str, in_features: int, out_features: int, axes, use_bias: bool) -> Projected:
    return Projected(in_features, out_features, axes, use_bias, pd, lora_rank=c.lora_on(name),
                     lora_scale=c.lora_scale)
  return make


class Attention(nn.Module):
  """Parameter holder of one attention layer (q/k/v/o projections, Qwen3 q/k norms)."""

  config: ModelConfig

  def setup(self):
    c = self.config
    hd, pd = c.resolved_head_dim, dtype(c.param_dtype)
    proj = _projection_factory(c)
    self.q_proj = proj("q", c.hidden_size, c.num_heads * hd, ("embed", "heads"), c.attention_bias)
    self.k_proj = proj("k", c.hidden_size, c.num_kv_heads * hd, ("embed", "kv_heads"), c.attention_bias)
    self.v_proj = proj("v", c.hidden_size, c.num_kv_heads * hd, ("embed", "kv_heads"), c.attention_bias)
    self.o_proj = proj("o", c.num_heads * hd, c.hidden_size, ("heads", "embed"), False)
    if c.qk_norm:
      self.q_norm = Scale(hd, pd)
      self.k_norm = Scale(hd, pd)

  def __call__(self) -> dict:
    p = dict(q=self.q_proj(), k=self.k_proj(), v=self.v_proj(), o=self.o_proj())
    if self.config.qk_norm:
      p.update(q_norm=self.q_norm(), k_norm=self.k_norm())
    return p


class Mlp(nn.Module):
  """Parameter holder of the SwiGLU MLP."""

  config: ModelConfig

  def setup(self):
    c = self.config
    proj = _projection_factory(c)
    self.gate_proj = proj("gate", c.hidden_size, c.intermediate_size, ("embed", "mlp"), False)
    self.up_proj = proj("up", c.hidden_size, c.intermediate_size, ("embed", "mlp"), False)
    self.down_proj = proj("down", c.intermediate_size, c.hidden_size, ("mlp", "embed"), False)

  def __call__(self) -> dict:
    return dict(gate=self.gate_proj(), up=self.up_proj(), down=self.down_proj())


def _qkv_stage(p: dict, c: ModelConfig, inv_freq, x, positions):
  """Token-wise: RMSNorm -> q/k/v projections -> (q/k norm) -> RoPE. x [..., D]."""
  act = dtype(c.dtype)
  hd = c.resolved_head_dim
  h = rms_norm(x, p["attn_norm"], c.rms_norm_eps)
  q = project(h, p["q"], act).reshape(x.shape[:-1] + (c.num_heads, hd))
  k = project(h, p["k"], act).reshape(x.shape[:-1] + (c.num_kv_heads, hd))
  v = project(h, p["v"], act).reshape(x.shape[:-1] + (c.num_kv_heads, hd))
  if c.qk_norm:
    q = rms_norm(q, p["q_norm"], c.rms_norm_eps)
    k = rms_norm(k, p["k_norm"], c.rms_norm_eps)
  cos, sin = rope_cos_sin(positions, inv_freq, act)
  return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _out_mlp_stage(p: dict, c: ModelConfig, x, o):
  """Token-wise: x + W_o o, then x + SwiGLU(RMSNorm(x)). x [..., D], o [..., H, hd]."""
  act = dtype(c.dtype)
  x = x + project(o.reshape(o.shape[:-2] + (-1,)), p["o"], act)
  h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps)
  gate = project(h, p["gate"], act)
  up = project(h, p["up"], act)
  return x + project(jax.nn.silu(gate) * up, p["down"], act)


def _head_stage(p: dict, c: ModelConfig, outputs: Sequence[str], x):
  """Token-wise: final RMSNorm, FP32 LM head, optional scalar heads. x [..., D]."""
  h = rms_norm(x, p["final_norm"], c.rms_norm_eps)
  out = {}
  if "hidden" in outputs:
    out["hidden"] = h
  if "logits" in outputs:
    ld = dtype(c.logits_dtype)
    if c.tie_word_embeddings:
      logits = jnp.einsum("...d,vd->...v", h.astype(ld), p["embedding"].astype(ld))
    else:
      logits = linear(h, p["lm_head"][0], None, ld)
    out["logits"] = logits.astype(jnp.float32)
  for name in ("values", "rewards"):
    if name in outputs:
      kernel, bias = p[name]
      out[name] = (linear(h, kernel, bias, jnp.float32))[..., 0]
  return out


class Block(nn.Module):
  """One decoder layer (pre-norm attention + SwiGLU MLP)."""

  config: ModelConfig

  def setup(self):
    c = self.config
    pd = dtype(c.param_dtype)
    self.attn_norm = Scale(c.hidden_size, pd)
    self.attn = Attention(c)
    self.mlp_norm = Scale(c.hidden_size, pd)
    self.mlp = Mlp(c)

  def declare(self) -> dict:
    """Creates (at init) and returns this layer's parameters."""
    return dict(self.attn(), attn_norm=self.attn_norm(), mlp_norm=self.mlp_norm(), **self.mlp())

  def __call__(self, x_btd, positions_bt, q_index_bt, kv_valid_bs, cache_k=None, cache_v=None):
    """Applies the layer.

    Args:
      x_btd: [B, T, D] residual stream.
      positions_bt: int32 [B, T] RoPE positions.
      q_index_bt: int32 [B, T] index of each token on the key axis.
      kv_valid_bs: bool [B, S] keys holding real tokens (S = T without cache).
      cache_k, cache_v: optional cache in the mode's K/V layout
        (``ops.kv_from_tokens``); the new keys/values are written at
        ``q_index_bt`` before attending.

    Returns:
      ``(x_btd, k, v)``: the new residual stream and the keys/values attended
      to in the mode's K/V layout (this layer's own in full-sequence mode, the
      updated cache otherwise).
    """
    c = self.config
    inv = c.batch_invariant
    p = self.declare()
    inv_freq = rope_inverse_frequencies(c)
    q, k, v = ops.map_tokens(lambda tr: _qkv_stage(p, c, inv_freq, *tr), (x_btd, positions_bt),
                             lead=2, invariant=inv)
    q = constrain(q, ("batch", "length", "act_heads", None))
    if cache_k is None:
      k, v = ops.kv_from_tokens(k, inv), ops.kv_from_tokens(v, inv)
    else:
      k, v = ops.kv_write(cache_k, k, q_index_bt, inv), ops.kv_write(cache_v, v, q_index_bt, inv)
    o = ops.causal_attention(q, k, v, q_index_bt, kv_valid_bs, invariant=inv)
    x_btd = ops.map_tokens(lambda tr: _out_mlp_stage(p, c, *tr), (x_btd, o), lead=2, invariant=inv)
    return constrain(x_btd, ("batch", "length", "act_embed")), k, v


class Decoder(nn.Module):
  """Decoder-only transformer; see the module docstring. Parameter names follow model_spec."""

  config: ModelConfig

  def setup(self):
    c = self.config
    pd = dtype(c.param_dtype)
    self.embed = Embedding(c.vocab_size, c.hidden_size, pd)
    block = nn.remat(Block, prevent_cse=True) if c.remat else Block
    self.layers = [block(c) for _ in range(c.num_layers)]
    self.final_norm = Scale(c.hidden_size, pd)
    if not c.tie_word_embeddings:
      self.lm_head = Linear(c.hidden_size, c.vocab_size, ("embed", "vocab"), False, pd)
    if c.value_head:
      self.value_head = Linear(c.hidden_size, 1, ("embed", None), True, pd)
    if c.reward_head:
      self.reward_head = Linear(c.hidden_size, 1, ("embed", None), True, pd)

  def declare(self) -> None:
    """Creates every parameter without computing anything (cheap ``init``)."""
    self.embed()
    for layer in self.layers:
      layer.declare()
    self.head(jnp.zeros((1, self.config.hidden_size), dtype(self.config.dtype)), ("logits", "values", "rewards"))

  def trunk(self, tokens_bt, positions_bt, q_index_bt, kv_valid_bs,
            cache_k: Optional[Sequence[jax.Array]] = None, cache_v: Optional[Sequence[jax.Array]] = None):
    """Embedding and all layers; returns ``(x_btd, keys, values)`` (tuples over layers)."""
    c = self.config
    x = jnp.take(self.embed(), tokens_bt, axis=0, mode="fill", fill_value=jnp.nan).astype(dtype(c.dtype))
    x = constrain(x, ("batch", "length", "act_embed"))
    keys, values = [], []
    for i, layer in enumerate(self.layers):
      ck = None if cache_k is None else cache_k[i]
      cv = None if cache_v is None else cache_v[i]
      x, k, v = layer(x, positions_bt, q_index_bt, kv_valid_bs, ck, cv)
      keys.append(k)
      values.append(v)
    return x, tuple(keys), tuple(values)

  def head(self, x, outputs: Sequence[str] = HEAD_OUTPUTS) -> dict:
    """Final norm and heads on x [..., D] (any leading dims); returns the requested outputs."""
    c = self.config
    outputs = tuple(o for o in outputs if (o != "values" or c.value_head) and (o != "rewards" or c.reward_head))
    p = dict(final_norm=self.final_norm())
    if "logits" in outputs:
      if c.tie_word_embeddings:
        p["embedding"] = self.embed()
      else:
        p["lm_head"] = self.lm_head()
    if "values" in outputs:
      p["values"] = self.value_head()
    if "rewards" in outputs:
      p["rewards"] = self.reward_head()
    lead = x.ndim - 1
    return ops.map_tokens(lambda h: _head_stage(p, c, outputs, h), x, lead=lead, invariant=c.batch_invariant)

  def __call__(self, tokens_bt, positions_bt, segment_mask_bt):
    """Full-sequence forward: every output of ``head`` for every position."""
    t = tokens_bt.shape[1]
    q_index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)
    x, _, _ = self.trunk(tokens_bt, positions_bt, q_index, segment_mask_bt)
    return self.head(x)


def abstract_boxed_params(config: ModelConfig) -> Any:
  """Shapes (``jax.ShapeDtypeStruct``) of the params, still boxed with logical axis metadata."""
  variables = jax.eval_shape(lambda rng: Decoder(config).init(rng, method=Decoder.declare), jax.random.PRNGKey(0))
  return variables["params"]
