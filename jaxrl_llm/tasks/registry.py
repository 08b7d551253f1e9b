"""Task registry: ``get_task("addition", max_digits=3)``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.settings import did_you_mean
from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.addition import AdditionTask
from jaxrl_llm.tasks.code_tests import CodeTestsTask
from jaxrl_llm.tasks.countdown import CountdownTask
from jaxrl_llm.tasks.jsonl import JsonlTask
from jaxrl_llm.tasks.sorting import SortingTask
from jaxrl_llm.tasks.tool_multiply import ToolMultiplyTask

DEFAULT_TASK = "addition"

_REGISTRY: dict[str, Callable[..., base.Task]] = {
    "addition": AdditionTask,
    "sorting": SortingTask,
    "countdown": CountdownTask,
    "jsonl": JsonlTask,
    "tool_multiply": ToolMultiplyTask,
    "code_tests": CodeTestsTask,
}


def list_tasks() -> list[str]:
  """Names of the registered tasks, sorted."""
  return sorted(_REGISTRY)


def register_task(name: str, factory: Callable[..., base.Task], *, overwrite: bool = False) -> None:
  """Adds a task factory (usually a ``Task`` dataclass) under ``name``."""
  if not name or not isinstance(name, str):
    raise ValueError(f"task name must be a non-empty str, got {name!r}")
  if name in _REGISTRY and not overwrite:
    raise ValueError(f"task {name!r} is already registered; pass overwrite=True to replace it")
  _REGISTRY[name] = factory


def unregister_task(name: str) -> None:
  """Removes a task registered with :func:`register_task` (KeyError naming it when absent)."""
  if name not in _REGISTRY:
    raise KeyError(f"task {name!r} is not registered; registered: {list_tasks()}")
  del _REGISTRY[name]


def task_factory(name: str) -> Callable[..., base.Task]:
  """The factory registered under ``name`` (what ``get_task(name, **kwargs)`` calls).

  Raises:
    ConfigError (a ValueError): for an unknown name, listing the known ones.
  """
  if name not in _REGISTRY:
    raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}"
                      f"{did_you_mean(name, list_tasks())}")
  return _REGISTRY[name]


def get_task(name: str, **kwargs: Any) -> base.Task:
  """Builds a registered task.

  Args:
    name: one of ``list_tasks()``.
    **kwargs: the task's fields (e.g. ``max_digits=3`` for addition).

  Returns:
    The task.

  Raises:
    ConfigError (a ValueError): for an unknown name (listing the known ones), an
      unknown field (listing the accepted ones), or arguments or data the task rejects.
  """
  factory = task_factory(name)
  if dataclasses.is_dataclass(factory):
    fields = [f.name for f in dataclasses.fields(factory) if f.init]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
      raise ConfigError(f"task {name!r} has no field(s) {unknown}; accepted fields: {fields}")
  try:
    return factory(**kwargs)
  except (TypeError, ValueError, OSError) as e:  # a rejected argument, malformed data, a missing file
    raise ConfigError(f"task {name!r} (task.kwargs={kwargs}): {e}") from e


__all__ = ["DEFAULT_TASK", "get_task", "list_tasks", "register_task", "task_factory",
           "unregister_task"]
