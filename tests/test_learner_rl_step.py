"""The RL step: training on informative groups only equals training on the whole masked batch."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import advantages as A, models, objectives as O
from jaxrl_llm.learner import optim, rl_step
from jaxrl_llm.learner.state import create_train_state

CONFIG = models.tiny("qwen2", vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1,
                     max_position_embeddings=16)
N = 4  # samples per prompt


def test_informative_rows_buckets_and_fallbacks():
  flags = np.repeat(np.array([1, 0, 1, 1, 0, 1, 1, 1], bool), 2)  # groups 1 and 4 informative
  np.testing.assert_array_equal(rl_step.informative_rows(flags, 2, 2), [2, 3, 8, 9])
  # three informative groups -> a 4-group bucket padded with the first filtered group
  flags3 = np.repeat(np.array([1, 0, 1, 0, 0, 1, 1, 1], bool), 2)
  np.testing.assert_array_equal(rl_step.informative_rows(flags3, 2, 2), [2, 3, 6, 7, 8, 9, 0, 1])
  # nothing to drop, or no smaller bucket: every row, in order
  np.testing.assert_array_equal(rl_step.informative_rows(np.zeros(16, bool), 2, 2), np.arange(16))
  np.testing.assert_array_equal(rl_step.informative_rows(flags, 2, 16), np.arange(16))
  # all groups solved: the smallest bucket
  assert len(rl_step.informative_rows(np.ones(16, bool), 2, 4)) == 4


def test_training_on_informative_rows_equals_the_masked_batch():
  rng = np.random.default_rng(0)
  groups, t = 8, 10
  b = groups * N
  params = models.init_params(CONFIG, jax.random.PRNGKey(0))
  tokens = jnp.asarray(rng.integers(3, 24, (b, t)), jnp.int32)
  seq = jnp.ones((b, t), bool)
  response = jnp.asarray(np.arange(t)[None] >= 4).repeat(b, 0)
  rewards = rng.integers(0, 2, (groups, N)).astype(np.float32)
  rewards[[0, 2, 3, 5, 7]] = 1.0  # five solved groups: zero variance
  out = A.group_advantages(jnp.asarray(rewards.reshape(-1)), N)
  response = response & ~out.zero_variance_b[:, None]
  adv = A.sequence_to_tokens(out.advantages_b, response)
  # behaviour log-probabilities off by a little, so ratios differ from 1 and the loss is not ~0
  behaviour = models.sequence_logprobs(params, CONFIG, tokens, seq, 1.0) + 0.1 * jnp.asarray(
      rng.normal(size=(b, t)), jnp.float32)
  zeros = jnp.zeros((b, t), jnp.float32)
  full = rl_step.RLBatch(tokens, seq, response, behaviour, adv, zeros, jnp.zeros((b, t), jnp.int32), zeros, zeros)
  rows = rl_step.informative_rows(np.asarray(out.zero_variance_b), N, N)
  assert len(rows) == 4 * N  # 3 informative groups -> a 4-group bucket
  small = jax.tree.map(lambda a: a[rows], full)

  objective = O.recipe("grpo", kl_coef=0.0)
  lr = 1e-3
  opt = optim.make_optimizer(lr)
  # pi_k := mu: the ratios pi_theta / mu differ from 1 (with pi_k from the forward, r = 1 and the loss is ~0)
  spec = rl_step.RLStepSpec(model=CONFIG, temperature=1.0, group_size=N, proximal="behaviour")
  step = rl_step.make_rl_step(spec, objective, opt)
  state = create_train_state(params, opt, 0)
  s_full, _, m_full = step(state, objective.init(None), full)
  s_small, _, m_small = step(state, objective.init(None), small)
  assert abs(float(m_full["loss"])) > 1e-3
  np.testing.assert_allclose(float(m_small["loss"]), float(m_full["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(m_small["grad_norm"]), float(m_full["grad_norm"]), rtol=1e-5)
  # Adam's first step moves a parameter by lr * g / (|g| + eps): where |g| is of the order of eps the
  # move is a fraction of lr that the last bits of g decide, and the two batches sum the same
  # gradients in another order. So the moves agree to 1% of lr (a gradient of the other sign is 2 lr away).
  for x, y in zip(jax.tree.leaves(s_full.params), jax.tree.leaves(s_small.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=1e-2 * lr)
