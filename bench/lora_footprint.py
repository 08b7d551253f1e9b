"""LoRA against full fine-tuning: optimizer-state bytes and weight-update bytes per step.

  python -m bench.lora_footprint

For the default addition model and the shapes of Qwen2.5-0.5B / 7B and Llama-3.1-8B
(built abstractly with ``jax.eval_shape``: nothing is allocated), with the learner's
real optimizer (``learner.optim.make_optimizer``, wrapped in ``optim.train_only`` for
LoRA) and the bytes the sampler pool publishes to a JAX actor per update (the whole
model for full fine-tuning; ``models.lora.adapters_only`` for LoRA). Sizes, not times:
no quiet window is needed. The last line is one JSON object.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from jaxrl_llm import models
from jaxrl_llm.learner import optim
from jaxrl_llm.models import lora

# (name, ModelConfig fields): the default job's model and public checkpoints' config.json shapes.
SHAPES = {
    "addition (default job)": dict(family="qwen2", vocab_size=15, hidden_size=128, intermediate_size=512,
                                   num_layers=4, num_heads=4, num_kv_heads=2, param_dtype="float32"),
    "Qwen2.5-0.5B": dict(family="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24,
                         num_heads=14, num_kv_heads=2, tie_word_embeddings=True, param_dtype="bfloat16"),
    "Qwen2.5-7B": dict(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_heads=28, num_kv_heads=4, param_dtype="bfloat16"),
    "Llama-3.1-8B": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_layers=32, num_heads=32, num_kv_heads=8, attention_bias=False,
                         param_dtype="bfloat16"),
}


def tree_bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def footprint(fields: dict, rank: int) -> dict:
  """Bytes of params, optimizer state and one update's publish, full vs LoRA of ``rank`` on all seven projections."""
  base = models.ModelConfig(**fields)
  with_lora = base.replace(lora_rank=rank, lora_alpha=2.0 * rank, lora_targets=models.LORA_TARGETS)
  key = jax.random.PRNGKey(0)
  params = jax.eval_shape(lambda k: models.init_params(base, k), key)
  params_lora = jax.eval_shape(lambda k: models.init_params(with_lora, k), key)
  full_opt = optim.make_optimizer(1e-4)
  lora_opt = optim.train_only(optim.make_optimizer(1e-4))
  return {"params_bytes": tree_bytes(params),
          "full_opt_state_bytes": tree_bytes(jax.eval_shape(full_opt.init, params)),
          "lora_opt_state_bytes": tree_bytes(jax.eval_shape(lora_opt.init, params_lora)),
          "full_publish_bytes": tree_bytes(params),
          "lora_publish_bytes": tree_bytes(lora.adapters_only(params_lora)),
          "adapter_params": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(lora.adapters_only(params_lora)))}


def main() -> dict:
  out = {}
  for name, fields in SHAPES.items():
    for rank in (8, 16):
      f = footprint(fields, rank)
      out[f"{name} r={rank}"] = f
      print(f"{name:24s} r={rank:<3d} params {f['params_bytes'] / 2**20:10.1f} MiB | optimizer state: full "
            f"{f['full_opt_state_bytes'] / 2**20:10.1f} MiB, LoRA {f['lora_opt_state_bytes'] / 2**20:8.2f} MiB "
            f"({f['full_opt_state_bytes'] / f['lora_opt_state_bytes']:.0f}x) | per update to a JAX actor: full "
            f"{f['full_publish_bytes'] / 2**20:10.1f} MiB, LoRA {f['lora_publish_bytes'] / 2**20:8.2f} MiB")
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
