"""LoRA adapters: the model, the learner's partial gradients, the optimizer state, exports, jobs.

What a user relies on: fresh adapters change nothing; only the adapters (and scalar
heads) train, and the optimizer holds state for them alone; the merged export and the
PEFT folder give the same logits through ``transformers`` + ``peft`` as the trained model;
GRPO, PPO and the reward model train with adapters; bad targets are named errors.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import bridge, configuration as C, jobs, models
from jaxrl_llm.bridge import peft_export
from jaxrl_llm.learner import optim, sft, update
from jaxrl_llm.learner.state import create_train_state
from jaxrl_llm.models import lora
from jaxrl_llm.settings import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from tiny_configs import tiny_config, tiny_rm_config  # noqa: E402

BASE = models.tiny(param_dtype="float32", dtype="float32", hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=2, num_kv_heads=1, vocab_size=64)
LORA = BASE.replace(lora_rank=4, lora_alpha=8.0, lora_targets=("q", "v", "o", "up", "down"))
TOKENS = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 0, 0, 0]])
MASK = TOKENS != 0


def _perturbed(params, scale=0.05, seed=1):
  """``params`` with random (nonzero) adapter B, so the adapters change the function."""
  key = jax.random.PRNGKey(seed)

  def bump(path, x):
    if str(getattr(path[-1], "key", "")) != "lora_b":
      return x
    return x + scale * jax.random.normal(jax.random.fold_in(key, x.size + len(str(path))), x.shape)
  return jax.tree_util.tree_map_with_path(bump, params)


def _changed_leaves(before, after):
  flat_b = jax.tree_util.tree_flatten_with_path(before)[0]
  flat_a = jax.tree.leaves(after)
  return sorted({jax.tree_util.keystr(p) for (p, b), a in zip(flat_b, flat_a)
                 if not np.array_equal(np.asarray(b), np.asarray(a))})


# ------------------------------------------------------------------ model


def test_fresh_adapters_change_nothing_and_merge_matches_unmerged():
  base = models.init_params(BASE, jax.random.PRNGKey(0))
  with_lora = models.init_params(LORA, jax.random.PRNGKey(0))
  assert len(lora.adapter_paths(with_lora)) == 5 * BASE.num_layers
  np.testing.assert_array_equal(models.sequence_logprobs(base, BASE, TOKENS, MASK),
                                models.sequence_logprobs(with_lora, LORA, TOKENS, MASK))
  trained = _perturbed(with_lora)
  unmerged = models.sequence_logprobs(trained, LORA, TOKENS, MASK)
  assert float(jnp.abs(unmerged - models.sequence_logprobs(base, BASE, TOKENS, MASK)).max()) > 1e-3
  merged = lora.merge(trained, LORA)
  assert not lora.has_adapters(merged) and jax.tree.structure(merged) == jax.tree.structure(base)
  np.testing.assert_allclose(models.sequence_logprobs(merged, BASE, TOKENS, MASK), unmerged, atol=2e-5)
  # without_adapters + adapters_only -> with_adapters round trip
  back = lora.with_adapters(lora.without_adapters(trained), lora.adapters_only(trained))
  assert jax.tree.structure(back) == jax.tree.structure(trained)


def test_adapters_are_sharded_like_their_base_weights():
  from jaxrl_llm.learner.mesh import make_mesh
  mesh = make_mesh({"data": 1})
  shardings = models.param_shardings(LORA, mesh)
  q = shardings["layers_0"]["attn"]["q_proj"]
  assert q["lora_a"].spec[0] == q["kernel"].spec[0] and q["lora_b"].spec[-1] == q["kernel"].spec[-1]
  down = shardings["layers_0"]["mlp"]["down_proj"]
  assert down["lora_a"].spec[0] == down["kernel"].spec[0] and down["lora_b"].spec[-1] == down["kernel"].spec[-1]


def test_unknown_target_is_a_named_error():
  with pytest.raises(ValueError, match="lora_targets"):
    BASE.replace(lora_rank=4, lora_targets=("q", "attn_out"))
  c = C.base_config()
  c.model.lora.rank = 4
  c.model.lora.targets = ("q", "attn_out")
  with pytest.raises(ConfigError, match=r"model\.lora\.targets"):
    C.validate(c)
  with pytest.raises(ValueError, match="already carry"):
    lora.add_adapters(models.init_params(LORA, jax.random.PRNGKey(0)), LORA, jax.random.PRNGKey(1))


# ------------------------------------------------------------------ learner


def _sft_batch():
  return sft.collate([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], eos_id=1, pad_id=0, length=16)


def test_adapter_gradients_equal_the_full_gradient_restricted_to_the_adapters():
  params = _perturbed(models.init_params(LORA, jax.random.PRNGKey(0)))
  batch = _sft_batch()
  count = jnp.asarray(float(np.asarray(batch.target_mask_bt).sum()))
  loss_fn = lambda p, b, n: sft.sft_token_loss(p, b, n, config=LORA)
  loss_full, grads_full, _ = update.accumulate(loss_fn, params, batch, 1, count)
  loss_part, grads_part, _ = update.accumulate(loss_fn, params, batch, 1, count, adapters_only=True)
  np.testing.assert_allclose(loss_part, loss_full, rtol=1e-6)
  mask = lora.trainable_mask(params)
  for g_full, g_part, m in zip(jax.tree.leaves(grads_full), jax.tree.leaves(grads_part), jax.tree.leaves(mask)):
    if m:
      np.testing.assert_allclose(g_part, g_full, rtol=1e-5, atol=1e-7)
    else:
      assert not np.any(np.asarray(g_part))


def test_sft_step_trains_only_adapters_and_the_optimizer_holds_only_theirs():
  params = models.init_params(LORA, jax.random.PRNGKey(0))
  opt = optim.train_only(optim.make_optimizer(1e-2))
  state = create_train_state(params, opt, 0)
  opt_floats = sum(int(x.size) for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating))
  adapter_floats = sum(int(x.size) for x in jax.tree.leaves(lora.adapters_only(params)))
  assert 2 * adapter_floats <= opt_floats < 2 * adapter_floats + 16  # Adam's two moments (+ a few scalars)
  step = sft.make_sft_step(LORA, opt)
  new, metrics = step(state, _sft_batch())
  assert float(metrics["update/skipped_nonfinite"]) == 0.0
  changed = _changed_leaves(params, new.params)
  assert changed and all("lora_a" in k or "lora_b" in k for k in changed)
  assert any("lora_b" in k for k in changed)
  assert optim.get_lr_scale(new.opt_state) == 1.0  # the LR controls still find their state


def test_train_only_zeroes_frozen_updates_and_clips_on_trainable_leaves():
  params = {"layers_0": {"attn": {"q_proj": {"kernel": jnp.ones((2, 2)), "lora_a": jnp.ones((2, 1)),
                                             "lora_b": jnp.zeros((1, 2))}}}}
  opt = optim.train_only(optax.sgd(1.0))
  grads = jax.tree.map(lambda x: jnp.full_like(x, 3.0), params)
  updates, _ = opt.update(grads, opt.init(params), params)
  q = updates["layers_0"]["attn"]["q_proj"]
  assert not np.any(np.asarray(q["kernel"])) and np.all(np.asarray(q["lora_b"]) == -3.0)


# ------------------------------------------------------------------ exports


def test_peft_round_trip_gives_the_same_logits_through_transformers(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  params = _perturbed(models.init_params(LORA, jax.random.PRNGKey(0)), scale=0.2)
  base_dir = bridge.export_hf_checkpoint(lora.without_adapters(params), BASE, str(tmp_path / "base"))
  adapter_dir = peft_export.export_peft_adapter(params, LORA, str(tmp_path / "adapter"), base_model=base_dir)
  merged_dir = bridge.export_hf_checkpoint(params, LORA, str(tmp_path / "merged"))
  cfg = json.load(open(os.path.join(adapter_dir, "adapter_config.json")))
  assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and set(cfg["target_modules"]) == {
      "q_proj", "v_proj", "o_proj", "up_proj", "down_proj"}

  ours = np.asarray(models.forward(params, LORA, TOKENS, models.positions_from_mask(MASK), MASK)["logits_btv"])
  ids = torch.tensor(np.asarray(TOKENS))
  attention = torch.tensor(np.asarray(MASK).astype(np.int64))
  base_model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(base_model, adapter_dir).eval()
  merged = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
  with torch.no_grad():
    via_peft = with_adapter(input_ids=ids, attention_mask=attention).logits.numpy()
    via_merged = merged(input_ids=ids, attention_mask=attention).logits.numpy()
  real = np.asarray(MASK)
  np.testing.assert_allclose(via_peft[real], ours[real], atol=2e-4)
  np.testing.assert_allclose(via_merged[real], ours[real], atol=2e-4)
  np.testing.assert_allclose(via_peft[real], via_merged[real], atol=2e-4)


def test_vllm_stream_carries_the_merged_weights():
  params = _perturbed(models.init_params(LORA, jax.random.PRNGKey(0)))
  merged = lora.merge(params, LORA)
  streamed = dict(bridge.iter_hf_tensors(params, LORA))
  expected = dict(bridge.iter_hf_tensors(merged, BASE))
  assert streamed.keys() == expected.keys() and not any("lora" in k for k in streamed)
  for name in expected:
    np.testing.assert_array_equal(streamed[name], expected[name])
  ranks = bridge.shard_for_vllm(params, LORA, tp_size=2)
  for got, want in zip(ranks, bridge.shard_for_vllm(merged, BASE, tp_size=2)):
    for name in want:
      np.testing.assert_array_equal(got[name], want[name])


def test_peft_export_needs_adapters(tmp_path):
  with pytest.raises(ValueError, match="no LoRA adapters"):
    peft_export.export_peft_adapter(models.init_params(BASE, jax.random.PRNGKey(0)), BASE, str(tmp_path))


# ------------------------------------------------------------------ jobs


def _only_adapters_and_heads_changed(before, after):
  changed = _changed_leaves(before, after)
  assert changed, "nothing trained"
  frozen = [k for k in changed if not any(n in k for n in ("lora_a", "lora_b", "value_head", "reward_head"))]
  assert not frozen, f"frozen weights changed: {frozen[:5]}"
  return changed


def test_grpo_job_trains_only_adapters_and_exports_merged_and_peft_folders(tmp_path):
  c = tiny_config(tmp_path / "grpo", model__lora__rank=4, model__lora__alpha=8.0, sft__steps=2)
  job = jobs.make_job(c)
  before = jax.tree.map(np.asarray, job.params)
  summary = job.train()
  _only_adapters_and_heads_changed(before, jax.tree.map(np.asarray, job.params))
  run = str(tmp_path / "grpo")
  assert os.path.isfile(os.path.join(run, "peft_adapter", "adapter_model.safetensors"))
  assert os.path.isfile(os.path.join(run, "peft_base", "model.safetensors"))
  assert summary["rl_steps"] == 2
  # the merged export loads as a plain model with the trained function
  merged = bridge.load_hf_params(os.path.join(run, "hf_export"), job.model_config.replace(lora_rank=0,
                                                                                          lora_targets=()))
  assert not lora.has_adapters(merged)
  trained = jax.tree.map(np.asarray, job.params)
  job.close()
  # resume: the checkpoint (adapters + their optimizer state) restores, and the run extends
  more = jobs.make_job(tiny_config(tmp_path / "grpo", model__lora__rank=4, model__lora__alpha=8.0, sft__steps=2,
                                   rl__steps=3))
  assert more.progress.step == 2
  for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(more.params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert more.train()["rl_steps"] == 3
  _only_adapters_and_heads_changed(before, jax.tree.map(np.asarray, more.params))
  more.close()


def test_ppo_job_trains_policy_and_critic_adapters_and_the_value_head(tmp_path):
  c = tiny_config(tmp_path / "ppo", objective__recipe="ppo", advantage__estimator="gae", critic__enabled=True,
                  model__lora__rank=2, model__lora__targets=("q", "v"), sft__steps=1, export__hf=False)
  job = jobs.make_job(c)
  before = jax.tree.map(np.asarray, (job.params, job.state.train.critic_params))
  job.train()
  changed = _only_adapters_and_heads_changed(before, jax.tree.map(np.asarray, (job.params,
                                                                               job.state.train.critic_params)))
  assert any("value_head" in k for k in changed) and any(k.startswith("[1]") and "lora_b" in k for k in changed)
  job.close()


def test_reward_model_job_trains_adapters_and_head(tmp_path):
  c = tiny_rm_config(tmp_path / "rm", model__lora__rank=4, reward_model__steps=3, export__hf=False)
  job = jobs.make_job(c)
  before = jax.tree.map(np.asarray, job.params)
  job.train()
  changed = _only_adapters_and_heads_changed(before, jax.tree.map(np.asarray, job.params))
  assert any("reward_head" in k for k in changed) and any("lora_b" in k for k in changed)
  job.close()
