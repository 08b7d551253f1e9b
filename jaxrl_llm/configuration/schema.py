"""The run config's schema: which settings dataclass declares which section, and what is derived from it.

:class:`Settings` is the one table of the schema: each of its fields names a
section of the config (``config.<section>``; "" for the top level) and is typed
by the settings dataclass that declares that section's fields. A section may be
fed by several dataclasses (``config.data``: :class:`DataSettings` and
``CurationConfig``); no field is declared twice. From this table:

* :func:`base_config` builds the locked ``ml_collections.ConfigDict`` of
  defaults (free mappings such as ``task.kwargs`` stay unlocked);
* :func:`settings` turns a config into typed, checked settings objects, e.g.
  ``settings(config).control`` (a :class:`ControlSettings` with the run's
  ``max_lag``);
* ``validate`` runs the declared checks and ``docs/config.md`` lists the fields.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Iterator

import ml_collections

from jaxrl_llm.configuration.operations import (CheckpointSettings, DataSettings, DiagnosticsSettings,
                                                EvalSettings, ExportSettings, LogSettings,
                                                PreferenceOptimizationSettings, RewardModelSettings,
                                                RewardSettings, RolloutSettings, SamplerSettings, VllmSettings)
from jaxrl_llm.configuration.environment import EnvSettings
from jaxrl_llm.configuration.training import (AdvantageSettings, CriticSettings, InitSettings, LearnerSettings,
                                              LoraSettings, ModelSettings, ObjectiveSettings, OptimizerSettings,
                                              RLSettings, RunSettings, SftSettings, TaskSettings)
from jaxrl_llm.diagnostics.consistency import ConsistencyThresholds
from jaxrl_llm.diagnostics.control import ControlSettings
from jaxrl_llm.diagnostics.guard import GuardSettings
from jaxrl_llm.settings import ConfigError, config_fields, default_of, from_section, is_free
from jaxrl_llm.tasks.curation import CurationConfig


def _section(path: str) -> Any:
  return dataclasses.field(metadata={"section": path})


@dataclasses.dataclass(frozen=True)
class Settings:
  """Every section of a run config as its settings dataclass (``settings(config).<name>``).

  The field order is the order of the config's sections.
  """

  run: RunSettings = _section("")
  task: TaskSettings = _section("task")
  model: ModelSettings = _section("model")
  lora: LoraSettings = _section("model.lora")
  init: InitSettings = _section("init")
  sft: SftSettings = _section("sft")
  rl: RLSettings = _section("rl")
  advantage: AdvantageSettings = _section("advantage")
  objective: ObjectiveSettings = _section("objective")
  optimizer: OptimizerSettings = _section("optimizer")
  critic: CriticSettings = _section("critic")
  learner: LearnerSettings = _section("learner")
  sampler: SamplerSettings = _section("sampler")
  vllm: VllmSettings = _section("sampler.vllm")
  rollout: RolloutSettings = _section("rollout")
  env: EnvSettings = _section("env")
  data: DataSettings = _section("data")
  curation: CurationConfig = _section("data")
  diagnostics: DiagnosticsSettings = _section("diagnostics")
  consistency: ConsistencyThresholds = _section("diagnostics")
  control: ControlSettings = _section("control")
  guard: GuardSettings = _section("guard")
  reward: RewardSettings = _section("reward")
  reward_model: RewardModelSettings = _section("reward_model")
  dpo: PreferenceOptimizationSettings = _section("dpo")
  eval: EvalSettings = _section("eval")
  checkpoint: CheckpointSettings = _section("checkpoint")
  log: LogSettings = _section("log")
  export: ExportSettings = _section("export")


@dataclasses.dataclass(frozen=True)
class Part:
  """One row of the schema: ``Settings.<name>`` is a ``cls`` built from ``config.<section>``."""

  name: str
  section: str
  cls: type


def parts() -> Iterator[Part]:
  """The schema's rows, in config order."""
  hints = typing.get_type_hints(Settings)
  for f in dataclasses.fields(Settings):
    yield Part(f.name, f.metadata["section"], hints[f.name])


def sections() -> list[str]:
  """Section paths in config order ("" is the top level)."""
  return list(dict.fromkeys(p.section for p in parts()))


def subsections(section: str) -> set[str]:
  """Names of the sections directly inside ``section`` ("" is the top level): ``{"vllm"}`` for "sampler"."""
  prefix = f"{section}." if section else ""
  return {s[len(prefix):].split(".")[0] for s in sections() if s != section and s.startswith(prefix) and s}


def field_path(section: str, name: str) -> str:
  return f"{section}.{name}" if section else name


def free_paths() -> frozenset[str]:
  """Paths of the mappings whose keys are free (``task.kwargs``, ``objective.kwargs``)."""
  return frozenset(field_path(p.section, f.name) for p in parts() for f in config_fields(p.cls) if is_free(f))


def base_config() -> ml_collections.ConfigDict:
  """Every field of a run with its declared default; configs override a subset.

  Returns a locked ConfigDict (assigning a field that does not exist raises),
  except the free mappings (``task.kwargs``, ``objective.kwargs``), to which a
  config file may add keys.
  """
  c = ml_collections.ConfigDict()
  for part in parts():
    node = c
    for name in part.section.split(".") if part.section else ():  # a nested section ("sampler.vllm") too
      if name not in node:
        node[name] = ml_collections.ConfigDict()
      node = node[name]
    for f in config_fields(part.cls):
      value = default_of(f)
      node[f.name] = ml_collections.ConfigDict(value) if isinstance(value, dict) else value
  c.lock()
  for path in free_paths():
    get_field(c, path).unlock()
  return c


def derived_values(config: ml_collections.ConfigDict) -> dict[str, dict[str, Any]]:
  """Values a settings dataclass takes from other sections, by ``Settings`` field name.

  The controller's staleness window is the pipeline's ``rollout.max_lag`` (0 in
  synchronous mode), and its smallest window is clipped to it.
  """
  lag = config.rollout.max_lag if config.rollout.mode == "pipeline" else 0
  return {"control": {"max_lag": lag, "min_lag": min(config.control.min_lag, lag)}}


def section_node(config: ml_collections.ConfigDict, section: str) -> Any:
  """``config.<section>`` (the config itself for "")."""
  return get_field(config, section) if section else config


def build_part(config: ml_collections.ConfigDict, part: Part) -> Any:
  """``part.cls`` from its section, with plain dicts for mappings and the derived values."""
  node = section_node(config, part.section)
  values = {f.name: plain(node[f.name]) for f in config_fields(part.cls) if f.name in node}
  return from_section(part.cls, values, **derived_values(config).get(part.name, {}))


def settings(config: ml_collections.ConfigDict) -> Settings:
  """Typed settings of every section, e.g. ``settings(config).guard.every``.

  Raises:
    ValueError: naming the field, for a value its settings dataclass rejects
      (``validate`` reports all of them at once first).
  """
  return Settings(**{part.name: build_part(config, part) for part in parts()})


def plain(value: Any) -> Any:
  """A ConfigDict as a plain dict (other values unchanged)."""
  return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def get_field(config: ml_collections.ConfigDict, path: str) -> Any:
  """``config.<path>``; ConfigError naming the path if it is missing."""
  node: Any = config
  for part in path.split("."):
    if not hasattr(node, "keys") or part not in node:
      raise ConfigError(f"config field {path!r} is missing")
    node = node[part]
  return node


def override(config: ml_collections.ConfigDict, path: str, value: Any) -> None:
  """Sets ``config.<path> = value``, naming the field if it does not exist.

  Inside a free mapping (``task.kwargs``, ``objective.kwargs``) a new key is
  added; validation then checks it against the task or recipe.
  """
  parts_ = path.split(".")
  node: Any = config
  for i, part in enumerate(parts_[:-1]):
    if part not in node:
      raise ConfigError(f"config field {'.'.join(parts_[:i + 1])!r} does not exist (in override {path!r})")
    node = node[part]
  if parts_[-1] not in node and ".".join(parts_[:-1]) not in free_paths():
    raise ConfigError(f"config field {path!r} does not exist")
  node[parts_[-1]] = value


def run_dir(config: ml_collections.ConfigDict) -> str:
  """The run folder: ``run_dir``, else ``runs/<name>``."""
  return config.run_dir or f"runs/{config.name}"


__all__ = ["ConfigError", "Part", "Settings", "base_config", "build_part", "derived_values", "field_path",
           "free_paths", "get_field", "override", "parts", "plain", "run_dir", "section_node", "sections", "settings",
           "subsections"]
