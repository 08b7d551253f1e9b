"""GRPO on GSM8K-style JSONL data from a Hugging Face checkpoint (Qwen2.5 family).

  jaxrl-train --config=configs/qwen2_5_gsm8k.py \\
      --config.init.hf_checkpoint=/path/to/Qwen2.5-0.5B-Instruct \\
      --config.task.kwargs.path=/path/to/gsm8k_train.jsonl

The checkpoint folder holds config.json, safetensors and tokenizer files; prompts
are wrapped in its chat template, and answers are checked by the math verifier.
Samplers: when an NVIDIA GPU is visible and vLLM is installed (the ``[vllm]``
extra), generation runs in vLLM engines inside Ray sampler actors
(``sampler.kind='vllm'``, ``rollout.mode='pipeline'``, staleness bound
``rollout.max_lag``); otherwise the built-in JAX sampler generates in the
learner's process. Either choice can be forced with ``--config.sampler.kind``
and ``--config.rollout.mode``.
"""

import importlib.util
import os

import ml_collections

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "qwen2_5_gsm8k"
  c.task.name = "jsonl"
  c.task.kwargs = ml_collections.ConfigDict({"path": "", "prompt_field": "question", "answer_field": "answer",
                                             "verifier": "math"})
  c.task.use_chat_template = True
  c.task.eval_size = 64
  c.model.param_dtype = "bfloat16"
  c.model.dtype = "bfloat16"
  c.model.max_position_embeddings = 1024
  c.sft.steps = 0
  c.rl.steps = 200
  c.rl.prompts_per_step = 8
  c.rl.samples_per_prompt = 8
  c.rl.max_new_tokens = 256
  c.objective.recipe = "grpo"
  c.objective.kwargs.kl_coef = 0.001
  c.optimizer.lr = 1e-6
  c.optimizer.warmup_steps = 10
  c.eval.every = 50
  if vllm_usable():
    c.sampler.kind = "vllm"
    c.rollout.mode = "pipeline"
    c.rollout.num_samplers = 1
    c.rollout.max_lag = 1
  return c


def vllm_usable() -> bool:
  """An NVIDIA device node exists and the vllm package is importable."""
  return os.path.exists("/dev/nvidia0") and importlib.util.find_spec("vllm") is not None
