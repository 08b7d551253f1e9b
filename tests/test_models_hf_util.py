"""Test helpers (no tests here): tiny Hugging Face models and a local HF -> params copy.

The real importer lives in ``jaxrl_llm.bridge``; this small copy keeps the model
tests independent of it. Kernels are the transpose of torch Linear weights.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxrl_llm.models import ModelConfig


def hf_config(c: ModelConfig):
  """The transformers config equivalent to ``c``."""
  rope = {"rope_type": "default", "rope_theta": float(c.rope_theta)}
  if c.rope_scaling is not None:
    s = c.rope_scaling
    rope = {"rope_type": "llama3", "rope_theta": float(c.rope_theta), "factor": s.factor,
            "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings}
  common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, max_position_embeddings=c.max_position_embeddings,
                rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=c.tie_word_embeddings, rope_parameters=rope,
                pad_token_id=c.pad_token_id, eos_token_id=c.eos_token_id, bos_token_id=c.bos_token_id,
                attn_implementation="eager")
  if c.family == "qwen2":
    return transformers.Qwen2Config(**common)
  if c.family == "qwen3":
    return transformers.Qwen3Config(head_dim=c.resolved_head_dim, attention_bias=False, **common)
  return transformers.LlamaConfig(head_dim=c.resolved_head_dim, attention_bias=False, mlp_bias=False, **common)


def hf_model(c: ModelConfig, seed: int = 0):
  """A float32 HF causal LM for ``c`` with every weight (norms and biases too) random."""
  torch.manual_seed(seed)
  cls = {"qwen2": transformers.Qwen2ForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
         "llama": transformers.LlamaForCausalLM}[c.family]
  model = cls(hf_config(c)).float().eval()
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight"):
        param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
      else:
        param.copy_(0.05 * torch.randn(param.shape, generator=gen))
  return model


def params_from_hf(model, c: ModelConfig) -> dict:
  """Copies an HF state dict into the model_spec params tree (Linear weights transposed)."""
  sd = {k: v.detach().cpu().numpy().astype(np.float32) for k, v in model.state_dict().items()}

  def cast(a):
    return jnp.asarray(a, dtype=jnp.dtype(c.param_dtype))

  def linear(prefix, bias):
    out = {"kernel": cast(sd[prefix + ".weight"].T)}
    if bias:
      out["bias"] = cast(sd[prefix + ".bias"])
    return out

  params = {"embed": {"embedding": cast(sd["model.embed_tokens.weight"])},
            "final_norm": {"scale": cast(sd["model.norm.weight"])}}
  for i in range(c.num_layers):
    pre = f"model.layers.{i}."
    attn = {name: linear(pre + "self_attn." + name, c.attention_bias and name != "o_proj")
            for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if c.qk_norm:
      attn["q_norm"] = {"scale": cast(sd[pre + "self_attn.q_norm.weight"])}
      attn["k_norm"] = {"scale": cast(sd[pre + "self_attn.k_norm.weight"])}
    params[f"layers_{i}"] = {
        "attn_norm": {"scale": cast(sd[pre + "input_layernorm.weight"])},
        "attn": attn,
        "mlp_norm": {"scale": cast(sd[pre + "post_attention_layernorm.weight"])},
        "mlp": {name: linear(pre + "mlp." + name, False) for name in ("gate_proj", "up_proj", "down_proj")},
    }
  if not c.tie_word_embeddings:
    params["lm_head"] = {"kernel": cast(sd["lm_head.weight"].T)}
  return params


def hf_logits(model, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> np.ndarray:
  """float32 logits [B, T, V] of right-padded sequences."""
  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(np.asarray(tokens_bt), dtype=torch.long),
                attention_mask=torch.as_tensor(np.asarray(mask_bt), dtype=torch.long))
  return out.logits.float().numpy()
