"""Cost of bitwise repeatability: one jitted RL step, default path vs invariant mode.

Times one RL step of the default job's shape (``--prompts`` x 8 rows, 16 tokens,
the 1M-parameter decoder of ``configs/grpo_addition.py``) in three modes:

* ``default``    the default model and accumulation (rows sharded over the mesh);
* ``inv_model``  the batch-invariant model with the default accumulation;
* ``atoms``      invariant mode: the batch-invariant model and the atom-wise gradient
                 tree of ``learner/update.py`` (bitwise equal across meshes).

Run it with the devices you want to compare, e.g.::

  python -m bench.invariance                                   # 1 CPU device
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m bench.invariance

The last line printed is one JSON object: per mode the compile time and the median
and minimum step time, and the ratios to the default path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Optional, Sequence

from bench.common import emit, load_average

MODES = ("default", "inv_model", "atoms")


def _batch(rows: int, tokens: int, vocab: int):
  import jax.numpy as jnp
  import numpy as np
  from jaxrl_llm.learner import rl_step

  rng = np.random.default_rng(0)
  seq = np.ones((rows, tokens), bool)
  response = seq & (np.arange(tokens)[None] >= 6)
  zeros = jnp.zeros((rows, tokens), jnp.float32)
  return rl_step.RLBatch(
      tokens_bt=jnp.asarray(rng.integers(3, vocab, (rows, tokens)).astype(np.int32)), seq_mask_bt=jnp.asarray(seq),
      response_mask_bt=jnp.asarray(response), behaviour_logp_bt=jnp.asarray(-rng.random((rows, tokens)), jnp.float32),
      advantages_bt=jnp.asarray(rng.normal(size=(rows, tokens)), jnp.float32), ref_logp_bt=zeros,
      lag_bt=jnp.zeros((rows, tokens), jnp.int32), old_values_bt=zeros, returns_bt=zeros)


def _step(mode: str, mesh, group_size: int, atoms: int):
  import jax
  from jaxrl_llm import models, objectives as O
  from jaxrl_llm.learner import optim, rl_step
  from jaxrl_llm.jobs.base import place_on_mesh
  from jaxrl_llm.learner.state import create_train_state
  from jaxrl_llm.models.config import ModelConfig

  config = ModelConfig(family="qwen2", vocab_size=16, hidden_size=128, intermediate_size=512, num_layers=4,
                       num_heads=4, num_kv_heads=2, max_position_embeddings=64, attention_bias=True,
                       batch_invariant=mode != "default", pad_token_id=0, eos_token_id=1, bos_token_id=2)
  params = jax.jit(lambda k: models.init_params(config, k), out_shardings=models.param_shardings(config, mesh))(
      jax.random.PRNGKey(0))
  opt = optim.make_optimizer(1e-4)
  objective = O.RECIPES["grpo"](kl_coef=0.0)
  state = place_on_mesh(create_train_state(params, opt, 0), mesh)
  spec = rl_step.RLStepSpec(model=config, temperature=1.0, group_size=group_size,
                            grad_atoms=atoms if mode == "atoms" else 0)
  return rl_step.make_rl_step(spec, objective, opt, mesh=mesh), state, objective.init(None)


def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--prompts", type=int, default=64)
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--atoms", type=int, default=8)
  p.add_argument("--modes", default=",".join(MODES))
  a = p.parse_args(argv)
  import jax
  from jaxrl_llm.learner import mesh as mesh_lib

  start = load_average()
  n, tokens = 8, 16
  mesh = mesh_lib.make_mesh({"data": -1})
  batch = _batch(a.prompts * n, tokens, 16)
  shards = mesh_lib.batch_divisor(mesh)
  sharded = jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(mesh, x.ndim)), batch)
  results = {}
  for mode in [m for m in a.modes.split(",") if m]:
    step, state, obj_state = _step(mode, mesh, n, a.atoms)
    data = sharded if mode != "atoms" and batch.tokens_bt.shape[0] % shards == 0 else batch
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, obj_state, data))
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(a.repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(step(state, obj_state, data))
      times.append(time.perf_counter() - t0)
    results[mode] = {"compile_s": compile_s, "median_s": statistics.median(times), "min_s": min(times)}
    print(f"{mode:10s} compile {compile_s:6.1f} s   step median {results[mode]['median_s']:.3f} s", flush=True)
  base = results.get("default", {}).get("median_s")
  summary = {"benchmark": "invariance", "devices": jax.device_count(), "rows": a.prompts * n, "tokens": tokens,
             "atoms": a.atoms, "results": results, "load_average_start": start, "load_average_end": load_average(),
             "cpu_count": os.cpu_count(),
             "ratio_vs_default": {m: r["median_s"] / base for m, r in results.items()} if base else {}}
  emit(summary)
  return summary


if __name__ == "__main__":
  main()
