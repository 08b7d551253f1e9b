"""Bit invariance (uint32 views) of advantages across padding, micro-batches and devices."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm import reduce
from jaxrl_llm.advantages import (
    gae,
    group_advantages,
    kl_penalized_rewards,
    make_advantage_normalizer,
    mean_sequence_kl,
    running_moments_init,
    running_moments_update,
    sequence_to_tokens,
    whiten,
)

N = 4          # samples per prompt
B, T = 16, 12  # 4 groups


def bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def assert_same_bits(a, b, what):
  np.testing.assert_array_equal(bits(a), bits(b), err_msg=what)


def make_inputs(seed=0, b=B, t=T):
  rng = np.random.default_rng(seed)
  mask = np.zeros((b, t), bool)
  for i in range(b):
    start = rng.integers(1, 4)                       # prompt tokens first
    mask[i, start:start + rng.integers(0, t - start + 1)] = True
  rewards = rng.choice([0.0, 1.0, 0.37], size=b).astype(np.float32)
  rewards[:N] = 1.0                                  # one zero-variance group
  return dict(
      rewards_b=rewards,
      values_bt=rng.normal(size=(b, t)).astype(np.float32),
      logp_bt=-rng.random((b, t)).astype(np.float32),
      ref_bt=-rng.random((b, t)).astype(np.float32),
      mask_bt=mask,
  )


def pipeline(rewards_b, values_bt, logp_bt, ref_bt, mask_bt):
  """Every advantage path of the package on one batch; returns named outputs."""
  valid_b = reduce.row_count(mask_bt) > 0
  out = {}
  rewards_bt, kl_bt = kl_penalized_rewards(rewards_b, logp_bt, ref_bt, mask_bt, 0.1)
  out["gae_adv"], out["gae_ret"] = gae(rewards_bt, values_bt, mask_bt, gamma=1.0, lam=0.95)
  out["ppo_whiten"] = whiten(out["gae_adv"], mask_bt)
  out["batch_token"] = make_advantage_normalizer("batch")(out["gae_adv"], mask_bt)
  for est in ("grpo", "dr_grpo", "rloo"):
    out[est] = group_advantages(rewards_b, N, estimator=est, valid_b=valid_b).advantages_b
  dr_bt = sequence_to_tokens(out["dr_grpo"], mask_bt)
  out["group_token"] = make_advantage_normalizer("group", group_size=N)(dr_bt, mask_bt)
  out["group_seq"] = make_advantage_normalizer("group", group_size=N, level="sequence")(
      dr_bt, mask_bt)
  out["batch_seq"] = make_advantage_normalizer("batch", shift_mean=False, level="sequence")(
      dr_bt, mask_bt)
  out["reward_whiten"] = whiten(rewards_b, valid_b, shift_mean=False)
  state = running_moments_update(running_moments_init(), rewards_b, valid_b)
  out["running_mean"], out["running_m2"] = state.mean, state.m2
  out["seq_kl"] = mean_sequence_kl(kl_bt, mask_bt)
  return out


GROUP_LOCAL = ("gae_adv", "gae_ret", "grpo", "dr_grpo", "rloo", "group_token", "group_seq")
run = jax.jit(pipeline)


@pytest.fixture(scope="module")
def reference():
  inputs = make_inputs()
  return inputs, jax.device_get(run(**inputs))


def crop(out, b, t):
  cropped = {}
  for k, v in out.items():
    v = np.asarray(v)
    cropped[k] = v[:b, :t] if v.ndim == 2 else (v[:b] if v.ndim == 1 else v)
  return cropped


def test_padding_rows_and_trailing_tokens_do_not_change_bits(reference):
  inputs, ref = reference
  pad_rows, pad_t = N, 5
  padded = {}
  for k, v in inputs.items():
    widths = [(0, pad_rows)] + ([(0, pad_t)] if v.ndim == 2 else [])
    fill = False if k == "mask_bt" else np.nan      # garbage in the padding
    padded[k] = np.pad(v, widths, constant_values=fill)
  padded["rewards_b"] = np.where(np.arange(B + pad_rows) < B, padded["rewards_b"], 1e30)
  out = jax.device_get(run(**padded))
  for k, v in crop(out, B, T).items():
    assert_same_bits(v, ref[k], k)
  for k in ("gae_adv", "ppo_whiten", "group_token", "batch_seq"):
    assert np.all(np.asarray(out[k])[B:] == 0) and np.all(np.asarray(out[k])[:, T:] == 0), k


def test_micro_batches_at_group_boundaries_give_the_same_bits(reference):
  inputs, ref = reference
  for parts in (4,):      # one group per micro-batch: the G == 1 edge case
    size = B // parts
    outs = [jax.device_get(run(**{k: v[i * size:(i + 1) * size] for k, v in inputs.items()}))
            for i in range(parts)]
    for k in GROUP_LOCAL:
      assert_same_bits(np.concatenate([o[k] for o in outs]), ref[k], f"{k} in {parts} parts")


@pytest.mark.parametrize("p", [2, 4, 8])
def test_sharded_batch_axis_gives_the_same_bits(reference, p):
  """``reference`` is the 1-device run; 2/4/8 devices must reproduce its bits."""
  inputs, ref = reference
  sharding = NamedSharding(Mesh(np.array(jax.devices()[:p]), ("data",)), P("data"))
  sharded = {k: jax.device_put(v, sharding) for k, v in inputs.items()}
  out = jax.device_get(run(**sharded))
  for k, v in out.items():
    assert_same_bits(v, ref[k], f"{k} on {p} devices")


@pytest.mark.parametrize("p", [2, 8])
def test_shard_map_global_mode_equals_unsharded_batch_mode(reference, p):
  inputs, ref = reference
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))

  def per_device(adv_bt, dr_bt, mask_bt, rewards_b, kl_bt):
    valid_b = reduce.row_count(mask_bt) > 0
    state = running_moments_update(running_moments_init(), rewards_b, valid_b, axis_name="data")
    return dict(
        batch_token=make_advantage_normalizer("global", axis_name="data")(adv_bt, mask_bt),
        batch_seq=make_advantage_normalizer("global", axis_name="data", shift_mean=False,
                                            level="sequence")(dr_bt, mask_bt),
        ppo_whiten=whiten(adv_bt, mask_bt, axis_name="data"),
        reward_whiten=whiten(rewards_b, valid_b, shift_mean=False, axis_name="data"),
        running_mean=state.mean, running_m2=state.m2,
        seq_kl=mean_sequence_kl(kl_bt, mask_bt, axis_name="data"),
        local=make_advantage_normalizer("batch")(adv_bt, mask_bt),
    )

  out_specs = dict(batch_token=P("data"), batch_seq=P("data"), ppo_whiten=P("data"),
                   reward_whiten=P("data"), running_mean=P(), running_m2=P(), seq_kl=P(),
                   local=P("data"))
  # reduce's axis_name path all-gathers partials, whose result JAX types as varying
  # although every device holds the same bits; hence check_vma=False for P() outputs.
  fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=out_specs,
                             check_vma=False))
  _, kl_bt = kl_penalized_rewards(inputs["rewards_b"], inputs["logp_bt"], inputs["ref_bt"],
                                  inputs["mask_bt"], 0.1)
  dr_bt = sequence_to_tokens(ref["dr_grpo"], inputs["mask_bt"])
  out = jax.device_get(fn(ref["gae_adv"], dr_bt, inputs["mask_bt"], inputs["rewards_b"], kl_bt))
  for k in out_specs:
    if k != "local":
      assert_same_bits(out[k], ref[k], f"global {k} on {p} devices")
  # "batch" inside shard_map is per device: the statistics of each block alone.
  size = B // p
  local = jax.jit(make_advantage_normalizer("batch"))
  local_ref = np.concatenate([
      local(ref["gae_adv"][i * size:(i + 1) * size], inputs["mask_bt"][i * size:(i + 1) * size])
      for i in range(p)])
  assert_same_bits(out["local"], local_ref, "per-device batch mode")
  assert not np.array_equal(bits(out["local"]), bits(ref["batch_token"]))

