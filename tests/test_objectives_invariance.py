"""Bit-level invariance of loss, metrics and gradients: micro-batching, padding, devices.

Comparisons are on the bits (float32 viewed as uint32), never ``allclose``.
COMPOSITE runs every transform at once (one compiled program covers them all);
LIGHT, with every kind of reduction but fewer metrics, serves the tests that
compile many programs (devices, shard_map, properties).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_llm import objectives as O

B, T, N = 16, 12, 4


def composite(mode="prompt_mean", **kw):
  # Transform-level quantiles off (the common ratio quantiles stay on): a smaller program.
  q = dict(quantiles=())
  return O.chain(
      O.staleness_filter(0.4, 2.5, max_lag=3),
      O.masked_is(0.2, 5.0, level="geometric"),
      O.truncated_is(2.0),
      O.segment_is(4, cap=3.0),
      O.ppo_clip(eps_low=0.2, eps_high=0.28, **q),
      O.dual_clip(3.0, **q),
      O.cispo(0.5, **q),
      O.gspo(**q),
      O.decoupled(**q),
      O.geppo_adaptive(**q),
      O.entropy_bonus(0.01),
      O.kl_loss(0.05, "k2"),
      O.sft_loss(0.1),
      O.critic_warmup(0),
      O.value_loss(0.5, 0.2),
      O.aggregate(mode, **kw),
  )


COMPOSITE = composite()
# Lighter, for the many-program tests: still every kind of reduction (row sums and
# counts, min / max, quantiles of tokens and of sequences, ESS, group sums, segment
# sums, filters, sequence ratios) but fewer metrics, so each compiled program is small.
LIGHT = O.chain(O.staleness_filter(0.4, 2.5, max_lag=3), O.segment_is(3, cap=3.0), O.gspo(),
                O.aggregate("prompt_mean"))
LIGHT_KEYS = ("mask_bt", "advantages_bt", "behaviour_logp_bt", "prox_logp_bt", "lag_bt")
FLOAT_FIELDS = ("advantages_bt", "behaviour_logp_bt", "prox_logp_bt", "ref_logp_bt",
                "entropy_bt", "values_bt", "old_values_bt", "returns_bt")


def make_batch(seed, b=B, t=T):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(0, t + 1, b)
  lengths[0] = t
  mask = np.arange(t)[None, :] < lengths[:, None]
  mask &= rng.random((b, t)) < 0.9  # holes (e.g. tool-output tokens)
  x = rng.normal(-1.5, 0.6, (b, t))
  mu = x + rng.normal(0, 0.3, (b, t))
  fields = dict(
      mask_bt=mask,
      advantages_bt=np.repeat(rng.normal(0, 1, (b, 1)), t, 1) + rng.normal(0, 0.1, (b, t)),
      behaviour_logp_bt=mu,
      prox_logp_bt=mu + rng.normal(0, 0.2, (b, t)),
      ref_logp_bt=x + rng.normal(0, 0.2, (b, t)),
      entropy_bt=rng.exponential(1.0, (b, t)),
      values_bt=rng.normal(0, 1, (b, t)),
      old_values_bt=rng.normal(0, 1, (b, t)),
      returns_bt=rng.normal(0, 1, (b, t)),
      lag_bt=rng.integers(0, 5, (b, t)).astype(np.int32),
      sft_mask_bt=rng.random((b, t)) < 0.2,
  )
  out = {k: (v.astype(np.float32) if k in FLOAT_FIELDS else v) for k, v in fields.items()}
  return x.astype(np.float32), out


def bits(tree):
  return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32).view(np.uint32), tree)


def assert_same_bits(a, b):
  ba, bb = bits(a), bits(b)
  assert jax.tree_util.tree_structure(ba) == jax.tree_util.tree_structure(bb)
  for path, (x, y) in zip(jax.tree_util.tree_flatten_with_path(ba)[0],
                          zip(jax.tree_util.tree_leaves(ba), jax.tree_util.tree_leaves(bb))):
    np.testing.assert_array_equal(x, y, err_msg=str(path[0]))


ONE_DEVICE = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("data",)), P("data"))


@functools.lru_cache(maxsize=None)
def _loss_and_grad(objective, group_size, with_metrics=True):
  def f(x, fields):
    partials, _ = O.per_example_partials(objective, x, state=objective.init(None),
                                         group_size=group_size, **fields)
    loss, metrics = O.finalize(partials)
    if not with_metrics:
      metrics = {}
      partials = (partials.loss_num_b, partials.loss_den_b)
    return loss, (metrics, partials)

  return jax.jit(jax.value_and_grad(f, has_aux=True))


def loss_and_grad(x, fields, objective=COMPOSITE, group_size=N, with_metrics=True):
  """(loss, metrics, grad, partials); unsharded inputs go to one device (the p=1 layout)."""
  if not isinstance(x, jax.Array):
    x = jax.device_put(x, ONE_DEVICE)
    fields = {k: jax.device_put(v, ONE_DEVICE) for k, v in fields.items()}
  (loss, (metrics, partials)), grad = _loss_and_grad(objective, group_size, with_metrics)(
      x, fields)
  return loss, metrics, grad, partials


_finalize = jax.jit(O.finalize)


@functools.lru_cache(maxsize=None)
def _partials(objective, group_size):
  return jax.jit(lambda x, fields: O.per_example_partials(
      objective, x, state=objective.init(None), group_size=group_size, **fields)[0])


@functools.lru_cache(maxsize=None)
def _micro(objective, group_size):
  """A micro-batch's partials and its gradient share of the whole-batch loss."""
  def f(x, fields, normaliser):
    partials, _ = O.per_example_partials(objective, x, state=objective.init(None),
                                         group_size=group_size, **fields)
    return O.micro_batch_loss(partials, normaliser), partials

  return jax.jit(jax.grad(f, has_aux=True))


def rows(fields, lo, hi):
  return {k: v[lo:hi] for k, v in fields.items()}


# ----------------------------------------------------------------------------- micro-batching


def test_micro_batches_give_the_bits_of_the_whole_batch():
  x, fields = make_batch(0)
  loss, metrics, grad, whole = loss_and_grad(x, fields)
  assert metrics["masked_share"] > 0 and metrics["tokens"] > 0  # the filters did act
  # 4 micro-batches (one prompt each): gradients of their loss shares with the whole-batch
  # normaliser (gradient accumulation), and partials concatenated in global row order.
  normaliser = O.loss_normaliser(whole)
  grads, parts = zip(*[_micro(COMPOSITE, N)(x[i:i + 4], rows(fields, i, i + 4), normaliser)
                       for i in range(0, B, 4)])
  merged = O.concat_partials(parts)
  assert_same_bits(merged, whole)
  assert_same_bits(_finalize(merged), (loss, metrics))
  assert_same_bits(np.concatenate(grads), grad)


def test_micro_batches_of_different_lengths_concatenate():
  x, fields = make_batch(1)
  fields = {k: fields[k] for k in LIGHT_KEYS}
  # The second micro-batch has no token past column 6 and is trimmed to 6 columns; the
  # padding that concat_partials adds back is neutral.
  fields["mask_bt"] = fields["mask_bt"].copy()
  fields["mask_bt"][8:, 6:] = False
  loss, metrics, _, _ = loss_and_grad(x, fields, LIGHT, 2)
  part = _partials(LIGHT, 2)
  a = part(x[:8], rows(fields, 0, 8))
  b = part(x[8:, :6], {k: v[8:, :6] for k, v in fields.items()})
  assert_same_bits(_finalize(O.concat_partials([a, b])), (loss, metrics))


# ----------------------------------------------------------------------------- padding


def pad(x, fields, extra_rows, extra_cols, junk=np.nan):
  def p(v, fill):
    return np.pad(v, ((0, extra_rows), (0, extra_cols)), constant_values=fill)

  out = {}
  for k, v in fields.items():
    if v.dtype == bool:
      out[k] = p(v, False)
    elif k == "lag_bt":
      out[k] = p(v, 10 ** 6)
    else:
      out[k] = p(v, junk)
  return p(x, junk), out


@pytest.mark.parametrize("junk", [np.nan, np.inf])
def test_padding_rows_and_trailing_tokens_change_no_bit(junk):
  # Every transform's loss and gradient (the metrics' padding invariance is covered by
  # the property test below, with the lighter objective).
  x, fields = make_batch(2)
  loss, _, grad, _ = loss_and_grad(x, fields, with_metrics=False)
  xp, fp = pad(x, fields, N, 5, junk)  # one whole padding prompt, five masked columns
  loss_p, _, grad_p, _ = loss_and_grad(xp, fp, with_metrics=False)
  assert_same_bits(loss_p, loss)
  assert_same_bits(grad_p[:B, :T], grad)
  assert np.all(np.asarray(grad_p)[B:] == 0) and np.all(np.asarray(grad_p)[:, T:] == 0)


AGG_OBJECTIVES = {mode: O.chain(O.ppo_clip(), O.kl_loss(0.1), O.aggregate(
    mode, **({"constant": 32.0} if mode == "seq_sum_norm" else {}))) for mode in O.AGGREGATIONS}
AGG_KEYS = ("mask_bt", "advantages_bt", "behaviour_logp_bt", "ref_logp_bt")


@jax.jit
def _all_aggregations(x, fields):
  """Loss, gradient and loss partials of every aggregation mode (one program)."""
  out = {}
  for mode, obj in AGG_OBJECTIVES.items():
    def f(x):
      partials, _ = O.per_example_partials(obj, x, state=obj.init(None), group_size=N, **fields)
      return O.finalize(partials)[0], (partials.loss_num_b, partials.loss_den_b)
    (loss, parts), grad = jax.value_and_grad(f, has_aux=True)(x)
    out[mode] = (loss, grad, parts)
  return out


def test_every_aggregation_is_padding_and_split_invariant():
  x, fields = make_batch(3)
  fields = {k: fields[k] for k in AGG_KEYS}
  whole = _all_aggregations(x, fields)
  padded = _all_aggregations(*pad(x, fields, N, 3))
  halves = [_all_aggregations(x[i:i + 8], rows(fields, i, i + 8)) for i in (0, 8)]
  for mode in O.AGGREGATIONS:
    loss, grad, (num, den) = whole[mode]
    assert float(loss) != 0.0 and np.any(np.asarray(grad) != 0), mode
    loss_p, grad_p, _ = padded[mode]
    assert_same_bits(loss_p, loss)
    assert_same_bits(np.asarray(grad_p)[:B, :T], grad)
    num_h = np.concatenate([h[mode][2][0] for h in halves])
    den_h = np.concatenate([h[mode][2][1] for h in halves])
    assert_same_bits((num_h, den_h), (num, den))
    assert_same_bits(O.finalize(O.Partials(num_h, den_h, {}))[0], loss)


# ----------------------------------------------------------------------------- devices


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_sharded_batch_gives_the_same_bits(p):
  assert len(jax.devices()) >= 8, "conftest should provide 8 CPU devices"
  x, fields = make_batch(4)
  fields = {k: fields[k] for k in LIGHT_KEYS}
  loss, metrics, grad, _ = loss_and_grad(x, fields, LIGHT, 2)  # one device
  mesh = Mesh(np.array(jax.devices()[:p]), ("data",))
  sharding = NamedSharding(mesh, P("data"))
  xs = jax.device_put(x, sharding)
  fs = {k: jax.device_put(v, sharding) for k, v in fields.items()}
  loss_s, metrics_s, grad_s, _ = loss_and_grad(xs, fs, LIGHT, 2)
  assert metrics["masked_share"] > 0 and metrics["gspo/seq_ratio_p50"] > 0
  assert grad_s.sharding.is_equivalent_to(sharding, 2)
  assert_same_bits((loss_s, metrics_s, grad_s), (loss, metrics, grad))


def test_shard_map_with_axis_name_gives_the_same_bits():
  x, fields = make_batch(5)
  fields = {k: fields[k] for k in LIGHT_KEYS}
  loss, metrics, grad, _ = loss_and_grad(x, fields, LIGHT, 2)
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

  def local(x, fields):
    def f(x):
      return O.objective_loss(LIGHT, x, state=LIGHT.init(None), group_size=2,
                              axis_name="data", **fields)
    (loss, (metrics, _)), g = jax.value_and_grad(f, has_aux=True)(x)
    return loss, metrics, g

  sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")),
                                  out_specs=(P(), P(), P("data"))))
  loss_s, metrics_s, grad_s = sharded(x, fields)
  assert_same_bits((loss_s, metrics_s, grad_s), (loss, metrics, grad))


# ----------------------------------------------------------------------------- properties

@st.composite
def batches(draw):
  groups, t = draw(st.sampled_from([(1, 5), (3, 2)]))
  b = 2 * groups
  seed = draw(st.integers(0, 2 ** 16))
  x, fields = make_batch(seed, b, t)
  fields = {k: fields[k] for k in LIGHT_KEYS}
  mask = np.array(draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))).reshape(b, t)
  dead_rows = np.array(draw(st.lists(st.booleans(), min_size=b, max_size=b)))
  mask[dead_rows] = False
  fields["mask_bt"] = mask
  return x, fields


def _finite(tree):
  return all(np.all(np.isfinite(np.asarray(v))) for v in jax.tree_util.tree_leaves(tree))


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(batches(), st.sampled_from([np.nan, np.inf, -1e30]))
def test_property_masked_entries_and_padding_are_inert(batch, junk):
  x, fields = batch
  loss, metrics, grad, _ = loss_and_grad(x, fields, LIGHT, 2)
  assert _finite((loss, metrics, grad))
  mask = fields["mask_bt"]
  assert np.all(np.asarray(grad)[~mask] == 0)
  # Junk in every masked entry (including fully masked rows) changes no bit.
  xj = np.where(mask, x, np.float32(junk))
  fj = {k: (v if v.dtype == bool else
            np.where(mask, v, np.int32(10 ** 6)) if k == "lag_bt" else
            np.where(mask, v, np.float32(junk))) for k, v in fields.items()}
  assert_same_bits(loss_and_grad(xj, fj, LIGHT, 2)[:3], (loss, metrics, grad))
  # Padding to a fixed (8, 7): whole extra prompts of masked rows, trailing masked tokens.
  xp, fp = pad(x, fields, 8 - x.shape[0], 7 - x.shape[1], junk)
  loss_p, metrics_p, grad_p, _ = loss_and_grad(xp, fp, LIGHT, 2)
  assert_same_bits((loss_p, metrics_p), (loss, metrics))
  assert_same_bits(np.asarray(grad_p)[: x.shape[0], : x.shape[1]], grad)
  if float(metrics["tokens"]) == 0:  # nothing given, or every token filtered out
    assert float(loss) == 0.0 and float(metrics["all_masked"]) == 1.0
    assert np.all(np.asarray(grad) == 0)
  else:
    assert float(metrics["all_masked"]) == 0.0
  if not mask.any():
    assert all(float(v) == 0.0 for k, v in metrics.items() if k != "all_masked")
