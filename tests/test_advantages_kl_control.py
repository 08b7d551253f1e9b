"""KL controllers: defaults, direction, ±20 % clipping per horizon, fixed controller, errors."""

import jax
import numpy as np
import pytest

from jaxrl_llm.advantages import adaptive_kl_controller, fixed_kl_controller


def test_defaults_are_lm_human_preferences():
  ctl = adaptive_kl_controller()
  np.testing.assert_allclose(ctl.init().coef, 0.15)
  # target 6: KL 6.6 -> error 0.1; 100 episodes of a 10000 horizon -> x (1 + 0.001).
  np.testing.assert_allclose(ctl.update(ctl.init(), 6.6, 100).coef, 0.15 * 1.001, rtol=1e-6)
  np.testing.assert_allclose(ctl.update(ctl.init(), 6.0, 512).coef, 0.15)


def test_direction_and_clipping_per_full_horizon():
  ctl = adaptive_kl_controller(init_kl_coef=1.0, target=2.0, horizon=50)
  update = jax.jit(ctl.update)
  s = ctl.init()
  up = update(s, 3.0, 10)      # error 0.5 -> clipped 0.2; 1 + 0.2 * 10 / 50
  down = update(s, 1.5, 10)    # error -0.25 -> clipped -0.2
  mild = update(s, 2.2, 10)    # error 0.1, unclipped
  np.testing.assert_allclose([up.coef, down.coef, mild.coef], [1.04, 0.96, 1.02], rtol=1e-6)
  np.testing.assert_allclose(update(s, 1e9, 50).coef, 1.2, rtol=1e-6)
  np.testing.assert_allclose(update(s, 0.0, 50).coef, 0.8, rtol=1e-6)
  # repeated updates keep moving the same way.
  for _ in range(3):
    s = update(s, 5.0, 25)
  np.testing.assert_allclose(s.coef, 1.1 ** 3, rtol=1e-5)


def test_fixed_controller_never_moves():
  ctl = fixed_kl_controller(0.05)
  s = ctl.update(ctl.init(), 100.0, 10**6)
  np.testing.assert_allclose(s.coef, 0.05)


@pytest.mark.parametrize("kwargs,match", [
    ({"target": 0.0}, "target must be finite and > 0"),
    ({"horizon": -1}, "horizon must be finite and > 0"),
    ({"init_kl_coef": -0.1}, "init_kl_coef must be finite and >= 0"),
])
def test_errors(kwargs, match):
  with pytest.raises(ValueError, match=match):
    adaptive_kl_controller(**kwargs)
  with pytest.raises(ValueError, match="kl_coef must be finite and >= 0"):
    fixed_kl_controller(float("nan"))
