"""Controlled hyper-parameters, the off-policy controller and the improvement guard (pure parts)."""

import inspect
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as O
from jaxrl_llm.diagnostics import control, guard

B, T = 4, 6


def _inputs():
  rng = np.random.default_rng(0)
  logp = jnp.asarray(rng.normal(-1.0, 0.3, (B, T)), jnp.float32)
  mu = logp + jnp.asarray(rng.normal(0.0, 0.3, (B, T)), jnp.float32)
  adv = jnp.asarray(rng.normal(size=(B, T)), jnp.float32)
  return logp, mu, jnp.ones((B, T), bool), adv


def _loss(objective, state):
  logp, mu, mask, adv = _inputs()
  loss, (metrics, _) = O.objective_loss(objective, logp, mask_bt=mask, advantages_bt=adv,
                                        behaviour_logp_bt=mu, state=state)
  return float(loss), metrics


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo", "gspo", "geppo", "ppo"])
def test_controlled_clip_scale_equals_scaled_eps(name):
  params = inspect.signature(O.RECIPES[name]).parameters
  extra = {"value_coef": None} if name == "ppo" else ({"kl_coef": 0.0} if name == "grpo" else {})
  keys = [k for k in ("eps", "eps_low", "eps_high") if k in params and params[k].default is not None]
  controlled = O.recipe(name, **{k: O.Controlled(params[k].default, "clip") for k in keys}, **extra)
  halved = O.recipe(name, **{k: params[k].default * 0.5 for k in keys}, **extra)
  state = O.set_control(controlled.init(None), "clip", 0.5)
  assert O.get_control(state, "clip") == 0.5
  assert _loss(controlled, state)[0] == _loss(halved, halved.init(None))[0]
  # at scale 1 the controlled objective is the plain recipe
  plain = O.recipe(name, **extra)
  assert _loss(controlled, controlled.init(None))[0] == _loss(plain, plain.init(None))[0]


def test_controlled_scale_changes_without_retracing():
  objective = O.chain(O.ppo_clip(O.Controlled(0.2, "clip")), O.aggregate("token_mean"))
  traces = []

  @jax.jit
  def loss(state):
    traces.append(1)
    logp, mu, mask, adv = _inputs()
    return O.objective_loss(objective, logp, mask_bt=mask, advantages_bt=adv, behaviour_logp_bt=mu, state=state)[0]

  state = objective.init(None)
  values = [float(loss(O.set_control(state, "clip", s))) for s in (1.0, 0.5, 0.1)]
  assert len(traces) == 1
  assert len(set(values)) == 3  # the scale reaches the jitted computation


def test_set_control_errors_name_the_key():
  objective = O.chain(O.ppo_clip(O.Controlled(0.2, "clip")), O.aggregate("token_mean"))
  state = objective.init(None)
  with pytest.raises(KeyError, match="'kl'"):
    O.set_control(state, "kl", 1.0)
  with pytest.raises(KeyError, match="'kl'.*clip"):
    O.get_control(state, "kl")
  with pytest.raises(ValueError, match="must be finite and > 0"):
    O.set_control(state, "clip", 0.0)


def _controller(**kw):
  settings = dict(drift_target=0.02, staleness_target=0.05, tolerance=1.5, tighten=0.8, relax=1.25,
                  min_clip_scale=0.3, max_clip_scale=1.0, max_lag=3, min_lag=1)
  settings.update(kw)
  return control.OffPolicyController(control.ControlSettings(**settings), kl_coef=0.1)


def test_controller_tightens_and_relaxes_the_clip_scale():
  ctl = _controller()
  ctl.update(drift=0.031)  # > 0.02 * 1.5
  assert ctl.state.clip_scale == pytest.approx(0.8)
  ctl.update(drift=0.025)  # inside the dead band [0.0133, 0.03]
  assert ctl.state.clip_scale == pytest.approx(0.8)
  for _ in range(10):
    ctl.update(drift=1.0)
  assert ctl.state.clip_scale == pytest.approx(0.3)  # floor
  ctl.update(drift=0.001)  # < 0.02 / 1.5
  assert ctl.state.clip_scale == pytest.approx(0.375)
  for _ in range(10):
    ctl.update(drift=0.0)
  assert ctl.state.clip_scale == 1.0  # ceiling
  ctl.update(drift=float("nan"))
  assert ctl.state.clip_scale == 1.0
  assert ctl.state.tightened == 6 and ctl.state.relaxed == 6  # moves at the bounds are not counted


def test_controller_moves_the_staleness_window_within_bounds():
  ctl = _controller()
  assert ctl.state.max_lag == 3
  for expected in (2, 1, 1):  # 0.1 > 0.05 * 1.5; floor at min_lag=1
    ctl.update(staleness=0.1)
    assert ctl.state.max_lag == expected
  ctl.update(staleness=0.04)  # dead band
  assert ctl.state.max_lag == 1
  for expected in (2, 3, 3):  # 0.01 < 0.05 / 1.5; ceiling at the configured max_lag
    ctl.update(staleness=0.01)
    assert ctl.state.max_lag == expected


def test_adaptive_kl_coefficient_hand_computed():
  ctl = _controller(kl_target=0.01, kl_horizon=1000.0)
  ctl.update(kl=0.015, episodes=100)  # error = 0.5 -> clipped 0.2; coef *= 1 + 0.2 * 100 / 1000
  assert ctl.state.kl_coef == pytest.approx(0.1 * 1.02)
  ctl.update(kl=0.009, episodes=500)  # error = -0.1; coef *= 1 - 0.1 * 0.5
  assert ctl.state.kl_coef == pytest.approx(0.1 * 1.02 * 0.95)
  assert _controller().state.kl_coef is None  # no target: no adaptive coefficient


def test_controller_state_round_trip_and_bad_settings():
  ctl = _controller()
  ctl.update(drift=0.5, staleness=0.5)
  other = _controller()
  other.set_state(ctl.get_state())
  assert other.get_state() == ctl.get_state()
  with pytest.raises(ValueError, match="unknown fields"):
    other.set_state({"clip": 1.0})
  with pytest.raises(ValueError, match="control.tighten=1.2"):
    control.ControlSettings(tighten=1.2)
  with pytest.raises(ValueError, match="control.min_lag=5"):
    control.ControlSettings(max_lag=2, min_lag=5)


def test_guard_threshold_and_verdicts_hand_computed():
  g = guard.ImprovementGuard(guard.GuardSettings(every=5, min_drop=0.05, z=2.0, max_rollbacks=2))
  assert not g.due(0) and not g.due(4) and g.due(10)
  first = g.judge(0, 0.5, 100)
  assert not first.rollback and first.reference is None
  # se = sqrt(0.25/100 + 0.21/100) = 0.06782; threshold = 0.1356 > min_drop
  se = math.sqrt(0.5 * 0.5 / 100 + 0.3 * 0.7 / 100)
  assert g.threshold(0.5, 0.3, 100) == pytest.approx(2 * se)
  assert g.judge(5, 0.4, 100).rollback is False  # drop 0.1 < 0.1386: noise, accepted
  assert g.state.good_accuracy == 0.4 and g.state.good_step == 5
  v = g.judge(10, 0.1, 100)  # drop 0.3
  assert v.rollback and v.reference == 0.4 and "ROLLBACK" in v.message(10)
  assert g.state.good_accuracy == 0.4  # the reference stays the last good one
  assert g.judge(15, 0.1, 100).rollback
  with pytest.raises(guard.RollbackLimitError, match="guard.max_rollbacks=2"):
    g.judge(20, 0.1, 100)


def test_guard_min_drop_dominates_on_large_sets_and_state_round_trip():
  g = guard.ImprovementGuard(guard.GuardSettings(min_drop=0.05, z=2.0))
  g.judge(0, 0.9, 100000)
  assert not g.judge(1, 0.86, 100000).rollback  # 4 points: below min_drop although many se's
  assert g.judge(2, 0.80, 100000).rollback
  other = guard.ImprovementGuard(guard.GuardSettings())
  other.set_state(g.get_state())
  assert other.get_state() == g.get_state()
  with pytest.raises(ValueError, match="guard.lr_shrink=0"):
    guard.GuardSettings(lr_shrink=0)
  with pytest.raises(ValueError, match="accuracy must be in"):
    g.judge(3, 1.5, 10)
