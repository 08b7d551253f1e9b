"""The local backend: an experiment's jobs as processes on this machine.

No XManager needed. For each work unit (in sweep order, ``parallel`` at a
time) it takes the addresses of :func:`~jaxrl_llm.experiments.definition.addresses_for`
(the experiment's ``ray_head`` / ``coordinator`` when set, which must then be
this machine's; else free ports on 127.0.0.1), starts the sampler nodes (and
waits for the Ray head to listen), then the learner processes, and waits for
the learners. If one learner fails, the others are stopped; sampler nodes are
stopped when the learners are done. Each job runs in its own process group
(so a job's children stop with it) and writes its output to
``<work unit>/logs/<job>.log``; the run itself writes ``metrics.jsonl``,
``curves.png``, ``summary.json``, TensorBoard events and checkpoints into
the work unit's folder, and ``work_unit.json`` records the jobs, their
arguments and exit codes. ``<experiment>/experiment.json`` lists the work
units.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from jaxrl_llm.configuration import ConfigError
from jaxrl_llm.experiments.definition import (LEARNER, SAMPLER, Addresses, Experiment, JobSpec, WorkUnit,
                                              addresses_for, flag_value)
from jaxrl_llm.experiments.planning import plan
from jaxrl_llm.rollout.cluster import free_port  # noqa: F401 (also the launchers' port picker)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass
class JobResult:
  """How one job ended: ``returncode`` (None: stopped by the launcher) and its log."""

  name: str
  returncode: Optional[int]
  log: str


@dataclasses.dataclass
class WorkUnitResult:
  """A finished work unit: its jobs' results, wall-clock seconds and output paths."""

  unit: WorkUnit
  jobs: list[JobResult]
  seconds: float

  @property
  def ok(self) -> bool:
    return all(j.returncode == 0 for j in self.jobs if j.name.startswith(LEARNER))

  @property
  def metrics(self) -> str:
    return os.path.join(self.unit.directory, "metrics.jsonl")

  @property
  def plot(self) -> str:
    return os.path.join(self.unit.directory, "curves.png")


def _wait_for_port(address: str, timeout_s: float, alive) -> None:
  host, port = address.rsplit(":", 1)
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if not alive():
      raise RuntimeError(f"the Ray head at {address} exited before listening")
    with socket.socket() as s:
      s.settimeout(1.0)
      if s.connect_ex((host, int(port))) == 0:
        return
    time.sleep(0.5)
  raise TimeoutError(f"the Ray head at {address} did not listen within {timeout_s:.0f} s")


def _command(job: JobSpec, python: str) -> list[str]:
  if job.executable == "python":
    return [python, *job.args]
  exe = shutil.which(job.executable)
  if exe is None:
    raise FileNotFoundError(f"job {job.name}: executable {job.executable!r} not found on PATH")
  return [exe, *job.args]


def start_job(job: JobSpec, log_dir: str, python: str = sys.executable) -> tuple[subprocess.Popen, str]:
  """Starts ``job`` in its own process group, output to ``<log_dir>/<job>.log``.

  Returns:
    (the process, the log path).
  """
  os.makedirs(log_dir, exist_ok=True)
  log_path = os.path.join(log_dir, f"{job.name}.log")
  env = dict(os.environ)
  env.update(job.env)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
  with open(log_path, "w") as log:
    proc = subprocess.Popen(_command(job, python), stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
  return proc, log_path


def stop_job(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
  """SIGTERM to the job's process group, SIGKILL after ``grace_s`` if it is still there."""
  if proc.poll() is not None:
    return
  for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=wait)
      return
    except subprocess.TimeoutExpired:
      continue


def run_jobs(jobs: Sequence[JobSpec], log_dir: str, addresses: Addresses = Addresses(),
             timeout_s: Optional[float] = None, python: str = sys.executable,
             ready_timeout_s: float = 120.0) -> list[JobResult]:
  """Runs one work unit's jobs: samplers first, then learners; returns when the learners end.

  Args:
    jobs: the work unit's :class:`JobSpec` s.
    log_dir: folder of the per-job logs.
    addresses: where the Ray head listens (waited for before the learners start).
    timeout_s: stop everything after this many seconds (learners then report
      ``returncode=None``).
    python: interpreter for ``python`` jobs.
    ready_timeout_s: how long the Ray head may take to start listening.

  Returns:
    One :class:`JobResult` per job, in ``jobs`` order; sampler nodes stopped
    by the launcher report ``returncode=None``.
  """
  procs: dict[str, tuple[subprocess.Popen, str]] = {}
  order = [j for j in jobs if j.kind == SAMPLER] + [j for j in jobs if j.kind == LEARNER]
  stopped: set[str] = set()
  try:
    for job in order:
      procs[job.name] = start_job(job, log_dir, python)
      if job.kind == SAMPLER and job.name.endswith("_0"):
        head = procs[job.name][0]
        _wait_for_port(addresses.ray_head, ready_timeout_s, lambda: head.poll() is None)
    learners = [j.name for j in order if j.kind == LEARNER]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(procs[n][0].poll() is None for n in learners):
      if any(procs[n][0].poll() not in (None, 0) for n in learners):
        break  # one learner failed: the others would wait for it forever
      if deadline is not None and time.monotonic() > deadline:
        break
      time.sleep(0.5)
  finally:
    for name, (proc, _) in procs.items():
      if proc.poll() is None:
        stopped.add(name)
        stop_job(proc)
  return [JobResult(j.name, None if j.name in stopped else procs[j.name][0].returncode, procs[j.name][1])
          for j in jobs if j.name in procs]


def run_work_unit(unit: WorkUnit, timeout_s: Optional[float] = None, python: str = sys.executable) -> WorkUnitResult:
  """Runs one work unit to completion and records it in ``<work unit>/work_unit.json``."""
  addresses = addresses_for(unit.experiment, free_port)
  jobs = unit.jobs(addresses)
  os.makedirs(unit.log_dir, exist_ok=True)
  start = time.monotonic()
  results = run_jobs(jobs, unit.log_dir, addresses, timeout_s, python)
  result = WorkUnitResult(unit, results, time.monotonic() - start)
  record = {
      "index": unit.index, "point": {k: flag_value(k, v) for k, v in unit.point.items()},
      "overrides": {k: flag_value(k, v) for k, v in unit.overrides.items()},
      "ok": result.ok, "seconds": result.seconds,
      "jobs": [{"name": j.name, "kind": j.kind, "command": [j.executable, *j.args], "env": dict(j.env),
                "returncode": r.returncode, "log": r.log} for j, r in zip(jobs, results)],
  }
  with open(os.path.join(unit.directory, "work_unit.json"), "w") as f:
    json.dump(record, f, indent=2)
  return result


def run_experiment(experiment: Experiment, parallel: int = 1, timeout_s: Optional[float] = None,
                   python: str = sys.executable) -> list[WorkUnitResult]:
  """Validates every work unit (nothing starts if one is bad), then runs them.

  Args:
    experiment: the definition.
    parallel: work units running at the same time.
    timeout_s: per work unit.
    python: interpreter of the learner processes.

  Returns:
    One :class:`WorkUnitResult` per work unit, in sweep order.

  Raises:
    ConfigError: before anything starts, naming the work unit and the field, or
      ``parallel`` > 1 with fixed addresses (``ray_head``, ``coordinator``) that
      concurrent work units would all bind.
  """
  units = plan(experiment)
  fixed = [f"{k}={getattr(experiment, k)!r}" for k in ("ray_head", "coordinator") if getattr(experiment, k)]
  if fixed and parallel > 1 and len(units) > 1:
    raise ConfigError(f"parallel={parallel} with experiment {', '.join(fixed)}: concurrent work units would all "
                      "listen on the same address; expected parallel=1, or empty addresses (free loopback ports)")
  os.makedirs(experiment.directory, exist_ok=True)
  with open(os.path.join(experiment.directory, "experiment.json"), "w") as f:
    json.dump({"name": experiment.name, "config": os.path.abspath(experiment.config),
               "learner_processes": experiment.learner_processes, "samplers": experiment.samplers,
               "sampler_cpus": experiment.sampler_cpus, "sampler_gpus": experiment.sampler_gpus,
               "ray_head": experiment.ray_head, "coordinator": experiment.coordinator,
               "work_units": [{"index": u.index, "directory": u.directory,
                               "point": {k: flag_value(k, v) for k, v in u.point.items()}} for u in units]},
              f, indent=2)
  if parallel <= 1:
    return [run_work_unit(u, timeout_s, python) for u in units]
  with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
    return list(pool.map(lambda u: run_work_unit(u, timeout_s, python), units))
