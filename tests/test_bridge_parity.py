"""Bridge + model parity: imported HF checkpoints give transformers' FP32 logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import models
from jaxrl_llm.bridge import hf_export, hf_import, layout

from test_bridge_hf import save_tiny_hf_model  # pylint: disable=wrong-import-order

torch = pytest.importorskip("torch")

TOL = 1e-4


def _tokens(vocab, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, size=(2, 12)).astype(np.int32)
  mask = np.ones((2, 12), bool)
  mask[1, 7:] = False            # right padding on the second sequence
  tokens[1, 7:] = 0
  return tokens, mask


def _ours(params, config, tokens, mask):
  out = models.forward(params, config, jnp.asarray(tokens), models.positions_from_mask(jnp.asarray(mask)),
                       jnp.asarray(mask))
  return np.asarray(out["logits_btv"])


def _theirs(model, tokens, mask):
  with torch.no_grad():
    return model(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                 attention_mask=torch.from_numpy(mask.astype(np.int64))).logits.float().numpy()


@pytest.mark.parametrize("name", ["qwen2", "qwen3_tied", "llama3", "llama_tied"])
def test_imported_checkpoint_logits_match_transformers(tmp_path, name):
  model = save_tiny_hf_model(name, tmp_path)
  params, config = hf_import.load_hf_checkpoint(tmp_path, param_dtype="float32", dtype="float32")
  tokens, mask = _tokens(config.vocab_size)
  ours, theirs = _ours(params, config, tokens, mask), _theirs(model, tokens, mask)
  assert ours.dtype == np.float32 and ours.shape == theirs.shape == (2, 12, 96)
  err = np.abs(ours - theirs)[mask].max()
  assert err < TOL, f"{name}: max |logit diff| {err:.2e} on real tokens"
  assert np.abs(theirs[mask]).max() > 0.1     # the comparison is not between near-zero logits


def test_model_params_follow_the_bridge_layout():
  for family in ("llama", "qwen2", "qwen3"):
    config = models.tiny(family, tie_word_embeddings=family == "qwen3", value_head=True, reward_head=True)
    params = jax.eval_shape(lambda key, c=config: models.init_params(c, key), jax.random.PRNGKey(0))
    layout.check_params_match(params, layout.backbone_specs(config) + layout.head_specs(config),
                              f"init_params({family})")


def test_exported_model_params_run_in_transformers(tmp_path):
  config = models.tiny("llama", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=2,
                       rope_theta=500000.0,
                       rope_scaling=models.RopeScaling(8.0, 1.0, 4.0, 32))
  rng = np.random.default_rng(2)
  params = {}
  for spec in layout.backbone_specs(config):
    scale, offset = (0.1, 1.0) if spec.path[-1] == "scale" else (0.2, 0.0)
    layout.set_path(params, spec.path, jnp.asarray(offset + scale * rng.normal(size=spec.shape), jnp.float32))
  hf_export.export_hf_checkpoint(params, config, tmp_path)
  transformers = pytest.importorskip("transformers")
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
  tokens, mask = _tokens(config.vocab_size, seed=1)
  err = np.abs(_ours(params, config, tokens, mask) - _theirs(model, tokens, mask))[mask].max()
  assert err < TOL, f"max |logit diff| {err:.2e}"
