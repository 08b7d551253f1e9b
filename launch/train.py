"""``jaxrl-train``: train a policy with RL (and an optional SFT warm start).

With no arguments it runs the embedded default, ``configs/grpo_addition.py``:
a small decoder learns multi-digit addition on the CPU.

  jaxrl-train                                        # the default job
  jaxrl-train --config=configs/ppo_addition.py       # another recipe
  jaxrl-train --config.objective.eps_high=0.28 --config.rl.steps=50

Every config field can be overridden as ``--config.<path>=<value>``; the whole
config is validated before anything starts.
"""

from __future__ import annotations

import os

from absl import app, flags, logging
from ml_collections import config_flags

import configs

_DEFAULT = os.path.join(os.path.dirname(configs.__file__), "grpo_addition.py")
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Path to a configs/*.py file.", lock_config=True)
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Overrides config.run_dir.")


def main(argv):
  del argv
  from jaxrl_llm import configuration
  from jaxrl_llm.learner import loop
  config = _CONFIG.value
  if _RUN_DIR.value:
    config.run_dir = _RUN_DIR.value
  try:
    configuration.validate(config)
  except configuration.ConfigError as e:
    raise app.UsageError(str(e)) from None
  logging.set_verbosity(logging.WARNING)
  loop.train(config)


def run():
  """Console-script entry point."""
  app.run(main)


if __name__ == "__main__":
  run()
