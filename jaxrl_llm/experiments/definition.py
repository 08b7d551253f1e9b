"""An experiment: a config, a hyper-parameter sweep, and the jobs of each run.

One definition, two launchers. :class:`Experiment` names a ``configs/*.py``
file, the overrides every run shares and a sweep (a list of override dicts,
one **work unit** per point). :func:`jaxrl_llm.experiments.planning.plan` checks
every work unit's config *before anything starts* and the work units turn into
:class:`JobSpec` s:

* ``learner_<i>``: ``python -m launch.train --config=<file> --config.<k>=<v> ...``
  for each of the ``learner_processes`` processes of a multi-host learner
  (``--num_processes`` / ``--process_id`` / ``--coordinator_address``);
* ``sampler_<j>``: a Ray node (``ray start ... --num-cpus=<sampler_cpus>
  --num-gpus=<sampler_gpus> --block``) that hosts sampler actors; node 0 is the
  head (``--head --port=<port of ray_head>``), the others join it
  (``--address=<ray_head>``). The learner runs with ``rollout.mode="pipeline"``
  and ``rollout.address=<ray_head>``.

Where the jobs meet (:func:`addresses_for`): ``Experiment.ray_head`` and
``Experiment.coordinator`` when set (a cluster's hosts), else free ports on
127.0.0.1. Sampler nodes bind loopback (``--node-ip-address=127.0.0.1``) only
when the head's host is a loopback address; otherwise Ray binds each node's own
address.

:func:`~jaxrl_llm.experiments.planning.plan` also refuses layouts the run would refuse at start-up or that
could never place its sampler actors: several learner processes with sampler
nodes or with ``rollout.mode="pipeline"`` (the Ray sampler pool is driven from
one learner process), sampler nodes whose GPUs (``sampler_gpus``) or CPUs
(``sampler_cpus``) cannot hold ``rollout.num_samplers`` actors
(:func:`jaxrl_llm.rollout.placement.gpus_per_actor`,
:func:`jaxrl_llm.rollout.placement.check_capacity`), sampler GPUs on nodes that
all run on this machine (a loopback head), a config that sets
``rollout.address`` itself while the experiment starts sampler nodes, and
malformed addresses.

:mod:`jaxrl_llm.experiments.local` runs the jobs as local processes;
:mod:`jaxrl_llm.experiments.xm_backend` hands the same jobs to XManager
(``xm.JobGroup`` of ``xm.Job`` s, one work unit per sweep point).

Example::

  exp = Experiment(name="eps_sweep", config="configs/grpo_addition.py",
                   overrides={"rl.steps": 50},
                   sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.2}])
  units = planning.plan(exp)   # raises ConfigError naming a bad field, launches nothing
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import sys
from typing import Any, Callable, Mapping, Sequence

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
      ``rollout.mode="pipeline"`` against them (``rollout.address`` is set to
      the head, so the config may not set it) and needs ``learner_processes=1``.
    sampler_cpus: CPUs each sampler node declares (``ray start --num-cpus``);
      each sampler actor reserves ``rollout.actor_cpus`` of them.
    sampler_gpus: GPUs each sampler node declares (``ray start --num-gpus``);
      each sampler actor asks for
      :func:`jaxrl_llm.rollout.placement.gpus_per_actor` of them (vLLM: the
      tensor-parallel size, + 1 with ``rollout.weight_transport='nccl'``; the
      JAX sampler on ``sampler.platform='gpu'``: 1; on the CPU: 0), all on one
      node. 0: the nodes offer CPUs only. > 0 needs a ``ray_head`` that is not
      loopback (nodes on one machine would all offer its GPUs 0..N-1).
    ray_head: ``host:port`` where the head sampler node listens (its host is
      where the launcher's executor places ``sampler_0``); the other nodes and
      the learner join it there. Empty: the launcher picks ``127.0.0.1:<free
      port>`` (every job on this machine). A loopback host (127.x,
      ``localhost``) binds every sampler node to 127.0.0.1; any other host lets
      Ray bind each node's own address.
    coordinator: ``host:port`` of learner process 0 (the host that runs
      ``learner_0``) when ``learner_processes > 1``. Empty: the launcher picks
      ``127.0.0.1:<free port>``.
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
  sampler_gpus: int = 0
  ray_head: str = ""
  coordinator: str = ""
  root: str = "runs/experiments"

  @property
  def directory(self) -> str:
    return os.path.abspath(os.path.join(self.root, self.name))


@dataclasses.dataclass(frozen=True)
class Addresses:
  """Where a work unit's processes meet (``host:port``); :func:`addresses_for` chooses them."""

  coordinator: str = ""  # process 0 of a multi-process learner
  ray_head: str = ""  # the head sampler node


LOOPBACK_PLACEHOLDER = "127.0.0.1:0"  # stands for the head address a launcher picks, while plan() validates


def parse_address(value: str, field: str) -> tuple[str, int]:
  """``"host:port"`` -> ``(host, port)``.

  Args:
    value: the address.
    field: the setting it comes from, for the message (``"ray_head"``).

  Raises:
    ConfigError: naming ``field`` when ``value`` is not ``host:port`` with a
      non-empty host and an integer port in [1, 65535].
  """
  host, sep, port = str(value).rpartition(":")
  if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
    raise ConfigError(f"experiment {field}={value!r}: expected host:port with an integer port in [1, 65535] "
                      "(e.g. 'sampler-0.cluster:6379'), or empty to let the launcher pick 127.0.0.1:<free port>")
  return host, int(port)


def is_loopback(host: str) -> bool:
  """Whether ``host`` names this machine's loopback interface (``127.x.x.x`` or ``localhost``)."""
  return host == "localhost" or host.startswith("127.")


def addresses_for(experiment: Experiment, free_port: Callable[[], int]) -> Addresses:
  """Where one work unit's jobs meet: the experiment's addresses when set, else loopback free ports.

  Both launchers call this once per work unit.

  Args:
    experiment: the definition (``ray_head`` and ``coordinator`` when set are used as they are).
    free_port: returns a TCP port free on 127.0.0.1 (called only for an address that is needed
      and not set).

  Returns:
    ``Addresses(coordinator=..., ray_head=...)``; an address the work unit does not need
    (no sampler nodes, a single learner process) is empty.
  """
  coordinator = ray_head = ""
  if experiment.learner_processes > 1:
    coordinator = experiment.coordinator or f"127.0.0.1:{free_port()}"
  if experiment.samplers:
    ray_head = experiment.ray_head or f"127.0.0.1:{free_port()}"
  return Addresses(coordinator=coordinator, ray_head=ray_head)


def sampler_node_args(index: int, ray_head: str, cpus: int, gpus: int) -> tuple[str, ...]:
  """``ray start`` arguments of sampler node ``index`` (0: the head) of a cluster whose head is ``ray_head``.

  Args:
    index: the node; 0 starts the head (``--head --port=<port of ray_head>``), any
      other joins it (``--address=<ray_head>``).
    ray_head: ``host:port`` of the head node.
    cpus, gpus: what the node declares (``--num-cpus``, ``--num-gpus``).

  Raises:
    ConfigError: when ``ray_head`` is not ``host:port``.
  """
  host, port = parse_address(ray_head, "ray_head")
  loopback = is_loopback(host)
  if index == 0:
    args: tuple[str, ...] = ("start", "--head", f"--port={port}")
    if loopback:
      args += ("--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1")
    args += ("--include-dashboard=false",)
  else:
    args = ("start", f"--address={ray_head}")
    if loopback:
      args += ("--node-ip-address=127.0.0.1",)
  return args + (f"--num-cpus={cpus}", f"--num-gpus={gpus}", "--block", "--disable-usage-stats")


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
    """The work unit's processes: sampler nodes first, then the learner processes.

    Args:
      addresses: where the jobs meet (:func:`addresses_for`).

    Raises:
      ValueError: when sampler nodes have no ``addresses.ray_head`` or several
        learner processes no ``addresses.coordinator``.
    """
    exp = self.experiment
    if exp.samplers and not addresses.ray_head:
      raise ValueError(f"{exp.samplers} sampler nodes need a head address (addresses.ray_head)")
    out = [JobSpec(f"{SAMPLER}_{j}", SAMPLER, "ray",
                   sampler_node_args(j, addresses.ray_head, exp.sampler_cpus, exp.sampler_gpus), {})
           for j in range(exp.samplers)]
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


def slug(point: Mapping[str, Any]) -> str:
  """A folder-name fragment of a sweep point (``eps=0.1,kl=0.0``; "base" for ``{}``)."""
  parts = [f"{k.rsplit('.', 1)[-1]}={v}" for k, v in point.items()]
  return re.sub(r"[^A-Za-z0-9_.=+-]", "_", ",".join(parts))[:80] or "base"
