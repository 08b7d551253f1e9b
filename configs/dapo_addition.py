"""DAPO on addition: clip-higher (0.2 / 0.28), token-level loss, zero-variance groups filtered.

Reference: Yu et al., DAPO, arXiv:2503.14476.
"""

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "dapo_addition"
  c.sft.steps = 150
  c.rl.steps = 200
  c.objective.recipe = "dapo"
  c.objective.eps_low = 0.2
  c.objective.eps_high = 0.28
  c.advantage.estimator = "grpo"
  c.rl.filter_zero_variance = True
  return c
