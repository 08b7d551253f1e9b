"""The ScaleRL recipe on addition: CISPO, prompt-level aggregation, batch-level advantage
normalisation, FP32 logits at the LM head, zero-variance filtering.

Reference: Khatri et al., The Art of Scaling Reinforcement Learning Compute for
LLMs (ScaleRL), arXiv:2510.13786; CISPO: MiniMax-M1, arXiv:2506.13585.
"""

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "cispo_scalerl"
  c.sft.steps = 150
  c.rl.steps = 200
  c.objective.recipe = "cispo"
  c.objective.aggregation = "prompt_mean"
  c.advantage.estimator = "dr_grpo"  # group mean baseline; the batch-level std comes next
  c.advantage.normalization = "batch"
  c.rl.filter_zero_variance = True
  c.model.dtype = "float32"  # logits are FP32 at the LM head in every config; this keeps the trunk FP32 too
  return c
