"""``validate(config)``: every declared check, then the checks that span several fields.

First, for every section: the checks declared with each field
(:func:`jaxrl_llm.settings.field_errors`), fields no settings dataclass declares,
and the keys of ``task.kwargs`` / ``objective.kwargs`` against the task factory's
and the recipe's signature. If those pass: each settings dataclass is built
(running its own cross-field checks, e.g. ``model.num_kv_heads`` dividing
``model.num_heads``), the recipe is built from ``objective.kwargs``, and the
checks below that relate sections run. Each error names the field, the value and
what was expected; all errors are reported together in one :class:`ConfigError`.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np

from jaxrl_llm import tasks
from jaxrl_llm.tasks import reward_plugins
from jaxrl_llm.configuration.schema import (ConfigError, build_part, field_path, parts, plain, section_node,
                                            sections, subsections)
from jaxrl_llm.learner.builders import (correction_errors, kwarg_errors, objective_errors, recipe_call,
                                        unknown_kwargs)
from jaxrl_llm.diagnostics import wandb_sink
from jaxrl_llm.rollout import placement
from jaxrl_llm.settings import config_fields, field_errors


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Checks every field; raises one ConfigError listing all problems, else returns ``config``."""
  errors = declared_errors(config)
  if not errors:
    errors = (construction_errors(config) + objective_errors(config) + correction_errors(config)
              + cross_field_errors(config) + placement_errors(config) + mixing_errors(config)
              + reward_plugins.check_components(config.reward.functions) + sink_errors(config)
              + env_errors(config))
  if errors:
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
  return config


def declared_errors(config: ml_collections.ConfigDict) -> list[str]:
  """The per-field checks of every section, unknown fields, and unknown task / recipe keyword arguments."""
  by_section: dict[str, list[str]] = {s: [] for s in sections()}
  declared: dict[str, set[str]] = {s: set() for s in sections()}
  for part in parts():
    declared[part.section].update(f.name for f in config_fields(part.cls))
    try:
      node = section_node(config, part.section)
    except ConfigError as e:
      by_section[part.section].append(str(e))
      continue
    values = {k: plain(node[k]) for k in node.keys() if k not in subsections(part.section)}
    by_section[part.section].extend(field_errors(part.cls, values, part.section))
  for section, names in declared.items():
    try:
      section_node(config, section)
    except ConfigError:
      continue
    known = names | subsections(section)
    by_section[section].extend(f"{field_path(section, k)}: not a config field (a typo?)"
                               for k in section_node(config, section).keys() if k not in known)
  if not by_section["task"]:
    by_section["task"].extend(task_errors(config))
  if not by_section["objective"]:
    by_section["objective"].extend(kwarg_errors(config))
  return list(dict.fromkeys(e for errors in by_section.values() for e in errors))


def task_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Keys of ``task.kwargs`` that the registered task's factory does not take."""
  name = config.task.name
  errors = unknown_kwargs("task.kwargs", dict(config.task.kwargs), tasks.task_factory(name), f"task {name!r}")
  if errors:  # typically a config file's arguments for its own task, kept when task.name is changed
    errors.append('task.kwargs: to drop arguments set for another task, pass --config.task.kwargs="{}" before'
                  " this task's own --config.task.kwargs.<name>=<value>")
  return errors


def construction_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Builds every settings dataclass; reports what their own (cross-field) checks reject."""
  errors = []
  for part in parts():
    try:
      build_part(config, part)
    except (TypeError, ValueError) as e:
      text, prefix = str(e), field_path(part.section, "") if part.section else ""
      errors.append(text if prefix and text.startswith(prefix) else f"{part.section or 'config'}: {text}")
  return list(dict.fromkeys(errors))


def env_errors(config: ml_collections.ConfigDict) -> list[str]:
  """``env.*`` against the rest: a loadable environment, synchronous rollouts, room for a turn."""
  c, errors = config, []
  if not c.env.name:
    return errors
  from jaxrl_llm.envs.base import load_environment_factory  # pylint: disable=import-outside-toplevel
  try:
    load_environment_factory(c.env.name)
  except Exception as e:  # the loader names env.name and what was expected
    errors.append(str(e))
  if c.rollout.mode == "pipeline" and c.rollout.exact_versions:
    errors.append(f"env.name={c.env.name!r} with rollout.exact_versions=True: expected False (an episode's "
                  "turns take the weights that arrive between them)")
  if c.data.dynamic_sampling:
    errors.append(f"env.name={c.env.name!r} with data.dynamic_sampling=True: expected False")
  if c.critic.enabled:
    errors.append(f"env.name={c.env.name!r} with critic.enabled=True: expected a group estimator "
                  "(no value targets for observation tokens)")
  return errors


def sink_errors(config: ml_collections.ConfigDict) -> list[str]:
  """An optional metrics sink whose package is missing (``log.wandb`` without wandb)."""
  if not config.log.wandb:
    return []
  try:
    wandb_sink.check_available()
  except ConfigError as e:
    return [str(e)]
  return []


def placement_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Sampler actors' devices and weight transport: what can be checked before the cluster is known.

  What depends on the machine (the learner's GPUs, the GPUs each node declares) is
  checked when the pool starts, before any actor does (:mod:`jaxrl_llm.rollout.placement`).
  """
  c = config
  errors = []
  pipeline = c.rollout.mode == "pipeline"
  if c.sampler.platform != "cpu" and not pipeline:
    errors.append(f"sampler.platform={c.sampler.platform!r} with rollout.mode={c.rollout.mode!r}: expected "
                  "rollout.mode='pipeline' (in 'sync' mode the sampler runs in the learner's process, on its devices)")
  if c.sampler.platform != "cpu" and c.sampler.kind != "jax":
    errors.append(f"sampler.platform={c.sampler.platform!r} with sampler.kind={c.sampler.kind!r}: expected "
                  "sampler.kind='jax' (a vLLM engine's GPUs are sampler.vllm.tensor_parallel_size)")
  if c.rollout.weight_transport != "object_store" and c.sampler.kind != "vllm":
    errors.append(f"rollout.weight_transport={c.rollout.weight_transport!r} with sampler.kind={c.sampler.kind!r}: "
                  "expected 'object_store' (the JAX sampler takes the host weights it receives as they are; "
                  "'ipc' and 'nccl' move them into a vLLM engine's GPUs)")
  try:
    ids = placement.parse_gpu_ids(c.rollout.local_gpus)
    need = placement.gpus_per_actor(c.sampler.kind, platform=c.sampler.platform,
                                    tensor_parallel_size=c.sampler.vllm.tensor_parallel_size,
                                    weight_transport=c.rollout.weight_transport, actor_gpus=c.rollout.actor_gpus)
  except ConfigError as e:
    return errors + [str(e)]
  share = c.rollout.actor_gpus
  if c.sampler.kind == "vllm" and 0 < share < 1 and c.sampler.vllm.gpu_memory_utilization > share:
    errors.append(f"sampler.vllm.gpu_memory_utilization={c.sampler.vllm.gpu_memory_utilization:g} with "
                  f"rollout.actor_gpus={c.rollout.actor_gpus:g}: engines sharing a GPU must each take at most their "
                  "share of its memory (expected gpu_memory_utilization <= actor_gpus)")
  if pipeline and ids is not None and not c.rollout.address and need:
    try:
      cluster = f"the local Ray cluster (rollout.local_gpus={c.rollout.local_gpus!r})"
      placement.check_capacity(placement.ActorResources(c.rollout.actor_cpus, need), c.rollout.num_samplers,
                               [len(ids)], cluster=cluster,
                               kind=c.sampler.kind, weight_transport=c.rollout.weight_transport)
    except ConfigError as e:
      errors.append(str(e))
  return errors


def cross_field_errors(config: ml_collections.ConfigDict) -> list[str]:
  """Constraints between sections: batch divisibility, estimator / critic / sampler / rollout compatibility."""
  c = config
  errors = []
  batch = c.rl.prompts_per_step * c.rl.samples_per_prompt
  if batch % c.learner.micro_batches:
    errors.append(f"learner.micro_batches={c.learner.micro_batches}: expected a divisor of the RL batch "
                  f"rl.prompts_per_step*rl.samples_per_prompt={batch}")
  if c.model.batch_invariant:
    errors.extend(atom_errors(c, batch))
  gae = c.advantage.estimator == "gae"
  if gae and not c.critic.enabled:
    errors.append("advantage.estimator='gae': expected critic.enabled=True (GAE needs value estimates)")
  if c.rl.filter_zero_variance and gae:
    errors.append("rl.filter_zero_variance=True with advantage.estimator='gae': expected False "
                  "(zero-variance groups are a group-relative notion)")
  if c.critic.enabled and not gae:
    errors.append(f"critic.enabled=True with advantage.estimator={c.advantage.estimator!r}: "
                  "expected 'gae' (the critic is only used by GAE)")
  if c.rl.max_new_tokens >= c.model.max_position_embeddings:
    errors.append(f"rl.max_new_tokens={c.rl.max_new_tokens}: expected < "
                  f"model.max_position_embeddings={c.model.max_position_embeddings}")
  pipeline = c.rollout.mode == "pipeline"
  if c.sampler.kind == "vllm" and not pipeline:
    errors.append(f"sampler.kind='vllm' with rollout.mode={c.rollout.mode!r}: expected rollout.mode='pipeline' "
                  "(vLLM engines run in Ray sampler actors)")
  if c.rollout.exact_versions and c.sampler.kind != "jax":
    errors.append(f"rollout.exact_versions=True with sampler.kind={c.sampler.kind!r}: expected sampler.kind='jax' "
                  "(an actor swaps an older version's weights in for an exact-version item; vLLM engines only "
                  "move to newer versions)")
  if pipeline and c.rl.updates_per_batch != 1:
    errors.append(f"rl.updates_per_batch={c.rl.updates_per_batch} with rollout.mode='pipeline': expected 1 "
                  "(the staleness bound counts one policy version per step)")
  if c.data.dynamic_sampling and pipeline:
    errors.append("data.dynamic_sampling=True with rollout.mode='pipeline': expected rollout.mode='sync' "
                  "(extra sampling rounds are drawn in the learner's process)")
  if c.data.dynamic_sampling and gae:
    errors.append("data.dynamic_sampling=True with advantage.estimator='gae': expected a group estimator")
  if c.data.rft_every and c.rl.prompts_per_step % c.learner.micro_batches:
    errors.append(f"data.rft_every={c.data.rft_every}: expected rl.prompts_per_step ({c.rl.prompts_per_step}) "
                  f"to be a multiple of learner.micro_batches ({c.learner.micro_batches}) (the RFT batch has one "
                  "row per prompt)")
  if c.control.enabled and c.control.kl_target > 0 and not objective_errors(c):
    call = recipe_call(c)
    if call.kl_coef <= 0:
      has = f"kl_coef={call.kl_coef}" if "kl_coef" in call.values else "no kl_coef"
      errors.append(f"control.kl_target={c.control.kl_target}: expected a recipe with kl_coef > 0 (recipe "
                    f"{call.recipe!r} has {has}; see objective.kwargs.kl_coef): the adaptive KL coefficient scales "
                    "the objective's KL term")
  if c.guard.clip_shrink < 1 and not c.control.enabled:
    errors.append(f"guard.clip_shrink={c.guard.clip_shrink}: expected 1.0 unless control.enabled=True "
                  "(the clip range is only adjustable under control)")
  if c.job == "reward_model" and c.reward_model.batch_size % c.learner.micro_batches:
    errors.append(f"learner.micro_batches={c.learner.micro_batches}: expected a divisor of "
                  f"reward_model.batch_size={c.reward_model.batch_size}")
  if c.job == "dpo" and c.dpo.batch_size % c.learner.micro_batches:
    errors.append(f"learner.micro_batches={c.learner.micro_batches}: expected a divisor of "
                  f"dpo.batch_size={c.dpo.batch_size}")
  if c.dpo.label_smoothing and c.dpo.loss != "dpo":
    errors.append(f"dpo.label_smoothing={c.dpo.label_smoothing} with dpo.loss={c.dpo.loss!r}: expected 0 "
                  "(label smoothing is a term of the DPO loss, conservative DPO)")
  if c.job == "rl" and c.reward_model.path and not (c.reward_model.rm_weight or c.reward_model.rule_weight):
    errors.append("reward_model.rm_weight=0 and reward_model.rule_weight=0: expected at least one > 0 "
                  "(the reward would be 0)")
  if c.advantage.kl_reward_coef and not gae:
    errors.append(f"advantage.kl_reward_coef={c.advantage.kl_reward_coef} with advantage.estimator="
                  f"{c.advantage.estimator!r}: expected 'gae' (a token-level reward needs GAE; group "
                  "estimators take one reward per sequence, use objective.kwargs.kl_coef there)")
  return errors


def mixing_errors(config: ml_collections.ConfigDict) -> list[str]:
  """``rollout.simulated_lag`` and ``data.sft_mix``: where they apply and how their rows fit the batch."""
  c = config
  errors = []
  if c.rollout.simulated_lag and c.rollout.mode == "pipeline":
    errors.append(f"rollout.simulated_lag={c.rollout.simulated_lag} with rollout.mode='pipeline': expected "
                  "rollout.simulated_lag=0 (the pipeline's staleness is real: set rollout.max_lag) or "
                  "rollout.mode='sync'")
  if not c.data.sft_mix:
    return errors
  if c.data.sft_mix != "task" and not os.path.isfile(c.data.sft_mix):
    errors.append(f"data.sft_mix={c.data.sft_mix!r}: expected 'task' or an existing JSONL file of "
                  "{prompt, response} objects")
  if c.critic.enabled:
    errors.append("data.sft_mix with critic.enabled=True: expected a group estimator without a critic "
                  "(demonstration rows have no returns for the value loss)")
  n, rows = c.rl.samples_per_prompt, c.data.sft_mix_rows
  unit = n * (c.learner.grad_atoms if c.model.batch_invariant else 1)
  unit = int(np.lcm(unit, c.learner.micro_batches))
  if rows % unit:
    errors.append(f"data.sft_mix_rows={rows}: expected a multiple of {unit} (rl.samples_per_prompt="
                  f"{n}, learner.micro_batches={c.learner.micro_batches}"
                  + (f", learner.grad_atoms={c.learner.grad_atoms}" if c.model.batch_invariant else "")
                  + "), so demonstration rows form whole groups")
  return errors


def atom_errors(config: ml_collections.ConfigDict, rl_batch: int) -> list[str]:
  """Batch-invariant mode: every learner batch must cut into learner.grad_atoms equal atoms."""
  atoms = config.learner.grad_atoms
  errors = []
  if atoms % config.learner.micro_batches:
    errors.append(f"learner.grad_atoms={atoms}: expected a multiple of learner.micro_batches="
                  f"{config.learner.micro_batches} (micro-batches group whole atoms)")
  if rl_batch % (atoms * config.rl.samples_per_prompt):
    errors.append(f"learner.grad_atoms={atoms}: expected a divisor of rl.prompts_per_step="
                  f"{config.rl.prompts_per_step} (model.batch_invariant=True: every atom holds whole groups of "
                  f"rl.samples_per_prompt={config.rl.samples_per_prompt} samples)")
  if config.sft.steps and config.sft.batch_size % atoms:
    errors.append(f"learner.grad_atoms={atoms}: expected a divisor of sft.batch_size={config.sft.batch_size} "
                  "(model.batch_invariant=True)")
  return errors


__all__ = ["validate", "declared_errors", "construction_errors", "cross_field_errors", "mixing_errors",
           "atom_errors"]
