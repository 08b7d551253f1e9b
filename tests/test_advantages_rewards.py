"""Reward processing: clipping, reference baseline, EOS placement, KL shaping, running z-score."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm.advantages import (
    RunningMoments,
    clip_rewards,
    kl_penalized_rewards,
    last_token_mask,
    mean_sequence_kl,
    reference_baseline,
    reward_at_eos,
    running_moments_init,
    running_moments_update,
    running_reward_normalizer,
    running_variance,
    running_zscore,
)

# row 0: prompt, 3 response tokens (EOS at t=3), pad; row 1: truncated at the end;
# row 2: empty response.
MASK = jnp.array([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], bool)


def test_clip_rewards():
  r = jnp.array([-7.0, -0.5, 0.0, 3.0, 12.0])
  np.testing.assert_array_equal(clip_rewards(r, 5.0), [-5, -0.5, 0, 3, 5])
  np.testing.assert_array_equal(clip_rewards(r, (-1.0, 10.0)), [-1, -0.5, 0, 3, 10])
  with pytest.raises(ValueError, match="clip_range must be finite and > 0"):
    clip_rewards(r, -1.0)
  with pytest.raises(ValueError, match="needs low < high"):
    clip_rewards(r, (2.0, 1.0))


def test_reference_baseline():
  r = jnp.array([1.0, 2.0, 3.0, 10.0, 20.0, 30.0])
  np.testing.assert_array_equal(reference_baseline(r, jnp.array([2.0, 25.0])),
                                [-1, 0, 1, -15, -5, 5])
  np.testing.assert_array_equal(reference_baseline(r, r), np.zeros(6))
  with pytest.raises(ValueError, match="not a whole number of samples for each of the 4"):
    reference_baseline(r, jnp.zeros(4))


def test_reward_on_last_response_token():
  np.testing.assert_array_equal(
      last_token_mask(MASK), [[0, 0, 0, 1, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 0]])
  out = reward_at_eos(jnp.array([2.0, -1.0, 5.0]), MASK)
  np.testing.assert_array_equal(out, [[0, 0, 0, 2, 0], [0, 0, 0, 0, -1], [0, 0, 0, 0, 0]])
  with pytest.raises(ValueError, match="rewards_b has 2 rows but mask_bt has 3"):
    reward_at_eos(jnp.zeros(2), MASK)


def test_kl_shaped_rewards_by_hand():
  logp = jnp.array([[9.0, -1.0, -2.0, -0.5, 9.0], [0, 0, -1.0, -1.0, -1.0], [0.0] * 5])
  ref = jnp.array([[0.0, -1.5, -1.0, -0.5, 0.0], [0, 0, -2.0, -0.5, -1.0], [0.0] * 5])
  rewards_bt, kl_bt = kl_penalized_rewards(jnp.array([2.0, -1.0, 5.0]), logp, ref, MASK, 0.1)
  np.testing.assert_allclose(kl_bt, [[0, 0.5, -1.0, 0, 0], [0, 0, 1.0, -0.5, 0], [0] * 5])
  # r_t = 1[EOS] r - 0.1 KL_t.
  np.testing.assert_allclose(rewards_bt, [[0, -0.05, 0.1, 2.0, 0], [0, 0, -0.1, 0.05, -1.0],
                                          [0] * 5], rtol=1e-6)
  # sequence KLs 0.5 - 1 = -0.5 and 1 - 0.5 = 0.5; the empty row is left out.
  assert mean_sequence_kl(kl_bt, MASK) == 0.0
  np.testing.assert_allclose(mean_sequence_kl(jnp.abs(kl_bt), MASK), 1.5)
  with pytest.raises(ValueError, match="kl_coef must be finite and >= 0"):
    kl_penalized_rewards(jnp.zeros(3), logp, ref, MASK, -0.1)
  with pytest.raises(ValueError, match="ref_logp_bt has shape \\(3, 4\\) but logp_bt"):
    kl_penalized_rewards(jnp.zeros(3), logp, ref[:, :4], MASK, 0.1)


def test_running_moments_two_batches_equal_one_pass():
  rng = np.random.default_rng(0)
  a = rng.normal(3.0, 2.0, size=37).astype(np.float32)
  b = rng.normal(-1.0, 0.5, size=20).astype(np.float32)
  update = jax.jit(running_moments_update)
  two = update(update(running_moments_init(), a), b)
  one = update(running_moments_init(), np.concatenate([a, b]))
  both = np.concatenate([a, b]).astype(np.float64)
  assert int(two.count) == int(one.count) == 57
  np.testing.assert_allclose(two.mean, one.mean, rtol=1e-6)
  np.testing.assert_allclose(two.m2, one.m2, rtol=1e-5)
  np.testing.assert_allclose(two.mean, both.mean(), rtol=1e-5)
  np.testing.assert_allclose(running_variance(two), both.var(), rtol=1e-5)


def test_running_moments_ignore_invalid_rows_and_empty_batches():
  x = jnp.array([1.0, 2.0, 3.0, 4.0])
  state = running_moments_update(running_moments_init(), x)
  padded = running_moments_update(running_moments_init(), jnp.array([1.0, 2.0, 3.0, 4.0, 1e9]),
                                  jnp.array([1, 1, 1, 1, 0], bool))
  for u, v in zip(state, padded):
    np.testing.assert_array_equal(u, v)
  np.testing.assert_allclose([state.mean, state.m2], [2.5, 5.0])
  same = running_moments_update(state, x, jnp.zeros(4, bool))
  for u, v in zip(state, same):
    np.testing.assert_array_equal(u, v)


def test_running_state_checkpoint_restore_continues_identically(tmp_path):
  rng = np.random.default_rng(1)
  batches = [rng.normal(size=8).astype(np.float32) for _ in range(4)]
  norm = running_reward_normalizer()
  update = jax.jit(norm.update)
  state = norm.init()
  for x in batches[:2]:
    _, state = update(state, x)
  with ocp.StandardCheckpointer() as ckpt:
    ckpt.save(tmp_path / "rm", state)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "rm", running_moments_init())
  assert isinstance(restored, RunningMoments)
  outs = []
  for s in (state, restored):
    zs = []
    for x in batches[2:]:
      z, s = update(s, x)
      zs.append(z)
    outs.append((zs, s))
  for z0, z1 in zip(outs[0][0], outs[1][0]):
    np.testing.assert_array_equal(np.asarray(z0).view(np.uint32), np.asarray(z1).view(np.uint32))
  for u, v in zip(outs[0][1], outs[1][1]):
    np.testing.assert_array_equal(u, v)


def test_running_zscore_by_hand():
  state = running_moments_update(running_moments_init(), jnp.array([1.0, 3.0]))
  # mean 2, std 1.
  np.testing.assert_allclose(running_zscore(state, jnp.array([0.0, 2.0, 5.0]), eps=1e-12),
                             [-2, 0, 3])
  np.testing.assert_allclose(running_zscore(state, jnp.array([4.0]), shift_mean=False,
                                            eps=1e-12), [4.0])
  # no data / one value: zero variance, nothing is scaled.
  np.testing.assert_array_equal(running_zscore(running_moments_init(), jnp.array([7.0])), [7.0])
  z, s = running_reward_normalizer().update(running_moments_init(), jnp.array([1.0, 3.0, 9.0]),
                                            jnp.array([1, 1, 0], bool))
  np.testing.assert_allclose(z, [-1, 1, 0], rtol=1e-6)
  assert int(s.count) == 2
  with pytest.raises(ValueError, match="values_b must be \\[B\\]"):
    running_moments_update(running_moments_init(), jnp.zeros((2, 2)))
