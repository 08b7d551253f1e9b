"""The XManager backend: the same experiment definition, launched through XManager.

Written against the open-source XManager API (``pip install 'jaxrl_llm[xm]'``;
imported lazily, so the rest of the package works without it):

* ``xm_local.create_experiment(experiment_title=...)`` opens the experiment;
* ``experiment.package([...])`` turns two ``xm.binary`` packageables into
  executables: the learner (this Python running ``-m launch.train``) and the
  sampler node (the ``ray`` command);
* per sweep point, ``experiment.add(xm.JobGroup(learner_0=xm.Job(...), ...,
  sampler_0=xm.Job(...)), args={job: {"args": {...}}})`` adds one work unit:
  the group holds the learner hosts (one job per process of a multi-host
  learner) and the sampler nodes, and the point's config overrides reach the
  learner jobs as ``--config.<path>=<value>`` arguments through ``args``.

Addresses come from :func:`~jaxrl_llm.experiments.definition.addresses_for`, as for
the local backend: the experiment's ``ray_head`` and ``coordinator`` when set, else
free ports on 127.0.0.1 of the launching machine. Sampler nodes bind loopback
(``--node-ip-address=127.0.0.1``) only when ``ray_head`` is a loopback address.

What runs where:

* ``executor`` defaults to ``xm_local.Local()``: every job is a process on this
  machine, and the default loopback addresses are right.
* Any other executor is passed to every ``xm.Job`` as it is. The default
  packageables are ``xm.binary`` s for ``xm_local.Local.Spec()`` (this Python, the
  local ``ray`` command); a cluster executor needs packageables built for its spec
  (for example ``xm.python_container`` for ``xm_local.Vertex``), passed as
  ``launch(..., packages={"learner": ..., "sampler": ...})``: the learner one runs
  ``python -m launch.train`` and takes the job's ``--key=value`` flags, the sampler
  one runs the ``ray`` command with the job's arguments. It also needs
  ``Experiment.ray_head`` set to the host that will run ``sampler_0`` (and
  ``coordinator`` to the host of ``learner_0`` when ``learner_processes > 1``): a
  free port on the launching machine is no address for a job on another host.
  With fixed addresses an experiment must have one work unit (every work unit
  would meet at the same address); :func:`launch` refuses more.
* On a cluster the learner's host must also run a Ray node joined to the head
  with none of the learner's GPUs (``ray start --address=<ray_head> --num-gpus=0``),
  since a Ray driver attaches to a Ray node on its own host; this backend does not
  start it (docs/experiments.md, "A cluster layout").
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, Mapping, Optional

from jaxrl_llm.configuration import ConfigError
from jaxrl_llm.experiments.definition import (LEARNER, SAMPLER, Addresses, Experiment, JobSpec, WorkUnit,
                                              addresses_for, flag_value)
from jaxrl_llm.experiments.planning import plan
from jaxrl_llm.experiments.local import REPO_ROOT
from jaxrl_llm.rollout.cluster import free_port


def import_xm():
  """``(xm, xm_local)`` from the installed ``xmanager``.

  Raises:
    ImportError: saying which extra to install.
  """
  try:
    from xmanager import xm, xm_local
  except ImportError as e:
    raise ImportError("the XManager backend needs the `xmanager` package: pip install 'jaxrl_llm[xm]' "
                      f"({e})") from e
  return xm, xm_local


def packageables(xm: Any, xm_local: Any, samplers: bool, python: str = sys.executable) -> dict[str, Any]:
  """``{"learner": xm.Packageable, ["sampler": ...]}`` for the Local executor.

  Args:
    xm, xm_local: the XManager modules (:func:`import_xm`).
    samplers: also package the sampler node (the ``ray`` command).
    python: interpreter of the learner.
  """
  spec = xm_local.Local.Spec()
  out = {LEARNER: xm.binary(executor_spec=spec, path=python, args=["-m", "launch.train"],
                            env_vars={"PYTHONPATH": REPO_ROOT})}
  if samplers:
    ray = shutil.which("ray")
    if ray is None:
      raise FileNotFoundError("sampler nodes need the `ray` command on PATH")
    out[SAMPLER] = xm.binary(executor_spec=spec, path=ray)
  return out


def _learner_flags(job: JobSpec) -> dict[str, str]:
  """A learner job's ``--key=value`` arguments as an ordered dict (after ``-m launch.train``)."""
  flags = {}
  for arg in job.args[2:]:
    key, value = arg[2:].split("=", 1)
    flags[key] = value
  return flags


def job_group(xm: Any, executables: Mapping[str, Any], executor: Any, unit: WorkUnit,
              addresses: Addresses) -> Any:
  """The work unit's ``xm.JobGroup``: ``learner_<i>`` jobs and ``sampler_<j>`` jobs.

  The learner jobs carry what every point shares (the config file, the
  shared overrides, the process flags); :func:`work_unit_args` carries the
  point's overrides and run folder.
  """
  shared = set(unit.experiment.overrides)
  own = {f"config.{k}" for k in unit.point if k not in shared} | {"run_dir"}
  jobs = {}
  for job in unit.jobs(addresses):
    if job.kind == LEARNER:
      args: Any = {k: v for k, v in _learner_flags(job).items() if k not in own}
    else:
      args = list(job.args)
    jobs[job.name] = xm.Job(executable=executables[job.kind], executor=executor, name=job.name, args=args,
                            env_vars=dict(job.env))
  return xm.JobGroup(**jobs)


def work_unit_args(unit: WorkUnit) -> dict[str, dict[str, dict[str, str]]]:
  """``experiment.add(..., args=...)`` of a work unit: its sweep point and run folder, per learner job."""
  point = {f"config.{k}": flag_value(k, v) for k, v in unit.point.items()}
  point["run_dir"] = unit.directory
  return {f"{LEARNER}_{i}": {"args": dict(point)} for i in range(unit.experiment.learner_processes)}


def launch(experiment: Experiment, python: str = sys.executable, executor: Optional[Any] = None,
           packages: Optional[Mapping[str, Any]] = None) -> Any:
  """Validates every work unit, then adds one XManager work unit per sweep point.

  Args:
    experiment: the definition (the same one the local backend runs); its
      ``ray_head`` / ``coordinator`` when set, else free loopback ports
      (:func:`~jaxrl_llm.experiments.definition.addresses_for`).
    python: interpreter of the learner jobs (default packageables only).
    executor: an ``xm.Executor`` (default ``xm_local.Local()``).
    packages: ``{"learner": xm.Packageable, "sampler": ...}`` for ``executor``'s spec
      (``"sampler"`` only with sampler nodes); default: :func:`packageables` for the
      Local executor.

  Returns:
    The XManager experiment (its work units are running when this returns).

  Raises:
    ConfigError: before anything is created, naming the work unit and field, a
      ``packages`` without the packageable a job needs, or fixed addresses
      (``ray_head``, ``coordinator``) with more than one work unit.
  """
  units = plan(experiment)
  fixed = [f"{k}={getattr(experiment, k)!r}" for k in ("ray_head", "coordinator") if getattr(experiment, k)]
  if fixed and len(units) > 1:
    raise ConfigError(f"experiment {', '.join(fixed)} with {len(units)} work units: XManager runs them at the same "
                      "time and every one would listen on the same address; expected one work unit per experiment "
                      "with fixed addresses, or empty addresses (free loopback ports, Local executor)")
  kinds = [LEARNER] + ([SAMPLER] if experiment.samplers else [])
  if packages is not None:
    missing = [k for k in kinds if k not in packages]
    if missing:
      raise ConfigError(f"launch packages={sorted(packages)}: expected a packageable for {missing} too")
  xm, xm_local = import_xm()
  executor = executor if executor is not None else xm_local.Local()
  if packages is not None:
    pk = {k: packages[k] for k in kinds}
  else:
    pk = packageables(xm, xm_local, bool(experiment.samplers), python)
  with xm_local.create_experiment(experiment_title=experiment.name) as xp:
    executables = dict(zip(pk, xp.package(list(pk.values()))))
    for unit in units:
      addresses = addresses_for(experiment, free_port)
      xp.add(job_group(xm, executables, executor, unit, addresses), args=work_unit_args(unit))
  return xp
