"""The ScaleRL recipe on addition: CISPO, prompt-level aggregation, batch-level advantage
normalisation, FP32 logits at the LM head, zero-variance filtering.

References: Khatri et al., The Art of Scaling Reinforcement Learning Compute for
LLMs (ScaleRL), arXiv:2510.13786; CISPO: MiniMax-M1, arXiv:2506.13585.
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("cispo_scalerl")
  c.objective.recipe = "cispo"
  c.objective.kwargs.aggregation = "prompt_mean"
  c.advantage.estimator = "dr_grpo"  # group-mean baseline; the std comes from the batch level
  c.advantage.normalization = "batch"
  c.advantage.norm_level = "sequence"  # each generation counts once in the batch std ...
  c.advantage.norm_shift_mean = False  # ... of advantages already centred on their group's mean
  # CISPO's ratio is to the generator's probabilities (PipelineRL / ScaleRL): pi_k := mu
  c.objective.proximal = "behaviour"
  c.rl.filter_zero_variance = True
  c.model.dtype = "float32"  # logits are FP32 at the LM head in every config; this keeps the trunk FP32 too
  return c
