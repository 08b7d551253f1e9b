"""DPO, IPO and SimPO losses against float64 NumPy references: values, gradients, masks and shape errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.objectives import preference as P
from jaxrl_llm.reward_model import loss as rm_loss

B = 7


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  pc, pr = rng.normal(-6.0, 3.0, B), rng.normal(-8.0, 3.0, B)
  rc, rr = pc + rng.normal(0.0, 2.0, B), pr + rng.normal(0.0, 2.0, B)
  lc, lr = rng.integers(1, 9, B).astype(np.float64), rng.integers(1, 9, B).astype(np.float64)
  valid = np.array([True, True, False, True, True, False, True])
  return pc, pr, rc, rr, lc, lr, valid


def _log_sigmoid(x):
  return -np.logaddexp(0.0, -x)


# float64 references: per-pair losses of the policy log-probabilities (pc, pr)
def ref_dpo(pc, pr, rc, rr, beta, eps):
  z = beta * ((pc - rc) - (pr - rr))
  return -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)


def ref_ipo(pc, pr, rc, rr, beta):
  return ((pc - rc) - (pr - rr) - 1.0 / (2.0 * beta)) ** 2


def ref_simpo(pc, pr, lc, lr, beta, gamma):
  return -_log_sigmoid(beta * (pc / lc - pr / lr) - gamma)


def _masked_mean(losses, valid):
  return losses[valid].mean()


def _fd_grad(f, x, h=1e-6):
  """Central finite differences of a float64 scalar function of a vector."""
  g = np.zeros_like(x)
  for i in range(x.size):
    up, down = x.copy(), x.copy()
    up[i] += h
    down[i] -= h
    g[i] = (f(up) - f(down)) / (2 * h)
  return g


CASES = {
    "dpo": (lambda pc, pr, rc, rr, lc, lr, v: P.dpo_loss(pc, pr, rc, rr, v, beta=0.3),
            lambda pc, pr, rc, rr, lc, lr: ref_dpo(pc, pr, rc, rr, 0.3, 0.0)),
    "cdpo": (lambda pc, pr, rc, rr, lc, lr, v: P.dpo_loss(pc, pr, rc, rr, v, beta=0.3, label_smoothing=0.2),
             lambda pc, pr, rc, rr, lc, lr: ref_dpo(pc, pr, rc, rr, 0.3, 0.2)),
    "ipo": (lambda pc, pr, rc, rr, lc, lr, v: P.ipo_loss(pc, pr, rc, rr, v, beta=0.25),
            lambda pc, pr, rc, rr, lc, lr: ref_ipo(pc, pr, rc, rr, 0.25)),
    "simpo": (lambda pc, pr, rc, rr, lc, lr, v: P.simpo_loss(pc, pr, lc, lr, v, beta=2.0, gamma=0.7),
              lambda pc, pr, rc, rr, lc, lr: ref_simpo(pc, pr, lc, lr, 2.0, 0.7)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_value_and_gradient_match_a_float64_reference(name):
  ours, ref = CASES[name]
  pc, pr, rc, rr, lc, lr, valid = _inputs()
  f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
  loss, metrics = ours(*map(f32, (pc, pr, rc, rr, lc, lr)), jnp.asarray(valid))
  want = _masked_mean(ref(pc, pr, rc, rr, lc, lr), valid)
  np.testing.assert_allclose(float(loss), want, rtol=2e-6, atol=1e-6)
  # gradient with respect to both policy log-probability vectors
  grad_c, grad_r = jax.grad(lambda a, b: ours(a, b, *map(f32, (rc, rr, lc, lr)), jnp.asarray(valid))[0],
                            argnums=(0, 1))(f32(pc), f32(pr))
  fd_c = _fd_grad(lambda x: _masked_mean(ref(x, pr, rc, rr, lc, lr), valid), pc)
  fd_r = _fd_grad(lambda x: _masked_mean(ref(pc, x, rc, rr, lc, lr), valid), pr)
  np.testing.assert_allclose(np.asarray(grad_c), fd_c, rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad_r), fd_r, rtol=1e-4, atol=1e-7)
  assert np.all(np.asarray(grad_c)[~valid] == 0.0) and np.all(np.asarray(grad_r)[~valid] == 0.0)
  # implicit rewards: beta * log-ratio (DPO, IPO) or beta * length-normalised log-prob (SimPO)
  beta = {"dpo": 0.3, "cdpo": 0.3, "ipo": 0.25, "simpo": 2.0}[name]
  chosen, rejected = ((beta * pc / lc, beta * pr / lr) if name == "simpo" else (beta * (pc - rc), beta * (pr - rr)))
  np.testing.assert_allclose(float(metrics["accuracy"]), np.mean((chosen > rejected)[valid]))
  np.testing.assert_allclose(float(metrics["margin"]), np.mean((chosen - rejected)[valid]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics["chosen"]), np.mean(chosen[valid]), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(metrics["rejected"]), np.mean(rejected[valid]), rtol=1e-5, atol=1e-6)
  assert float(metrics["pairs"]) == valid.sum()


def test_reference_gets_no_gradient_and_jit_matches():
  pc, pr, rc, rr, _, _, valid = _inputs(1)
  args = [jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)]
  g_ref = jax.grad(lambda c, r: P.dpo_loss(args[0], args[1], c, r, beta=0.1)[0], argnums=(0, 1))(args[2], args[3])
  assert all(np.all(np.asarray(g) == 0.0) for g in g_ref)
  eager, _ = P.ipo_loss(*args, jnp.asarray(valid), beta=0.1)
  jitted, _ = jax.jit(lambda *a: P.ipo_loss(*a, beta=0.1))(*args, jnp.asarray(valid))
  assert float(eager) == float(jitted)


def test_masked_pairs_change_nothing_and_normaliser_splits_the_mean():
  pc, pr, rc, rr, lc, lr, valid = _inputs(2)
  bad = np.where(valid, pc, np.nan)  # NaN in padding pairs reaches neither loss nor metrics
  loss, m = P.dpo_loss(bad, pr, rc, rr, valid, beta=0.1)
  kept, m_kept = P.dpo_loss(pc[valid], pr[valid], rc[valid], rr[valid], beta=0.1)
  np.testing.assert_allclose(float(loss), float(kept), rtol=1e-6)
  assert np.isfinite(float(m["margin"])) and float(m["pairs"]) == float(m_kept["pairs"])
  # two halves, each divided by the whole batch's count, add up to the whole
  n = float(valid.sum())
  halves = [P.simpo_loss(pc[s], pr[s], lc[s], lr[s], valid[s], beta=2.0, normaliser=n)[0]
            for s in (slice(0, 3), slice(3, B))]
  whole, _ = P.simpo_loss(pc, pr, lc, lr, valid, beta=2.0)
  np.testing.assert_allclose(float(sum(halves)), float(whole), rtol=1e-6)
  none, m_none = P.dpo_loss(pc, pr, rc, rr, np.zeros(B, bool))
  assert float(none) == 0.0 and float(m_none["accuracy"]) == 0.0


def test_at_the_reference_dpo_is_log2_and_accuracy_is_chance():
  pc, pr, _, _, _, _, _ = _inputs(3)
  loss, m = P.dpo_loss(pc, pr, pc, pr, beta=0.1)
  np.testing.assert_allclose(float(loss), np.log(2.0), rtol=1e-6)
  assert float(m["accuracy"]) == 0.5  # every implicit reward is 0: ties count one half


def test_pair_losses_dispatch_and_errors():
  pc, pr, rc, rr, lc, lr, _ = _inputs(4)
  losses, chosen, rejected = P.pair_losses("ipo", pc, pr, rc, rr, beta=0.5)
  np.testing.assert_allclose(np.asarray(losses), ref_ipo(pc, pr, rc, rr, 0.5), rtol=1e-5)
  with pytest.raises(ValueError, match=r"pair_losses: loss='kto': expected one of \('dpo', 'ipo', 'simpo'\)"):
    P.pair_losses("kto", pc, pr, rc, rr)
  with pytest.raises(ValueError, match="loss='simpo' needs chosen_length_b"):
    P.pair_losses("simpo", pc, pr)
  with pytest.raises(ValueError, match="loss='dpo' needs ref_chosen_b"):
    P.pair_losses("dpo", pc, pr, chosen_length_b=lc, rejected_length_b=lr)


def test_bad_shapes_raise_naming_the_array():
  pc, pr, rc, rr, lc, lr, valid = _inputs(5)
  with pytest.raises(ValueError, match=r"dpo_loss: ref_rejected_b has 6 rows but policy_chosen_b has 7"):
    P.dpo_loss(pc, pr, rc, rr[:6])
  with pytest.raises(ValueError, match=r"ipo_loss: policy_chosen_b must be \[B\] \(rank 1\); got shape \(7, 1\)"):
    P.ipo_loss(pc[:, None], pr, rc, rr)
  with pytest.raises(ValueError, match=r"simpo_loss: valid_b has 3 rows but policy_chosen_b has 7"):
    P.simpo_loss(pc, pr, lc, lr, valid[:3])
  with pytest.raises(ValueError, match=r"simpo_loss: rejected_length_b must be \[B\]"):
    P.simpo_loss(pc, pr, lc, lr[:, None])


def test_reward_model_metrics_are_the_shared_ones():
  pc, pr, *_ = _inputs(6)
  assert rm_loss.pairwise_accuracy is P.pairwise_accuracy and rm_loss.preference_metrics is P.preference_metrics
  with pytest.raises(ValueError, match="bradley_terry_loss: rejected_b has 6 rows but chosen_b has 7"):
    rm_loss.bradley_terry_loss(pc, pr[:6])
