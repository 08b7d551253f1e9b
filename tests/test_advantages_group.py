"""Group-relative advantages: hand values, NumPy reference, flags, validity, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import reduce
from jaxrl_llm.advantages import (
    dr_grpo_advantages,
    group_advantages,
    group_zero_variance,
    grpo_advantages,
    rloo_advantages,
    sequence_to_tokens,
)


def np_group(r, n, estimator, eps=1e-6, ddof=0, valid=None):
  """Independent float64 reference, one group at a time."""
  valid = np.ones(r.shape, bool) if valid is None else valid
  out = np.zeros(r.shape)
  flags = []
  for g in range(len(r) // n):
    sl = slice(g * n, (g + 1) * n)
    rv = r[sl][valid[sl]].astype(np.float64)
    zero = len(rv) < 2 or rv.max() == rv.min()
    flags.append(zero)
    if zero:
      continue
    for i in np.nonzero(valid[sl])[0]:
      x = float(r[sl][i])
      if estimator == "grpo":
        a = (x - rv.mean()) / (rv.std(ddof=ddof) + eps)
      elif estimator == "dr_grpo":
        a = x - rv.mean()
      else:
        a = x - (rv.sum() - x) / (len(rv) - 1)
      out[g * n + i] = a
  return out, np.array(flags)


def test_grpo_by_hand():
  # group [1, 0, 1, 1]: mean 0.75, population std sqrt(0.1875) = 0.4330127.
  out = grpo_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 4, eps=0.0 + 1e-12)
  np.testing.assert_allclose(out.advantages_b, [0.57735, -1.7320508, 0.57735, 0.57735],
                             rtol=1e-5)
  # sample std (ddof=1): sqrt(0.25) = 0.5 -> (0.25 / 0.5, -0.75 / 0.5).
  out1 = grpo_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 4, ddof=1, eps=1e-12)
  np.testing.assert_allclose(out1.advantages_b, [0.5, -1.5, 0.5, 0.5], rtol=1e-6)


def test_dr_grpo_and_rloo_by_hand():
  r = jnp.array([3.0, 1.0, 2.0, 10.0, 10.0, 4.0])
  # groups of 3: means 2 and 8.
  np.testing.assert_allclose(dr_grpo_advantages(r, 3).advantages_b, [1, -1, 0, 2, 2, -4])
  # RLOO: 3 - (1+2)/2 = 1.5; 1 - 2.5 = -1.5; 2 - 2 = 0; 10 - 7 = 3; 3; 4 - 10 = -6.
  np.testing.assert_allclose(rloo_advantages(r, 3).advantages_b, [1.5, -1.5, 0, 3, 3, -6])


def test_zero_variance_groups_are_exact_zero_and_flagged():
  # 0.8132702 repeated: the rounded float32 mean differs from it, so the two-pass
  # variance is 3.6e-15, not 0; equality must be tested exactly.
  r = jnp.array([0.8132702] * 3 + [0.3, 0.7, 0.7] + [0.7] * 3, jnp.float32)
  assert reduce.group_moments(r[:3], 3)[1][0] > 0
  for est in ("grpo", "dr_grpo", "rloo"):
    out = group_advantages(r, 3, estimator=est)
    np.testing.assert_array_equal(out.zero_variance_g, [True, False, True])
    np.testing.assert_array_equal(out.zero_variance_b, [True] * 3 + [False] * 3 + [True] * 3)
    assert np.all(np.asarray(out.advantages_b)[[0, 1, 2, 6, 7, 8]] == 0.0)
    assert np.all(np.asarray(out.advantages_b)[3:6] != 0.0)
  np.testing.assert_array_equal(group_zero_variance(r, 3), [True, False, True])


def test_invalid_rows_leave_the_statistics():
  r = jnp.array([1.0, 0.0, 123.0, 0.5, 7.0, 7.0, -5.0, 8.0])
  valid = jnp.array([1, 1, 0, 1, 1, 0, 1, 0], bool)
  out = group_advantages(r, 4, estimator="dr_grpo", valid_b=valid)
  # group 0 valid {1, 0, 0.5}: mean 0.5; group 1 valid {7, -5}: mean 1.
  np.testing.assert_allclose(out.advantages_b, [0.5, -0.5, 0, 0, 6, 0, -6, 0])
  # one valid sample is a zero-variance group; no valid sample too.
  single = group_advantages(r, 4, valid_b=jnp.array([1, 0, 0, 0, 0, 0, 0, 0], bool))
  np.testing.assert_array_equal(single.zero_variance_g, [True, True])
  assert np.all(np.asarray(single.advantages_b) == 0)


@pytest.mark.parametrize("estimator,ddof", [("grpo", 0), ("grpo", 1), ("dr_grpo", 0),
                                            ("rloo", 0)])
def test_matches_numpy_reference(estimator, ddof):
  rng = np.random.default_rng(0)
  n = 4
  r = rng.integers(0, 3, size=40).astype(np.float32) * rng.choice([1.0, 0.37], size=40)
  r = r.astype(np.float32)
  valid = rng.random(40) > 0.15
  fn = jax.jit(lambda r, v: group_advantages(r, n, estimator=estimator, ddof=ddof, valid_b=v))
  out = fn(r, valid)
  ref, flags = np_group(r, n, estimator, ddof=ddof, valid=valid)
  np.testing.assert_allclose(out.advantages_b, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(out.zero_variance_g, flags)
  assert flags.any() and not flags.all()


def test_sequence_to_tokens():
  m = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
  out = sequence_to_tokens(jnp.array([2.0, 3.0, -1.0]), m)
  np.testing.assert_array_equal(out, [[0, 2, 2, 0], [0, 0, 0, 0], [-1, -1, -1, -1]])


def test_errors():
  with pytest.raises(ValueError, match="not a whole number of groups of group_size=4"):
    grpo_advantages(jnp.zeros(6), 4)
  with pytest.raises(ValueError, match="group_size must be positive"):
    grpo_advantages(jnp.zeros(6), 0)
  with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
    group_advantages(jnp.zeros(4), 2, estimator="ppo")
  with pytest.raises(ValueError, match="rewards_b must be \\[B\\]"):
    grpo_advantages(jnp.zeros((4, 2)), 2)
  with pytest.raises(ValueError, match="valid_b has 3 rows but rewards_b has 4"):
    grpo_advantages(jnp.zeros(4), 2, valid_b=jnp.ones(3, bool))
  with pytest.raises(ValueError, match="values_b has 2 rows but mask_bt has 3"):
    sequence_to_tokens(jnp.zeros(2), jnp.ones((3, 4), bool))
  with pytest.raises(ValueError, match="ddof must be 0 or 1"):
    grpo_advantages(jnp.zeros(4), 2, ddof=2)
