"""Decoder models (Llama 3 / Qwen2 / Qwen2.5 / Qwen3) and their functional API.

Parameters (``init_params``) are plain nested dicts with kernels ``[in, out]``::

  embed/embedding [V, D]; layers_{i}/{attn_norm,mlp_norm}/scale [D];
  layers_{i}/attn/{q,k,v,o}_proj/kernel (+ q/k/v bias for Qwen2; q_norm/k_norm for Qwen3);
  layers_{i}/mlp/{gate,up,down}_proj/kernel; final_norm/scale; lm_head/kernel [D, V]
  (absent when tied); value_head / reward_head {kernel [D, 1], bias [1]} when enabled.

Entry points: ``init_params``, ``forward``, ``sequence_logprobs`` (the learner's
log-probabilities), ``sequence_logprobs_and_entropy``, ``reward_scores``, and the
sampler's ``prefill`` / ``decode_step`` with a ``KVCache``; ``param_shardings``
maps every parameter (``batch_sharding`` the batch dimension of a batch array)
to a ``NamedSharding`` through ``LOGICAL_AXIS_RULES``.

Modules, lowest first: ``config``, ``axes`` (the logical-axis table),
``layers``, ``transformer``, ``lora`` (adapters: trainable leaves, merge), ``api``,
``sharding``.
"""

from jaxrl_llm.models.api import (KVCache, decode_step, extend, forward, init_params, last_true_index,
                                  positions_from_mask, prefill, reward_scores, sequence_logprobs,
                                  sequence_logprobs_and_entropy)
from jaxrl_llm.models.axes import LOGICAL_AXIS_RULES
from jaxrl_llm.models.config import FAMILIES, LORA_TARGETS, ModelConfig, RopeScaling, tiny
from jaxrl_llm.models.sharding import batch_sharding, logical_axes, param_shardings
from jaxrl_llm.models.transformer import Decoder

__all__ = [
    "Decoder",
    "FAMILIES",
    "KVCache",
    "LORA_TARGETS",
    "LOGICAL_AXIS_RULES",
    "ModelConfig",
    "RopeScaling",
    "batch_sharding",
    "decode_step",
    "extend",
    "forward",
    "init_params",
    "last_true_index",
    "logical_axes",
    "param_shardings",
    "positions_from_mask",
    "prefill",
    "reward_scores",
    "sequence_logprobs",
    "sequence_logprobs_and_entropy",
    "tiny",
]
