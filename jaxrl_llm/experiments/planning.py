"""Checking an experiment before anything launches, and turning it into work units.

:func:`plan` builds each sweep point's config exactly as its learner will,
validates it, and checks the experiment's layout against it
(:func:`check_experiment`, :func:`check_layout`); see
:mod:`jaxrl_llm.experiments.definition` for the definition and the jobs.
"""

from __future__ import annotations

import math
import os
import shutil

import ml_collections

from jaxrl_llm import configuration
from jaxrl_llm.configuration import ConfigError
from jaxrl_llm.experiments.definition import (LOOPBACK_PLACEHOLDER, Experiment, WorkUnit, apply_overrides,
                                              is_loopback, load_config, parse_address, slug)
from jaxrl_llm.rollout import placement


def check_experiment(experiment: Experiment) -> None:
  """The experiment's own settings, before any config is built.

  Raises:
    ConfigError: naming the setting that is out of range, an address that is
      not ``host:port``, an address set for jobs the work unit does not have,
      sampler GPUs on loopback sampler nodes (every node would offer the same
      GPUs, the learner's among them), several learner processes with sampler
      nodes, or a missing ``ray`` command.
  """
  exp = experiment
  if not exp.name or "/" in exp.name:
    raise ConfigError(f"experiment name {exp.name!r}: expected a non-empty name without '/'")
  if not exp.sweep:
    raise ConfigError("experiment sweep: expected at least one point (use [{}] for a single run)")
  for field in ("learner_processes", "sampler_cpus"):
    if getattr(exp, field) < 1:
      raise ConfigError(f"experiment {field}={getattr(exp, field)}: expected >= 1")
  for field in ("devices_per_process", "samplers", "sampler_gpus"):
    if getattr(exp, field) < 0:
      raise ConfigError(f"experiment {field}={getattr(exp, field)}: expected >= 0")
  for field in ("ray_head", "coordinator"):
    if getattr(exp, field):
      parse_address(getattr(exp, field), field)
  if exp.ray_head and not exp.samplers:
    raise ConfigError(f"experiment ray_head={exp.ray_head!r} with samplers=0: expected samplers > 0 (ray_head is "
                      "where the experiment's sampler nodes meet; to join a cluster the experiment does not start, "
                      "set rollout.address in the config instead)")
  if exp.coordinator and exp.learner_processes < 2:
    raise ConfigError(f"experiment coordinator={exp.coordinator!r} with learner_processes={exp.learner_processes}: "
                      "expected learner_processes > 1 (a single learner process has no coordinator)")
  if exp.ray_head and exp.ray_head == exp.coordinator:
    raise ConfigError(f"experiment ray_head and coordinator are both {exp.ray_head!r}: expected two different "
                      "host:port addresses (the Ray head and learner process 0 each listen on their own port)")
  on_loopback = not exp.ray_head or is_loopback(parse_address(exp.ray_head, "ray_head")[0])
  if exp.samplers and exp.sampler_gpus and on_loopback:
    raise ConfigError(f"experiment sampler_gpus={exp.sampler_gpus} with ray_head={exp.ray_head!r} (every sampler "
                      f"node on this machine): each node would hand out GPUs 0..{exp.sampler_gpus - 1} of the "
                      "machine (Ray numbers a node's GPUs from 0 unless CUDA_VISIBLE_DEVICES says otherwise), the "
                      "same GPUs for every node and GPUs the learner's JAX also takes; expected sampler_gpus=0 on "
                      "loopback, a cluster ray_head, or, for GPU samplers on this machine, samplers=0 with "
                      "rollout.mode='pipeline' and rollout.local_gpus (the run's own Ray cluster offers only GPUs "
                      "the learner does not use)")
  if exp.samplers and exp.learner_processes > 1:
    raise ConfigError(f"experiment learner_processes={exp.learner_processes} with samplers={exp.samplers}: the Ray "
                      "sampler pool is driven from one learner process (rollout.mode='pipeline' refuses a "
                      "multi-process learner at start-up); expected learner_processes=1 with sampler nodes, or "
                      "samplers=0 and rollout.mode='sync' for a multi-process learner")
  if exp.samplers and not shutil.which("ray"):
    raise ConfigError(f"experiment samplers={exp.samplers}: the `ray` command is not on PATH (pip install 'ray')")


def check_layout(experiment: Experiment, config: ml_collections.ConfigDict) -> None:
  """What a work unit's config asks of the experiment's processes and sampler nodes.

  Args:
    experiment: the definition.
    config: the work unit's config, after its overrides (validated, for the capacity checks).

  Raises:
    ConfigError: for ``rollout.mode='pipeline'`` with several learner processes, and, with
      sampler nodes, for sampler actors the nodes cannot hold (their GPUs: ``sampler_gpus``
      against :func:`jaxrl_llm.rollout.placement.gpus_per_actor` through
      :func:`jaxrl_llm.rollout.placement.check_capacity`; their CPUs: ``sampler_cpus``
      against ``rollout.actor_cpus``).
  """
  exp = experiment
  r = config.rollout
  if exp.learner_processes > 1 and r.mode == "pipeline":
    raise ConfigError(f"rollout.mode='pipeline' with experiment learner_processes={exp.learner_processes}: the Ray "
                      "sampler pool is driven from one learner process (the run refuses this at start-up); expected "
                      "rollout.mode='sync' for a multi-process learner, or learner_processes=1")
  if not exp.samplers:
    return
  s = config.sampler
  need = placement.ActorResources(
      cpus=float(r.actor_cpus),
      gpus=placement.gpus_per_actor(kind=s.kind, platform=s.platform,
                                    tensor_parallel_size=s.vllm.tensor_parallel_size,
                                    weight_transport=r.weight_transport, actor_gpus=r.actor_gpus))
  cluster = f"the experiment's Ray cluster (samplers={exp.samplers} nodes, sampler_gpus={exp.sampler_gpus} each)"
  if need.gpus > 0:
    placement.check_capacity(need, int(r.num_samplers), [float(exp.sampler_gpus)] * exp.samplers, cluster=cluster,
                             kind=s.kind, weight_transport=r.weight_transport)
  per_node = math.floor(exp.sampler_cpus / need.cpus + 1e-9)
  if need.gpus > 0:
    per_node = min(per_node, math.floor(exp.sampler_gpus / need.gpus + 1e-9))
  if per_node * exp.samplers < r.num_samplers:
    gpus = f" and {need.gpus:g} GPU(s)" if need.gpus else ""
    raise ConfigError(f"rollout.num_samplers={r.num_samplers}: the experiment's sampler nodes (samplers="
                      f"{exp.samplers}, sampler_cpus={exp.sampler_cpus}, sampler_gpus={exp.sampler_gpus} each) hold "
                      f"{per_node * exp.samplers} sampler actor(s) of rollout.actor_cpus={r.actor_cpus:g} "
                      f"CPU(s){gpus}; expected more sampler_cpus or samplers, or fewer rollout.num_samplers")


def plan(experiment: Experiment) -> list[WorkUnit]:
  """Validates every work unit's config and layout and returns the work units; launches nothing.

  Each point's config is built exactly as its learner will build it (the
  config file, then ``overrides``, then the point, then with sampler nodes
  ``rollout.mode='pipeline'`` and ``rollout.address``) and checked with
  :func:`jaxrl_llm.configuration.validate`, then against the experiment's
  processes and sampler nodes (:func:`check_layout`).

  Raises:
    ConfigError: naming the work unit and the field (a field that does not
      exist, a value of the wrong type, or a value outside what it accepts),
      the experiment setting that is out of range (:func:`check_experiment`),
      a config that sets ``rollout.address`` while the experiment starts sampler
      nodes, or a layout the run cannot use (:func:`check_layout`).
  """
  check_experiment(experiment)
  units = []
  for index, point in enumerate(experiment.sweep):
    where = f"work unit {index} {dict(point)}"
    merged = dict(experiment.overrides)
    merged.update(point)
    config = apply_overrides(load_config(experiment.config), merged, where)
    if experiment.samplers:
      if config.rollout.address:
        raise ConfigError(f"{where}: rollout.address={config.rollout.address!r} with experiment samplers="
                          f"{experiment.samplers}: the experiment starts its own sampler nodes and points "
                          "rollout.address at their head (ray_head); expected rollout.address unset, or samplers=0 "
                          "to join the cluster at rollout.address")
      # the learner gets the head's address at launch; any address validates as "a cluster joined"
      apply_overrides(config, {"rollout.mode": "pipeline",
                               "rollout.address": experiment.ray_head or LOOPBACK_PLACEHOLDER}, where)
    try:
      configuration.validate(config)
      check_layout(experiment, config)
    except ConfigError as e:
      raise ConfigError(f"{where}: {e}") from None
    directory = os.path.join(experiment.directory, f"{index:02d}_{slug(point)}")
    units.append(WorkUnit(index, dict(point), merged, directory, experiment))
  return units
