"""An experiment: a config, a hyper-parameter sweep, and the jobs of each run.

One definition, two launchers. :class:`Experiment` names a ``configs/*.py``
file, the overrides every run shares and a sweep (a list of override dicts,
one **work unit** per point). :func:`plan` checks every work unit's config
*before anything starts* and turns each into :class:`JobSpec` s:

* ``learner_<i>``: ``python -m launch.train --config=<file> --config.<k>=<v> ...``
  for each of the ``learner_processes`` processes of a multi-host learner
  (``--num_processes`` / ``--process_id`` / ``--coordinator_address``);
* ``sampler_<j>``: a Ray node (``ray start ... --block``) that hosts sampler
  actors; the learner joins it with ``rollout.mode="pipeline"`` and
  ``rollout.address`` (node 0 is the head, the others join it).

:mod:`jaxrl_llm.experiments.local` runs the jobs as local processes;
:mod:`jaxrl_llm.experiments.xm_backend` hands the same jobs to XManager
(``xm.JobGroup`` of ``xm.Job`` s, one work unit per sweep point).

Example::

  exp = Experiment(name="eps_sweep", config="configs/grpo_addition.py",
                   overrides={"rl.steps": 50},
                   sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.2}])
  units = plan(exp)            # raises ConfigError naming a bad field, launches nothing
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import sys
from typing import Any, Mapping, Sequence

import ml_collections

from jaxrl_llm import configuration
from jaxrl_llm.configuration import ConfigError

LEARNER = "learner"
SAMPLER = "sampler"


@dataclasses.dataclass(frozen=True)
class Experiment:
  """What to run.

  Attributes:
    name: experiment name (a folder name: no '/').
    config: path of a ``configs/*.py`` file with ``get_config()``.
    sweep: one override dict per work unit, e.g. ``[{"objective.kwargs.eps": 0.1}, ...]``;
      keys are dotted config paths.
    overrides: applied to every work unit before its sweep point.
    learner_processes: processes of each run's learner (multi-host when > 1).
    devices_per_process: > 0: XLA CPU devices per learner process (local CPU
      runs); 0 leaves the platform's devices alone.
    samplers: Ray sampler nodes per work unit; > 0 switches the run to
      ``rollout.mode="pipeline"`` against them.
    sampler_cpus: CPUs each sampler node offers to sampler actors.
    root: folder under which ``<name>/<work unit>/`` are written.
  """

  name: str
  config: str
  sweep: Sequence[Mapping[str, Any]] = ({},)
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  learner_processes: int = 1
  devices_per_process: int = 0
  samplers: int = 0
  sampler_cpus: int = 1
  root: str = "runs/experiments"

  @property
  def directory(self) -> str:
    return os.path.abspath(os.path.join(self.root, self.name))


@dataclasses.dataclass(frozen=True)
class Addresses:
  """Where a work unit's processes meet (``host:port``); chosen by the launcher."""

  coordinator: str = ""  # process 0 of a multi-process learner
  ray_head: str = ""  # the head sampler node


@dataclasses.dataclass(frozen=True)
class JobSpec:
  """One process of a work unit.

  Attributes:
    name: unique within the work unit (``learner_0``, ``sampler_0``, ...).
    kind: ``"learner"`` or ``"sampler"``.
    executable: ``"python"`` (run with the current interpreter) or ``"ray"``
      (the Ray command-line tool).
    args: the arguments after the executable.
    env: environment variables to set.
  """

  name: str
  kind: str
  executable: str
  args: tuple[str, ...]
  env: Mapping[str, str]


@dataclasses.dataclass(frozen=True)
class WorkUnit:
  """One run of the sweep, with its config already validated.

  Attributes:
    index: position in the sweep.
    point: the sweep point (its own overrides).
    overrides: shared overrides then the point's, in application order.
    directory: the run's folder (logs, metrics.jsonl, curves.png, ...).
    experiment: the experiment it belongs to.
  """

  index: int
  point: Mapping[str, Any]
  overrides: Mapping[str, Any]
  directory: str
  experiment: Experiment

  @property
  def name(self) -> str:
    return os.path.basename(self.directory)

  @property
  def log_dir(self) -> str:
    return os.path.join(self.directory, "logs")

  def learner_flags(self) -> dict[str, Any]:
    """``launch.train`` flags as an ordered dict (``{"config.objective.kwargs.eps": 0.1, ...}``).

    XManager turns a dict into ``--key=value`` arguments; :meth:`jobs` does
    the same for local processes.
    """
    flags: dict[str, Any] = {"config": os.path.abspath(self.experiment.config)}
    flags.update({f"config.{k}": v for k, v in self.overrides.items()})
    if self.experiment.samplers:
      flags["config.rollout.mode"] = "pipeline"
    flags["run_dir"] = self.directory
    return flags

  def jobs(self, addresses: Addresses = Addresses()) -> list[JobSpec]:
    """The work unit's processes: sampler nodes first, then the learner processes."""
    exp = self.experiment
    out = []
    for j in range(exp.samplers):
      if j == 0:
        port = addresses.ray_head.rsplit(":", 1)[-1]
        args = ("start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false")
      else:
        args = ("start", f"--address={addresses.ray_head}")
      args += (f"--num-cpus={exp.sampler_cpus}", "--num-gpus=0", "--block", "--disable-usage-stats")
      out.append(JobSpec(f"{SAMPLER}_{j}", SAMPLER, "ray", args, {}))
    flags = self.learner_flags()
    if exp.samplers:
      flags["config.rollout.address"] = addresses.ray_head
    train_args = [format_flag(k, v) for k, v in flags.items()]
    return out + learner_jobs(train_args, exp.learner_processes, exp.devices_per_process, addresses.coordinator)


def learner_jobs(train_args: Sequence[str], processes: int = 1, devices_per_process: int = 0,
                 coordinator: str = "") -> list[JobSpec]:
  """The processes of one learner: ``python -m launch.train <train_args>`` N times.

  Args:
    train_args: ``launch.train`` arguments (``--config=...``, overrides, ``--run_dir``).
    processes: N; with N > 1 each gets ``--num_processes``, ``--process_id``
      and ``--coordinator_address``.
    devices_per_process: > 0: that many XLA CPU devices per process (and the
      CPU platform); 0: the platform's own devices.
    coordinator: ``host:port`` of process 0 (needed when N > 1).

  Returns:
    ``learner_0 ... learner_{N-1}``.
  """
  if processes > 1 and not coordinator:
    raise ValueError(f"{processes} learner processes need a coordinator address")
  env = ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices_per_process}"}
         if devices_per_process else {})
  out = []
  for i in range(processes):
    args = ("-m", "launch.train") + tuple(train_args)
    if processes > 1:
      args += (f"--num_processes={processes}", f"--process_id={i}", f"--coordinator_address={coordinator}")
    out.append(JobSpec(f"{LEARNER}_{i}", LEARNER, "python", args, dict(env)))
  return out


def format_flag(key: str, value: Any) -> str:
  """``--key=value`` as absl and ``ml_collections.config_flags`` parse it back."""
  return f"--{key}={flag_value(key, value)}"


def flag_value(key: str, value: Any) -> str:
  """The command-line text of an override value.

  Raises:
    ConfigError: naming the field, for values a flag cannot carry (None, containers).
  """
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (int, float, str)):
    return repr(value) if isinstance(value, float) else str(value)
  raise ConfigError(f"override {key!r}={value!r}: expected a bool, number or string (a command-line value)")


def load_config(path: str) -> ml_collections.ConfigDict:
  """Runs ``get_config()`` of a ``configs/*.py`` file.

  Raises:
    ConfigError: naming the file when it is missing or has no ``get_config``.
  """
  if not os.path.isfile(path):
    raise ConfigError(f"experiment config {path!r}: no such file")
  spec = importlib.util.spec_from_file_location(f"_jaxrl_config_{abs(hash(os.path.abspath(path)))}", path)
  module = importlib.util.module_from_spec(spec)
  root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
  if root not in sys.path:  # configs import their siblings as ``configs.<name>``
    sys.path.insert(0, root)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"experiment config {path!r}: defines no get_config()")
  return module.get_config()


def apply_overrides(config: ml_collections.ConfigDict, overrides: Mapping[str, Any],
                    where: str = "") -> ml_collections.ConfigDict:
  """Sets every ``path: value`` of ``overrides`` on the (locked) ``config``.

  Raises:
    ConfigError: naming the field that does not exist or the value its type
      rejects (prefixed with ``where``, e.g. the work unit).
  """
  prefix = f"{where}: " if where else ""
  for path, value in overrides.items():
    flag_value(path, value)
    try:
      configuration.override(config, path, value)
    except ConfigError as e:
      raise ConfigError(f"{prefix}{e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
      raise ConfigError(f"{prefix}config field {path!r} cannot take {value!r}: {e}") from None
  return config


def _slug(point: Mapping[str, Any]) -> str:
  parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()]
  return re.sub(r"[^A-Za-z0-9_.=+-]", "_", ",".join(parts))[:80] or "base"


def plan(experiment: Experiment) -> list[WorkUnit]:
  """Validates every work unit's config and returns the work units; launches nothing.

  Each point's config is built exactly as its learner will build it (the
  config file, then ``overrides``, then the point) and checked with
  :func:`jaxrl_llm.configuration.validate`.

  Raises:
    ConfigError: naming the work unit and the field (a field that does not
      exist, a value of the wrong type, or a value outside what it accepts).
    ValueError: naming the experiment setting that is out of range.
  """
  if not experiment.name or "/" in experiment.name:
    raise ValueError(f"experiment name {experiment.name!r}: expected a non-empty name without '/'")
  if not experiment.sweep:
    raise ValueError("experiment sweep: expected at least one point (use [{}] for a single run)")
  for field in ("learner_processes", "sampler_cpus"):
    if getattr(experiment, field) < 1:
      raise ValueError(f"experiment {field}={getattr(experiment, field)}: expected >= 1")
  for field in ("devices_per_process", "samplers"):
    if getattr(experiment, field) < 0:
      raise ValueError(f"experiment {field}={getattr(experiment, field)}: expected >= 0")
  if experiment.samplers and not shutil.which("ray"):
    raise ValueError(f"experiment samplers={experiment.samplers}: the `ray` command is not on PATH")
  units = []
  for index, point in enumerate(experiment.sweep):
    where = f"work unit {index} {dict(point)}"
    merged = dict(experiment.overrides)
    merged.update(point)
    config = apply_overrides(load_config(experiment.config), merged, where)
    if experiment.samplers:
      apply_overrides(config, {"rollout.mode": "pipeline"}, where)
    try:
      configuration.validate(config)
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from None
    directory = os.path.join(experiment.directory, f"{index:02d}_{_slug(point)}")
    units.append(WorkUnit(index, dict(point), merged, directory, experiment))
  return units

