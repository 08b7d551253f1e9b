"""The default job: SFT warm start, then GRPO on multi-digit addition, on the CPU.

  jaxrl-train                       # this config
  jaxrl-train --config.rl.steps=50  # shorter
"""

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "grpo_addition"
  c.task.name = "addition"
  c.sft.steps = 150
  c.rl.steps = 200
  c.objective.recipe = "grpo"
  c.advantage.estimator = "grpo"
  return c
