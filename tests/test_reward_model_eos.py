"""The score position: right- and left-padded rows, truncated rows without EOS, the no-EOS penalty."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.reward_model import eos

PAD, EOS = 0, 1
# row 0: finished (EOS at 3); row 1: truncated at the length limit (no EOS); row 2: finished,
# fills the row; row 3: empty.
RIGHT = np.array([[5, 6, 7, EOS, PAD, PAD],
                  [5, 8, 9, 9, 9, PAD],
                  [4, 5, 6, 7, 8, EOS],
                  [PAD] * 6], np.int32)
RIGHT_MASK = RIGHT != PAD


def left_pad(tokens, mask):
  out_t, out_m = np.full_like(tokens, PAD), np.zeros_like(mask)
  for i, (t, m) in enumerate(zip(tokens, mask)):
    n = int(m.sum())
    if n:
      out_t[i, -n:], out_m[i, -n:] = t[m], True
  return out_t, out_m


def test_score_index_right_and_left_padded():
  np.testing.assert_array_equal(eos.score_index(RIGHT_MASK), [3, 4, 5, 0])
  left, left_mask = left_pad(RIGHT, RIGHT_MASK)
  np.testing.assert_array_equal(eos.score_index(left_mask), [5, 5, 5, 0])
  # the token read is the same on both sides: EOS for finished rows, the last generated token otherwise.
  for tokens, mask in ((RIGHT, RIGHT_MASK), (left, left_mask)):
    idx = np.asarray(eos.score_index(mask))
    np.testing.assert_array_equal(tokens[np.arange(3), idx[:3]], [EOS, 9, EOS])


def test_ends_with_eos_flags_truncated_and_empty_rows():
  np.testing.assert_array_equal(eos.ends_with_eos(RIGHT, RIGHT_MASK, EOS), [True, False, True, False])
  np.testing.assert_array_equal(eos.ends_with_eos(*left_pad(RIGHT, RIGHT_MASK), EOS), [True, False, True, False])
  # several stop ids (e.g. <|im_end|> and <|endoftext|>)
  np.testing.assert_array_equal(eos.ends_with_eos(RIGHT, RIGHT_MASK, (EOS, 9)), [True, True, True, False])


def test_no_eos_penalty():
  out = eos.apply_no_eos_penalty(jnp.array([1.0, 1.0, -2.0]), jnp.array([True, False, False]), 0.5)
  np.testing.assert_array_equal(out, [1.0, 0.5, -2.5])
  np.testing.assert_array_equal(eos.apply_no_eos_penalty(jnp.ones(2), jnp.zeros(2, bool), 0.0), [1, 1])
  with pytest.raises(ValueError, match="penalty must be finite and >= 0"):
    eos.apply_no_eos_penalty(jnp.ones(2), jnp.zeros(2, bool), -1.0)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_reward_scores_equal_for_left_and_right_padding(batch_invariant):
  config = ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, max_position_embeddings=32, param_dtype="float32", dtype="float32",
                       reward_head=True, batch_invariant=batch_invariant, pad_token_id=PAD, eos_token_id=EOS)
  params = models.init_params(config, jax.random.PRNGKey(0))
  rows = slice(0, 3)  # the empty row has no score
  right = models.reward_scores(params, config, jnp.asarray(RIGHT[rows]), jnp.asarray(RIGHT_MASK[rows]))
  left_t, left_m = left_pad(RIGHT[rows], RIGHT_MASK[rows])
  left = models.reward_scores(params, config, jnp.asarray(left_t), jnp.asarray(left_m))
  assert np.isfinite(np.asarray(left)).all()
  np.testing.assert_allclose(left, right, rtol=1e-5, atol=1e-6)
  # and equal to the head read by hand at the last real token of each row alone
  for i in range(3):
    n = int(RIGHT_MASK[i].sum())
    alone = models.reward_scores(params, config, jnp.asarray(RIGHT[i:i + 1, :n]), jnp.ones((1, n), bool))
    np.testing.assert_allclose(alone, right[i:i + 1], rtol=1e-5, atol=1e-6)
  # changing a padding token does not change any score
  poked = RIGHT[rows].copy()
  poked[0, 5] = 9
  again = models.reward_scores(params, config, jnp.asarray(poked), jnp.asarray(RIGHT_MASK[rows]))
  np.testing.assert_array_equal(again, right)
