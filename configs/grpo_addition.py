"""The default job: SFT warm start, then GRPO on multi-digit addition, on the CPU.

  jaxrl-train                       # this config
  jaxrl-train --config.rl.steps=50  # shorter

Task, warm-start and batch settings are shared with the other addition configs
(configs/addition_base.py).
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("grpo_addition")
  c.objective.recipe = "grpo"
  # No KL term (the grpo recipe's default is 0.04): no reference policy is kept.
  c.objective.kwargs.kl_coef = 0.0
  c.advantage.estimator = "grpo"
  return c
