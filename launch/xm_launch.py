"""Launches a hyper-parameter sweep: one work unit per point, with XManager or locally.

  # XManager (pip install 'jaxrl_llm[xm]'): one xm.JobGroup per point, on the Local executor
  python -m launch.xm_launch --name=eps_sweep --config=configs/grpo_addition.py \
      --sweep=objective.kwargs.eps=0.1,0.2 --set=rl.steps=50

  # the same experiment as local processes, without XManager
  python -m launch.xm_launch --backend=local --name=eps_sweep --config=configs/grpo_addition.py \
      --sweep=objective.kwargs.eps=0.1,0.2 --set=rl.steps=50

``--sweep=path=v1,v2,...`` (repeatable) sweeps a config field; several
``--sweep`` flags make their cartesian product. ``--set=path=value``
(repeatable) applies to every work unit. Each work unit runs
``--learner_processes`` learner processes (a multi-host learner when > 1) or
``--samplers`` Ray sampler nodes with one learner process (the run then uses
``rollout.mode=pipeline`` and ``rollout.address`` set to the head), each node
declaring ``--sampler_cpus`` CPUs and ``--sampler_gpus`` GPUs. ``--ray_head`` and
``--coordinator`` (``host:port``) fix where the head sampler node and learner
process 0 listen; empty, each work unit gets free ports on 127.0.0.1.
Every work unit's config and layout are validated before anything launches: a
field that does not exist, or sampler nodes that cannot hold the run's sampler
actors, is an error naming the field. Outputs: ``<root>/<name>/<work unit>/``
(logs/, metrics.jsonl, curves.png, summary.json, work_unit.json).
"""

from __future__ import annotations

import ast
import itertools
import sys

from absl import app, flags

from launch import cli

_NAME = flags.DEFINE_string("name", "sweep", "Experiment name (folder under --root).")
_CONFIG = flags.DEFINE_string("config", "configs/grpo_addition.py", "A configs/*.py file.")
_SWEEP = flags.DEFINE_multi_string("sweep", [], "path=v1,v2,... : one work unit per value (product over flags).")
_SET = flags.DEFINE_multi_string("set", [], "path=value applied to every work unit.")
_BACKEND = flags.DEFINE_enum("backend", "xm", ["xm", "local"], "xm: XManager; local: local processes.")
_LEARNER_PROCESSES = flags.DEFINE_integer("learner_processes", 1, "Processes per learner.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices_per_process", 0, "XLA CPU devices per learner process (0: platform's).",
                                lower_bound=0)
_SAMPLERS = flags.DEFINE_integer("samplers", 0, "Ray sampler nodes per work unit.", lower_bound=0)
_SAMPLER_CPUS = flags.DEFINE_integer("sampler_cpus", 1, "CPUs each sampler node declares (ray start --num-cpus).",
                                     lower_bound=1)
_SAMPLER_GPUS = flags.DEFINE_integer("sampler_gpus", 0, "GPUs each sampler node declares (ray start --num-gpus).",
                                     lower_bound=0)
_RAY_HEAD = flags.DEFINE_string("ray_head", "", "host:port of the head sampler node on a cluster; empty: "
                                "127.0.0.1:<free port>.")
_COORDINATOR = flags.DEFINE_string("coordinator", "", "host:port of learner process 0 on a cluster; empty: "
                                   "127.0.0.1:<free port>.")
_ROOT = flags.DEFINE_string("root", "runs/experiments", "Output root.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Local backend: work units at a time.", lower_bound=1)


def parse_value(text: str):
  """``0.1`` -> float, ``3`` -> int, ``true`` -> True, anything else stays a string."""
  if text.lower() in ("true", "false"):
    return text.lower() == "true"
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text
  return value if isinstance(value, (int, float, str, bool)) else text


def _split(flag: str, text: str) -> tuple[str, str]:
  if "=" not in text:
    raise app.UsageError(f"--{flag}={text!r}: expected path=value")
  return tuple(text.split("=", 1))  # type: ignore[return-value]


def build_experiment(name, config, sweep, sets, learner_processes=1, devices_per_process=0, samplers=0,
                     root="runs/experiments", sampler_cpus=1, sampler_gpus=0, ray_head="", coordinator=""):
  """The :class:`~jaxrl_llm.experiments.Experiment` these flags describe.

  Raises:
    app.UsageError: naming a ``--sweep`` or ``--set`` value that is not ``path=value``.
  """
  from jaxrl_llm.experiments import Experiment
  axes = []
  for text in sweep:
    path, values = _split("sweep", text)
    axes.append([(path, parse_value(v)) for v in values.split(",")])
  points = [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]
  overrides = dict((p, parse_value(v)) for p, v in (_split("set", s) for s in sets))
  return Experiment(name=name, config=config, sweep=points, overrides=overrides,
                    learner_processes=learner_processes, devices_per_process=devices_per_process,
                    samplers=samplers, sampler_cpus=sampler_cpus, sampler_gpus=sampler_gpus, ray_head=ray_head,
                    coordinator=coordinator, root=root)


def main(argv):
  del argv
  from jaxrl_llm import experiments
  with cli.user_errors():
    exp = build_experiment(_NAME.value, _CONFIG.value, _SWEEP.value, _SET.value, _LEARNER_PROCESSES.value,
                           _DEVICES.value, _SAMPLERS.value, _ROOT.value, sampler_cpus=_SAMPLER_CPUS.value,
                           sampler_gpus=_SAMPLER_GPUS.value, ray_head=_RAY_HEAD.value,
                           coordinator=_COORDINATOR.value)
    units = experiments.plan(exp)
  print(f"experiment {exp.name}: {len(units)} work units in {exp.directory}")
  with cli.user_errors():  # fixed addresses with concurrent work units are refused by the backend
    if _BACKEND.value == "xm":
      xp = experiments.launch_xm(exp)
      print(f"XManager experiment {xp.experiment_id}: {len(units)} work units added")
      return
    results = experiments.run_local(exp, parallel=_PARALLEL.value)
  for r in results:
    print(f"  {r.unit.name}: {'ok' if r.ok else 'FAILED'} in {r.seconds:.0f} s -> {r.unit.directory}")
  sys.exit(0 if all(r.ok for r in results) else 1)


if __name__ == "__main__":
  cli.run(main)
