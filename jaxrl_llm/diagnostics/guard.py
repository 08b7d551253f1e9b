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
good one. This is the seeds' "validate each update, roll back a regression",
the practical form of the monotonic-improvement guarantee of TRPO/PPO
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

from jaxrl_llm.diagnostics._host import settings_checker


@dataclasses.dataclass(frozen=True)
class GuardSettings:
  """``config.guard``.

  Attributes:
    every: evaluate every this many RL steps (>= 1).
    eval_size: held-out prompts per check (>= 1).
    min_drop: smallest accuracy drop that counts as a regression (>= 0).
    z: standard errors a drop must exceed (>= 0).
    lr_shrink: learning-rate scale multiplier after a rollback, in (0, 1].
    clip_shrink: clip-scale multiplier after a rollback, in (0, 1].
    max_rollbacks: stop the run after this many rollbacks in a row (>= 1).
  """

  every: int = 25
  eval_size: int = 128
  min_drop: float = 0.05
  z: float = 2.0
  lr_shrink: float = 0.5
  clip_shrink: float = 1.0
  max_rollbacks: int = 3

  def __post_init__(self):
    need = settings_checker("guard", self)
    need(isinstance(self.every, int) and self.every >= 1, "every", "an integer >= 1")
    need(isinstance(self.eval_size, int) and self.eval_size >= 1, "eval_size", "an integer >= 1")
    need(self.min_drop >= 0, "min_drop", ">= 0")
    need(self.z >= 0, "z", ">= 0")
    need(0 < self.lr_shrink <= 1, "lr_shrink", "in (0, 1]")
    need(0 < self.clip_shrink <= 1, "clip_shrink", "in (0, 1]")
    need(isinstance(self.max_rollbacks, int) and self.max_rollbacks >= 1, "max_rollbacks", "an integer >= 1")


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
