"""PPO with a critic and GAE on addition: SFT warm start, critic warm-up (actor frozen), then PPO.

The critic is a separate decoder with a value head, initialised from the
warm-start policy's architecture (or from a reward model via
``--config.critic.init_from=<HF folder>``).
"""

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "ppo_addition"
  c.sft.steps = 150
  c.rl.steps = 200
  c.objective.recipe = "ppo"
  c.advantage.estimator = "gae"
  c.advantage.gamma = 1.0
  c.advantage.lam = 0.95
  c.advantage.normalization = "batch"
  c.critic.enabled = True
  c.critic.lr = 1e-3
  c.critic.warmup_steps = 10
  return c
