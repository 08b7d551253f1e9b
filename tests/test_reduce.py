"""The deterministic reductions: exact values, and bit-identity across splits, padding and devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm import reduce as R


def bits(x):
  return np.asarray(x, np.float32).view(np.uint32)


def _data(b=64, t=300, seed=0):
  rng = np.random.default_rng(seed)
  # Values spanning many magnitudes make every re-association visible in the bits.
  v = (rng.normal(size=(b, t)) * np.exp(rng.normal(size=(b, t)) * 3)).astype(np.float32)
  m = rng.random((b, t)) < 0.7
  return v, m


def _stats(v, m):
  return (R.token_sum(v, m), R.masked_row_sum(v, m), R.token_mean(v, m),
          R.batch_moments(R.masked_row_sum(v, m))[1])


_stats_jit = jax.jit(_stats)


def test_hand_values():
  v = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, np.nan]])
  m = jnp.array([[True, True, False], [True, True, False]])
  np.testing.assert_array_equal(R.masked_row_sum(v, m), [3.0, 9.0])
  assert float(R.token_sum(v, m)) == 12.0
  assert float(R.token_mean(v, m)) == 3.0
  mean, var = R.batch_moments(jnp.array([1.0, 3.0, 100.0]), jnp.array([True, True, False]))
  assert (float(mean), float(var)) == (2.0, 1.0)
  mean_g, var_g, count_g = R.group_moments(jnp.array([1.0, 3.0, 2.0, 2.0]), 2)
  np.testing.assert_array_equal(mean_g, [2.0, 2.0])
  np.testing.assert_array_equal(var_g, [1.0, 0.0])
  np.testing.assert_array_equal(count_g, [2.0, 2.0])


def test_tree_is_pairwise_over_adjacent_leaves():
  x = np.array([1e8, 1.0, -1e8, 1.0], np.float32)
  # ((1e8 + 1) + (-1e8 + 1)) in float32 = 0.0; a left-to-right sum gives 1.0.
  assert float(R.tree_sum(jnp.asarray(x))) == float((np.float32(1e8) + np.float32(1.0)) + (np.float32(-1e8) + np.float32(1.0)))


def test_all_masked_is_zero_not_nan():
  v = jnp.full((4, 5), jnp.nan)
  m = jnp.zeros((4, 5), bool)
  assert float(R.token_mean(v, m)) == 0.0
  assert float(R.batch_mean(jnp.zeros(4), jnp.zeros(4, bool))) == 0.0
  assert bits(R.token_sum(v, m)) == bits(jnp.float32(0.0))  # +0.0, not -0.0


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_bits_identical_across_device_counts(devices):
  v, m = _data()
  base = _stats_jit(v, m)
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  s = NamedSharding(mesh, P("data"))
  out = _stats_jit(jax.device_put(v, s), jax.device_put(m, s))
  for a, b in zip(out, base):
    np.testing.assert_array_equal(bits(a), bits(b))


def test_plain_sum_is_not_invariant_which_is_why_this_module_exists():
  v, m = _data()
  plain = jax.jit(lambda v, m: jnp.sum(jnp.where(m, v, 0.0)))
  sums = set()
  for devices in (1, 2, 4, 8):
    s = NamedSharding(Mesh(np.array(jax.devices()[:devices]), ("data",)), P("data"))
    sums.add(int(bits(plain(jax.device_put(v, s), jax.device_put(m, s)))))
  assert len(sums) > 1


def test_shard_map_axis_name_matches_global():
  v, m = _data()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  f = jax.jit(jax.shard_map(lambda v, m: R.token_sum(v, m, axis_name="data"), mesh=mesh,
                            in_specs=(P("data"), P("data")), out_specs=P()))
  np.testing.assert_array_equal(bits(f(v, m)), bits(_stats_jit(v, m)[0]))


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_bits_identical_across_micro_batches(micro):
  v, m = _data()
  base = _stats_jit(v, m)
  size = v.shape[0] // micro
  row_fn = jax.jit(R.masked_row_sum)
  rows = np.concatenate([np.asarray(row_fn(v[i:i + size], m[i:i + size])) for i in range(0, v.shape[0], size)])
  np.testing.assert_array_equal(bits(rows), bits(base[1]))
  np.testing.assert_array_equal(bits(jax.jit(R.batch_sum)(rows)), bits(base[0]))
  # Aligned block partials combine through the upper tree levels to the same bits.
  blocks = np.stack([np.asarray(jax.jit(R.batch_sum)(rows[i:i + size])) for i in range(0, len(rows), size)])
  np.testing.assert_array_equal(bits(R.tree_sum(blocks)), bits(base[0]))


def test_bits_identical_under_padding():
  v, m = _data()
  base = _stats_jit(v, m)
  rng = np.random.default_rng(1)
  # Trailing masked tokens holding garbage (including NaN) and extra fully-masked rows.
  extra_t = rng.normal(size=(v.shape[0], 37)).astype(np.float32)
  extra_t[0, 0] = np.nan
  v2 = np.concatenate([v, extra_t], 1)
  m2 = np.concatenate([m, np.zeros_like(extra_t, bool)], 1)
  v3 = np.concatenate([v2, np.full((9, v2.shape[1]), np.inf, np.float32)])
  m3 = np.concatenate([m2, np.zeros((9, v2.shape[1]), bool)])
  for vv, mm in ((v2, m2), (v3, m3)):
    out = _stats_jit(vv, mm)
    np.testing.assert_array_equal(bits(out[0]), bits(base[0]))
    np.testing.assert_array_equal(bits(out[1][:v.shape[0]]), bits(base[1]))
    np.testing.assert_array_equal(bits(out[2]), bits(base[2]))


@pytest.mark.parametrize("rows", [1, 8])
def test_row_sums_do_not_depend_on_the_rest_of_the_batch(rows):
  v, m = _data()
  out = jax.jit(R.masked_row_sum)(v[:rows], m[:rows])
  np.testing.assert_array_equal(bits(out), bits(_stats_jit(v, m)[1][:rows]))


def test_group_statistics_split_at_group_boundaries():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(32,)).astype(np.float32)
  whole = jax.jit(R.group_moments, static_argnums=1)(r, 4)
  halves = [jax.jit(R.group_moments, static_argnums=1)(r[i:i + 16], 4) for i in (0, 16)]
  for k in range(3):
    np.testing.assert_array_equal(bits(whole[k]), bits(np.concatenate([h[k] for h in halves])))


def test_bad_shapes_name_the_arrays():
  with pytest.raises(ValueError, match=r"values_bt \(2, 3\).*mask_bt \(2, 4\)"):
    R.masked_row_sum(jnp.zeros((2, 3)), jnp.zeros((2, 4), bool))
  with pytest.raises(ValueError, match="group_size=3"):
    R.group_sum(jnp.zeros(8), 3)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 12), t=st.integers(1, 40), pad_rows=st.integers(0, 5),
       pad_t=st.integers(0, 20), seed=st.integers(0, 2**16))
def test_property_padding_and_masking(b, t, pad_rows, pad_t, seed):
  rng = np.random.default_rng(seed)
  v = rng.normal(size=(b, t)).astype(np.float32)
  m = rng.random((b, t)) < 0.5
  base = R.token_sum(v, m), R.token_mean(v, m)
  v2 = np.pad(v, ((0, pad_rows), (0, pad_t)), constant_values=np.nan)
  m2 = np.pad(m, ((0, pad_rows), (0, pad_t)))
  out = R.token_sum(v2, m2), R.token_mean(v2, m2)
  for a, c in zip(out, base):
    assert np.isfinite(np.asarray(a))
    np.testing.assert_array_equal(bits(a), bits(c))
  np.testing.assert_allclose(float(base[0]), float(np.sum(np.where(m, v, 0), dtype=np.float64)), rtol=1e-4, atol=1e-4)


def test_gradient_flows_through_an_exactly_zero_sum():
  # On-policy GRPO: advantages that cancel give a loss of exactly 0, but not a zero gradient.
  g = jax.grad(lambda x: R.token_sum(x * jnp.array([[1.0, -1.0]]), jnp.ones((1, 2), bool)))(jnp.array([[2.0, 2.0]]))
  np.testing.assert_array_equal(g, [[1.0, -1.0]])
