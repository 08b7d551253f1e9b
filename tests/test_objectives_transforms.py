"""Objective transforms: hand-computed values, gradients, construction errors, state."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import objectives as O
from jaxrl_llm.objectives import stats as S

LOG = math.log


SHAPE = (4, 8)  # every hand test is padded to one shape so compiled programs are reused


def _pad(a, fill):
  a = np.asarray(a)
  out = np.full(SHAPE, fill, a.dtype)
  out[: a.shape[0], : a.shape[1]] = a
  return out


@functools.lru_cache(maxsize=None)
def _evaluator(objective, names, statics, wrt, want):
  def f(x, diff, state, fields):
    fields = dict(zip(names, fields))
    if wrt != "logp_bt":
      fields[wrt] = diff
    loss, (metrics, state) = O.objective_loss(objective, x, state=state, **fields,
                                              **dict(statics))
    # Only the metrics a test reads are returned (the rest is dead code for XLA),
    # which keeps each compiled program small.
    kept = {k: v for k, v in metrics.items()
            if any(k == w or (w.endswith("/") and k.startswith(w)) for w in want)}
    return loss, (kept, state)

  return jax.jit(jax.value_and_grad(f, argnums=1 if wrt != "logp_bt" else 0, has_aux=True))


def run(objective, logp, wrt="logp_bt", want=(), **fields):
  """Loss, metrics and d loss / d ``wrt`` (logp_bt by default) of ``objective``.

  ``want``: metric names, or prefixes ending in "/", to return.

  Arrays are padded with masked entries (NaN values) to SHAPE, which must not
  change any result; the gradient is cropped back.
  """
  state = fields.pop("state", None)
  state = objective.init(None) if state is None else state
  statics = tuple(sorted((k, fields.pop(k)) for k in ("group_size", "quantiles") if k in fields))
  shape = np.shape(logp)
  padded = {}
  for k, v in fields.items():
    if k.endswith("mask_bt"):
      padded[k] = _pad(np.asarray(v, bool), False)
    elif k == "lag_bt":
      padded[k] = _pad(np.asarray(v, np.int32), 99)
    else:
      padded[k] = _pad(np.asarray(v, np.float32), np.nan)
  x = jnp.asarray(_pad(np.asarray(logp, np.float32), np.nan))
  names = tuple(sorted(k for k in padded if k != wrt))
  diff = jnp.asarray(padded[wrt]) if wrt != "logp_bt" else x
  f = _evaluator(objective, names, statics, wrt, tuple(want))
  (loss, (metrics, new_state)), grad = f(x, diff, state, tuple(padded[k] for k in names))
  grad = np.asarray(grad)
  assert np.all(grad[shape[0]:] == 0) and np.all(grad[:, shape[1]:] == 0)
  return (float(loss), {k: float(v) for k, v in metrics.items()},
          grad[: shape[0], : shape[1]], new_state)


def run_w(want, objective, logp, **fields):
  """:func:`run` returning the metrics named (or prefixed) in ``want``."""
  return run(objective, logp, want=want, **fields)


def record_after(transforms, logp, **fields):
  """[(mask_bt, weights_bt)] after each transform applied alone to a fresh record.

  One compiled program for all ``transforms``; inputs padded to SHAPE, outputs cropped.
  """
  shape = np.shape(logp)
  padded = {k: _pad(np.asarray(v, bool), False) if k == "mask_bt" else
               _pad(np.asarray(v, np.int32), 99) if k == "lag_bt" else
               _pad(np.asarray(v, np.float32), np.nan) for k, v in fields.items()}

  @jax.jit
  def f(x, fields):
    out = []
    for t in transforms:
      rec, _ = t.update(O.make_record(x, **fields), t.init(None))
      out.append((rec.mask_bt, rec.weights_bt))
    return out

  results = []
  for mask, weights in f(_pad(np.asarray(logp, np.float32), np.nan), padded):
    mask, weights = np.asarray(mask), np.asarray(weights)
    assert not mask[shape[0]:].any() and not mask[:, shape[1]:].any()
    assert np.all(weights[shape[0]:] == 0) and np.all(weights[:, shape[1]:] == 0)
    results.append((mask[: shape[0], : shape[1]], weights[: shape[0], : shape[1]]))
  return results


PPO = O.chain(O.ppo_clip(0.2), O.aggregate("token_mean"))
DAPO = O.recipes.dapo()
DECOUPLED = O.recipes.decoupled_ppo(0.2)
GEPPO = O.recipes.geppo(0.2)


def ratio_inputs(ratios, adv, base=-1.0):
  """logp / prox arrays [1, n] with exp(logp - prox) = ratios."""
  x = np.full((1, len(ratios)), base, np.float64)
  p = x - np.log(np.asarray(ratios, np.float64))[None]
  return x.astype(np.float32), p.astype(np.float32), np.asarray([adv], np.float32)


# ----------------------------------------------------------------------------- PPO family


def test_ppo_clip_hand_values_and_gradient():
  # r = [1.5, 0.5, 1.1, 0.9] with A = [1, -1, 2, -2], eps = 0.2:
  # objectives min(rA, clip(r)A) = [1.2, -0.8, 2.2, -1.8]; token-mean loss = -(0.4)/4.
  x, p, a = ratio_inputs([1.5, 0.5, 1.1, 0.9], [1.0, -1.0, 2.0, -2.0])
  mask = np.ones_like(x, bool)
  want = ("ppo_clip/", "ratio_max", "ratio_min", "ratio_mean", "ratio_p50")
  # With pi_k given (here equal to mu) the transform reports its own ratio stats ...
  loss, m, g, _ = run_w(want, PPO, x, mask_bt=mask, advantages_bt=a, behaviour_logp_bt=p,
                        prox_logp_bt=p)
  assert loss == pytest.approx(-(1.2 - 0.8 + 2.2 - 1.8) / 4, rel=1e-6)
  # Clipped in the direction of the advantage -> zero gradient; else -A r / N.
  np.testing.assert_allclose(g, [[0.0, 0.0, -2.2 / 4, 1.8 / 4]], rtol=1e-6)
  assert g[0, 0] == 0.0 and g[0, 1] == 0.0
  assert m["ppo_clip/clip_frac_low"] == 0.25 and m["ppo_clip/clip_frac_high"] == 0.25
  assert m["ppo_clip/ratio_max"] == pytest.approx(1.5, rel=1e-6)
  assert m["ppo_clip/ratio_min"] == pytest.approx(0.5, rel=1e-6)
  assert m["ppo_clip/ratio_mean"] == pytest.approx(1.0, rel=1e-6)
  assert m["ppo_clip/ratio_p50"] == pytest.approx(0.9, rel=1e-6)  # sorted: .5 .9 1.1 1.5
  # ... without it, pi_k = mu and they would repeat the common ratio_* metrics.
  loss2, m2, g2, _ = run_w(want, PPO, x, mask_bt=mask, advantages_bt=a, behaviour_logp_bt=p)
  assert loss2 == loss and np.array_equal(g2, g)
  assert "ppo_clip/ratio_mean" not in m2 and "ppo_clip/clip_frac_low" in m2
  for k in ("ratio_max", "ratio_min", "ratio_mean", "ratio_p50"):
    assert m2[k] == m[f"ppo_clip/{k}"]


def test_ppo_gradient_zero_exactly_where_clipped_towards_advantage():
  ratios = np.repeat([0.5, 0.75, 0.85, 1.0, 1.15, 1.25, 1.5, 2.0], 4)
  adv = np.tile([-1.5, -0.5, 0.5, 1.5], 8)
  x, p, a = ratio_inputs(ratios, adv)
  x, p, a = x.reshape(4, 8), p.reshape(4, 8), a.reshape(4, 8)
  _, _, g, _ = run(PPO, x, mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  r = np.exp(x.astype(np.float64) - p).ravel()
  g, adv = g.ravel(), a.ravel()
  clipped = ((adv > 0) & (r > 1.2)) | ((adv < 0) & (r < 0.8))
  assert clipped.sum() == 10 and (~clipped).sum() == 22
  assert np.all(g[clipped] == 0.0)
  assert np.all(g[~clipped] != 0.0)
  np.testing.assert_allclose(g[~clipped], -(adv * r)[~clipped] / 32, rtol=1e-5)


def test_dapo_clip_higher_acts_only_on_positive_advantages():
  # eps_low = 0.2, eps_high = 0.28.
  ratios = [1.25, 1.30, 1.30, 0.75, 0.75, 1.5]
  adv = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
  x, p, a = ratio_inputs(ratios, adv)
  loss, m, g, _ = run_w(("ppo_clip/",), DAPO, x, mask_bt=np.ones_like(x, bool), advantages_bt=a,
                      behaviour_logp_bt=p)
  n = 6
  expected_grad = [-1.25 / n,  # A > 0, r < 1.28: live
                   0.0,        # A > 0, r > 1.28: clipped by the raised upper bound
                   1.30 / n,   # A < 0, r > 1.28: upper bound does not bind
                   0.0,        # A < 0, r < 0.8: lower bound binds
                   -0.75 / n,  # A > 0, r < 0.8: lower bound does not bind
                   1.5 / n]    # A < 0, r = 1.5: still live (no upper clip for A < 0)
  np.testing.assert_allclose(g[0], expected_grad, rtol=1e-5, atol=1e-8)
  objs = [1.25, 1.28, -1.30, -0.8, 0.75, -1.5]
  assert loss == pytest.approx(-sum(objs) / n, rel=1e-5)
  assert m["ppo_clip/clip_frac_high"] == pytest.approx(1 / 6)
  assert m["ppo_clip/clip_frac_low"] == pytest.approx(1 / 6)
  # The same inputs with symmetric eps = 0.2 clip the first token too.
  _, _, g_sym, _ = run(PPO, x,
                       mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  assert g_sym[0, 0] == 0.0 and g[0, 0] != 0.0


def test_dual_clip_bounds_negative_advantages():
  # r = [4, 2, 4], A = [-1, -1, 1], c = 3, eps = 0.2:
  # t0: min(-4, -1.2) = -4 -> max(-4, -3) = -3 (dual active, zero grad)
  # t1: min(-2, -1.2) = -2 -> -2 (live, grad -A r / N = 2/3)
  # t2: A > 0: min(4, 1.2) = 1.2 (clipped high, zero grad)
  x, p, a = ratio_inputs([4.0, 2.0, 4.0], [-1.0, -1.0, 1.0])
  obj = O.chain(O.dual_clip(3.0, 0.2), O.aggregate("token_mean"))
  loss, m, g, _ = run_w(("dual_clip/",), obj, x,
                      mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  assert loss == pytest.approx(-(-3.0 - 2.0 + 1.2) / 3, rel=1e-6)
  np.testing.assert_allclose(g[0], [0.0, 2.0 / 3, 0.0], rtol=1e-6)
  assert m["dual_clip/clip_frac_dual"] == pytest.approx(1 / 3)
  assert m["dual_clip/clip_frac_high"] == pytest.approx(1 / 3)


def test_cispo_value_and_gradient_is_sg_weight_times_advantage():
  # r = [2.0, 0.5, 1.2], A = [1, 1, -1], x = [-1, -2, -0.5], eps_high = 0.5 (cap 1.5),
  # no lower bound: r_hat = [1.5, 0.5, 1.2]; loss_t = -r_hat A x = [-1.5*-1, -0.5*-2, 1.2*-0.5].
  x = np.array([[-1.0, -2.0, -0.5]], np.float32)
  r = np.array([2.0, 0.5, 1.2])
  p = (x - np.log(r)).astype(np.float32)
  a = np.array([[1.0, 1.0, -1.0]], np.float32)
  loss, m, g, _ = run_w(("cispo/",), O.chain(O.cispo(0.5), O.aggregate("token_mean")), x,
                      mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  assert loss == pytest.approx((1.5 + 1.0 - 0.6) / 3, rel=1e-6)
  # grad = -sg(r_hat) * A / N: nonzero even where the weight is clipped.
  np.testing.assert_allclose(g[0], [-1.5 / 3, -0.5 / 3, 1.2 / 3], rtol=1e-6)
  assert m["cispo/clip_frac_high"] == pytest.approx(1 / 3)
  assert m["cispo/clip_frac_low"] == 0.0
  # With a lower bound (eps_low = 0.2) the 0.5 weight is lifted to 0.8.
  _, _, g2, _ = run(O.chain(O.cispo(0.5, eps_low=0.2), O.aggregate("token_mean")), x,
                    mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  np.testing.assert_allclose(g2[0, 1], -0.8 / 3, rtol=1e-6)


def test_gspo_sequence_ratio_and_clip():
  # Row 0: x - p = [0.1, 0.3] -> s = e^0.2, A = 1, clipped at 1 + 4e-4: obj = 1.0004, no grad.
  # Row 1: x = p -> s = 1, A = -1: obj = -1 per token;
  # grad per token = -(-1)(1) / (2 rows * 2 tokens).
  x = np.array([[-1.0, -1.0], [-2.0, -0.5]], np.float32)
  p = np.array([[-1.1, -1.3], [-2.0, -0.5]], np.float32)
  a = np.array([[1.0, 1.0], [-1.0, -1.0]], np.float32)
  loss, m, g, _ = run_w(("gspo/",), O.recipes.gspo(), x, mask_bt=np.ones_like(x, bool),
                        advantages_bt=a,
                      behaviour_logp_bt=p)
  assert loss == pytest.approx((-1.0004 + 1.0) / 2, abs=1e-6)
  np.testing.assert_allclose(g, [[0.0, 0.0], [0.25, 0.25]], rtol=1e-6)
  assert m["gspo/seq_ratio_max"] == pytest.approx(math.exp(0.2), rel=1e-6)
  assert m["gspo/seq_ratio_min"] == pytest.approx(1.0)
  assert m["gspo/clip_frac_high"] == 0.5


def test_decoupled_weights_by_prox_over_behaviour():
  # rho_k = pi_k/mu = [2, 0.5]; r = pi/pi_k = [1.1, 1.5]; A = 1, eps = 0.2:
  # loss = -(2 * 1.1 + 0.5 * 1.2) / 2; grad = [-2 * 1.1 / 2, 0].
  x = np.array([[-1.0, -1.0]], np.float32)
  prox = (x - np.log([1.1, 1.5])).astype(np.float32)
  mu = (prox - np.log([2.0, 0.5])).astype(np.float32)
  a = np.ones_like(x)
  loss, m, g, _ = run_w(("decoupled/", "ess"), DECOUPLED, x, mask_bt=np.ones_like(x, bool),
                      advantages_bt=a, behaviour_logp_bt=mu, prox_logp_bt=prox)
  assert loss == pytest.approx(-(2 * 1.1 + 0.5 * 1.2) / 2, rel=1e-6)
  np.testing.assert_allclose(g[0], [-2 * 1.1 / 2, 0.0], rtol=1e-6, atol=1e-9)
  assert m["decoupled/prox_weight_max"] == pytest.approx(2.0, rel=1e-6)
  assert m["decoupled/prox_weight_ess"] == pytest.approx(2.5 ** 2 / 4.25 / 2, rel=1e-6)
  assert m["ess"] == pytest.approx(2.5 ** 2 / 4.25 / 2, rel=1e-6)


def test_geppo_clip_window_centred_on_rho_k():
  # rho_k = [2, 2, 0.5], rho_new = [2.1, 2.5, 0.2], A = [1, 1, -1], eps = 0.2:
  # windows [1.8, 2.2], [1.8, 2.2], [0.3, 0.7]
  # objs: 2.1 (live), 2.2 (clipped high), min(-0.2, -0.3) = -0.3 (clipped low).
  mu = np.array([[-1.0, -1.0, -1.0]], np.float32)
  prox = (mu + np.log([2.0, 2.0, 0.5])).astype(np.float32)
  x = (mu + np.log([2.1, 2.5, 0.2])).astype(np.float32)
  a = np.array([[1.0, 1.0, -1.0]], np.float32)
  loss, m, g, _ = run_w(("geppo_adaptive/",), GEPPO, x, mask_bt=np.ones_like(x, bool),
                        advantages_bt=a,
                      behaviour_logp_bt=mu, prox_logp_bt=prox)
  assert loss == pytest.approx(-(2.1 + 2.2 - 0.3) / 3, rel=1e-6)
  np.testing.assert_allclose(g[0], [-2.1 / 3, 0.0, 0.0], rtol=1e-5, atol=1e-9)
  assert m["geppo_adaptive/clip_frac_high"] == pytest.approx(1 / 3)
  assert m["geppo_adaptive/clip_frac_low"] == pytest.approx(1 / 3)
  assert m["geppo_adaptive/centre_mean"] == pytest.approx(1.5, rel=1e-6)
  tv = 0.5 * (abs(2.1 / 2 - 1) + abs(2.5 / 2 - 1) + abs(0.2 / 0.5 - 1)) / 3
  assert m["geppo_adaptive/tv_drift"] == pytest.approx(tv, rel=1e-5)


def test_on_policy_decoupled_and_geppo_equal_ppo():
  rng = np.random.default_rng(2)
  x = rng.normal(-1, 0.3, (4, 6)).astype(np.float32)
  mu = (x + rng.normal(0, 0.3, x.shape)).astype(np.float32)
  a = rng.normal(size=x.shape).astype(np.float32)
  mask = rng.random(x.shape) < 0.8
  kw = dict(mask_bt=mask, advantages_bt=a, behaviour_logp_bt=mu)
  ref, _, g_ref, _ = run(PPO, x, **kw)
  for obj in (DECOUPLED, GEPPO):
    loss, _, g, _ = run(obj, x, **kw)
    assert loss == pytest.approx(ref, rel=1e-6)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5, atol=1e-8)


# ------------------------------------------------------------------------- IS weights and filters


def _is_fields(rho, shape=None):
  rho = np.asarray(rho, np.float64)
  mu = np.full(rho.shape, -1.0)
  prox = mu + np.log(rho)
  return dict(mask_bt=np.ones(rho.shape, bool), advantages_bt=np.ones(rho.shape, np.float32),
              behaviour_logp_bt=mu.astype(np.float32), prox_logp_bt=prox.astype(np.float32))


def test_truncated_is_token_sequence_geometric():
  f = _is_fields([[2.0, 0.5, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [1e30, 1e30, 1e30, 1e30]])
  (_, w_tok), (_, w_seq), (_, w_geo) = record_after(
      [O.truncated_is(1.5), O.truncated_is(3.0, level="sequence"),
       O.truncated_is(3.0, level="geometric")], f["prox_logp_bt"], **f)
  np.testing.assert_allclose(w_tok[:2], [[1.5, 0.5, 1, 1], [1.5, 1.5, 1, 1]], rtol=1e-6)
  np.testing.assert_allclose(w_seq[:2], [[1.0] * 4, [3.0] * 4], rtol=1e-6)
  np.testing.assert_allclose(w_geo[:2], [[1.0] * 4, [2 ** 0.5] * 4], rtol=1e-6)  # (2*2*1*1)^(1/4)
  # Huge ratios / sequence products (e^276) do not overflow: the weight is exactly the cap.
  assert np.all(w_tok[2] == np.float32(1.5)) and np.all(w_seq[2] == np.float32(3.0))
  assert np.all(w_geo[2] == np.float32(3.0))


def test_truncated_is_feeds_the_policy_term_and_ess():
  # weights [1.5, 0.5] on a PPO term with r = 1 and A = 1: loss = -(1.5 + 0.5) / 2.
  f = _is_fields([[2.0, 0.5]])
  obj = O.chain(O.truncated_is(1.5), O.ppo_clip(), O.aggregate("token_mean"))
  loss, m, g, _ = run_w(("truncated_is/", "ess"), obj,
                      f["prox_logp_bt"], **f)
  assert loss == pytest.approx(-1.0, rel=1e-6)
  np.testing.assert_allclose(g[0], [-0.75, -0.25], rtol=1e-6)
  assert m["truncated_is/truncated_share"] == 0.5
  assert m["truncated_is/ess"] == pytest.approx(4.0 / 2.5 / 2, rel=1e-6)
  assert m["ess"] == pytest.approx(4.0 / 2.5 / 2, rel=1e-6)


def test_masked_is_token_and_sequence():
  f = _is_fields([[0.4, 1.0, 2.5, 2.0], [1.5, 1.5, 1.0, 1.0]])
  x = f["prox_logp_bt"]
  (mask, w), (mask_seq, _) = record_after(
      [O.masked_is(0.5, 2.0), O.masked_is(0.5, 2.1, level="sequence")], x, **f)
  np.testing.assert_array_equal(mask, [[False, True, False, True], [True] * 4])
  np.testing.assert_array_equal(w, [[0, 1, 0, 1], [1, 1, 1, 1]])
  # Sequence level: row products 2.0 (kept) and 2.25 (dropped).
  np.testing.assert_array_equal(mask_seq, [[True] * 4, [False] * 4])
  obj = O.chain(O.masked_is(0.5, 2.0), O.ppo_clip(), O.aggregate("token_mean"))
  _, m, _, _ = run_w(("masked_is/", "masked_share", "tokens"), obj, x,
                   **f)
  assert m["masked_is/masked_share"] == 0.25 and m["masked_share"] == 0.25
  assert m["tokens"] == 6.0


def test_staleness_filter_ratio_and_lag():
  f = _is_fields([[0.7, 1.0, 1.0, 1.3], [1.0, 1.0, 1.0, 1.0]])
  lag = np.array([[0, 3, 2, 0], [0, 0, 3, 0]], np.int32)
  x = f["prox_logp_bt"]
  (mask, _), (mask_seq, _) = record_after(
      [O.staleness_filter(0.8, 1.25, max_lag=2),
       O.staleness_filter(None, None, max_lag=2, level="sequence")], x, lag_bt=lag, **f)
  np.testing.assert_array_equal(mask, [[False, False, True, False], [True, True, False, True]])
  np.testing.assert_array_equal(mask_seq, [[False] * 4, [False] * 4])
  _, m, _, _ = run_w(("staleness_filter/",),
                     O.chain(O.staleness_filter(0.8, 1.25, max_lag=2), O.ppo_clip(),
                           O.aggregate("token_mean")), x, lag_bt=lag, **f)
  assert m["staleness_filter/stale_share"] == 0.25
  assert m["staleness_filter/ratio_out_share"] == 0.25
  assert m["staleness_filter/masked_share"] == 0.5
  with pytest.raises(ValueError, match="lag_bt"):
    record_after([O.staleness_filter(max_lag=1)], x, **f)


def test_segment_is_products_over_masked_segments():
  # mask [T, T, F, T, T, T]; masked tokens 0..4 form segments {0,1}, {2,3}, {4} (L = 2).
  rho = np.array([[2.0, 1.5, 9.0, 0.5, 2.0, 4.0]])
  f = _is_fields(rho)
  f["mask_bt"] = np.array([[True, True, False, True, True, True]])
  results = record_after([O.segment_is(2), O.segment_is(2, cap=3.5), O.segment_is(1),
                          O.segment_is(8)], f["prox_logp_bt"], **f)
  (_, w2), (_, w2c), (_, w1), (_, w8) = results
  np.testing.assert_allclose(w2, [[3.0, 3.0, 0.0, 1.0, 1.0, 4.0]], rtol=1e-6)
  np.testing.assert_allclose(w2c, [[3.0, 3.0, 0.0, 1.0, 1.0, 3.5]], rtol=1e-6)
  # L = 1 is token-level IS; L >= T the full sequence product.
  np.testing.assert_allclose(w1, [[2.0, 1.5, 0.0, 0.5, 2.0, 4.0]], rtol=1e-6)
  np.testing.assert_allclose(w8, [[12.0, 12.0, 0.0, 12.0, 12.0, 12.0]], rtol=1e-5)


# ----------------------------------------------------------------------------- additive terms


def test_entropy_bonus():
  x = np.array([[-1.0, -2.0]], np.float32)
  fields = dict(mask_bt=np.ones((1, 2), bool), advantages_bt=np.zeros((1, 2), np.float32),
                behaviour_logp_bt=x)
  obj = O.chain(O.entropy_bonus(0.1), O.aggregate("token_mean"))
  loss, m, g, _ = run_w(("entropy_bonus/",), obj, x, wrt="entropy_bt", entropy_bt=[[1.0, 2.0]],
                        **fields)
  assert loss == pytest.approx(-0.15, rel=1e-6)
  np.testing.assert_allclose(g, [[-0.05, -0.05]], rtol=1e-6)
  assert m["entropy_bonus/entropy_mean"] == 1.5
  with pytest.raises(ValueError, match="entropy_bt"):
    O.objective_loss(obj, x, state=obj.init(None), **fields)


@pytest.mark.parametrize("estimator,value,grad", [
    ("k1", -LOG(2), 1.0),
    ("k2", 0.5 * LOG(2) ** 2, -LOG(2)),
    ("k3", 1.0 - LOG(2), -1.0),
])
def test_kl_loss_estimators(estimator, value, grad):
  # d = log pi_ref - log pi_theta = log 2.
  x = np.array([[-1.0]], np.float32)
  ref = (x + LOG(2)).astype(np.float32)
  obj = O.chain(O.kl_loss(1.0, estimator), O.aggregate("token_mean"))
  loss, m, g, _ = run_w(("kl_loss/",), obj, x,
                      mask_bt=np.ones((1, 1), bool), advantages_bt=np.zeros((1, 1), np.float32),
                      behaviour_logp_bt=x, ref_logp_bt=ref)
  assert loss == pytest.approx(value, rel=1e-5)
  assert g[0, 0] == pytest.approx(grad, rel=1e-5)
  assert m["kl_loss/kl_mean"] == pytest.approx(value, rel=1e-5)
  if estimator != "k1":
    assert m["kl_loss/k1_mean"] == pytest.approx(-LOG(2), rel=1e-5)
  if estimator != "k3":
    assert m["kl_loss/k3_mean"] == pytest.approx(1.0 - LOG(2), rel=1e-5)
  assert f"kl_loss/{estimator}_mean" not in m


def test_sft_loss_on_marked_tokens():
  x = np.array([[-1.0, -2.0]], np.float32)
  loss, m, g, _ = run_w(("sft_loss/",), O.chain(O.sft_loss(0.5), O.aggregate("token_mean")), x,
                      mask_bt=np.ones((1, 2), bool), advantages_bt=np.zeros((1, 2), np.float32),
                      behaviour_logp_bt=x, sft_mask_bt=np.array([[True, False]]))
  assert loss == pytest.approx(0.25, rel=1e-6)
  np.testing.assert_allclose(g, [[-0.25, 0.0]], rtol=1e-6)
  assert m["sft_loss/nll_mean"] == 1.0 and m["sft_loss/token_share"] == 0.5


def test_value_loss_clipped():
  # (V, V_old, R): (1.5, 1.0, 2.0): err .25, clipped V 1.2 -> .64 (max, zero grad)
  #                (1.1, 1.0, 2.0): both .81 -> grad (V - R) = -0.9
  #                (0.5, 1.0, 0.0): err .25, clipped V 0.8 -> .64 (max, zero grad)
  x = np.zeros((1, 3), np.float32)
  fields = dict(mask_bt=np.ones((1, 3), bool), advantages_bt=x, behaviour_logp_bt=x,
                values_bt=[[1.5, 1.1, 0.5]], old_values_bt=[[1.0, 1.0, 1.0]],
                returns_bt=[[2.0, 2.0, 0.0]])
  obj = O.chain(O.value_loss(1.0, 0.2), O.aggregate("token_mean"))
  loss, m, g, _ = run_w(("value_loss/",), obj, x, wrt="values_bt", **fields)
  assert loss == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3, rel=1e-5)
  np.testing.assert_allclose(g, [[0.0, -0.9 / 3, 0.0]], rtol=1e-5, atol=1e-9)
  assert m["value_loss/clip_frac"] == pytest.approx(2 / 3)
  assert m["value_loss/loss_mean"] == pytest.approx(0.5 * (0.64 + 0.81 + 0.64) / 3, rel=1e-5)
  unclipped = O.chain(O.value_loss(1.0, None), O.aggregate("token_mean"))
  loss_u, _, g_u, _ = run(unclipped, x, wrt="values_bt", **fields)
  assert loss_u == pytest.approx(0.5 * (0.25 + 0.81 + 0.25) / 3, rel=1e-5)
  np.testing.assert_allclose(g_u, [[-0.5 / 3, -0.9 / 3, 0.5 / 3]], rtol=1e-5)


def test_critic_warmup_freezes_policy_terms_then_releases():
  x, p, a = ratio_inputs([1.1, 0.9], [1.0, 1.0])
  v = np.array([[1.0, 1.0]], np.float32)
  fields = dict(mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p,
                values_bt=v, old_values_bt=v, returns_bt=v + 1)
  obj = O.chain(O.ppo_clip(), O.critic_warmup(2), O.value_loss(1.0),
                O.aggregate("token_mean"))
  state = obj.init(None)
  losses, grads = [], []
  for _ in range(3):
    loss, m, g, state = run_w(("critic_warmup/",), obj, x, state=state, **fields)
    losses.append(loss)
    grads.append(g)
  assert losses[0] == pytest.approx(0.5) and losses[1] == pytest.approx(0.5)
  assert np.all(grads[0] == 0.0)
  assert losses[2] == pytest.approx(0.5 - (1.1 + 0.9) / 2, rel=1e-6)
  assert int(state[1].count) == 3
  assert m["critic_warmup/frozen"] == 0.0


def test_custom_transform_composes():
  def double_advantages(record):
    return record.replace(advantages_bt=2.0 * record.advantages_bt)

  x, p, a = ratio_inputs([1.0, 1.0], [1.0, -0.5])
  obj = O.chain(O.stateless(double_advantages), O.ppo_clip(), O.aggregate("seq_mean_token_sum"))
  loss, _, _, _ = run(obj, x, mask_bt=np.ones_like(x, bool), advantages_bt=a,
                      behaviour_logp_bt=p)
  assert loss == pytest.approx(-(2.0 - 1.0), rel=1e-6)


# ----------------------------------------------------------------------------- aggregation


def _surrogate_objective(mode, **kw):
  s = jnp.asarray(_pad(np.array([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0],
                                  [2.0, 2.0, 7.0]], np.float32), 5.0))

  def set_surrogate(record):
    return record.replace(surrogate_bt=jnp.where(record.mask_bt, s, jnp.nan))

  return O.chain(O.stateless(set_surrogate), O.aggregate(mode, **kw))


@pytest.mark.parametrize("mode,kw,expected", [
    ("token_mean", {}, 14 / 6),
    ("seq_mean_token_mean", {}, (2 + 4 + 2) / 3),
    ("seq_mean_token_sum", {}, (6 + 4 + 4) / 3),
    ("seq_sum_norm", {"constant": 4.0}, (6 / 4 + 4 / 4 + 4 / 4) / 3),
    # pooled per prompt: (6 + 4) / (3 + 1) tokens and 4 / 2, then the mean over prompts
    ("prompt_mean", {}, ((6 + 4) / 4 + 4 / 2) / 2),
])
def test_aggregation_modes_hand_values(mode, kw, expected):
  mask = np.array([[1, 1, 1], [1, 0, 0], [0, 0, 0], [1, 1, 0]], bool)
  z = np.zeros((4, 3), np.float32)
  loss, m, _, _ = run_w(("tokens", "sequences", "all_masked"), _surrogate_objective(mode, **kw),
                        z, mask_bt=mask, advantages_bt=z,
                      behaviour_logp_bt=z, group_size=2)
  assert loss == pytest.approx(expected, rel=1e-6)
  assert m["tokens"] == 6.0 and m["sequences"] == 3.0 and m["all_masked"] == 0.0


# ----------------------------------------------------------------------------- metrics


def test_common_metrics_hand_values():
  # ratio pi/mu = [0.5, 1, 2, e] on the mask; the fifth token is padding.
  r = np.array([[0.5, 1.0, 2.0, math.e, 1.0]])
  mu = np.full(r.shape, -1.0, np.float32)
  x = (mu + np.log(r)).astype(np.float32)
  mask = np.array([[True, True, True, True, False]])
  want = ("ratio_mean", "ratio_min", "ratio_max", "ratio_p50", "ratio_p1", "ratio_p99",
          "approx_kl_k1", "approx_kl_k3", "ess", "masked_share", "tokens")
  _, m, _, _ = run_w(want, DAPO, x, mask_bt=mask, advantages_bt=np.ones_like(x),
                   behaviour_logp_bt=mu)
  lr = np.log(r[0, :4])
  assert m["ratio_mean"] == pytest.approx(np.mean(r[0, :4]), rel=1e-6)
  assert m["ratio_min"] == pytest.approx(0.5) and m["ratio_max"] == pytest.approx(math.e)
  assert m["ratio_p50"] == pytest.approx(1.0)  # ceil(0.5 * 4) - 1 = index 1 of [.5, 1, 2, e]
  assert m["ratio_p1"] == pytest.approx(0.5) and m["ratio_p99"] == pytest.approx(math.e)
  assert m["approx_kl_k1"] == pytest.approx(np.mean(-lr), rel=1e-5)
  assert m["approx_kl_k3"] == pytest.approx(np.mean(np.expm1(lr) - lr), rel=1e-5)
  assert m["ess"] == 1.0 and m["masked_share"] == 0.0 and m["tokens"] == 4.0


def test_quantiles_match_numpy_inverted_cdf():
  rng = np.random.default_rng(4)
  for n in (1, 7, 1001):
    v = rng.normal(size=n).astype(np.float32) * 10
    v[: n // 3] = np.round(v[: n // 3])  # duplicates and zeros, incl. -0.0
    v[0] = -0.0
    mask = rng.random(n) < 0.8
    mask[0] = True
    qs = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
    got = np.asarray(O.masked_quantiles(v, mask, qs))
    kept = v[mask].astype(np.float64)
    for q, g in zip(qs, got):
      expected = np.quantile(kept, q, method="inverted_cdf")
      assert g == np.float32(expected), (n, q, g, expected)
  assert np.all(np.asarray(O.masked_quantiles(np.ones(4), np.zeros(4, bool), (0.5,))) == 0)


def test_quantile_names():
  assert S.quantile_name("ratio", 0.5) == "ratio_p50"
  assert S.quantile_name("ratio", 0.01) == "ratio_p1"
  assert S.quantile_name("ratio", 0.999) == "ratio_p99.9"


# ----------------------------------------------------------------------------- state, schedules


def test_schedule_hyperparameter_keeps_count():
  sched = optax.linear_schedule(0.2, 0.1, 10)
  obj = O.chain(O.ppo_clip(sched), O.aggregate("token_mean"))
  state = obj.init(None)
  assert int(state[0].count) == 0
  x, p, a = ratio_inputs([1.5], [1.0])
  fields = dict(mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=p)
  losses = []
  for _ in range(11):
    loss, _, _, state = run(obj, x, state=state, **fields)
    losses.append(loss)
  assert losses[0] == pytest.approx(-1.2, rel=1e-6)
  assert losses[10] == pytest.approx(-1.1, rel=1e-6)
  assert int(state[0].count) == 11


def test_jit_with_state():
  obj = O.chain(O.ppo_clip(optax.constant_schedule(0.2)), O.critic_warmup(1),
                O.aggregate("token_mean"))
  x, p, a = ratio_inputs([1.5, 0.9], [1.0, -1.0])

  @jax.jit
  def step(x, state):
    return O.objective_loss(obj, x, mask_bt=jnp.ones(x.shape, bool), advantages_bt=a,
                            behaviour_logp_bt=p, state=state)

  state = obj.init(None)
  loss0, (_, state) = step(x, state)
  loss1, (_, state) = step(x, state)
  assert float(loss0) == 0.0
  assert float(loss1) == pytest.approx(-(1.2 - 0.9) / 2, rel=1e-6)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("factory,match", [
    (lambda: O.ppo_clip(0.0), "eps"),
    (lambda: O.ppo_clip(eps_high=-0.1), "eps_high"),
    (lambda: O.ppo_clip(eps_low=0.0), "eps_low"),
    (lambda: O.dual_clip(1.0), "c must"),
    (lambda: O.cispo(0.0), "eps_high"),
    (lambda: O.gspo(0.0, 1e-4), "eps_low"),
    (lambda: O.decoupled(-1.0), "eps"),
    (lambda: O.geppo_adaptive(0.0), "eps"),
    (lambda: O.truncated_is(0.0), "cap"),
    (lambda: O.truncated_is(2.0, level="prefix"), "level"),
    (lambda: O.masked_is(2.0, 1.0), "lo must be < hi"),
    (lambda: O.masked_is(1.0, 1.0), "lo must be < hi"),
    (lambda: O.masked_is(-1.0, 1.0), "lo"),
    (lambda: O.staleness_filter(1.3, 0.8), "lo must be < hi"),
    (lambda: O.staleness_filter(max_lag=-1), "max_lag"),
    (lambda: O.staleness_filter(None, None), "nothing to filter"),
    (lambda: O.segment_is(0), "segment_len"),
    (lambda: O.segment_is(4, cap=0.0), "cap"),
    (lambda: O.kl_loss(0.1, "k4"), "estimator"),
    (lambda: O.entropy_bonus(-1.0), "coef"),
    (lambda: O.value_loss(0.5, clip_eps=0.0), "clip_eps"),
    (lambda: O.critic_warmup(-1), "steps"),
    (lambda: O.aggregate("seq_sum_norm"), "constant"),
    (lambda: O.aggregate("seq_sum_norm", constant=0.0), "constant"),
    (lambda: O.aggregate("token_mean", constant=4.0), "constant"),
    (lambda: O.ppo_clip(optax.constant_schedule(-0.2)), "eps"),
    (lambda: O.recipe("ppo2"), "ppo2"),
])
def test_bad_hyperparameters_raise_at_construction(factory, match):
  with pytest.raises((ValueError, TypeError), match=match):
    factory()


def test_unknown_aggregation_names_mode_and_lists_valid():
  with pytest.raises(ValueError) as e:
    O.aggregate("sequence_mean")
  msg = str(e.value)
  assert "'sequence_mean'" in msg
  for mode in O.AGGREGATIONS:
    assert repr(mode) in msg


def test_shape_mismatch_names_arrays_and_shapes():
  obj = O.recipes.dapo()
  x = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError) as e:
    O.objective_loss(obj, x, mask_bt=np.ones((2, 3), bool), advantages_bt=np.zeros((2, 4)),
                     behaviour_logp_bt=x, state=obj.init(None))
  assert "advantages_bt" in str(e.value) and "(2, 4)" in str(e.value)
  assert "logp_bt" in str(e.value) and "(2, 3)" in str(e.value)
  with pytest.raises(ValueError, match=r"logp_bt must be \[B, T\]"):
    O.objective_loss(obj, np.zeros(3), mask_bt=np.ones(3, bool), advantages_bt=np.zeros(3),
                     behaviour_logp_bt=np.zeros(3), state=obj.init(None))
  with pytest.raises(ValueError, match="group_size"):
    O.objective_loss(obj, x, mask_bt=np.ones((2, 3), bool), advantages_bt=x,
                     behaviour_logp_bt=x, state=obj.init(None), group_size=4)


def test_structural_errors():
  x = np.zeros((2, 2), np.float32)
  fields = dict(mask_bt=np.ones((2, 2), bool), advantages_bt=x, behaviour_logp_bt=x)
  no_agg = O.chain(O.ppo_clip())
  with pytest.raises(ValueError, match="no aggregation"):
    run(no_agg, x, **fields)
  late = O.chain(O.ppo_clip(), O.aggregate("token_mean"), O.kl_loss(0.1))
  with pytest.raises(ValueError, match="after aggregate"):
    run(late, x, ref_logp_bt=x, **fields)
  with pytest.raises(ValueError, match="ref_logp_bt"):
    run(O.recipes.grpo(), x, **fields)
  with pytest.raises(ValueError, match="group_size"):
    run(O.chain(O.ppo_clip(), O.aggregate("prompt_mean")), x, **fields)
  with pytest.raises(TypeError, match="factory"):
    O.chain(O.ppo_clip)
  obj = O.recipes.dapo()
  with pytest.raises(ValueError, match="tuple of 2 states"):
    O.objective_loss(obj, x, state=(), **fields)


def test_exactly_zero_loss_still_has_gradient():
  # On-policy (ratio 1) with advantages that cancel: the loss is exactly 0 but its
  # gradient is -A / N, not 0 (the sums' -0.0 canonicalisation must not kill it).
  x = np.full((2, 2), -1.0, np.float32)
  a = np.array([[1.0, 1.0], [-1.0, -1.0]], np.float32)
  loss, _, g, _ = run(PPO, x, mask_bt=np.ones_like(x, bool), advantages_bt=a, behaviour_logp_bt=x)
  assert loss == 0.0
  np.testing.assert_array_equal(g, -a / 4)
