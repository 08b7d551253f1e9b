"""vLLM tensor-parallel resharding: names, fusions, slices, padding, and the inverse."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm.bridge import layout, reshard
from jaxrl_llm.models.config import ModelConfig


def make_config(family="qwen2", **kw):
  base = dict(family=family, vocab_size=100, hidden_size=32, intermediate_size=48, num_layers=2,
              num_heads=4, num_kv_heads=2, attention_bias=family == "qwen2", qk_norm=family == "qwen3",
              param_dtype="float32", dtype="float32")
  base.update(kw)
  return ModelConfig(**base)


def random_params(config, seed=0):
  rng = np.random.default_rng(seed)
  params = {}
  for spec in layout.backbone_specs(config):
    layout.set_path(params, spec.path, jnp.asarray(rng.normal(size=spec.shape), jnp.float32))
  return params


CONFIGS = {
    "qwen2_gqa": make_config("qwen2"),                                   # K=2: replicated at P=4
    "qwen3_tied": make_config("qwen3", head_dim=16, tie_word_embeddings=True, num_kv_heads=4),
    "llama_mqa": make_config("llama", num_kv_heads=1, vocab_size=64),   # K=1: replicated at P=2,4
}


def expected_vllm_names(config):
  names = ["model.embed_tokens.weight"]
  for i in range(config.num_layers):
    a = f"model.layers.{i}.self_attn"
    names.append(f"{a}.qkv_proj.weight")
    if config.attention_bias:
      names.append(f"{a}.qkv_proj.bias")
    names.append(f"{a}.o_proj.weight")
    if config.qk_norm:
      names += [f"{a}.q_norm.weight", f"{a}.k_norm.weight"]
    names += [f"model.layers.{i}.mlp.gate_up_proj.weight", f"model.layers.{i}.mlp.down_proj.weight",
              f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
  names.append("model.norm.weight")
  if not config.tie_word_embeddings:
    names.append("lm_head.weight")
  return names


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reshard_round_trip_bit_exact_with_vllm_names(name, tp):
  config = CONFIGS[name]
  params = random_params(config)
  full = dict(reshard.iter_hf_tensors(params, config))
  assert list(full) == [s.hf_name for s in layout.backbone_specs(config)]
  ranks = reshard.shard_for_vllm(params, config, tp)
  plan = reshard.make_reshard_plan(config, tp)
  assert len(ranks) == tp
  for rank in ranks:
    assert list(rank) == expected_vllm_names(config)
    for entry in plan.entries:
      assert rank[entry.vllm_name].shape == plan.rank_shape(entry)
  back = reshard.reassemble(ranks, plan)
  assert sorted(back) == sorted(full)
  for key, value in full.items():
    assert back[key].dtype == value.dtype
    np.testing.assert_array_equal(back[key], value, err_msg=key)


def test_rank_contents_follow_vllm_rules():
  config = CONFIGS["qwen2_gqa"]   # H=4, K=2, hd=8, F=48, V=100
  params = random_params(config, seed=3)
  full = dict(reshard.iter_hf_tensors(params, config))
  ranks = reshard.shard_for_vllm(params, config, 4)
  hd = 8
  q = full["model.layers.1.self_attn.q_proj.weight"]
  k = full["model.layers.1.self_attn.k_proj.weight"]
  v = full["model.layers.1.self_attn.v_proj.weight"]
  kb = full["model.layers.1.self_attn.k_proj.bias"]
  for r in range(4):
    qkv = ranks[r]["model.layers.1.self_attn.qkv_proj.weight"]
    assert qkv.shape == (3 * hd, 32)                 # 1 q head + 1 k head + 1 v head
    np.testing.assert_array_equal(qkv[:hd], q[r * hd:(r + 1) * hd])
    kv_head = r // 2                                 # K=2 < P=4: head r // (P/K), replicated twice
    np.testing.assert_array_equal(qkv[hd:2 * hd], k[kv_head * hd:(kv_head + 1) * hd])
    np.testing.assert_array_equal(qkv[2 * hd:], v[kv_head * hd:(kv_head + 1) * hd])
    bias = ranks[r]["model.layers.1.self_attn.qkv_proj.bias"]
    np.testing.assert_array_equal(bias[hd:2 * hd], kb[kv_head * hd:(kv_head + 1) * hd])
    gate_up = ranks[r]["model.layers.1.mlp.gate_up_proj.weight"]
    np.testing.assert_array_equal(gate_up[:12], full["model.layers.1.mlp.gate_proj.weight"][12 * r:12 * (r + 1)])
    np.testing.assert_array_equal(gate_up[12:], full["model.layers.1.mlp.up_proj.weight"][12 * r:12 * (r + 1)])
    np.testing.assert_array_equal(ranks[r]["model.layers.1.mlp.down_proj.weight"],
                                  full["model.layers.1.mlp.down_proj.weight"][:, 12 * r:12 * (r + 1)])
    np.testing.assert_array_equal(ranks[r]["model.layers.1.self_attn.o_proj.weight"],
                                  full["model.layers.1.self_attn.o_proj.weight"][:, 8 * r:8 * (r + 1)])
    # V=100 is padded to 128 (multiple of 64): 32 rows per rank; rows >= 100 are zeros.
    emb = ranks[r]["model.embed_tokens.weight"]
    assert emb.shape == (32, 32)
    real = min(max(100 - 32 * r, 0), 32)
    np.testing.assert_array_equal(emb[:real], full["model.embed_tokens.weight"][32 * r:32 * r + real])
    assert not emb[real:].any()
    assert ranks[r]["model.norm.weight"] is ranks[0]["model.norm.weight"]


def test_sharded_params_and_dtype_cast():
  config = CONFIGS["qwen3_tied"]
  params = random_params(config, seed=5)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  sharded = jax.tree_util.tree_map(
      lambda x: jax.device_put(x, NamedSharding(mesh, P("fsdp", "tensor") if x.ndim == 2 else P())), params)
  assert not layout.get_path(sharded, ("layers_0", "attn", "q_proj", "kernel")).sharding.is_fully_replicated
  want = reshard.shard_for_vllm(params, config, 2, dtype="bfloat16")
  got = reshard.shard_for_vllm(sharded, config, 2, dtype="bfloat16")
  for a, b in zip(want, got):
    assert list(a) == list(b)
    for key in a:
      assert b[key].dtype == jnp.bfloat16
      np.testing.assert_array_equal(a[key], b[key])
  full = dict(reshard.iter_hf_tensors(sharded, config, dtype="bfloat16"))
  back = reshard.reassemble(got, reshard.make_reshard_plan(config, 2))
  for key, value in full.items():
    np.testing.assert_array_equal(back[key], value)


def test_iter_vllm_shards_streams_in_plan_order():
  config = CONFIGS["llama_mqa"]
  plan = reshard.make_reshard_plan(config, 2)
  names = [name for name, shards in reshard.iter_vllm_shards(random_params(config), plan)]
  assert names == [e.vllm_name for e in plan.entries] == expected_vllm_names(config)
  assert plan.padded_vocab_size == 64 and plan.kv_replicas == 2 and plan.kv_heads_per_rank == 1


@pytest.mark.parametrize("kw, tp, message", [
    (dict(num_heads=6, num_kv_heads=2, head_dim=8), 4, "num_heads=6 is not divisible by tp_size=4"),
    (dict(num_heads=6, num_kv_heads=6, head_dim=8), 3, "padded vocabulary 128"),
    (dict(num_heads=8, num_kv_heads=8, intermediate_size=44, head_dim=8), 8, "intermediate_size=44"),
    (dict(num_heads=12, num_kv_heads=6, head_dim=8), 4, "num_kv_heads=6 is not divisible"),
    (dict(num_heads=12, num_kv_heads=3, head_dim=8), 4, "tp_size=4 is not a multiple of num_kv_heads=3"),
])
def test_plan_errors(kw, tp, message):
  with pytest.raises(ValueError, match=message):
    reshard.make_reshard_plan(make_config("llama", **kw), tp)


def test_plan_replicates_kv_heads_by_integer_factor():
  plan = reshard.make_reshard_plan(make_config("llama", num_heads=8, num_kv_heads=2, head_dim=8), 8)
  assert plan.kv_replicas == 4 and plan.kv_heads_per_rank == 1
  assert [plan.kv_head_range(r) for r in range(8)] == [(r // 4, r // 4 + 1) for r in range(8)]


def test_reassemble_rejects_inconsistent_replicas_and_shapes():
  config = CONFIGS["qwen2_gqa"]
  plan = reshard.make_reshard_plan(config, 4)
  ranks = reshard.shard_for_vllm(random_params(config), config, 4)
  bad = [dict(r) for r in ranks]
  qkv = bad[1]["model.layers.0.self_attn.qkv_proj.weight"].copy()
  qkv[8] += 1.0   # rank 1's copy of KV head 0 no longer equals rank 0's
  bad[1]["model.layers.0.self_attn.qkv_proj.weight"] = qkv
  with pytest.raises(ValueError, match="rank 1 differs from rank 0"):
    reshard.reassemble(bad, plan)
  bad = [dict(r) for r in ranks]
  bad[2]["model.norm.weight"] = bad[2]["model.norm.weight"][:-1]
  with pytest.raises(ValueError, match="rank 2 model.norm.weight: expected shape"):
    reshard.reassemble(bad, plan)
  with pytest.raises(ValueError, match="expected 4 ranks"):
    reshard.reassemble(ranks[:2], plan)
