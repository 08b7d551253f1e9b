"""Rejection-sampling fine-tuning: best-of-K selection and the SFT batch it builds."""

import jax
import numpy as np
import pytest

from jaxrl_llm import models, reduce
from jaxrl_llm.learner import rft, sft

EOS, PAD = 1, 0


def test_select_best_of_k_hand_checked():
  rewards = [0.0, 1.0, 1.0, 0.5,  # best 1.0, tie between rows 1 and 2 -> row 1
             0.0, 0.0, 0.0, 0.0,  # best 0.0 < min_reward: dropped
             0.2, 0.9, 0.9, 0.1]  # best 0.9 at rows 9 and 10 -> row 9
  np.testing.assert_array_equal(rft.select_best_of_k(rewards, 4, min_reward=0.5), [1, 9])
  np.testing.assert_array_equal(rft.select_best_of_k(rewards, 4, min_reward=1.0), [1])
  finished = np.ones(12, bool)
  finished[[1, 9, 10]] = False  # truncated rows are not eligible
  np.testing.assert_array_equal(rft.select_best_of_k(rewards, 4, 0.2, finished_b=finished), [2, 8])
  np.testing.assert_array_equal(rft.select_best_of_k(rewards, 12, 0.0), [1])
  assert rft.select_best_of_k(rewards, 4, min_reward=2.0).shape == (0,)
  assert rft.select_best_of_k(rewards, 4).dtype == np.int64


def test_select_best_of_k_bad_input():
  with pytest.raises(ValueError, match="group_size"):
    rft.select_best_of_k([1.0, 0.0, 1.0], 2)
  with pytest.raises(ValueError, match="group_size"):
    rft.select_best_of_k([1.0, 0.0], 0)
  with pytest.raises(ValueError, match=r"rewards_b must have shape \[B\]"):
    rft.select_best_of_k([[1.0, 0.0]], 2)
  with pytest.raises(ValueError, match="finite"):
    rft.select_best_of_k([1.0, float("nan")], 2)
  with pytest.raises(ValueError, match="finished_b"):
    rft.select_best_of_k([1.0, 0.0], 2, finished_b=[True])


def test_rft_batch_contents_one_stop_token():
  prompts_g = [[5, 6], [7]]  # per group, N = 2
  responses = [[8, EOS], [9, 9, EOS, PAD, PAD], [10, 11], [12, EOS]]
  batch = rft.rft_batch(prompts_g, responses, [1, 2], EOS, PAD, length=16, bucket=8)
  # row 1: prompt of group 0 + [9, 9] (trailing pads and EOS stripped) + one EOS
  # row 2: prompt of group 1 + [10, 11] (unfinished: collate appends the EOS)
  np.testing.assert_array_equal(batch.tokens_bt, [[5, 6, 9, 9, EOS, PAD, PAD, PAD],
                                                  [7, 10, 11, EOS, PAD, PAD, PAD, PAD]])
  np.testing.assert_array_equal(batch.seq_mask_bt, [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.target_mask_bt, [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]])
  per_row = rft.rft_batch([[5, 6], [5, 6], [7], [7]], responses, [1, 2], EOS, PAD, length=16, bucket=8)
  np.testing.assert_array_equal(per_row.tokens_bt, batch.tokens_bt)
  padded = rft.rft_batch(prompts_g, responses, [1, 2], EOS, PAD, length=16, bucket=8, num_rows=4)
  np.testing.assert_array_equal(padded.tokens_bt[:2], batch.tokens_bt)
  np.testing.assert_array_equal(padded.tokens_bt[2:], PAD)
  np.testing.assert_array_equal(padded.seq_mask_bt[2:], [[1, 0, 0, 0, 0, 0, 0, 0]] * 2)
  assert not np.asarray(padded.target_mask_bt[2:]).any()


def test_rft_batch_bad_input():
  responses = [[8, EOS], [9, EOS]]
  with pytest.raises(ValueError, match="rows is empty"):
    rft.rft_batch([[5]], responses, [], EOS, PAD, 16)
  with pytest.raises(ValueError, match="rows must be ints"):
    rft.rft_batch([[5]], responses, [2], EOS, PAD, 16)
  with pytest.raises(ValueError, match="prompt_ids"):
    rft.rft_batch([[5], [6], [7]], responses, [0], EOS, PAD, 16)
  with pytest.raises(ValueError, match="num_rows"):
    rft.rft_batch([[5]], responses, [0, 1], EOS, PAD, 16, num_rows=1)
  with pytest.raises(ValueError, match="context length"):
    rft.rft_batch([[5] * 10], responses, [0], EOS, PAD, 8)


def test_best_of_k_metrics():
  m = rft.best_of_k_metrics([0.0, 1.0, 0.0, 0.0, 0.5, 0.2], [1, 4], 2)
  assert m == {"rft/selected_groups": 2.0, "rft/selected_share": 2 / 3, "rft/selected_reward_mean": 0.75}


def test_padding_rows_change_neither_loss_nor_gradient():
  config = models.tiny("qwen2", vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=1,
                       max_position_embeddings=16)
  params = models.init_params(config, jax.random.PRNGKey(0))
  rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 0.0]
  rows = rft.select_best_of_k(rewards, 2, 1.0)
  np.testing.assert_array_equal(rows, [0, 3])
  prompts_g = [[3, 4, 5], [6, 7], [8]]
  responses = [[9, 10, EOS], [11, EOS], [12, EOS], [13, 14, 15, EOS], [2], [2, EOS]]
  loss_grad = jax.jit(jax.value_and_grad(
      lambda p, b: sft.sft_token_loss(p, b, reduce.token_count(b.target_mask_bt), config)[0]))
  plain = rft.rft_batch(prompts_g, responses, rows, EOS, PAD, 16)
  padded = rft.rft_batch(prompts_g, responses, rows, EOS, PAD, 16, num_rows=4)
  (loss, grads), (loss_p, grads_p) = loss_grad(params, plain), loss_grad(params, padded)
  assert np.isfinite(loss) and loss > 0
  np.testing.assert_allclose(loss_p, loss, rtol=1e-6)
  for g, gp in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_p)):
    assert np.all(np.isfinite(gp))
    np.testing.assert_allclose(gp, g, rtol=1e-5, atol=1e-7)
