"""pi_k in the RL step: the objectives see the learner's pre-update log-probabilities, not mu."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import models, objectives as O
from jaxrl_llm.learner import rl_step
from jaxrl_llm.learner.state import create_train_state

CONFIG = models.tiny("qwen2", vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1,
                     max_position_embeddings=16)
N, GROUPS, T = 2, 4, 10
EPS = 0.2


def _batch(params, stale_noise: float, seed: int = 0) -> rl_step.RLBatch:
  rng = np.random.default_rng(seed)
  b = GROUPS * N
  tokens = jnp.asarray(rng.integers(3, 24, (b, T)), jnp.int32)
  seq = jnp.ones((b, T), bool)
  response = jnp.asarray(np.arange(T)[None] >= 4).repeat(b, 0)
  adv = jnp.where(response, jnp.asarray(rng.normal(size=(b, 1)), jnp.float32), 0.0)
  logp = models.sequence_logprobs(params, CONFIG, tokens, seq, 1.0)
  behaviour = logp + stale_noise * jnp.asarray(rng.normal(size=(b, T)), jnp.float32)
  zeros = jnp.zeros((b, T), jnp.float32)
  return rl_step.RLBatch(tokens, seq, response, behaviour, adv, zeros, jnp.ones((b, T), jnp.int32), zeros, zeros)


def _step(objective, proximal="forward", micro_batches=1):
  opt = optax.sgd(1.0)  # new params = params - gradient: the step's gradient is readable exactly
  spec = rl_step.RLStepSpec(model=CONFIG, temperature=1.0, group_size=N, proximal=proximal,
                            micro_batches=micro_batches)
  return rl_step.make_rl_step(spec, objective, opt), opt


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(0))


def _gradient(params, new_params):
  return jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), params, new_params)


def test_stale_decoupled_step_matches_the_float64_decoupled_loss(params):
  """pi_k = the step's own forward (not mu): value and gradient of the decoupled loss of Hilton et al."""
  batch = _batch(params, stale_noise=0.3)
  objective = O.recipe("decoupled_ppo", eps=EPS)
  step, opt = _step(objective)
  state = create_train_state(params, opt, 0)
  new, _, m = step(state, objective.init(None), batch)
  logp_k = np.asarray(m["logp_bt"], np.float64)
  mu = np.asarray(batch.behaviour_logp_bt, np.float64)
  mask = np.asarray(batch.response_mask_bt)
  assert np.abs(logp_k - mu)[mask].max() > 0.1  # stale: pi_k != mu in the record
  # float64 reference at theta = theta_k: r = pi_theta / pi_k = 1 (inside the clip), weight rho_k = pi_k / mu
  rho = np.exp(logp_k - mu)
  adv = np.asarray(batch.advantages_bt, np.float64)
  loss_ref = -(rho * adv)[mask].sum() / mask.sum()
  np.testing.assert_allclose(float(m["loss"]), loss_ref, rtol=1e-5)
  np.testing.assert_allclose(float(m["decoupled/prox_weight_mean"]), rho[mask].mean(), rtol=1e-5)
  np.testing.assert_allclose(float(m["decoupled/ratio_mean"]), 1.0, rtol=1e-6)

  # gradient reference: d/dtheta of -sum(rho * A * pi_theta / pi_k) / N = -sum(rho * A * dlogpi) / N
  rho32, adv32, mask32 = (jnp.asarray(x, jnp.float32) for x in (rho, adv, mask))

  def reference(p):
    logp = models.sequence_logprobs(p, CONFIG, batch.tokens_bt, batch.seq_mask_bt, 1.0)
    return -jnp.sum(jnp.where(mask32 > 0, rho32 * adv32 * jnp.exp(logp - jax.lax.stop_gradient(logp)), 0.0)) \
        / jnp.sum(mask32)

  want = jax.grad(reference)(params)
  got = _gradient(params, new.params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, np.asarray(w, np.float64), rtol=1e-4, atol=1e-7)


def test_fresh_decoupled_ppo_equals_ppo_bit_for_bit(params):
  """With mu = pi_k (a bit-identical sampler) and one update, decoupled PPO is PPO."""
  batch = _batch(params, stale_noise=0.0)
  ppo = O.recipe("grpo", kl_coef=0.0, aggregation="token_mean")
  step, opt = _step(ppo)
  state = create_train_state(params, opt, 0)
  _, _, m0 = step(state, ppo.init(None), batch)
  batch = batch.replace(behaviour_logp_bt=m0["logp_bt"])  # the learner's own pi_k, same bits
  results = {}
  for name, objective in (("ppo", ppo), ("decoupled", O.recipe("decoupled_ppo", eps=0.2))):
    step, _ = _step(objective)
    new, _, m = step(state, objective.init(None), batch)
    results[name] = (new.params, float(m["loss"]))
  assert results["ppo"][1] == results["decoupled"][1]
  for a, b in zip(jax.tree.leaves(results["ppo"][0]), jax.tree.leaves(results["decoupled"][0])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_precomputed_pi_k_matches_the_forward_and_behaviour_mode_uses_mu(params):
  batch = _batch(params, stale_noise=0.3)
  objective = O.recipe("decoupled_ppo", eps=EPS)
  state = create_train_state(params, optax.sgd(1.0), 0)
  forward, _ = _step(objective, "forward")
  _, _, m_fwd = forward(state, objective.init(None), batch)
  precomputed = batch.replace(prox_logp_bt=models.sequence_logprobs(params, CONFIG, batch.tokens_bt,
                                                                    batch.seq_mask_bt, 1.0))
  for micro in (1, 2):  # "batch": pi_k given, held across micro-batches
    step, _ = _step(objective, "batch", micro)
    _, _, m = step(state, objective.init(None), precomputed)
    np.testing.assert_allclose(float(m["loss"]), float(m_fwd["loss"]), rtol=1e-5)
  ppo = O.recipe("grpo", kl_coef=0.0, aggregation="token_mean")
  step, _ = _step(ppo, "behaviour")  # pi_k := mu: the clip ratio is the common pi_theta / mu
  assert "ppo_clip/ratio_mean" not in step(state, ppo.init(None), batch)[2]
  _, _, m = step(state, ppo.init(None), batch)
  mu_ratio = np.exp(np.asarray(m_fwd["logp_bt"]) - np.asarray(batch.behaviour_logp_bt))
  np.testing.assert_allclose(float(m["ratio_mean"]),
                             mu_ratio[np.asarray(batch.response_mask_bt)].mean(), rtol=1e-5)
  with pytest.raises(ValueError, match="prox_logp_bt"):
    step, _ = _step(objective, "batch")
    step(state, objective.init(None), batch)
  with pytest.raises(ValueError, match="micro_batches=1"):
    rl_step.RLStepSpec(model=CONFIG, temperature=1.0, group_size=N, proximal="forward", micro_batches=2)


def test_dual_clip_reachable_from_the_recipes():
  for name in ("ppo", "grpo", "dapo", "decoupled_ppo"):
    kwargs = {"value_coef": None} if name == "ppo" else {}
    chain = O.recipe(name, dual_c=3.0, **kwargs)
    assert isinstance(chain, O.ObjectiveTransform)
  with pytest.raises(ValueError, match="dual_c must be a number > 1"):
    O.recipe("grpo", dual_c=1.0)
  # the dual bound caps the loss of a token with A < 0 and a large ratio at -c * A
  logp = jnp.log(jnp.array([[5.0]]))
  kw = dict(mask_bt=jnp.array([[True]]), advantages_bt=jnp.array([[-1.0]]), behaviour_logp_bt=jnp.zeros((1, 1)))
  plain = O.recipe("grpo", kl_coef=0.0)
  dual = O.recipe("grpo", kl_coef=0.0, dual_c=3.0)
  loss_plain, _ = O.objective_loss(plain, logp, state=plain.init(None), **kw)
  loss_dual, _ = O.objective_loss(dual, logp, state=dual.init(None), **kw)
  np.testing.assert_allclose([float(loss_plain), float(loss_dual)], [5.0, 3.0], rtol=1e-6)
