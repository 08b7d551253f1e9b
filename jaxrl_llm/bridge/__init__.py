"""Weights and tokenizers between Hugging Face, the Flax learner and the samplers.

  hf_config      config.json <-> ModelConfig (Llama, Qwen2, Qwen3)
  hf_import      HF safetensors folder -> sharded Flax params, tensor by tensor
  hf_export      Flax params -> HF folder transformers loads
  reshard        Flax params -> vLLM tensor-parallel names, fusions and slices
  tokenizer      tokenizers wrapper, chat templates, char-level tokenizers
  fingerprint    sampler / learner agreement (tokenizer, template, model)

The name table shared by all of them is :mod:`jaxrl_llm.bridge.layout`.
"""

from jaxrl_llm.bridge.fingerprint import (Fingerprint, FingerprintMismatchError, check_fingerprints,
                                          check_tokenizer_matches_config, make_fingerprint,
                                          model_fingerprint)
from jaxrl_llm.bridge.hf_config import (SUPPORTED_ARCHITECTURES, config_from_hf, config_to_hf,
                                        hf_eos_token_ids, read_hf_config)
from jaxrl_llm.bridge.hf_export import export_hf_checkpoint
from jaxrl_llm.bridge.hf_import import CheckpointMismatchError, load_hf_checkpoint, load_hf_params
from jaxrl_llm.bridge.reshard import (ReshardPlan, iter_hf_tensors, iter_vllm_shards, make_reshard_plan,
                                      reassemble, shard_for_vllm)
from jaxrl_llm.bridge.tokenizer import Tokenizer, build_char_tokenizer

__all__ = [
    "CheckpointMismatchError", "Fingerprint", "FingerprintMismatchError", "ReshardPlan",
    "SUPPORTED_ARCHITECTURES", "Tokenizer", "build_char_tokenizer", "check_fingerprints",
    "check_tokenizer_matches_config", "config_from_hf", "config_to_hf", "export_hf_checkpoint",
    "hf_eos_token_ids", "iter_hf_tensors", "iter_vllm_shards", "load_hf_checkpoint", "load_hf_params",
    "make_fingerprint", "make_reshard_plan", "model_fingerprint", "read_hf_config", "reassemble",
    "shard_for_vllm",
]
