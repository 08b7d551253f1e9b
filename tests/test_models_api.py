"""Functional API of the decoder: parameter layout, dtypes, heads, remat, sharding, padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jaxrl_llm import models

SMALL = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4, num_kv_heads=2)


def _shapes(params):
  return {jax.tree_util.keystr(k): (tuple(v.shape), str(v.dtype)) for k, v in jax.tree_util.tree_leaves_with_path(params)}


def test_param_layout_follows_model_spec():
  config = models.ModelConfig(family="qwen3", qk_norm=True, attention_bias=False, head_dim=24, value_head=True,
                              reward_head=True, **dict(SMALL, num_layers=2))  # default dtypes: bf16 params
  shapes = _shapes(models.init_params(config, jax.random.PRNGKey(0)))
  d, v, f, hd = 64, 200, 96, 24
  bf16 = "bfloat16"
  expected = {
      "['embed']['embedding']": ((v, d), bf16),
      "['final_norm']['scale']": ((d,), bf16),
      "['lm_head']['kernel']": ((d, v), bf16),
      "['value_head']['kernel']": ((d, 1), bf16), "['value_head']['bias']": ((1,), bf16),
      "['reward_head']['kernel']": ((d, 1), bf16), "['reward_head']['bias']": ((1,), bf16),
  }
  for i in range(2):
    pre = f"['layers_{i}']"
    expected.update({
        pre + "['attn_norm']['scale']": ((d,), bf16),
        pre + "['attn']['q_proj']['kernel']": ((d, 4 * hd), bf16),
        pre + "['attn']['k_proj']['kernel']": ((d, 2 * hd), bf16),
        pre + "['attn']['v_proj']['kernel']": ((d, 2 * hd), bf16),
        pre + "['attn']['o_proj']['kernel']": ((4 * hd, d), bf16),
        pre + "['attn']['q_norm']['scale']": ((hd,), bf16),
        pre + "['attn']['k_norm']['scale']": ((hd,), bf16),
        pre + "['mlp_norm']['scale']": ((d,), bf16),
        pre + "['mlp']['gate_proj']['kernel']": ((d, f), bf16),
        pre + "['mlp']['up_proj']['kernel']": ((d, f), bf16),
        pre + "['mlp']['down_proj']['kernel']": ((f, d), bf16),
    })
  assert shapes == expected


def test_qwen2_biases_and_tied_embeddings():
  config = models.tiny("qwen2", tie_word_embeddings=True, **SMALL)
  params = models.init_params(config, jax.random.PRNGKey(0))
  assert "lm_head" not in params
  attn = params["layers_0"]["attn"]
  assert attn["q_proj"]["bias"].shape == (64,) and attn["k_proj"]["bias"].shape == (32,)
  assert "bias" not in attn["o_proj"]
  # tied head: logits = h @ embedding.T
  tokens = jnp.array([[3, 4, 5]], jnp.int32)
  mask = jnp.ones((1, 3), bool)
  out = models.forward(params, config, tokens, models.positions_from_mask(mask), mask)
  np.testing.assert_allclose(out["logits_btv"], out["hidden_btd"] @ params["embed"]["embedding"].T, atol=1e-5)


def test_bf16_default_dtypes_give_fp32_logits_close_to_fp32_model():
  config = models.ModelConfig(**SMALL)  # bf16 params and activations, fp32 logits
  params = models.init_params(config, jax.random.PRNGKey(1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, 200, (2, 12)), jnp.int32)
  mask = jnp.ones((2, 12), bool)
  out = models.forward(params, config, tokens, models.positions_from_mask(mask), mask)
  assert out["logits_btv"].dtype == jnp.float32 and out["hidden_btd"].dtype == jnp.bfloat16
  f32 = config.replace(param_dtype="float32", dtype="float32")
  ref = models.forward(jax.tree.map(lambda a: a.astype(jnp.float32), params), f32, tokens,
                       models.positions_from_mask(mask), mask)
  err = float(jnp.abs(out["logits_btv"] - ref["logits_btv"]).max())
  assert 0 < err < 5e-2, err


def test_value_and_reward_heads():
  config = models.tiny("llama", value_head=True, reward_head=True, **SMALL)
  params = models.init_params(config, jax.random.PRNGKey(2))
  params["reward_head"]["bias"] = jnp.array([0.5], jnp.float32)
  tokens = jnp.asarray(np.random.default_rng(1).integers(2, 200, (3, 10)), jnp.int32)
  lengths = jnp.array([10, 4, 1])
  mask = jnp.arange(10)[None] < lengths[:, None]
  out = models.forward(params, config, tokens, models.positions_from_mask(mask), mask)
  assert out["values_bt"].shape == (3, 10) and out["values_bt"].dtype == jnp.float32
  scores = models.reward_scores(params, config, tokens, mask)
  np.testing.assert_allclose(scores, out["rewards_bt"][jnp.arange(3), lengths - 1], atol=1e-5)
  assert float(jnp.std(scores)) > 0
  with pytest.raises(ValueError, match="reward_head"):
    models.reward_scores(params, config.replace(reward_head=False), tokens, mask)


def test_remat_gives_same_gradients():
  config = models.tiny("qwen2", **SMALL)
  params = models.init_params(config, jax.random.PRNGKey(3))
  tokens = jnp.asarray(np.random.default_rng(2).integers(2, 200, (2, 9)), jnp.int32)
  mask = jnp.ones((2, 9), bool)

  def grads(cfg):
    return jax.jit(jax.grad(lambda p: jnp.sum(models.sequence_logprobs(p, cfg, tokens, mask))))(params)

  for a, b in zip(jax.tree.leaves(grads(config)), jax.tree.leaves(grads(config.replace(remat=True)))):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_left_padding_with_mask_matches_right_padding():
  config = models.tiny("qwen3", **SMALL)
  params = models.init_params(config, jax.random.PRNGKey(4))
  seq = np.random.default_rng(3).integers(2, 200, 7).astype(np.int32)
  tokens = np.zeros((2, 10), np.int32)
  tokens[0, :7] = seq  # right-padded
  tokens[1, 3:] = seq  # left-padded
  mask = tokens != 0
  logits = models.forward(params, config, tokens, models.positions_from_mask(mask), mask)["logits_btv"]
  np.testing.assert_allclose(logits[1, 3:], logits[0, :7], atol=1e-5)
  assert float(jnp.abs(logits[0, 0] - logits[0, 1]).max()) > 1e-3


def test_entropy_matches_numpy():
  config = models.tiny("qwen2", **SMALL)
  params = models.init_params(config, jax.random.PRNGKey(5))
  tokens = jnp.asarray(np.random.default_rng(4).integers(2, 200, (2, 6)), jnp.int32)
  mask = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], bool)
  logp, entropy = models.sequence_logprobs_and_entropy(params, config, tokens, mask, temperature=0.5)
  logits = np.asarray(models.forward(params, config, tokens, models.positions_from_mask(mask), mask)["logits_btv"],
                      np.float64) / 0.5
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  ent = -(probs * np.log(probs)).sum(-1)
  expected = np.where(mask, np.concatenate([np.zeros((2, 1)), ent[:, :-1]], axis=1), 0)
  np.testing.assert_allclose(entropy, expected, atol=1e-4)
  logq = np.log(probs)
  picked = np.take_along_axis(logq[:, :-1], np.asarray(tokens)[:, 1:, None], axis=-1)[..., 0]
  np.testing.assert_allclose(logp, np.where(mask, np.concatenate([np.zeros((2, 1)), picked], axis=1), 0), atol=1e-5)


def test_param_shardings_and_sharded_forward():
  devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
  mesh = Mesh(devices, ("data", "fsdp", "tensor"))
  config = models.tiny("qwen2", **dict(SMALL, vocab_size=201))
  shardings = models.param_shardings(config, mesh)
  assert shardings["layers_0"]["attn"]["q_proj"]["kernel"].spec == P("fsdp", "tensor")
  assert shardings["layers_0"]["attn"]["k_proj"]["bias"].spec == P("tensor")
  assert shardings["layers_0"]["mlp"]["down_proj"]["kernel"].spec == P("tensor", "fsdp")
  assert shardings["layers_0"]["attn_norm"]["scale"].spec == P(None)
  assert shardings["embed"]["embedding"].spec == P(None, "fsdp")  # 201 rows: not divisible, replicated
  assert shardings["lm_head"]["kernel"].spec == P("fsdp", None)
  logical = models.logical_axes(config)
  assert tuple(logical["layers_0"]["attn"]["o_proj"]["kernel"]) == ("heads", "embed")
  # a mesh without some axes works too
  small = models.param_shardings(config, Mesh(np.array(jax.devices()[:2]), ("tensor",)))
  assert small["layers_0"]["mlp"]["up_proj"]["kernel"].spec == P(None, "tensor")

  params = models.init_params(config, jax.random.PRNGKey(6))
  tokens = jnp.asarray(np.random.default_rng(5).integers(2, 201, (4, 8)), jnp.int32)
  mask = jnp.ones((4, 8), bool)
  ref = models.sequence_logprobs(params, config, tokens, mask)
  sharded = jax.device_put(params, shardings)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda p, t, m: models.sequence_logprobs(p, config, t, m))(sharded, tokens, mask)
  np.testing.assert_allclose(got, ref, atol=1e-5)
