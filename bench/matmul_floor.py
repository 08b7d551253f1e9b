"""The matmul floor of one learner step: the summed standalone times of all its matmuls.

Every matmul of one forward + backward of the tiny Qwen2 on B = 32 x T = 128 tokens
(``bench/learner.py``'s step) is jitted alone on its own shapes and timed (median of
20): per layer the 7 projections (q, k, v, o, gate, up, down) forward (``X W``) and
backward (``dY W^T``, ``X^T dY``), the attention score and value products (forward
and two backward products each), and the LM head. The sum is the time a step would
take if every other op (norms, RoPE, softmax, SwiGLU, loss, AdamW) were free, so
``tokens / sum`` bounds the learner's tokens/s with XLA:CPU's dot kernels.

Usage: ``python -m bench.matmul_floor`` (about 20 s). The last line is one JSON object.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import emit, load_average

TOKENS, LAYERS, BATCH, SEQ, HEADS, HEAD_DIM, HIDDEN, VOCAB = 4096, 4, 32, 128, 4, 32, 128, 256
PROJECTIONS = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 512), (128, 512), (512, 128)]


def _median_time(fn, *shapes, repeats: int = 20) -> float:
  args = [jnp.asarray(np.random.default_rng(0).random(s), jnp.float32) for s in shapes]
  f = jax.jit(fn)
  f(*args).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f(*args).block_until_ready()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main() -> dict:
  start = load_average()
  dot = lambda a, b: a @ b
  projections = sum(_median_time(dot, (TOKENS, i), (i, o)) + _median_time(dot, (TOKENS, o), (o, i))
                    + _median_time(dot, (i, TOKENS), (TOKENS, o)) for i, o in PROJECTIONS) * LAYERS
  head = (_median_time(dot, (TOKENS, HIDDEN), (HIDDEN, VOCAB)) + _median_time(dot, (TOKENS, VOCAB), (VOCAB, HIDDEN))
          + _median_time(dot, (HIDDEN, TOKENS), (TOKENS, VOCAB)))
  qkv = (BATCH, HEADS, SEQ, HEAD_DIM)
  scores = _median_time(lambda q, k: jnp.einsum("bhtd,bhsd->bhts", q, k), qkv, qkv)
  values = _median_time(lambda p, v: jnp.einsum("bhts,bhsd->bhtd", p, v), (BATCH, HEADS, SEQ, SEQ), qkv)
  attention = 3 * (scores + values) * LAYERS  # forward + two backward products each
  total = projections + head + attention
  result = {"benchmark": "matmul_floor", "tokens_per_step": TOKENS, "projections_s": projections, "head_s": head,
            "attention_s": attention, "floor_s": total, "max_tokens_per_s": TOKENS / total,
            "load_average_start": start, "load_average_end": load_average()}
  print(f"matmul floor of one step: {1e3 * total:.1f} ms -> at most {TOKENS / total:,.0f} tokens/s")
  emit(result)
  return result


if __name__ == "__main__":
  main()
