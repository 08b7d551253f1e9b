"""Curriculum sampling: prompts up to a difficulty ceiling that rises as the policy improves.

Levels are ascending ceilings on ``task.difficulty(example)`` (the task's own measure:
operand digits for addition, list length for sorting, numbers given for countdown, a
declared field for JSONL rows). At level ``l`` the stream admits the prompts whose
difficulty is at most ``levels[l]``; the last level admits everything. The level rises
when the pass rate of the current level's prompts reaches ``promote_pass_rate`` over
their last ``level_window`` attempts (``schedule="pass_rate"``), or every
``steps_per_level`` batches (``schedule="steps"``).

References:
  Kimi k1.5 (curriculum sampling from easy to hard): arXiv:2501.12599.
  Curriculum learning: Bengio et al., ICML 2009.
"""

from __future__ import annotations

import bisect
import collections
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.curation.config import CurationConfig, check_int

DifficultyFn = Callable[[base.Example], float]


def probe_levels(difficulties: Sequence[float], max_levels: int) -> tuple[float, ...]:
  """Ceilings from probed difficulties: the distinct values, or ``max_levels`` quantiles of them.

  Example:
    >>> probe_levels([3, 1, 2, 2, 1], max_levels=8)
    (1.0, 2.0, 3.0)
  """
  values = np.asarray(difficulties, np.float64)
  levels = np.unique(values)
  if levels.size > max_levels:
    qs = np.arange(1, max_levels + 1) / max_levels
    levels = np.unique(np.quantile(values, qs, method="inverted_cdf"))
  return tuple(float(v) for v in levels)


class Curriculum:
  """The level table and the current level of a curriculum.

  Args:
    config: the curation settings (``schedule``, ``promote_pass_rate``, ``level_window``,
      ``steps_per_level``).
    levels: ascending difficulty ceilings (non-empty).
    difficulty: ``example -> float`` (usually ``task.difficulty``).
  """

  def __init__(self, config: CurationConfig, levels: Sequence[float], difficulty: DifficultyFn):
    if not levels:
      raise ValueError("a curriculum needs at least one level (data.levels or a probed stream)")
    self.config = config
    self.levels = tuple(float(v) for v in levels)
    self.difficulty = difficulty
    self.promotions = 0
    self._level = 0  # "pass_rate" schedule
    self._recent: collections.deque = collections.deque(maxlen=config.level_window)

  def level_of(self, example: base.Example) -> int:
    """The first level whose ceiling >= the example's difficulty (the last level for anything harder)."""
    return min(bisect.bisect_left(self.levels, float(self.difficulty(example))), len(self.levels) - 1)

  def level(self, batch_index: int) -> int:
    """The current level, given the number of batches drawn so far."""
    if self.config.schedule == "steps":
      return min(batch_index // self.config.steps_per_level, len(self.levels) - 1)
    return self._level

  def observe(self, examples: Sequence[base.Example], success_gn: np.ndarray) -> None:
    """Counts the attempts at the current level ([G, N] successes); promotes on the pass rate."""
    if self.config.schedule != "pass_rate":
      return
    current = self._level
    for ex, row in zip(examples, success_gn):
      if self.level_of(ex) == current:
        self._recent.extend(row.tolist())
    window = self._recent
    if (current < len(self.levels) - 1 and len(window) == window.maxlen
        and math.fsum(window) / len(window) >= self.config.promote_pass_rate):
      self._level += 1
      self._recent.clear()
      self.promotions += 1

  def metrics(self, batch_index: int) -> dict[str, float]:
    """``curation/level``, ``curation/ceiling`` and ``curation/level_pass_rate``."""
    level = self.level(batch_index)
    recent = self._recent
    return {"curation/level": float(level), "curation/ceiling": self.levels[level],
            "curation/level_pass_rate": math.fsum(recent) / len(recent) if recent else float("nan")}

  def get_state(self) -> dict[str, Any]:
    """``{"level", "level_recent", "levels"}`` (JSON)."""
    return {"level": self._level, "level_recent": list(self._recent), "levels": list(self.levels)}

  def set_state(self, state: Mapping[str, Any], promotions: int) -> None:
    """Restores ``get_state``'s fields; the level table must be this one's.

    Raises:
      ValueError: when the state's levels differ or its level is not an integer >= 0.
    """
    levels = tuple(float(v) for v in state["levels"])
    if levels != self.levels:
      raise ValueError(f"prompt-source state has curriculum levels {list(levels)}, this source {list(self.levels)}")
    self._level = check_int("state.level", int(state["level"]), 0)
    self._recent = collections.deque((float(v) for v in state["level_recent"]), maxlen=self.config.level_window)
    self.promotions = int(promotions)


__all__ = ["Curriculum", "DifficultyFn", "probe_levels"]
