"""Reward functions as plug-ins: weighted components named in the config, combined into one reward.

``reward.functions`` lists ``(name, weight)`` pairs (TRL's ``reward_funcs`` + ``reward_weights``)::

  --config.reward.functions="(('my_pkg.rewards:format_bonus', 0.2), ('task', 1.0))"

* ``"task"`` is the task's own verifiable reward (``task.reward``);
* ``"package.module:name"`` (``name`` may be dotted: ``module:Class.method``) is any
  importable callable ``fn(example, response_text) -> float``: ``example`` is the task's
  example of the prompt (for a JSONL task, its row's fields), ``response_text`` the decoded
  response. It runs where the task's reward runs (``reward.mode``: a worker process by
  default, so the module must be importable from the run's working directory or
  ``PYTHONPATH``);
* ``"http://host:port/path"`` is a reward server, sent each batch in one request
  (:mod:`jaxrl_llm.tasks.remote_reward`: the JSON protocol, timeout, retries); label ``remote``.

The RL reward is ``sum_i weight_i * r_i``. Each component runs in a guarded
:class:`~jaxrl_llm.tasks.RewardRunner` of its own (``reward.*`` limits), so a raising,
hanging, crashing or NaN-returning component scores 0 on that call and is counted under
``reward/<label>/*``, and one that fails most calls for ``reward.failure_steps`` steps stops
the run naming it. Each step logs each component's mean as ``reward/<label>/mean`` (label:
``task``, or the callable's name). Held-out evaluation keeps scoring the task's own reward.
An empty tuple (the default) is the task's reward alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.settings import did_you_mean
from jaxrl_llm.tasks import remote_reward

TASK = "task"
REMOTE = "remote"  # the label of a reward server's component (remote_1, ... for more)
FIELD = "reward.functions"


@dataclasses.dataclass(frozen=True)
class RewardComponent:
  """One ``(name, weight)`` entry of ``reward.functions``, with the label its metrics use."""

  name: str
  weight: float
  label: str


def parse_components(value: Any) -> list[RewardComponent]:
  """The components of ``reward.functions`` (structure only: nothing is imported).

  Raises:
    ConfigError: naming ``reward.functions[i]`` for an entry that is not a ``(name, weight)``
      pair, a name that is neither ``"task"`` nor ``"module:callable"``, a weight that is not a
      finite number, or a name listed twice.
  """
  if value in (None, "", ()):
    return []
  if not isinstance(value, (tuple, list)):
    raise ConfigError(f"{FIELD}={value!r}: expected a tuple of (name, weight) pairs, e.g. "
                      "\"(('my_pkg.rewards:fmt', 0.2), ('task', 1.0))\"")
  out, labels = [], set()
  for i, entry in enumerate(value):
    where = f"{FIELD}[{i}]={entry!r}"
    if not isinstance(entry, (tuple, list)) or len(entry) != 2:
      raise ConfigError(f"{where}: expected a (name, weight) pair")
    name, weight = entry
    if not isinstance(name, str) or not (name == TASK or _is_import_path(name) or remote_reward.is_url(name)):
      raise ConfigError(f"{where}: the name must be 'task', an import path 'package.module:callable' or a reward "
                        "server's http(s):// URL")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight):
      raise ConfigError(f"{where}: the weight must be a finite number")
    label = (TASK if name == TASK else REMOTE if remote_reward.is_url(name)
             else name.rsplit(":", 1)[1].rsplit(".", 1)[-1])
    if any(c.name == name for c in out):
      raise ConfigError(f"{where}: {name!r} is listed twice")
    if label in labels:
      label = f"{label}_{i}"
    labels.add(label)
    out.append(RewardComponent(name, float(weight), label))
  return out


def _is_import_path(name: str) -> bool:
  module, sep, attr = name.partition(":")
  return bool(sep and module and attr and all(p.isidentifier() for p in module.split(".") + attr.split(".")))


def resolve(name: str, task: Any = None) -> Callable[[Any, str], float]:
  """The callable of a component name (``"task"``: ``task.reward``).

  Raises:
    ConfigError: naming the import path when the module does not import, the attribute is
      missing (with the closest name the module has) or is not callable.
  """
  if name == TASK:
    if task is None:
      raise ConfigError(f"{FIELD}: 'task' needs the task")
    return task.reward
  module_name, _, attr = name.partition(":")
  try:
    obj: Any = importlib.import_module(module_name)
  except ImportError as e:
    raise ConfigError(f"{FIELD}: {name!r}: module {module_name!r} does not import ({e}); it must be importable "
                      "from the run's working directory or PYTHONPATH") from None
  except Exception as e:  # the module raised while importing: its own error, named
    raise ConfigError(f"{FIELD}: {name!r}: importing module {module_name!r} raised {type(e).__name__}: {e}") from None
  for part in attr.split("."):
    if not hasattr(obj, part):
      names = [n for n in dir(obj) if not n.startswith("_")]
      raise ConfigError(f"{FIELD}: {name!r}: {getattr(obj, '__name__', obj)!r} has no attribute {part!r}"
                        f"{did_you_mean(part, names)}")
    obj = getattr(obj, part)
  if not callable(obj):
    raise ConfigError(f"{FIELD}: {name!r} is a {type(obj).__name__}, not a callable fn(example, response_text)")
  return obj


def check_components(value: Any) -> list[str]:
  """Config errors of ``reward.functions`` (its structure, and each import path resolved)."""
  try:
    components = parse_components(value)
    for c in components:
      if c.name != TASK and not remote_reward.is_url(c.name):
        resolve(c.name)
  except ConfigError as e:
    return [str(e)]
  return []


class WeightedRewards:
  """Scores with every component's guarded runner and returns the weighted sum.

  Has the :class:`~jaxrl_llm.tasks.RewardRunner` interface the RL job's score stage uses
  (``score``, ``end_step``, ``metrics``, ``get_state`` / ``set_state``, ``close``) plus
  ``step_metrics`` (each component's mean on the last batch).

  Args:
    runners: ``(component, runner)`` pairs; the runners' names are the components' labels.
  """

  def __init__(self, runners: Sequence[tuple[RewardComponent, Any]]):
    if not runners:
      raise ValueError("WeightedRewards: expected at least one component")
    self.runners = list(runners)
    self._last: dict[str, float] = {}

  def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
    """float32 [B]: ``sum_i weight_i * r_i`` (a failed call of a component contributes 0)."""
    total = np.zeros((len(pairs),), np.float64)
    self._last = {}
    for component, runner in self.runners:
      rewards = np.asarray(runner.score(pairs), np.float64)
      self._last[component.label] = float(rewards.mean()) if len(rewards) else 0.0
      total += component.weight * rewards
    return total.astype(np.float32)

  def step_metrics(self) -> dict[str, float]:
    """``reward/<label>/mean`` of each component on the last scored batch."""
    return {f"reward/{label}/mean": value for label, value in self._last.items()}

  def end_step(self) -> None:
    for _, runner in self.runners:
      runner.end_step()

  @property
  def metrics(self) -> dict[str, float]:
    out: dict[str, float] = {}
    for _, runner in self.runners:
      out.update(runner.metrics)
    return out

  def get_state(self) -> dict:
    return {c.label: runner.get_state() for c, runner in self.runners}

  def set_state(self, state: dict) -> None:
    for c, runner in self.runners:
      if c.label in state:
        runner.set_state(state[c.label])

  def close(self) -> None:
    for _, runner in self.runners:
      runner.close()


__all__ = ["FIELD", "REMOTE", "RewardComponent", "TASK", "WeightedRewards", "check_components", "parse_components",
           "resolve"]
