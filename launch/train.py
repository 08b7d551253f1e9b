"""``jaxrl-train``: train a policy with RL (and an optional SFT warm start).

With no arguments it runs the embedded default, ``configs/grpo_addition.py``:
a small decoder learns multi-digit addition on the CPU.

  jaxrl-train                                        # the default job
  jaxrl-train --config=configs/ppo_addition.py       # another recipe
  jaxrl-train --config=configs/dapo_addition.py --config.objective.kwargs.eps_high=0.3 --config.rl.steps=50
  jaxrl-train --config=configs/rm_addition.py        # a reward model (config.job="reward_model")

Every config field can be overridden as ``--config.<path>=<value>``, and a recipe or
task argument added as ``--config.objective.kwargs.<name>=<value>`` /
``--config.task.kwargs.<name>=<value>`` (only these two mappings accept new keys; a
misspelt field elsewhere is an error); the whole config is validated before anything
starts (docs/config.md lists every field, recipe argument and task argument).

A wrong input (a mistyped flag or field, an unknown recipe or task, a mesh larger than
the machine, a missing file) prints one paragraph and exits with status 2; a run stopped
on purpose (non-finite updates, a failing reward) prints one paragraph and exits with 1;
``--verbose`` or ``JAXRL_VERBOSE=1`` adds the traceback (launch/cli.py).

A multi-host learner runs this same command once per process, with
``--num_processes=N --process_id=i --coordinator_address=host:port`` (or the
``JAXRL_NUM_PROCESSES`` / ``JAXRL_PROCESS_ID`` / ``JAXRL_COORDINATOR``
variables); ``python -m launch.local_multihost`` starts N such processes on
this machine.
"""

from __future__ import annotations

import os

from absl import flags, logging
from ml_collections import config_flags

import configs
from launch import cli

_DEFAULT = os.path.join(os.path.dirname(configs.__file__), "grpo_addition.py")
# The config files return base_config()'s locked ConfigDict, whose only open parts are
# task.kwargs and objective.kwargs: accept_new_attributes lets a flag add a key there,
# and a new key anywhere else still fails (lock_config=True would lock the kwargs too).
_CONFIG = config_flags.DEFINE_config_file("config", _DEFAULT, "Path to a configs/*.py file.", lock_config=False,
                                          accept_new_attributes=True)
_RUN_DIR = flags.DEFINE_string("run_dir", None, "Overrides config.run_dir.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 of a multi-process learner (default: $JAXRL_COORDINATOR).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "Learner processes (default: $JAXRL_NUM_PROCESSES, else 1).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index (default: $JAXRL_PROCESS_ID).")


def main(argv):
  del argv
  from jaxrl_llm import configuration, errors  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.learner import multihost  # pylint: disable=import-outside-toplevel
  try:
    multihost.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  except ValueError as e:
    cli.fail(str(e), cli.USAGE_EXIT)
  from jaxrl_llm import jobs  # pylint: disable=import-outside-toplevel
  config = cli.load_config(_CONFIG)
  if _RUN_DIR.value:
    config.run_dir = _RUN_DIR.value
  logging.set_verbosity(logging.WARNING)
  with cli.user_errors():
    try:
      configuration.validate(config)
      job = jobs.make_job(config)
    except OSError as e:  # before anything ran, a file the input names is missing or unreadable
      raise errors.ConfigError(str(e)) from e
    job.train()


def run():
  """Console-script entry point."""
  cli.run(main)


if __name__ == "__main__":
  run()
