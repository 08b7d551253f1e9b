"""PPO with a critic and GAE on addition: SFT warm start, critic warm-up (actor frozen), then PPO.

The critic is a separate decoder with a value head (random init, or a reward
model via ``--config.critic.init_from=<HF folder>``).
"""

from configs.addition_base import addition_config


def get_config():
  c = addition_config("ppo_addition")
  c.objective.recipe = "ppo"
  c.advantage.estimator = "gae"
  c.advantage.gamma = 1.0
  c.advantage.lam = 0.95
  c.advantage.normalization = "batch"
  c.critic.enabled = True
  c.critic.lr = 1e-3
  c.critic.warmup_steps = 10
  c.rl.filter_zero_variance = False  # a GAE batch has no groups to filter
  return c
