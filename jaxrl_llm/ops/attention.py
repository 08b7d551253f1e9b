"""Causal grouped-query attention: a fast default path and a batch-invariant path.

Both compute, for every query ``t`` of sequence ``b`` and head ``h`` (KV head
``h // G`` with ``G = H / K``)::

  s_j   = (q_t . k_j) * scale                     for keys j with valid_j and j <= i_t
  o_t   = sum_j softmax(s)_j v_j

where ``i_t`` is the query's index in the key/cache axis. Keys live at the
index equal to their token position (the learner's sequence layout and the
sampler's KV-cache layout are the same), so causality is ``j <= i_t``.

The batch-invariant path is a blocked online softmax (flash attention) over
fixed key blocks of ``KEY_BLOCK`` keys::

  m' = max(m, max_j s_j)      a = exp(m - m')      p_j = exp(s_j - m') (0 if masked)
  l' = a l + sum_j p_j        acc' = a acc + sum_j p_j v_j        o = acc / l

run for each fixed tile of ``ROW_TILE`` query rows (queries of any sequence,
flattened) against the key block of each row's own sequence, gathered to a
fixed ``[ROW_TILE, KEY_BLOCK, K, hd]`` shape. Every score, reduction and
rescale therefore runs in one compiled loop body whatever the batch size,
query count (full sequence vs one decode token) or key length (sequence
length vs cache length). Key blocks past a tile's last query are skipped, and
a block whose keys are all masked for a row is an exact no-op for that row
(``m' = m``, ``a = exp(0) = 1``, ``p = 0``), so the extra cache blocks of the
sampler and the padding of the learner do not change a single bit.

References:
  Dao et al., "FlashAttention" (arXiv:2205.14135); Milakov & Gimelshein,
  "Online normalizer calculation for softmax" (arXiv:1805.02867);
  Ainslie et al., "GQA" (arXiv:2305.13245).
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jax import lax

from jaxrl_llm.ops.tiling import MIN_TILES, ROW_TILE, fixed_fori_loop, map_row_tiles

KEY_BLOCK = 32
"""Keys per block of the batch-invariant attention."""

_M_INIT = -1e30  # running-max start: finite, so fully-masked rows never produce NaN


# ----------------------------------------------------------------------------- KV layout
# Keys/values (the learner's per-layer K/V and the sampler's cache) are stored in
# the layout each kernel reads fastest on XLA:CPU (measured, decode B=128, S=160):
#   default mode    head-major [B, K, S, hd]: the decode contractions batch over
#                   (B, K) with no per-step transpose of the whole cache;
#   invariant mode  token-major [B, S, K, hd]: each row's key block is one
#                   contiguous [KEY_BLOCK, K, hd] slab for the per-row gather
#                   (a strided gather from the head-major layout was 3x slower).


def kv_seq_axis(invariant: bool) -> int:
  """Axis of the key/cache positions in the mode's K/V layout."""
  return 1 if invariant else 2


def kv_from_tokens(x_btkd: jax.Array, invariant: bool) -> jax.Array:
  """[B, T, K, hd] keys or values (token-major) -> the mode's K/V layout."""
  return x_btkd if invariant else x_btkd.transpose(0, 2, 1, 3)


def kv_write(cache: jax.Array, x_btkd: jax.Array, index_bt: jax.Array, invariant: bool) -> jax.Array:
  """Writes token ``t`` of row ``b`` of ``x_btkd`` at cache position ``index_bt[b, t]``."""
  rows = jnp.arange(cache.shape[0])[:, None]
  x = x_btkd.astype(cache.dtype)
  if invariant:
    return cache.at[rows, index_bt].set(x, unique_indices=True)
  return cache.at[rows, :, index_bt].set(x, unique_indices=True)


def causal_attention(q_bthd: jax.Array, k: jax.Array, v: jax.Array, q_index_bt: jax.Array,
                     kv_valid_bs: jax.Array, *, invariant: bool = False, scale: float | None = None) -> jax.Array:
  """Causal GQA over keys stored at their positions.

  Args:
    q_bthd: queries [B, T, H, hd] (RoPE applied).
    k: keys (RoPE applied) in the mode's layout (``kv_from_tokens``):
      [B, K, S, hd] by default, [B, S, K, hd] when ``invariant``; key ``j``
      sits at position ``j``.
    v: values, same layout.
    q_index_bt: int32 [B, T] index of each query on the key axis (its position).
    kv_valid_bs: bool [B, S] keys holding real tokens.
    invariant: use the batch-invariant blocked kernel.
    scale: score scale, default ``hd ** -0.5``.

  Returns:
    [B, T, H, hd] attention output in ``q_bthd.dtype``. Queries with no valid
    key get zeros.
  """
  chex.assert_rank([q_bthd, k, v, q_index_bt, kv_valid_bs], [4, 4, 4, 2, 2])
  chex.assert_equal_shape([k, v])
  b, t, h, hd = q_bthd.shape
  s_len = k.shape[kv_seq_axis(invariant)]
  kv_heads = k.shape[3 - kv_seq_axis(invariant)]
  if h % kv_heads:
    raise ValueError(f"causal_attention: {h} query heads is not a multiple of {kv_heads} KV heads")
  if k.shape[0] != b or k.shape[3] != hd or kv_valid_bs.shape != (b, s_len) or q_index_bt.shape != (b, t):
    layout = "[B, S, K, hd]" if invariant else "[B, K, S, hd]"
    raise ValueError(f"causal_attention: shapes disagree: q {q_bthd.shape}, k {k.shape} (layout {layout}), "
                     f"q_index {q_index_bt.shape}, kv_valid {kv_valid_bs.shape}")
  scale = float(hd) ** -0.5 if scale is None else float(scale)
  if invariant:
    return _blocked_attention(q_bthd, k, v, q_index_bt, kv_valid_bs, scale)
  return _dense_attention(q_bthd, k, v, q_index_bt, kv_valid_bs, scale)


_FEW_QUERIES = 8  # decode-sized T: contract by broadcast-multiply-reduce instead of batched dots


def _dense_attention(q, k, v, q_index, kv_valid, scale):
  """One masked softmax over all keys (fast path, shape-dependent rounding).

  For a few queries per row (decode) the contractions are written as
  broadcast-multiply-reduce: XLA:CPU runs the batched [G, hd] x [hd, S] dots of
  einsum as one small GEMM per (row, KV head), which measured 1.4x slower for
  the whole decode step (B = 128, S = 160). Longer query blocks use einsum.
  """
  b, t, h, hd = q.shape
  kv_heads, s_len = k.shape[1], k.shape[2]
  groups = h // kv_heads
  mask = kv_valid[:, None, :] & (jnp.arange(s_len)[None, None, :] <= q_index[:, :, None])  # [B, T, S]
  few = t <= _FEW_QUERIES
  if few:
    qg = q.reshape(b, t, kv_heads, groups, hd).transpose(0, 2, 1, 3, 4).reshape(b, kv_heads, t * groups, hd)
    scores = jnp.sum(qg[:, :, :, None, :].astype(jnp.float32) * k[:, :, None, :, :].astype(jnp.float32), axis=-1)
    mask = jnp.repeat(mask, groups, axis=1)[:, None]  # [B, 1, T*G, S]
  else:
    qg = q.reshape(b, t, kv_heads, groups, hd)
    scores = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    mask = mask[:, None, None]  # [B, 1, 1, T, S]
  scores = jnp.where(mask, scores * scale, -jnp.inf)
  m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), _M_INIT)
  p = jnp.where(mask, jnp.exp(scores - m), 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom > 0, denom, 1.0)
  if few:
    out = jnp.sum(p[..., None] * v[:, :, None, :, :].astype(jnp.float32), axis=-2)  # [B, K, T*G, hd]
    out = out.reshape(b, kv_heads, t, groups, hd).transpose(0, 2, 1, 3, 4)
  else:
    out = jnp.einsum("bkgts,bksd->btkgd", p, v.astype(jnp.float32))
  return out.reshape(b, t, h, hd).astype(q.dtype)


def _blocked_attention(q, k, v, q_index, kv_valid, scale):
  """Online-softmax attention with fixed [ROW_TILE queries x KEY_BLOCK keys] units."""
  b, t, h, hd = q.shape
  s_len, kv_heads = k.shape[1], k.shape[2]
  groups = h // kv_heads
  num_blocks = max(MIN_TILES, -(-s_len // KEY_BLOCK))
  pad = num_blocks * KEY_BLOCK - s_len
  if pad:
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kv_valid = jnp.pad(kv_valid, ((0, 0), (0, pad)))
  k_blocks = k.reshape(b * num_blocks, KEY_BLOCK, kv_heads, hd)
  v_blocks = v.reshape(b * num_blocks, KEY_BLOCK, kv_heads, hd)
  valid_blocks = kv_valid.reshape(b * num_blocks, KEY_BLOCK)
  key_offsets = jnp.arange(KEY_BLOCK, dtype=jnp.int32)

  rows = (
      q.reshape(b * t, kv_heads, groups, hd),
      jnp.repeat(jnp.arange(b, dtype=jnp.int32), t),
      q_index.reshape(b * t).astype(jnp.int32),
  )

  def tile_fn(tile):
    q_t, seq_t, qi_t = tile  # [M, K, G, hd], [M], [M]
    last_block = jnp.max(qi_t) // KEY_BLOCK

    def update(carry, j):
      m, l, acc = carry  # [M, K, G], [M, K, G], [M, K, G, hd]
      block = seq_t * num_blocks + j
      k_g = k_blocks[block]  # [M, KB, K, hd]: each row's own sequence, one contiguous slab per row
      v_g = v_blocks[block].astype(jnp.float32)
      valid = valid_blocks[block] & (j * KEY_BLOCK + key_offsets[None, :] <= qi_t[:, None])  # [M, KB]
      valid = valid[:, None, None, :]
      s = jnp.einsum("mkgd,mjkd->mkgj", q_t, k_g, preferred_element_type=jnp.float32) * scale
      s = jnp.where(valid, s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      alpha = jnp.exp(m - m_new)
      p = jnp.where(valid, jnp.exp(s - m_new[..., None]), 0.0)
      l = l * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha[..., None] + jnp.einsum("mkgj,mjkd->mkgd", p, v_g)
      return m_new, l, acc

    def step(j, carry):
      return lax.cond(j <= last_block, update, lambda c, _: c, carry, j)

    m0 = jnp.full(q_t.shape[:3], _M_INIT, jnp.float32)
    init = (m0, jnp.zeros_like(m0), jnp.zeros(q_t.shape, jnp.float32))
    _, l, acc = fixed_fori_loop(num_blocks, step, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.astype(q.dtype)

  out = map_row_tiles(tile_fn, rows, tile=ROW_TILE)
  return out.reshape(b, t, h, hd)
