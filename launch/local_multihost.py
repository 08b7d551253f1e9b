"""Starts an N-process learner on this machine: ``launch.train`` once per process.

  python -m launch.local_multihost --num_processes=2 --devices_per_process=4 -- \
      --config=configs/grpo_addition.py --config.model.batch_invariant=true --run_dir=runs/mh

Everything after ``--`` goes to every ``launch.train`` process. The processes
join one JAX job through a coordinator on 127.0.0.1 (a free port) and talk over
gloo; with ``--devices_per_process`` each gets that many XLA CPU devices, so the
learner mesh spans ``N * devices_per_process`` devices. Each process's output
goes to ``<process_logs>/learner_<i>.log`` (default: ``<run_dir>/logs``). The
command exits with the first non-zero exit code; if one process fails, the
others are stopped.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

_NUM_PROCESSES = flags.DEFINE_integer("num_processes", 2, "Learner processes.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 0,
                                "XLA CPU devices per process (0: the platform's own devices).", lower_bound=0)
_LOGS = flags.DEFINE_string("process_logs", None, "Folder of the per-process logs (default: <run_dir>/logs).")
_TIMEOUT = flags.DEFINE_float("timeout_s", None, "Stop the processes after this many seconds.")


def _run_dir(train_args):
  for arg in train_args:
    if arg.startswith("--run_dir="):
      return arg.split("=", 1)[1]
  return os.path.join("runs", "local_multihost")


def main(argv):
  from jaxrl_llm.experiments import definition, local
  train_args = list(argv[1:])
  log_dir = _LOGS.value or os.path.join(_run_dir(train_args), "logs")
  coordinator = f"127.0.0.1:{local.free_port()}"
  jobs = definition.learner_jobs(train_args, _NUM_PROCESSES.value, _DEVICES.value, coordinator)
  print(f"starting {len(jobs)} learner processes (coordinator {coordinator}); logs in {os.path.abspath(log_dir)}")
  results = local.run_jobs(jobs, log_dir, timeout_s=_TIMEOUT.value)
  code = 0
  for r in results:
    print(f"  {r.name}: exit code {r.returncode} ({r.log})")
    if r.returncode != 0 and code == 0:
      code = 1 if r.returncode is None else r.returncode
  sys.exit(code)


if __name__ == "__main__":
  app.run(main)
