"""Functional API of the decoder: what the learner, the sampler and the bridge call.

All functions take the parameter pytree of ``init_params`` (plain nested dicts,
kernels ``[in, out]``) and a ``ModelConfig``; none closes over parameters, so
they can be jitted once and called with new weights without recompiling.

Log-probability alignment (the learner's and the sampler's)::

  logp_bt[:, t] = log_softmax(logits_bt[:, t - 1] / temperature)[tokens_bt[:, t]]
  logp_bt[:, 0] = 0,  logp_bt = 0 where mask_bt is False.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxrl_llm import ops
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import INIT_STD
from jaxrl_llm.models.transformer import Decoder, abstract_boxed_params

Params = Any
LORA_KEY = 0x10A  # init_params draws the adapters' A from fold_in(rng, LORA_KEY)

# Public entry points are jitted with the (hashable, frozen) config static, so a
# call outside ``jit`` runs one compiled program instead of op-by-op dispatch;
# inside a caller's ``jit`` they inline.
_jit_config = functools.partial(jax.jit, static_argnames=("config",))


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
  """Random parameters: normal(0, 0.02) kernels and embedding, unit norm scales, zero biases.

  All normal weights come from one ``jax.random.normal`` draw that is split into
  the parameters (one random kernel to compile instead of one per parameter,
  ~3x faster to build on CPU); the distribution is the one the holder modules
  declare, so ``Decoder(config).init`` gives equally distributed (not equal) values.

  Args:
    config: model config.
    rng: a ``jax.random`` key.

  Returns:
    Plain nested dict of arrays in ``config.param_dtype`` (layout in model_spec). With
    ``config.lora_rank`` > 0: the base parameters of the same key as without LoRA, plus
    fresh adapters (``lora.add_adapters``).
  """
  if config.lora_rank:
    base = init_params(config.replace(lora_rank=0, lora_targets=()), rng)
    return lora.add_adapters(base, config, jax.random.fold_in(rng, LORA_KEY))
  shapes = nn.meta.unbox(abstract_boxed_params(config))
  paths, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  kinds = [str(getattr(path[-1], "key", path[-1])) for path, _ in paths]
  random_sizes = [math.prod(leaf.shape) for (_, leaf), kind in zip(paths, kinds) if kind not in ("scale", "bias")]

  @jax.jit
  def init(key):
    flat = jax.random.normal(key, (sum(random_sizes),), jnp.float32) * INIT_STD
    out, offset = [], 0
    for (_, leaf), kind in zip(paths, kinds):
      if kind == "scale":
        value = jnp.ones(leaf.shape, leaf.dtype)
      elif kind == "bias":
        value = jnp.zeros(leaf.shape, leaf.dtype)
      else:
        size = math.prod(leaf.shape)
        value = flat[offset:offset + size].reshape(leaf.shape).astype(leaf.dtype)
        offset += size
      out.append(value)
    return out

  return jax.tree_util.tree_unflatten(treedef, init(rng))


def positions_from_mask(mask_bt: Bool[Array, "B T"]) -> Int[Array, "B T"]:
  """RoPE positions: 0 at the first real token, +1 per real token (pads repeat the last)."""
  return jnp.maximum(jnp.cumsum(mask_bt.astype(jnp.int32), axis=1) - 1, 0)


def _key_index(tokens_bt):
  t = tokens_bt.shape[1]
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)


def _check_tokens(name: str, tokens_bt, mask_bt):
  chex.assert_rank(tokens_bt, 2)
  chex.assert_type(tokens_bt, int)
  if mask_bt is not None:
    chex.assert_equal_shape([tokens_bt, mask_bt])
  if tokens_bt.shape[1] < 1:
    raise ValueError(f"{name}: tokens_bt has no positions (shape {tokens_bt.shape})")


@_jit_config
def forward(params: Params, config: ModelConfig, tokens_bt: Int[Array, "B T"],
            positions_bt: Int[Array, "B T"], segment_mask_bt: Bool[Array, "B T"]) -> dict:
  """Full-sequence forward pass.

  Args:
    params: parameter pytree.
    config: model config.
    tokens_bt: int [B, T] token ids (right-padded).
    positions_bt: int [B, T] RoPE positions.
    segment_mask_bt: bool [B, T] real tokens; attention is causal over real keys.

  Returns:
    dict with ``logits_btv`` float32 [B, T, V] (no temperature), ``hidden_btd``
    [B, T, D] (after the final norm), ``values_bt`` float32 [B, T] when
    ``config.value_head`` and ``rewards_bt`` float32 [B, T] (reward head at every
    position) when ``config.reward_head``.
  """
  _check_tokens("forward", tokens_bt, segment_mask_bt)
  chex.assert_equal_shape([tokens_bt, positions_bt])
  out = Decoder(config).apply({"params": params}, tokens_bt, positions_bt, segment_mask_bt)
  names = dict(hidden="hidden_btd", logits="logits_btv", values="values_bt", rewards="rewards_bt")
  return {names[k]: v for k, v in out.items()}


def _shifted_logprobs(params, config, tokens_bt, mask_bt, temperature, with_entropy):
  model = Decoder(config)
  mask_bt = mask_bt.astype(bool)
  x, _, _ = model.apply({"params": params}, tokens_bt, positions_from_mask(mask_bt), _key_index(tokens_bt),
                        mask_bt, method=Decoder.trunk)
  logits = model.apply({"params": params}, x, ("logits",), method=Decoder.head)["logits"]
  out = ops.token_logprobs(logits[:, :-1], tokens_bt[:, 1:], temperature,
                           invariant=config.batch_invariant, with_entropy=with_entropy)
  outs = out if with_entropy else (out,)
  pad = jnp.zeros((tokens_bt.shape[0], 1), jnp.float32)
  outs = tuple(jnp.where(mask_bt, jnp.concatenate([pad, o], axis=1), 0.0) for o in outs)
  return outs if with_entropy else outs[0]


@_jit_config
def sequence_logprobs(params: Params, config: ModelConfig, tokens_bt: Int[Array, "B T"],
                      mask_bt: Bool[Array, "B T"], temperature: float = 1.0) -> Float[Array, "B T"]:
  """Per-token log-probabilities of a batch of sequences (the learner's log pi).

  ``logp[:, t] = log_softmax(logits[:, t-1] / temperature)[tokens[:, t]]`` in
  float32; 0 at ``t = 0`` and where ``mask_bt`` is False. Positions are
  ``cumsum(mask) - 1``; attention sees real tokens only. In batch-invariant mode
  a row's result is bitwise independent of the other rows and equals the
  built-in sampler's behaviour log-probabilities.

  Args:
    params: parameter pytree.
    config: model config.
    tokens_bt: int [B, T] prompt + response, right-padded.
    mask_bt: bool [B, T] real tokens (prompt and response).
    temperature: sampling temperature tau > 0.

  Returns:
    float32 [B, T] log-probabilities.
  """
  _check_tokens("sequence_logprobs", tokens_bt, mask_bt)
  return _shifted_logprobs(params, config, tokens_bt, mask_bt, temperature, False)


@_jit_config
def sequence_logprobs_and_entropy(params: Params, config: ModelConfig, tokens_bt: Int[Array, "B T"],
                                  mask_bt: Bool[Array, "B T"], temperature: float = 1.0
                                  ) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  """``sequence_logprobs`` plus the entropy of each predictive distribution (same alignment).

  ``entropy[:, t] = H(softmax(logits[:, t-1] / temperature))``; 0 at t = 0 and off-mask.

  Returns:
    ``(logp_bt, entropy_bt)``, both float32 [B, T].
  """
  _check_tokens("sequence_logprobs_and_entropy", tokens_bt, mask_bt)
  return _shifted_logprobs(params, config, tokens_bt, mask_bt, temperature, True)


def last_true_index(mask_bt: Bool[Array, "B T"]) -> Int[Array, "B"]:
  """Index of the last True of each row (0 for an all-False row)."""
  t = mask_bt.shape[1]
  return jnp.max(jnp.where(mask_bt, jnp.arange(t, dtype=jnp.int32)[None], 0), axis=1)


@_jit_config
def reward_scores(params: Params, config: ModelConfig, tokens_bt: Int[Array, "B T"],
                  mask_bt: Bool[Array, "B T"]) -> Float[Array, "B"]:
  """Scalar reward-model score per sequence, read at the last True position of ``mask_bt``.

  Args:
    params: parameter pytree with ``reward_head``.
    config: model config with ``reward_head=True``.
    tokens_bt: int [B, T] tokens, right-padded.
    mask_bt: bool [B, T] real tokens; the score is read at the last one (EOS).

  Returns:
    float32 [B] rewards.
  """
  if not config.reward_head:
    raise ValueError("reward_scores: config.reward_head is False; the model has no reward head")
  _check_tokens("reward_scores", tokens_bt, mask_bt)
  model = Decoder(config)
  mask_bt = mask_bt.astype(bool)
  x, _, _ = model.apply({"params": params}, tokens_bt, positions_from_mask(mask_bt), _key_index(tokens_bt),
                        mask_bt, method=Decoder.trunk)
  last = x[jnp.arange(x.shape[0]), last_true_index(mask_bt)]
  return model.apply({"params": params}, last, ("rewards",), method=Decoder.head)["rewards"]


@struct.dataclass
class KVCache:
  """Per-layer keys/values at their token positions, plus which slots hold real tokens.

  Attributes:
    k: tuple over layers of keys in the mode's layout (``ops.kv_from_tokens``):
      [B, K, S, hd] by default, [B, S, K, hd] in batch-invariant mode.
    v: tuple over layers of values, same layout.
    valid_bs: bool [B, S].
  """

  k: tuple
  v: tuple
  valid_bs: jax.Array

  @property
  def length(self) -> int:
    return int(self.valid_bs.shape[1])


@functools.partial(jax.jit, static_argnames=("config", "cache_length"))
def prefill(params: Params, config: ModelConfig, tokens_bt: Int[Array, "B T"], lengths_b: Int[Array, "B"],
            cache_length: int) -> tuple[Float[Array, "B V"], KVCache]:
  """Runs right-padded prompts and returns the next-token logits and a KV cache.

  Args:
    params: parameter pytree.
    config: model config.
    tokens_bt: int [B, T] prompts, right-padded (prompt token i at index i).
    lengths_b: int [B] prompt lengths (>= 1).
    cache_length: S >= T, slots of the cache.

  Returns:
    ``(logits_bv, cache)``: float32 [B, V] logits after each prompt's last
    token, and a cache of length S holding the prompts.
  """
  _check_tokens("prefill", tokens_bt, None)
  b, t = tokens_bt.shape
  if cache_length < t:
    raise ValueError(f"prefill: cache_length={cache_length} is shorter than the prompts ({t})")
  model = Decoder(config)
  mask = jnp.arange(t)[None, :] < lengths_b[:, None]
  x, keys, values = model.apply({"params": params}, tokens_bt, positions_from_mask(mask), _key_index(tokens_bt),
                                mask, method=Decoder.trunk)
  last = x[jnp.arange(b), jnp.maximum(lengths_b - 1, 0)]
  logits = model.apply({"params": params}, last, ("logits",), method=Decoder.head)["logits"]
  pad = [(0, 0)] * 4
  pad[ops.kv_seq_axis(config.batch_invariant)] = (0, cache_length - t)
  cache = KVCache(k=tuple(jnp.pad(k, pad) for k in keys), v=tuple(jnp.pad(v, pad) for v in values),
                  valid_bs=jnp.pad(mask, ((0, 0), (0, cache_length - t))))
  return logits, cache


@_jit_config
def decode_step(params: Params, config: ModelConfig, cache: KVCache, tokens_b: Int[Array, "B"],
                index_b: Int[Array, "B"]) -> tuple[Float[Array, "B V"], KVCache]:
  """Feeds one token per row at cache index (= position) ``index_b``.

  Args:
    params: parameter pytree.
    config: model config.
    cache: KV cache from ``prefill`` / a previous step.
    tokens_b: int [B] the new tokens.
    index_b: int [B] their positions (< cache length).

  Returns:
    ``(logits_bv, cache)``: float32 [B, V] next-token logits and the updated cache.
  """
  chex.assert_rank([tokens_b, index_b], 1)
  index_b = index_b.astype(jnp.int32)
  return extend(params, config, cache, tokens_b[:, None], index_b, jnp.ones_like(index_b))


@_jit_config
def extend(params: Params, config: ModelConfig, cache: KVCache, tokens_bt: Int[Array, "B T"],
           start_b: Int[Array, "B"], count_b: Int[Array, "B"]) -> tuple[Float[Array, "B V"], KVCache]:
  """Appends up to T tokens per row to a cache (chunked prefill at each row's own offset).

  Row ``b``'s first ``count_b[b]`` tokens go to cache indices (= positions)
  ``start_b[b] .. start_b[b] + count_b[b] - 1``; they attend to the cache and
  to each other causally. The multi-turn sampler uses it to add an
  environment's observation after a model turn without re-reading the
  history. ``decode_step`` is the T = 1 case. The padding tokens of a row
  (``t >= count_b[b]``) are written past its last real token and left
  invalid, so nothing attends to them and the row's next tokens overwrite
  them (indices past the cache are dropped).

  Args:
    params: parameter pytree.
    config: model config.
    cache: KV cache from ``prefill`` / earlier steps.
    tokens_bt: int [B, T] new tokens, row ``b`` left-aligned.
    start_b: int [B] index of each row's first new token.
    count_b: int [B] real tokens per row (0 leaves the row unchanged; its logits are then garbage).

  Returns:
    ``(logits_bv, cache)``: float32 [B, V] logits after each row's last new token, and the cache.
  """
  chex.assert_rank([tokens_bt, start_b, count_b], [2, 1, 1])
  model = Decoder(config)
  b, t = tokens_bt.shape
  offsets = jnp.arange(t, dtype=jnp.int32)[None, :]
  index_bt = start_b.astype(jnp.int32)[:, None] + offsets
  real_bt = offsets < count_b[:, None]
  rows = jnp.arange(b)[:, None]
  slots = cache.valid_bs.shape[1]
  valid = cache.valid_bs.at[rows, jnp.where(real_bt, index_bt, slots)].set(True, mode="drop")
  x, keys, values = model.apply({"params": params}, tokens_bt, index_bt, index_bt, valid, cache.k, cache.v,
                                method=Decoder.trunk)
  last = x[jnp.arange(b), jnp.maximum(count_b - 1, 0)]
  logits = model.apply({"params": params}, last, ("logits",), method=Decoder.head)["logits"]
  return logits, KVCache(k=keys, v=values, valid_bs=valid)


__all__ = [
    "KVCache",
    "decode_step",
    "extend",
    "forward",
    "init_params",
    "last_true_index",
    "positions_from_mask",
    "prefill",
    "reward_scores",
    "sequence_logprobs",
    "sequence_logprobs_and_entropy",
]
