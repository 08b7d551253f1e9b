"""Logit parity with Hugging Face transformers (float32, tolerance 1e-4).

Covers Qwen2 (QKV bias), Qwen3 (q/k norm, head_dim != D/H, tied embeddings) and
Llama with Llama 3 RoPE scaling in default mode, and Qwen3 in batch-invariant
mode, on right-padded batches of unequal lengths.
"""

import jax
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.models import RopeScaling
from test_models_hf_util import hf_logits, hf_model, params_from_hf

SMALL = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
             max_position_embeddings=256)

CASES = {
    "qwen2": models.tiny("qwen2", **SMALL),
    "qwen3_tied": models.tiny("qwen3", tie_word_embeddings=True, head_dim=24, **SMALL),
    "llama3_scaled": models.tiny("llama", rope_theta=500000.0, rms_norm_eps=1e-5,
                                 rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                          original_max_position_embeddings=16), **SMALL),
}


def _batch(vocab, lengths, t, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (len(lengths), t)).astype(np.int32)
  mask = np.arange(t)[None] < np.asarray(lengths)[:, None]
  return np.where(mask, tokens, 0).astype(np.int32), mask


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name):
  config = CASES[name]
  hf = hf_model(config, seed=3)
  params = params_from_hf(hf, config)
  tokens, mask = _batch(config.vocab_size, [40, 17, 1], 40)
  expected = hf_logits(hf, tokens, mask)
  out = jax.jit(lambda p, t, m: models.forward(p, config, t, models.positions_from_mask(m), m))(params, tokens, mask)
  logits = np.asarray(out["logits_btv"])
  assert logits.dtype == np.float32
  err = np.abs(logits - expected)[mask].max()
  print(f"{name}: max |logits - HF| = {err:.2e}")
  assert err < 1e-4, err
  # the logits really differ between positions and families (not a degenerate match)
  assert np.abs(expected[0, 1] - expected[0, 2]).max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3_tied"])
def test_invariant_mode_matches_transformers(name):
  config = CASES[name].replace(batch_invariant=True)
  hf = hf_model(config, seed=4)
  params = params_from_hf(hf, config)
  tokens, mask = _batch(config.vocab_size, [37, 5], 37, seed=1)
  expected = hf_logits(hf, tokens, mask)
  logits = np.asarray(models.forward(params, config, tokens, models.positions_from_mask(mask), mask)["logits_btv"])
  err = np.abs(logits - expected)[mask].max()
  print(f"{name} (batch-invariant): max |logits - HF| = {err:.2e}")
  assert err < 1e-4, err


def test_sequence_logprobs_match_transformers_log_softmax():
  config = CASES["qwen2"]
  hf = hf_model(config, seed=5)
  params = params_from_hf(hf, config)
  tokens, mask = _batch(config.vocab_size, [30, 12], 30, seed=2)
  logits = hf_logits(hf, tokens, mask) / 0.7
  logp_ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - logits.max(-1, keepdims=True)
  expected = np.zeros(tokens.shape, np.float32)
  expected[:, 1:] = np.take_along_axis(logp_ref[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
  expected = np.where(mask, expected, 0.0)
  logp = np.asarray(models.sequence_logprobs(params, config, tokens, mask, temperature=0.7))
  assert logp[:, 0].tolist() == [0.0, 0.0]
  assert (logp[~mask] == 0).all()
  np.testing.assert_allclose(logp, expected, atol=1e-4)
