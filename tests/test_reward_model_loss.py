"""Bradley-Terry loss, margin, pairwise accuracy and mean margin: hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.reward_model import loss as L


def softplus(x):
  return math.log1p(math.exp(x))


def test_pairwise_losses_by_hand_with_and_without_margin():
  chosen = jnp.array([2.0, 0.0, -1.0])
  rejected = jnp.array([0.0, 0.0, 1.0])
  # -log sigmoid(d) = softplus(-d) with d = 2, 0, -2.
  np.testing.assert_allclose(L.pairwise_losses(chosen, rejected),
                             [softplus(-2.0), math.log(2.0), softplus(2.0)], rtol=1e-6)
  # with margins m: d - m = 2 - 1, 0 - 0.5, -2 - 0.
  np.testing.assert_allclose(L.pairwise_losses(chosen, rejected, jnp.array([1.0, 0.5, 0.0])),
                             [softplus(-1.0), softplus(0.5), softplus(2.0)], rtol=1e-6)


def test_loss_is_stable_for_large_gaps():
  out = L.pairwise_losses(jnp.array([1e4, -1e4]), jnp.array([0.0, 0.0]))
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(out, [0.0, 1e4], rtol=1e-6)


def test_mean_loss_metrics_and_padding_pairs():
  chosen = jnp.array([2.0, 0.0, -1.0, 100.0])
  rejected = jnp.array([0.0, 0.0, 1.0, -100.0])
  valid = jnp.array([True, True, True, False])
  total, m = L.bradley_terry_loss(chosen, rejected, valid_b=valid)
  expected = (softplus(-2.0) + math.log(2.0) + softplus(2.0)) / 3
  np.testing.assert_allclose(total, expected, rtol=1e-6)
  # one right, one tie (counts 1/2), one wrong; the padding pair is ignored.
  np.testing.assert_allclose(m["accuracy"], 0.5)
  np.testing.assert_allclose(m["margin"], (2.0 + 0.0 - 2.0) / 3, atol=1e-7)
  np.testing.assert_allclose(m["chosen"], 1.0 / 3, rtol=1e-6)
  np.testing.assert_allclose(m["rejected"], 1.0 / 3, rtol=1e-6)
  assert float(m["pairs"]) == 3.0
  # an explicit normaliser (the whole batch's pair count) divides the summed losses.
  part, _ = L.bradley_terry_loss(chosen[:2], rejected[:2], normaliser=3.0)
  np.testing.assert_allclose(part, (softplus(-2.0) + math.log(2.0)) / 3, rtol=1e-6)


def test_accuracy_and_margin_of_a_constant_model_are_chance_and_zero():
  s = jnp.ones(5)
  assert float(L.pairwise_accuracy(s, s)) == 0.5
  assert float(L.mean_margin(s, s)) == 0.0


def test_jit_and_grad():
  f = jax.jit(lambda c, r, m: L.bradley_terry_loss(c, r, m)[0])
  c, r, m = jnp.array([1.0, 0.5]), jnp.array([0.0, 1.0]), jnp.array([0.0, 0.25])
  np.testing.assert_allclose(f(c, r, m), L.bradley_terry_loss(c, r, m)[0], rtol=1e-6)
  g = jax.grad(lambda c: L.bradley_terry_loss(c, r, m)[0])(c)
  # d/dc softplus(-(c - r - m)) / n = -sigmoid(-(c - r - m)) / n
  np.testing.assert_allclose(g, -jax.nn.sigmoid(-(c - r - m)) / 2, rtol=1e-6)


def test_shape_errors_name_the_array():
  with pytest.raises(ValueError, match="rejected_b has 2 rows but chosen_b has 3"):
    L.pairwise_losses(jnp.zeros(3), jnp.zeros(2))
  with pytest.raises(ValueError, match="chosen_b must be \\[B\\]"):
    L.bradley_terry_loss(jnp.zeros((2, 2)), jnp.zeros(2))
