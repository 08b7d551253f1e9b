"""Kernels with a fast default path and a bitwise batch-invariant path.

Batch-invariant mode (``ModelConfig.batch_invariant``) makes every quantity of a
sequence independent of what else is in the batch, and the sampler's KV-cache
decode equal to the learner's full-sequence forward, bit for bit:

* token-wise work (norms, projections, RoPE, MLP, LM head, log-softmax) runs in
  ``map_row_tiles``: one loop body on fixed [ROW_TILE, ...] shapes;
* attention is a blocked online softmax over fixed [ROW_TILE, KEY_BLOCK] units
  with exact no-op masked blocks (``causal_attention(..., invariant=True)``);
* loops have opaque trip counts and at least two steps, and their forward pass
  is the same primal loop under ``jax.grad`` (recomputing custom VJPs), so the
  bits do not depend on tile counts or on being differentiated.

See ``tiling.py`` for what was measured on XLA:CPU and why each rule is needed.
"""

from jaxrl_llm.ops.attention import KEY_BLOCK, causal_attention, kv_from_tokens, kv_seq_axis, kv_write
from jaxrl_llm.ops.logprobs import token_logprobs
from jaxrl_llm.ops.tiling import ROW_TILE, fixed_fori_loop, map_row_tiles, map_tokens, opaque

__all__ = [
    "KEY_BLOCK",
    "ROW_TILE",
    "causal_attention",
    "kv_from_tokens",
    "kv_seq_axis",
    "kv_write",
    "fixed_fori_loop",
    "map_row_tiles",
    "map_tokens",
    "opaque",
    "token_logprobs",
]
