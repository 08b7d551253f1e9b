"""Settings of the curated prompt source (``config.data``), each declared once.

Every field of :class:`CurationConfig` is declared with
:func:`jaxrl_llm.settings.setting`: its default, its one-line meaning and its check
are written here only; ``jaxrl_llm.configuration`` builds the ``config.data``
section from these declarations and validates it with the same checks, so an error
names ``data.<field>`` wherever the value came from.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jaxrl_llm import settings
from jaxrl_llm.settings import setting

STRATEGIES = ("stream", "prioritized", "curriculum")
SCHEDULES = ("pass_rate", "steps")

FINITE = settings.Check(lambda v: settings.NUMBER(v) and math.isfinite(v), "a finite number")
NONNEG_FINITE = settings.in_range(0.0, math.inf, high_open=True)
ASCENDING = settings.Check(
    lambda v: isinstance(v, (tuple, list)) and all(FINITE(x) for x in v) and all(b > a for a, b in zip(v, v[1:])),
    "a strictly ascending list of finite numbers (empty: probe the stream)")


def check_int(name: str, value: Any, low: int) -> int:
  """``value`` as an int when it is an integer >= ``low`` (NumPy integers too); else ValueError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
    raise ValueError(f"{name}={value!r}: expected an integer >= {low}")
  return int(value)


@dataclasses.dataclass(frozen=True)
class CurationConfig:
  """Settings of :class:`~jaxrl_llm.tasks.curation.CuratedPromptSource` (the ``config.data`` fields it reads).

  Example::

    CurationConfig(strategy="curriculum", schedule="steps", steps_per_level=50)
    CurationConfig(drop_pass_rate=1.5)  # ValueError: data.drop_pass_rate=1.5: expected a number in [0, 1]
  """

  strategy: str = setting("stream", "how prompts are drawn: the stream in order, 'prioritized' by 1 - pass rate, "
                          "'curriculum' by task difficulty", choices=STRATEGIES)
  success_threshold: float = setting(1.0, "a sample counts as a success when its reward is >= this", FINITE)
  window: int = setting(8, "recent attempts (samples) per prompt in its pass rate", settings.POSITIVE_INT)
  min_attempts: int = setting(0, "attempts a prompt needs before it can retire (0: data.window)", settings.NONNEG_INT)
  retire_solved: bool = setting(True, "no-positive resampling: a prompt whose pass rate reaches data.drop_pass_rate "
                                "is never drawn again", settings.BOOL)
  drop_pass_rate: float = setting(0.9, "pass rate at which a prompt retires (with data.retire_solved)", settings.UNIT)
  max_tracked: int = setting(65536, "most prompts whose pass rate is remembered, least recently seen forgotten first "
                             "(0: unbounded)", settings.NONNEG_INT)
  pool_size: int = setting(256, "'prioritized': candidate prompts in the pool (>= rl.prompts_per_step)",
                           settings.POSITIVE_INT)
  priority_floor: float = setting(0.05, "'prioritized': added to 1 - pass rate, so solved-looking prompts keep "
                                  "a chance", NONNEG_FINITE)
  prior_success: float = setting(0.5, "'prioritized': pass rate assumed before a prompt's first attempt",
                                 settings.UNIT)
  max_uses: int = setting(8, "'prioritized': draws after which a prompt leaves the pool, so never-solved prompts "
                          "cannot fill it for good (0: never)", settings.NONNEG_INT)
  schedule: str = setting("pass_rate", "'curriculum': promote on the current level's pass rate, or every "
                          "data.steps_per_level batches", choices=SCHEDULES)
  levels: tuple = setting((), "'curriculum': ascending difficulty ceilings (task.difficulty); empty: the distinct "
                          "difficulties of the first data.probe_examples prompts", ASCENDING)
  max_levels: int = setting(8, "'curriculum': most levels derived by probing (quantiles beyond that)",
                            settings.POSITIVE_INT)
  probe_examples: int = setting(512, "'curriculum': stream prompts probed to derive the levels", settings.POSITIVE_INT)
  promote_pass_rate: float = setting(0.8, "'curriculum', schedule 'pass_rate': the level rises when its pass rate "
                                     "over data.level_window attempts reaches this", settings.UNIT)
  level_window: int = setting(64, "'curriculum': recent attempts at the current level in its pass rate",
                              settings.POSITIVE_INT)
  steps_per_level: int = setting(100, "'curriculum', schedule 'steps': batches drawn per level",
                                 settings.POSITIVE_INT)
  max_skip: int = setting(100_000, "consecutive stream prompts that may be skipped (retired, too hard, pooled) "
                          "before the source stops with an error", settings.POSITIVE_INT)
  max_outstanding: int = setting(64, "most drawn but unrecorded batches kept for replay after a resume",
                                 settings.POSITIVE_INT)

  def __post_init__(self):
    settings.check(self, "data")
    object.__setattr__(self, "levels", tuple(float(v) for v in self.levels))

  @property
  def attempts_to_retire(self) -> int:
    """``min_attempts``, or ``window`` when it is 0."""
    return self.min_attempts or self.window


__all__ = ["STRATEGIES", "SCHEDULES", "CurationConfig", "check_int"]
