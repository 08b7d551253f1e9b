"""Consistency and off-policy diagnostics: hand-computed values, a synthetic off-policy
family, determinism (row order), empty masks and bad input."""

import json
import math
import warnings

import numpy as np
import pytest

from jaxrl_llm import diagnostics as D

E = math.exp

# A 2 x 3 batch, last entry of row 1 padding (NaN there must be ignored). Log-probabilities
# are binary fractions, so d = logp - behaviour is exact: d = [0, -0.5, 0.25 | 0.125, -0.25].
LOGP = np.array([[-1.0, -2.0, -0.5], [-1.5, -3.0, np.nan]], np.float32)
BEHAV = np.array([[-1.0, -1.5, -0.75], [-1.625, -2.75, 0.0]], np.float32)
MASK = np.array([[True, True, True], [True, True, False]])
R = [1.0, E(-0.5), E(0.25), E(0.125), E(-0.25)]  # pi / mu of the five tokens


def no_warnings(fn, *args, **kwargs):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return fn(*args, **kwargs)


# ----------------------------------------------------------------------------- by hand


def test_consistency_stats_by_hand():
  m = no_warnings(D.consistency_stats, LOGP, BEHAV, MASK)
  sum_r = 1.0 + E(-0.5) + E(0.25) + E(0.125) + E(-0.25)
  sum_r2 = 1.0 + E(-1.0) + E(0.5) + E(0.25) + E(-0.5)
  expected = {
      "tokens": 5.0,
      "ratio_mean": sum_r / 5,
      "ratio_min": E(-0.5),
      "ratio_max": E(0.25),
      # sorted: e^-.5, e^-.25, 1, e^.125, e^.25; ranks ceil(q * 5) - 1 = 0, 2, 4
      "ratio_p1": E(-0.5), "ratio_p50": 1.0, "ratio_p99": E(0.25),
      "log_ratio_mean": (0 - 0.5 + 0.25 + 0.125 - 0.25) / 5,  # -0.075
      "abs_log_ratio_mean": (0 + 0.5 + 0.25 + 0.125 + 0.25) / 5,  # 0.225
      "kl_k1": 0.075,
      "kl_k2": 0.5 * (0 + 0.25 + 0.0625 + 0.015625 + 0.0625) / 5,
      "kl_k3": ((1 - 1 - 0) + (E(-0.5) - 1 + 0.5) + (E(0.25) - 1 - 0.25)
                + (E(0.125) - 1 - 0.125) + (E(-0.25) - 1 + 0.25)) / 5,
      "out_of_bounds": 3 / 5,  # e^-.5 = 0.61, e^.25 = 1.28, e^-.25 = 0.78 lie outside [0.8, 1.25]
      "ess_rate": sum_r ** 2 / (5 * sum_r2),
  }
  assert set(m) == {f"consistency/{k}" for k in expected}
  for k, v in expected.items():
    assert m[f"consistency/{k}"] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_consistency_bounds_and_prefix():
  m = D.consistency_stats(LOGP, BEHAV, MASK, bounds=(0.5, 1.5), quantiles=(0.2, 0.999), prefix="x")
  assert m["x/out_of_bounds"] == 0.0
  # ranks: ceil(0.2 * 5) - 1 = 0 and ceil(4.995) - 1 = 4
  assert m["x/ratio_p20"] == E(-0.5) and m["x/ratio_p99.9"] == E(0.25)


def test_consistency_alerts_by_hand():
  m = D.consistency_stats(LOGP, BEHAV, MASK)
  alerts = D.consistency_alerts(m)
  # 0.225 > 0.05, k3 ~ 0.04 > 1e-3, 0.6 > 0.05; ESS rate ~ 0.96, ratios in [0.1, 10]
  assert [a.name for a in alerts] == ["consistency_abs_log_ratio_mean", "consistency_kl_k3",
                                      "consistency_out_of_bounds"]
  assert alerts[0].value == pytest.approx(0.225) and alerts[0].threshold == 0.05
  assert "consistency/out_of_bounds = 0.6 > maximum 0.05" in str(alerts[2])
  assert json.loads(json.dumps(alerts)) == [a.message for a in alerts]  # alerts are their messages
  strict = D.ConsistencyThresholds(max_abs_log_ratio_mean=None, max_kl_k3=None, max_out_of_bounds=None,
                                   min_ess_rate=0.99, max_ratio=1.2, min_ratio=0.7)
  alerts = D.consistency_alerts(m, strict)
  assert [(a.metric, a.relation) for a in alerts] == [("consistency/ess_rate", "<"),
                                                       ("consistency/ratio_max", ">"),
                                                       ("consistency/ratio_min", "<")]
  assert "< minimum 0.7" in alerts[2].message
  exact = D.consistency_stats(BEHAV, BEHAV, MASK)
  assert D.consistency_alerts(exact) == []


def test_staleness_by_hand():
  lag = np.array([[0, 1, 1], [2, 0, -7]])  # -7 is padding, ignored
  m = no_warnings(D.staleness, LOGP, BEHAV, lag, MASK)
  # (1 - r)^+ per token: [0, 1 - e^-.5, 0 | 0, 1 - e^-.25]; lags [0, 1, 1 | 2, 0]
  sum_r = 1.0 + E(-0.5) + E(0.25) + E(0.125) + E(-0.25)
  sum_r2 = 1.0 + E(-1.0) + E(0.5) + E(0.25) + E(-0.5)
  expected = {
      "staleness_tv": ((1 - E(-0.5)) + (1 - E(-0.25))) / 5,
      "staleness_tv_lag0": (0 + (1 - E(-0.25))) / 2,
      "staleness_tv_lag1": ((1 - E(-0.5)) + 0) / 2,
      "staleness_tv_lag2": 0.0,
      "lag_share0": 2 / 5, "lag_share1": 2 / 5, "lag_share2": 1 / 5,
      "stale_share": 3 / 5,
      "ess_rate": sum_r ** 2 / (5 * sum_r2),
      "tokens": 5.0,
  }
  assert set(m) == {f"offpolicy/{k}" for k in expected}
  for k, v in expected.items():
    assert m[f"offpolicy/{k}"] == pytest.approx(v, rel=1e-12, abs=1e-15), k


def test_update_drift_by_hand():
  # tokens:   1       2       3        4          5
  mu = np.array([[-1.0, -1.5, -0.75], [-1.625, -2.75, 0.0]], np.float32)
  before = np.array([[-1.0, -2.0, -0.5], [-1.5, -3.0, 0.0]], np.float32)
  after = np.array([[-1.0, -1.5, -0.625], [-1.5625, -3.0, 5.0]], np.float32)
  # w = pi_k/mu = [1, e^-.5, e^.25, e^.125, e^-.25]; log q = [0, .5, -.125, -.0625, 0]
  m = no_warnings(D.update_drift, before, after, mu, MASK)
  expected = {
      "drift_tv": (E(0.25) * (1 - E(-0.125)) + E(0.125) * (1 - E(-0.0625))) / 5,
      "drift_kl_k3": (E(-0.5) * (E(0.5) - 1 - 0.5) + E(0.25) * (E(-0.125) - 1 + 0.125)
                      + E(0.125) * (E(-0.0625) - 1 + 0.0625)) / 5,
      "prob_change_rate": 2 / 5,  # |q - 1| = 0.65 and 0.118 exceed 0.1; 0.061 does not
      "prob_change_max": E(0.5) - 1,
      "drift_tokens": 5.0,
  }
  assert set(m) == {f"offpolicy/{k}" for k in expected}
  for k, v in expected.items():
    assert m[f"offpolicy/{k}"] == pytest.approx(v, rel=1e-12), k
  on_policy = D.update_drift(before, after, None, MASK, change=0.05)
  assert on_policy["offpolicy/drift_tv"] == pytest.approx(((1 - E(-0.125)) + (1 - E(-0.0625))) / 5, rel=1e-12)
  assert on_policy["offpolicy/prob_change_rate"] == 3 / 5


def test_monte_carlo_returns_by_hand():
  r = np.array([[0.0, 0.0, 1.0, 7.0], [0.0, 2.0, 5.0, 0.0]], np.float32)
  m = np.array([[1, 1, 1, 0], [0, 1, 0, 1]], bool)
  g = no_warnings(D.monte_carlo_returns, r, m, gamma=0.5)
  # row 0: G2 = 1, G1 = 0.5 * 1, G0 = 0.5 * 0.5; row 1: G3 = 0, G1 = 2 + 0.5 * G3 (the gap at 2 is skipped)
  np.testing.assert_array_equal(g, [[0.25, 0.5, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
  assert g.dtype == np.float64


def test_monte_carlo_returns_match_gae_with_lambda_one():
  from jaxrl_llm.advantages import gae
  rng = np.random.default_rng(3)
  r = rng.normal(size=(5, 9)).astype(np.float32)
  m = rng.random((5, 9)) < 0.7
  adv, _ = gae(r, np.zeros_like(r), m, gamma=0.9, lam=1.0)
  np.testing.assert_allclose(D.monte_carlo_returns(r, m, 0.9), np.asarray(adv), rtol=1e-5, atol=1e-6)


def test_advantage_substitution_error_by_hand():
  est = np.array([[1.0, 2.0, 3.0], [0.5, 9.0, 0.0]], np.float32)
  ret = np.array([[1.5, 1.0, 3.0], [0.5, np.inf, 0.0]], np.float32)
  m = np.array([[1, 1, 1], [1, 0, 0]], bool)
  out = no_warnings(D.advantage_substitution_error, est, ret, m)
  # e = [-0.5, 1, 0, 0]; G = [1.5, 1, 3, 0.5], mean 1.5, Var = (0 + .25 + 2.25 + 1) / 4
  var_g = 3.5 / 4
  var_e = ((-0.625) ** 2 + 0.875 ** 2 + 0.125 ** 2 + 0.125 ** 2) / 4
  assert out["offpolicy/adv_substitution_mse"] == 1.25 / 4
  assert out["offpolicy/adv_substitution_bias"] == 0.5 / 4
  assert out["offpolicy/adv_substitution_rel"] == pytest.approx((1.25 / 4) / var_g, rel=1e-14)
  assert out["offpolicy/adv_substitution_ev"] == pytest.approx(1 - var_e / var_g, rel=1e-14)
  flat = no_warnings(D.advantage_substitution_error, est, np.ones_like(ret), m)
  assert math.isnan(flat["offpolicy/adv_substitution_rel"]) and math.isnan(flat["offpolicy/adv_substitution_ev"])
  assert flat["offpolicy/adv_substitution_mse"] == (0 + 1 + 4 + 0.25) / 4


def test_advantage_drift_by_hand():
  a = np.array([[1.0, -2.0], [0.5, 0.0]], np.float32)
  b = np.array([[1.5, 2.0], [0.5, 1.0]], np.float32)
  m = np.ones((2, 2), bool)
  out = no_warnings(D.advantage_drift, a, b, m)
  # D = [.5, 4, 0, 1]: mean D^2 = 17.25 / 4; mean a^2 = 5.25 / 4; one sign flip (-2 -> 2); 0 -> 1 is none
  assert out["offpolicy/adv_drift_mse"] == 17.25 / 4
  assert out["offpolicy/adv_drift"] == pytest.approx(math.sqrt(17.25 / 5.25), rel=1e-14)
  assert out["offpolicy/adv_drift_sign_flip"] == 1 / 4
  zero = D.advantage_drift(np.zeros_like(a), b, m)
  assert math.isnan(zero["offpolicy/adv_drift"])


def test_data_alerts_by_hand():
  adv = np.array([[0.5, -150.0, 2.0], [-0.25, 0.0, np.nan]], np.float32)
  m, alerts = no_warnings(D.data_alerts, adv, MASK, filter_rate=0.6)
  assert m == {"data/adv_abs_max": 150.0, "data/adv_outside_unit": 2 / 5, "data/filter_rate": 0.6,
               "data/kept_share": 1 - 0.6}
  assert [a.name for a in alerts] == ["data_adv_abs_max"]  # a high filter rate is a metric, not an alert
  assert "data/adv_abs_max = 150 > maximum 100" in alerts[0].message
  # the limit is strict; an unknown filter rate is NaN
  at_limit = np.array([[100.0, 1.0, -1.0], [0.0, 0.0, 0.0]], np.float32)
  m, alerts = D.data_alerts(at_limit, MASK, filter_rate=None)
  assert alerts == [] and m["data/adv_outside_unit"] == 1 / 5 and math.isnan(m["data/filter_rate"])
  m, alerts = D.data_alerts(at_limit, MASK, filter_rate=1.0, max_abs_advantage=99.0)
  assert [a.name for a in alerts] == ["data_adv_abs_max"] and m["data/kept_share"] == 0.0
  assert D.data_alerts(adv, MASK, filter_rate=0.9, max_abs_advantage=None)[1] == []


# ----------------------------------------------------------------------------- synthetic off-policy family


class Family:
  """Categorical policies over V tokens at T states: pi_v(.|t) = softmax(L_t + v * Delta_t)."""

  def __init__(self, v=6, t=16, b=256, seed=0):
    rng = np.random.default_rng(seed)
    self.logits = rng.normal(size=(t, v))
    self.delta = rng.normal(scale=0.25, size=(t, v))
    self.u = rng.random((b, t))  # common random numbers: the same uniforms for every version
    self.pos = np.broadcast_to(np.arange(t), (b, t))

  def logpi(self, version):
    z = self.logits + version * self.delta
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))

  def sample(self, version):
    """Token ids [B, T] drawn from pi_version by inverse CDF."""
    cdf = np.cumsum(np.exp(self.logpi(version)), -1)
    return np.minimum((self.u[:, :, None] > cdf[None]).sum(-1), cdf.shape[-1] - 1)

  def logp_of(self, version, tokens):
    return self.logpi(version)[self.pos, tokens].astype(np.float32)

  def tv(self, v1, v2):
    """Exact mean over states of TV(pi_v1, pi_v2)."""
    return float((0.5 * np.abs(np.exp(self.logpi(v1)) - np.exp(self.logpi(v2))).sum(-1)).mean())


CURRENT = 8
LAGS = (0, 1, 2, 4, 8)


@pytest.fixture(scope="module")
def family():
  return Family()


def stale_batch(family, k):
  """Data from pi_{CURRENT - k}, scored by the learner's pi_CURRENT."""
  tokens = family.sample(CURRENT - k)
  return family.logp_of(CURRENT, tokens), family.logp_of(CURRENT - k, tokens)


def test_staleness_and_ratio_dispersion_grow_with_lag(family):
  mask = np.ones(family.u.shape, bool)
  rows = []
  for k in LAGS:
    logp, behav = stale_batch(family, k)
    c = D.consistency_stats(logp, behav, mask)
    s = D.staleness(logp, behav, np.full(mask.shape, k), mask)
    assert s[f"offpolicy/staleness_tv_lag{k}"] == s["offpolicy/staleness_tv"]
    assert s["offpolicy/stale_share"] == (1.0 if k else 0.0)
    # the sample estimate tracks the exact TV between the two policies
    assert s["offpolicy/staleness_tv"] == pytest.approx(family.tv(CURRENT, CURRENT - k), abs=0.01)
    rows.append((s["offpolicy/staleness_tv"], c["consistency/ratio_max"], c["consistency/out_of_bounds"],
                 c["consistency/kl_k3"], -c["consistency/ess_rate"], -c["consistency/ratio_min"]))
    if k == 0:  # same policy: ratio 1 and TV 0 exactly
      assert c["consistency/ratio_min"] == c["consistency/ratio_max"] == c["consistency/ratio_mean"] == 1.0
      assert c["consistency/kl_k3"] == c["consistency/kl_k1"] == c["consistency/out_of_bounds"] == 0.0
      assert c["consistency/ess_rate"] == 1.0 and s["offpolicy/staleness_tv"] == 0.0
      assert D.consistency_alerts(c) == []
  rows = np.array(rows)
  assert (np.diff(rows, axis=0) > 0).all(), rows  # every statistic grows strictly with k
  assert D.consistency_alerts(D.consistency_stats(*stale_batch(family, 8), mask))  # and alerts


def test_per_lag_staleness_of_a_mixed_batch(family):
  """A batch mixing lags reports, per lag, exactly the bits of that lag's rows alone."""
  parts = [stale_batch(family, k) for k in LAGS]
  rows = slice(0, 32)
  logp = np.concatenate([p[0][rows] for p in parts])
  behav = np.concatenate([p[1][rows] for p in parts])
  lag = np.concatenate([np.full((32, logp.shape[1]), k) for k in LAGS])
  mask = np.ones(logp.shape, bool)
  mixed = D.staleness(logp, behav, lag, mask)
  assert mixed["offpolicy/stale_share"] == 4 / 5
  for k, (lp, bp) in zip(LAGS, parts):
    alone = D.staleness(lp[rows], bp[rows], np.full(lp[rows].shape, k), mask[:32])
    assert mixed[f"offpolicy/staleness_tv_lag{k}"] == alone["offpolicy/staleness_tv"]
    assert mixed[f"offpolicy/lag_share{k}"] == 1 / 5


def test_drift_importance_weight_is_right(family):
  """U_k from stale data: weighting by pi_k/mu recovers TV(pi_{k+1}, pi_k); no weight is biased."""
  mask = np.ones(family.u.shape, bool)
  exact = family.tv(CURRENT + 1, CURRENT)
  for k in (0, 4, 8):
    tokens = family.sample(CURRENT - k)
    before, after = family.logp_of(CURRENT, tokens), family.logp_of(CURRENT + 1, tokens)
    behav = family.logp_of(CURRENT - k, tokens)
    weighted = D.update_drift(before, after, behav, mask)["offpolicy/drift_tv"]
    unweighted = D.update_drift(before, after, None, mask)["offpolicy/drift_tv"]
    assert weighted == pytest.approx(exact, abs=0.003)
    if k:
      assert abs(unweighted - exact) > 5 * abs(weighted - exact)
  no_update = D.update_drift(before, before, behav, mask)
  assert no_update["offpolicy/drift_tv"] == 0.0 and no_update["offpolicy/prob_change_rate"] == 0.0


# ----------------------------------------------------------------------------- determinism, empty


def random_inputs(seed=5, b=12, t=40):
  rng = np.random.default_rng(seed)
  logp = rng.normal(-2.0, 1.0, (b, t)).astype(np.float32)
  behav = (logp + rng.normal(0.0, 0.3, (b, t))).astype(np.float32)
  after = (logp + rng.normal(0.0, 0.1, (b, t))).astype(np.float32)
  mask = rng.random((b, t)) < 0.8
  lag = rng.integers(0, 4, (b, t))
  adv = rng.normal(0.0, 2.0, (b, t)).astype(np.float32)
  return logp, behav, after, mask, lag, adv


def all_metrics(logp, behav, after, mask, lag, adv):
  out = dict(D.consistency_stats(logp, behav, mask))
  out.update(D.staleness(logp, behav, lag, mask))
  out.update(D.update_drift(logp, after, behav, mask))
  out.update(D.advantage_substitution_error(adv, D.monte_carlo_returns(adv, mask, 0.9), mask))
  out.update(D.advantage_drift(adv, after, mask))
  out.update(D.data_alerts(adv, mask, 0.25)[0])
  return out


def test_row_order_invariance_and_determinism():
  arrays = random_inputs()
  base = all_metrics(*arrays)
  assert base == all_metrics(*arrays)  # same inputs, same bits
  perm = np.random.default_rng(9).permutation(arrays[0].shape[0])
  permuted = all_metrics(*(a[perm] for a in arrays))
  assert list(base) == list(permuted)
  for k in base:
    assert np.float64(base[k]).tobytes() == np.float64(permuted[k]).tobytes(), k


def test_empty_mask_gives_nan_without_warnings():
  logp, behav, after, _, lag, adv = random_inputs()
  empty = np.zeros(logp.shape, bool)
  out = no_warnings(all_metrics, logp, behav, after, empty, lag, adv)
  counts = {"consistency/tokens", "offpolicy/tokens", "offpolicy/drift_tokens", "data/filter_rate",
            "data/kept_share"}
  assert all(out[k] == 0.0 for k in counts - {"data/filter_rate", "data/kept_share"})
  assert all(math.isnan(v) for k, v in out.items() if k not in counts), out
  assert not any(k.startswith("offpolicy/staleness_tv_lag") for k in out)
  assert D.consistency_alerts(D.consistency_stats(logp, behav, empty)) == []
  assert D.data_alerts(adv, empty, None)[1] == []


# ----------------------------------------------------------------------------- step helper


def test_step_diagnostics_checks_fresh_tokens_and_returns_alerts():
  logp, behav, after, mask, lag, adv = random_inputs()
  behav = np.where(lag == 0, logp, behav).astype(np.float32)  # fresh tokens: bit-identical sampler
  diag = D.StepDiagnostics(max_prob_change_rate=0.01)
  m, alerts = diag.before_update(logp, behav, mask, lag, adv * 100, filter_rate=0.9)
  assert m["consistency/tokens"] == np.count_nonzero(mask & (lag == 0))
  assert m["consistency/kl_k3"] == 0.0 and m["consistency/ratio_max"] == 1.0
  assert m["offpolicy/kl_k3"] > 0 and m["offpolicy/staleness_tv"] > 0  # stale tokens differ
  assert [a.name for a in alerts] == ["data_adv_abs_max"]  # filter rate 0.9: a metric only
  assert m["data/filter_rate"] == 0.9 and not any(k.startswith("alerts/") for k in m)
  m2, alerts2 = diag.after_update(logp, after, behav, mask)
  assert [a.name for a in alerts2] == ["offpolicy_prob_change_rate"]
  m3, alerts3 = diag.before_update(logp, behav, mask, None, adv * 100)
  assert m3["consistency/tokens"] == np.count_nonzero(mask)  # no lag: every token is fresh
  # without lags the stale tokens count as fresh and fail the consistency check
  assert [a.name for a in alerts3] == ["consistency_abs_log_ratio_mean", "consistency_kl_k3",
                                        "consistency_out_of_bounds", "data_adv_abs_max"]
  again, _ = diag.before_update(logp, behav, mask, None, adv * 100)
  assert json.dumps(again) == json.dumps(m3)  # stateless: the same call gives the same metrics


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("call, match", [
    (lambda: D.consistency_stats(LOGP, BEHAV[:, :2], MASK), r"behaviour_logp_bt has shape \(2, 2\) but logp_bt "
                                                             r"has shape \(2, 3\)"),
    (lambda: D.consistency_stats(LOGP[0], BEHAV[0], MASK[0]), r"logp_bt must be \[B, T\] \(rank 2\)"),
    (lambda: D.consistency_stats(LOGP, BEHAV, MASK.astype(np.int32)), "mask_bt must be a bool mask"),
    (lambda: D.consistency_stats(np.where(MASK, np.nan, 0), BEHAV, MASK),
     r"logp_bt has 5 non-finite value\(s\) inside the mask \(first at \[b, t\] = \[0, 0\]"),
    (lambda: D.consistency_stats(LOGP, BEHAV, MASK, bounds=(1.1, 1.25)), "0 <= lo <= 1 <= hi"),
    (lambda: D.consistency_stats(LOGP, BEHAV, MASK, quantiles=(1.5,)), "quantiles must lie in"),
    (lambda: D.ConsistencyThresholds(max_out_of_bounds=2.0), r"max_out_of_bounds=2.0: expected a number in \[0, 1\]"),
    (lambda: D.consistency_alerts({}), "stats has no 'consistency/abs_log_ratio_mean'"),
    (lambda: D.staleness(LOGP, BEHAV, np.array([[0, -1, 0], [0, 0, 0]]), MASK),
     r"lag_bt must be >= 0 on the mask .* got -1 at \[b, t\] = \[0, 1\]"),
    (lambda: D.staleness(LOGP, BEHAV, np.zeros((2, 3), np.float32), MASK), "lag_bt must be an integer array"),
    (lambda: D.staleness(LOGP, BEHAV, np.zeros((3, 3), int), MASK), r"lag_bt has shape \(3, 3\)"),
    (lambda: D.update_drift(LOGP, LOGP, None, MASK, change=0.0), "change must be > 0"),
    (lambda: D.update_drift(LOGP, LOGP[:1], None, MASK), r"logp_before_bt has shape \(2, 3\) but logp_after_bt"),
    (lambda: D.monte_carlo_returns(LOGP, MASK, gamma=1.5), r"gamma must lie in \[0.0, 1.0\]"),
    (lambda: D.advantage_substitution_error(LOGP, BEHAV.T, MASK), r"mc_returns_bt has shape \(3, 2\)"),
    (lambda: D.advantage_drift(np.array([[0, np.inf, 0], [0, 0, np.nan]]), BEHAV, MASK),
     r"adv_a_bt has 1 non-finite value\(s\) inside the mask \(first at \[b, t\] = \[0, 1\]: inf"),
    (lambda: D.data_alerts(BEHAV, MASK, filter_rate=1.5), "filter_rate must lie in"),
    (lambda: D.StepDiagnostics(thresholds={"max_kl_k3": 1.0}), "thresholds must be a ConsistencyThresholds"),
    (lambda: D.StepDiagnostics(max_stale_share=1.5), "max_stale_share must lie in"),
])
def test_bad_input_raises_naming_the_array(call, match):
  with pytest.raises(ValueError, match=match):
    call()
