"""DAPO on addition: clip-higher (0.2 / 0.28), token-level loss, zero-variance groups filtered.

Reference: Yu et al., DAPO, arXiv:2503.14476.
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("dapo_addition")
  c.objective.recipe = "dapo"
  c.objective.kwargs.eps_low = 0.2
  c.objective.kwargs.eps_high = 0.28
  c.advantage.estimator = "grpo"
  c.rl.filter_zero_variance = True
  return c
