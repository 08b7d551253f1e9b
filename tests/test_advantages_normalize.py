"""Normalisation modes and whitening: hand values, degenerate statistics, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import reduce
from jaxrl_llm.advantages import (
    make_advantage_normalizer,
    masked_moments,
    normalize_advantages,
    whiten,
)

S2 = np.sqrt(2.0)
X = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, np.nan], [7.0, 7.0, 0.0], [7.0, -1e30, 0.0]])
M = jnp.array([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]], bool)


def test_masked_moments_by_hand():
  mom = masked_moments(X[:2], M[:2])
  # tokens {1, 2, 3, 4, 5}: mean 3, population variance 2.
  np.testing.assert_allclose([mom.mean, mom.var, mom.count], [3.0, 2.0, 5.0], rtol=1e-6)
  assert not mom.degenerate
  empty = masked_moments(X, jnp.zeros_like(M))
  assert empty.mean == 0 and empty.var == 0 and empty.count == 0 and empty.degenerate


def test_none_mode_only_masks():
  out = normalize_advantages(X, M, "none")
  np.testing.assert_array_equal(out, np.where(M, np.nan_to_num(X), 0.0))


def test_batch_mode_token_level_by_hand():
  out = normalize_advantages(X[:2], M[:2], "batch", eps=1e-12)
  np.testing.assert_allclose(out, np.array([[-2, -1, 0], [1, 2, 0]]) / S2, rtol=1e-6)
  out = normalize_advantages(X[:2], M[:2], "batch", eps=1e-12, shift_mean=False)
  np.testing.assert_allclose(out, np.array([[1, 2, 3], [4, 5, 0]]) / S2, rtol=1e-6)


def test_batch_mode_sequence_level_by_hand():
  # row means 2 and 4.5: mean 3.25, std 1.25; each row counts once.
  out = normalize_advantages(X[:2], M[:2], "batch", eps=1e-12, level="sequence")
  np.testing.assert_allclose(out, [[-1.8, -1.0, -0.2], [0.6, 1.4, 0.0]], rtol=1e-6, atol=1e-6)


def test_group_mode_by_hand_with_degenerate_group():
  # group 0 = rows 0-1 (tokens 1..5), group 1 = rows 2-3 (tokens {7, 7, 7}).
  out = normalize_advantages(X, M, "group", group_size=2, eps=1e-12)
  np.testing.assert_allclose(out[:2], np.array([[-2, -1, 0], [1, 2, 0]]) / S2, rtol=1e-6)
  assert np.all(np.asarray(out[2:]) == 0.0)
  kept = normalize_advantages(X, M, "group", group_size=2, shift_mean=False)
  np.testing.assert_array_equal(kept[2:], [[7, 7, 0], [7, 0, 0]])
  seq = normalize_advantages(X, M, "group", group_size=2, eps=1e-12, level="sequence")
  np.testing.assert_allclose(seq[:2], [[-1.8, -1.0, -0.2], [0.6, 1.4, 0.0]], rtol=1e-6,
                             atol=1e-6)
  assert np.all(np.asarray(seq[2:]) == 0.0)


def test_group_mode_equals_batch_mode_per_group():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 5)).astype(np.float32)
  m = rng.random((6, 5)) > 0.3
  out = normalize_advantages(x, m, "group", group_size=3)
  for g in range(2):
    ref = normalize_advantages(x[3 * g:3 * g + 3], m[3 * g:3 * g + 3], "batch")
    np.testing.assert_array_equal(out[3 * g:3 * g + 3], ref)


def test_all_masked_gives_zeros_without_nan():
  for mode, kw in [("none", {}), ("batch", {}), ("group", {"group_size": 2})]:
    for level in ("token", "sequence"):
      out = normalize_advantages(X, jnp.zeros_like(M), mode, level=level, **kw)
      assert np.all(np.asarray(out) == 0.0), (mode, level)


def test_whiten_openai_convention():
  # mean 2, population variance 2/3: rsqrt(2/3 + 1e-8) = 1.2247449.
  np.testing.assert_allclose(whiten(jnp.array([1.0, 2.0, 3.0])), [-1.2247449, 0, 1.2247449],
                             rtol=1e-6)
  np.testing.assert_allclose(whiten(jnp.array([1.0, 2.0, 3.0]), shift_mean=False),
                             [0.7752551, 2.0, 3.2247449], rtol=1e-6)
  out = whiten(X[:2], M[:2], shift_mean=False)
  # tokens 1..5: mean 3, variance 2; the masked NaN stays out and becomes 0.
  np.testing.assert_allclose(out, [[3 - 2 / S2, 3 - 1 / S2, 3], [3 + 1 / S2, 3 + 2 / S2, 0]],
                             rtol=1e-6)
  const = jnp.full((4,), 0.8132702)
  assert np.all(np.asarray(whiten(const)) == 0.0)
  np.testing.assert_array_equal(whiten(const, shift_mean=False), const)


def test_group_size_is_ignored_outside_group_mode():
  np.testing.assert_array_equal(normalize_advantages(X, M, "batch", group_size=2),
                                normalize_advantages(X, M, "batch"))


def test_normalizer_is_jittable():
  norm = jax.jit(make_advantage_normalizer("group", group_size=2))
  np.testing.assert_array_equal(norm(X, M), make_advantage_normalizer("group", group_size=2)(X, M))


@pytest.mark.parametrize("kwargs,match", [
    ({"mode": "prompt"}, "unknown advantage normalisation mode 'prompt'"),
    ({"mode": "batch", "level": "word"}, "unknown statistics level 'word'"),
    ({"mode": "group"}, "mode 'group' needs group_size"),
    ({"mode": "batch", "group_size": 0}, "group_size must be positive"),
    ({"mode": "global"}, "mode 'global' needs axis_name"),
    ({"mode": "batch", "axis_name": "data"}, "axis_name is only used by mode 'global'"),
    ({"mode": "batch", "eps": 0.0}, "eps must be finite and > 0"),
    ({"mode": "group", "group_size": -2}, "group_size must be positive"),
])
def test_construction_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_advantage_normalizer(**kwargs)


def test_call_errors_name_the_arrays():
  norm = make_advantage_normalizer("group", group_size=3)
  with pytest.raises(ValueError, match="not a whole number of groups of group_size=3"):
    norm(X, M)
  with pytest.raises(ValueError, match="mask_bt has shape \\(4, 2\\) but advantages_bt"):
    make_advantage_normalizer("batch")(X, M[:, :2])
  with pytest.raises(ValueError, match="whiten: values must be \\[B\\] or \\[B, T\\]"):
    whiten(jnp.zeros((2, 2, 2)))


# ----------------------------------------------------------------------------- degenerate statistics
# Found by a float64 re-implementation: at level="sequence" a row's value was the float32 mean
# of its tokens, so a constant sequence advantage had a 1-ulp spread over rows of different
# lengths, which an exact max == min test missed and 1 / (std + eps) blew up.

A_CONST = np.float32(0.4639781)  # the pairwise mean of three copies is A_CONST + 1 ulp


@pytest.mark.parametrize("mode", ["batch", "group"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_constant_sequence_advantage_is_degenerate_regression(mode, level):
  a = A_CONST
  assert np.float32(np.float32(a + a) + a) / np.float32(3) != a  # the rounding that caused it
  adv = np.array([[a, 0, 0], [a, a, a]], np.float32)
  mask = np.array([[1, 0, 0], [1, 1, 1]], bool)
  kept = normalize_advantages(adv, mask, mode, group_size=2, level=level, shift_mean=False)
  np.testing.assert_array_equal(kept, adv)  # was ~454402 everywhere
  shifted = normalize_advantages(adv, mask, mode, group_size=2, level=level, shift_mean=True)
  np.testing.assert_array_equal(shifted, np.zeros_like(adv))


def _vmapped(mode, level, shift_mean):
  norm = make_advantage_normalizer(mode, group_size=2, level=level, shift_mean=shift_mean)
  return jax.jit(jax.vmap(norm))


def _random_constants(rng, shape):
  """float32 constants of both signs over six decades, including short mantissas."""
  a = rng.choice([-1.0, 1.0], shape) * 10.0 ** rng.uniform(-3, 3, shape)
  a[..., :1] = np.round(a[..., :1], 2)
  return a.astype(np.float32)


@pytest.mark.parametrize("mode", ["batch", "group"])
@pytest.mark.parametrize("shift_mean", [False, True])
def test_constant_advantages_randomized_are_degenerate(mode, shift_mean):
  """Many random constants, random lengths: the input back exactly (or exactly 0)."""
  rng = np.random.default_rng(7 + shift_mean)
  k, b, t = 2000, 4, 9
  per_group = _random_constants(rng, (k, b // 2))
  if mode == "batch":
    per_group[:, 1] = per_group[:, 0]  # one constant for the whole batch
  values_b = np.repeat(per_group, 2, axis=1)
  lengths = rng.integers(0, t + 1, (k, b))
  lengths[:, ::2] = np.maximum(lengths[:, ::2], 1)  # every group has a non-empty row
  mask = np.arange(t)[None, None, :] < lengths[:, :, None]
  adv = np.where(mask, values_b[:, :, None], np.float32(0.0)).astype(np.float32)
  want = np.zeros_like(adv) if shift_mean else adv
  for level in ("token", "sequence"):
    out = np.asarray(_vmapped(mode, level, shift_mean)(adv, mask))
    bad = np.any(out != want, axis=(1, 2))
    assert not bad.any(), (level, per_group[bad][:3], np.abs(out - want).max())


@pytest.mark.parametrize("mode", ["batch", "group"])
@pytest.mark.parametrize("shift_mean", [False, True])
def test_equal_sequence_means_up_to_rounding_are_degenerate(mode, shift_mean):
  """Rows that are permutations of the same tokens: equal exact means, float32 means may differ."""
  rng = np.random.default_rng(11 + shift_mean)
  k, t = 500, 7
  tokens = rng.normal(0, 1, (k, 1, t)).astype(np.float32)
  adv = rng.permuted(np.repeat(tokens, 4, axis=1), axis=2)
  mask = np.ones_like(adv, bool)
  seq_means = np.asarray(jax.vmap(lambda x, m: reduce.masked_row_sum(x, m) / t)(adv, mask))
  assert (seq_means.max(1) != seq_means.min(1)).mean() > 0.2  # the rounding really occurs
  out = np.asarray(_vmapped(mode, "sequence", shift_mean)(adv, mask))
  np.testing.assert_array_equal(out, np.zeros_like(adv) if shift_mean else adv)


def test_equal_sequence_advantages_give_equal_outputs_whatever_the_length():
  """A broadcast sequence advantage is taken exactly, so equal advantages stay equal."""
  a, c = A_CONST, np.float32(-1.25)
  adv = np.array([[a, 0, 0], [a, a, a], [c, c, 0], [a, a, 0]], np.float32)
  mask = adv != 0
  for mode in ("batch", "group"):
    for shift_mean in (False, True):
      out = np.asarray(normalize_advantages(adv, mask, mode, group_size=4, level="sequence",
                                            shift_mean=shift_mean))
      firsts = out[[0, 1, 3], 0]
      assert np.all(firsts == firsts[0]) and np.all(out[1] == out[1, 0])
      # population std of the sequence values {a, a, c, a}, float64 reference
      seq = np.array([a, a, c, a], np.float64)
      ref = ((seq - seq.mean()) if shift_mean else seq) / (seq.std() + 1e-6)
      np.testing.assert_allclose(out[:, 0], ref, rtol=1e-6)


def test_small_but_real_spread_is_still_normalised():
  # a range of 1e-4 at magnitude 1 is ~1700 ulps: information, not rounding.
  adv = np.array([[1.0, 1.0], [1.0001, 1.0001]], np.float32)
  mask = np.ones_like(adv, bool)
  for level in ("token", "sequence"):
    out = normalize_advantages(adv, mask, "batch", level=level, eps=1e-12)
    np.testing.assert_allclose(out, [[-1, -1], [1, 1]], rtol=5e-3)  # 1.0001 rounds
  mom = masked_moments(adv, mask)
  assert not mom.degenerate
  near = masked_moments(jnp.array([1.0, np.nextafter(np.float32(1), np.float32(2))]))
  assert near.degenerate  # a 1-ulp range is rounding
