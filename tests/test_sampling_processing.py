"""Token selection: top-k / top-p kept sets and renormalised log-probabilities vs numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.sampling import SamplerConfig, kept_set, select_tokens


def _numpy_kept(logits, temperature, top_k, top_p):
  """Reference: top-k by value (ties kept), then nucleus over the renormalised top-k distribution."""
  z = logits.astype(np.float64) / temperature
  keep = np.ones_like(z, bool)
  if 0 < top_k < z.shape[-1]:
    kth = np.sort(z, axis=-1)[:, ::-1][:, top_k - 1:top_k]
    keep &= z >= kth
  if top_p < 1:
    for b in range(z.shape[0]):
      order = np.argsort(-z[b], kind="stable")
      order = order[keep[b, order]]
      p = np.exp(z[b, order] - z[b, order].max())
      p /= p.sum()
      before = np.cumsum(p) - p
      n_keep = max(int((before < top_p).sum()), 1)
      keep[b] &= z[b] >= z[b, order[n_keep - 1]]
  return keep


def _numpy_logp(logits, keep, temperature, tokens):
  z = np.where(keep, logits.astype(np.float64) / temperature, -np.inf)
  logq = z - z.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  return logq[np.arange(len(tokens)), tokens]


@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (5, 1.0, 0.7), (0, 0.6, 1.3), (8, 0.75, 0.9)])
def test_logprob_of_the_sampled_distribution_matches_numpy(top_k, top_p, temperature):
  rng = np.random.default_rng(top_k)
  logits = (rng.standard_normal((64, 40)) * 2).astype(np.float32)
  uniform = rng.random(64).astype(np.float32)
  tokens, logp = jax.jit(lambda l, u: select_tokens(l, u, temperature=temperature, top_k=top_k, top_p=top_p))(
      logits, uniform)
  tokens, logp = np.asarray(tokens), np.asarray(logp)
  keep = _numpy_kept(logits, temperature, top_k, top_p)
  assert keep[np.arange(64), tokens].all(), "sampled a token outside the kept set"
  np.testing.assert_allclose(logp, _numpy_logp(logits, keep, temperature, tokens), atol=1e-5)
  mask = kept_set(jnp.asarray(logits), temperature, top_k, top_p)
  if top_k == 0 and top_p == 1.0:
    assert mask is None
  else:
    np.testing.assert_array_equal(np.asarray(mask), keep)
    assert (keep.sum(-1) < 40).all()


def test_sample_frequencies_follow_the_truncated_distribution():
  logits = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))
  n = 20000
  batch = np.tile(logits, (n, 1))
  uniform = jax.random.uniform(jax.random.PRNGKey(0), (n,))
  tokens, logp = jax.jit(lambda l, u: select_tokens(l, u, temperature=1.0, top_k=4, top_p=0.7))(batch, uniform)
  # top-k keeps 4 (mass 0.9); renormalised 0.444, 0.278, 0.167, 0.111; top-p 0.7 keeps the first 2.
  expected = np.array([0.4, 0.25]) / 0.65
  freq = np.bincount(np.asarray(tokens), minlength=6) / n
  assert freq[2:].sum() == 0
  np.testing.assert_allclose(freq[:2], expected, atol=0.015)
  np.testing.assert_allclose(np.asarray(logp)[:2], np.log(expected[np.asarray(tokens)[:2]]), atol=1e-5)


def test_greedy_takes_argmax_and_reports_its_logprob():
  logits = np.array([[0.1, 2.0, -1.0, 1.5], [3.0, 0.0, 0.0, 2.9]], np.float32)
  tokens, logp = select_tokens(jnp.asarray(logits), jnp.zeros(2), temperature=0.5, greedy=True)
  assert np.asarray(tokens).tolist() == [1, 0]
  np.testing.assert_allclose(logp, _numpy_logp(logits, np.ones_like(logits, bool), 0.5, np.array([1, 0])),
                             atol=1e-6)


def test_uniform_zero_never_picks_a_removed_token():
  logits = np.array([[5.0, -1.0, 4.0, 0.0]], np.float32)
  for u in (0.0, 0.999999):
    tokens, _ = select_tokens(jnp.asarray(logits), jnp.array([u], jnp.float32), temperature=1.0, top_k=2)
    assert int(tokens[0]) in (0, 2)


@pytest.mark.parametrize("field,value,match", [
    ("temperature", 0.0, "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -1, "top_k"),
    ("max_new_tokens", 0, "max_new_tokens"), ("num_samples", 0, "num_samples"),
    ("stop_token_ids", [1, 2], "stop_token_ids")])
def test_sampler_config_rejects_bad_values(field, value, match):
  with pytest.raises(ValueError, match=match):
    SamplerConfig(**{field: value})
