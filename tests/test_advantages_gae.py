"""GAE: hand-computed values, variable lengths, Monte Carlo limits, NumPy reference, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.advantages import gae


def np_gae(r, v, m, gamma, lam, boot=None):
  """Independent float64 reference: loop over each row's response positions."""
  b, t = r.shape
  adv, ret = np.zeros((b, t)), np.zeros((b, t))
  for i in range(b):
    next_v = 0.0 if boot is None else float(boot[i])
    next_a = 0.0
    for j in reversed(np.nonzero(m[i])[0]):
      delta = r[i, j] + gamma * next_v - v[i, j]
      next_a = delta + gamma * lam * next_a
      next_v = v[i, j]
      adv[i, j], ret[i, j] = next_a, next_a + v[i, j]
  return adv, ret


def random_batch(rng, b, t, gaps=False):
  """Rows of prompt | response | padding with random lengths (response may be empty)."""
  m = np.zeros((b, t), bool)
  for i in range(b):
    p = rng.integers(0, t)
    n = rng.integers(0, t - p + 1)
    m[i, p:p + n] = True
    if gaps and n > 2:
      m[i, p + 1] = False
  r = rng.normal(size=(b, t)).astype(np.float32)
  v = rng.normal(size=(b, t)).astype(np.float32)
  return r, v, m


def test_three_token_example_by_hand():
  # prompt token, 3 response tokens, 1 pad; gamma 0.9, lambda 0.8, reward 1 on EOS.
  # t3: delta = 1 - 0.7 = 0.3;            A = 0.3
  # t2: delta = 0.9*0.7 - 0.6 = 0.03;     A = 0.03 + 0.72*0.3   = 0.246
  # t1: delta = 0.9*0.6 - 0.5 = 0.04;     A = 0.04 + 0.72*0.246 = 0.21712
  r = jnp.array([[0.0, 0.0, 0.0, 1.0, 0.0]])
  v = jnp.array([[9.0, 0.5, 0.6, 0.7, 9.0]])
  m = jnp.array([[0, 1, 1, 1, 0]], bool)
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.8)
  np.testing.assert_allclose(adv, [[0.0, 0.21712, 0.246, 0.3, 0.0]], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(ret, [[0.0, 0.71712, 0.846, 1.0, 0.0]], rtol=1e-6, atol=1e-7)


def test_bootstrap_value_for_truncated_row():
  # one response token, value 0.5, reward 0; the state after it is worth 2.0.
  # A = 0 + gamma * 2.0 - 0.5 = 1.3 with gamma 0.9.
  r = jnp.array([[0.0, 0.0]])
  v = jnp.array([[0.5, 0.0]])
  m = jnp.array([[1, 0]], bool)
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.95, bootstrap_value_b=jnp.array([2.0]))
  np.testing.assert_allclose(adv, [[1.3, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[1.8, 0.0]], rtol=1e-6)


def test_variable_lengths_by_hand_gamma1_lambda1():
  # gamma = lambda = 1: return = sum of future rewards; advantage = return - V.
  r = jnp.array([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0], [4.0, 4.0, 4.0, 4.0]])
  v = jnp.array([[0.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
  m = jnp.array([[0, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  adv, ret = gae(r, v, m, gamma=1.0, lam=1.0)
  np.testing.assert_allclose(ret, [[0, 6, 5, 3], [5, 0, 0, 0], [0, 0, 0, 0]])
  np.testing.assert_allclose(adv, [[0, 5, 4, 2], [3, 0, 0, 0], [0, 0, 0, 0]])


def test_lambda_one_is_discounted_return_minus_value():
  rng = np.random.default_rng(0)
  r, v, m = random_batch(rng, 6, 9)
  gamma = 0.8
  boot = rng.normal(size=6).astype(np.float32)
  adv, ret = gae(r, v, m, gamma=gamma, lam=1.0, bootstrap_value_b=boot)
  expected = np.zeros_like(r, dtype=np.float64)
  for i in range(6):
    idx = np.nonzero(m[i])[0]
    for k, j in enumerate(idx):
      future = idx[k:]
      disc = gamma ** np.arange(len(future))
      expected[i, j] = np.sum(disc * r[i, future]) + gamma ** len(future) * boot[i]
  np.testing.assert_allclose(ret, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(adv, np.where(m, expected - v, 0.0), rtol=1e-5, atol=1e-5)


def test_gamma_zero_is_one_step_td():
  rng = np.random.default_rng(1)
  r, v, m = random_batch(rng, 4, 6)
  adv, _ = gae(r, v, m, gamma=0.0, lam=0.7)
  np.testing.assert_allclose(adv, np.where(m, r - v, 0.0), rtol=1e-6)


@pytest.mark.parametrize("gamma,lam,gaps", [(1.0, 0.95, False), (0.99, 0.9, True),
                                            (0.5, 0.0, False)])
def test_matches_numpy_reference(gamma, lam, gaps):
  rng = np.random.default_rng(2)
  r, v, m = random_batch(rng, 8, 12, gaps=gaps)
  boot = rng.normal(size=8).astype(np.float32)
  fn = jax.jit(lambda r, v, m, b: gae(r, v, m, gamma=gamma, lam=lam, bootstrap_value_b=b))
  adv, ret = fn(r, v, m, boot)
  ref_adv, ref_ret = np_gae(r, v, m, gamma, lam, boot)
  np.testing.assert_allclose(adv, ref_adv, rtol=2e-5, atol=2e-5)
  np.testing.assert_allclose(ret, ref_ret, rtol=2e-5, atol=2e-5)


def test_zero_outside_mask_and_nan_values_there_are_harmless():
  rng = np.random.default_rng(3)
  r, v, m = random_batch(rng, 5, 7)
  r = np.where(m, r, np.nan)
  v = np.where(m, v, np.inf)
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.9)
  assert np.all(np.isfinite(adv)) and np.all(np.isfinite(ret))
  assert np.all(np.asarray(adv)[~m] == 0) and np.all(np.asarray(ret)[~m] == 0)


def test_gamma_lambda_can_be_traced():
  rng = np.random.default_rng(4)
  r, v, m = random_batch(rng, 3, 5)
  adv, _ = jax.jit(lambda g, l: gae(r, v, m, gamma=g, lam=l))(0.9, 0.8)
  np.testing.assert_allclose(adv, np_gae(r, v, m, 0.9, 0.8)[0], rtol=2e-5, atol=2e-5)


def test_shape_errors_name_the_arrays():
  r = jnp.zeros((2, 3))
  with pytest.raises(ValueError, match="values_bt has shape \\(2, 4\\) but rewards_bt"):
    gae(r, jnp.zeros((2, 4)), jnp.ones((2, 3), bool), gamma=1.0, lam=1.0)
  with pytest.raises(ValueError, match="mask_bt must be \\[B, T\\]"):
    gae(r, r, jnp.ones((6,), bool), gamma=1.0, lam=1.0)
  with pytest.raises(ValueError, match="bootstrap_value_b has 3 rows but rewards_bt has 2"):
    gae(r, r, jnp.ones((2, 3), bool), gamma=1.0, lam=1.0, bootstrap_value_b=jnp.zeros(3))


@pytest.mark.parametrize("name,gamma,lam", [("gamma", 1.5, 0.9), ("gamma", -0.1, 0.9),
                                            ("lam", 0.9, 1.01), ("lam", 0.9, float("nan"))])
def test_gamma_lambda_outside_unit_interval(name, gamma, lam):
  r = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match=f"{name} must lie in \\[0, 1\\]"):
    gae(r, r, jnp.ones((1, 2), bool), gamma=gamma, lam=lam)
