"""The monotonic-improvement guard: validate updates on held-out prompts, roll back regressions.

Every ``every`` RL steps the loop evaluates the policy on a fixed held-out set
and asks :meth:`ImprovementGuard.judge` whether the accuracy dropped
significantly below the last accepted ("good") evaluation. A drop is
significant when it exceeds both ``min_drop`` and ``z`` standard errors of the
difference of two binomial proportions measured on ``n`` prompts each::

  se   = sqrt(p_good (1 - p_good) / n + p (1 - p) / n)
  drop = p_good - p  >  max(min_drop, z * se)

On a regression the loop restores the parameters, optimizer state and
objective state of the last good version, multiplies the learning-rate scale
by ``lr_shrink`` (and the clip scale by ``clip_shrink``), logs the event and
continues with new prompts; otherwise the current version becomes the new
good one. Validating each update and rolling back a regression is the
practical form of the monotonic-improvement guarantee of TRPO/PPO
(Schulman et al., arXiv:1502.05477), which holds only for small, well-estimated
steps.

The guard's host state is a small JSON dict (saved in the progress record);
the snapshot of the last good arrays is part of the checkpointed run state, so
a resumed run can still roll back.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from jaxrl_llm.settings import BOOL, NONNEG, POSITIVE_INT, check, in_range, setting


@dataclasses.dataclass(frozen=True)
class GuardSettings:
  """``config.guard``: each field declared once with its meaning and check (:func:`jaxrl_llm.settings.setting`)."""

  enabled: bool = setting(False, "held-out check every `every` RL steps; roll back a significant regression", BOOL)
  every: int = setting(25, "RL steps between two guard checks", POSITIVE_INT)
  eval_size: int = setting(128, "held-out prompts per check", POSITIVE_INT)
  min_drop: float = setting(0.05, "smallest accuracy drop that counts as a regression", NONNEG)
  z: float = setting(2.0, "standard errors a drop must exceed to count", NONNEG)
  lr_shrink: float = setting(0.5, "learning-rate scale multiplier after a rollback", in_range(0, 1, low_open=True))
  clip_shrink: float = setting(1.0, "clip-scale multiplier after a rollback (< 1 needs control.enabled)",
                               in_range(0, 1, low_open=True))
  max_rollbacks: int = setting(3, "stop the run after more than this many rollbacks in a row", POSITIVE_INT)

  def __post_init__(self):
    check(self, "guard")


@dataclasses.dataclass
class GuardState:
  """JSON-serialisable guard state."""

  good_accuracy: Optional[float] = None
  good_step: int = 0
  checks: int = 0
  rollbacks: int = 0
  rollbacks_in_a_row: int = 0


@dataclasses.dataclass(frozen=True)
class Verdict:
  """The outcome of one check.

  Attributes:
    rollback: True when the accuracy regressed significantly.
    accuracy: the accuracy just measured.
    reference: the last good accuracy it was compared with (None at the first check).
    threshold: the drop that would have counted as significant.
  """

  rollback: bool
  accuracy: float
  reference: Optional[float]
  threshold: float

  def message(self, step: int) -> str:
    if self.reference is None:
      return f"guard: step {step} accuracy {self.accuracy:.3f} (first check, accepted)"
    verb = "ROLLBACK" if self.rollback else "accepted"
    return (f"guard: step {step} accuracy {self.accuracy:.3f} vs last good {self.reference:.3f} "
            f"(significant drop > {self.threshold:.3f}): {verb}")


class RollbackLimitError(RuntimeError):
  """Raised after ``guard.max_rollbacks`` consecutive rollbacks."""


class ImprovementGuard:
  """Decides accept / roll back from held-out accuracies; see the module docstring."""

  def __init__(self, settings: GuardSettings):
    self.settings = settings
    self.state = GuardState()

  def due(self, rl_step: int) -> bool:
    return rl_step > 0 and rl_step % self.settings.every == 0

  def threshold(self, reference: float, accuracy: float, n: int) -> float:
    se = math.sqrt(max(reference * (1 - reference), 0.0) / n + max(accuracy * (1 - accuracy), 0.0) / n)
    return max(self.settings.min_drop, self.settings.z * se)

  def judge(self, rl_step: int, accuracy: float, n: int) -> Verdict:
    """Compares ``accuracy`` (on ``n`` prompts) with the last good one and updates the state."""
    if not 0.0 <= accuracy <= 1.0 or n < 1:
      raise ValueError(f"guard.judge: accuracy must be in [0, 1] and n >= 1; got {accuracy}, {n}")
    st = self.state
    st.checks += 1
    ref = st.good_accuracy
    if ref is None:
      st.good_accuracy, st.good_step = accuracy, rl_step
      return Verdict(False, accuracy, None, 0.0)
    threshold = self.threshold(ref, accuracy, n)
    if ref - accuracy > threshold:
      st.rollbacks += 1
      st.rollbacks_in_a_row += 1
      if st.rollbacks_in_a_row > self.settings.max_rollbacks:
        raise RollbackLimitError(
            f"guard: {st.rollbacks_in_a_row} rollbacks in a row (limit guard.max_rollbacks="
            f"{self.settings.max_rollbacks}); the last good version is from RL step {st.good_step} "
            f"with held-out accuracy {ref:.3f}")
      return Verdict(True, accuracy, ref, threshold)
    st.good_accuracy, st.good_step = accuracy, rl_step
    st.rollbacks_in_a_row = 0
    return Verdict(False, accuracy, ref, threshold)

  def metrics(self) -> dict[str, float]:
    st = self.state
    return {"guard/rollbacks": float(st.rollbacks), "guard/good_accuracy": float(st.good_accuracy or 0.0),
            "guard/good_step": float(st.good_step)}

  def get_state(self) -> dict[str, Any]:
    return dataclasses.asdict(self.state)

  def set_state(self, state: Mapping[str, Any]) -> None:
    self.state = GuardState(**dict(state))
