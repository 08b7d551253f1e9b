"""Dynamic sampling: over-sample until a learner batch holds enough informative groups.

A group whose samples all got the same reward has zero group-relative advantage and
gives no gradient. DAPO (arXiv:2503.14476) keeps sampling until the batch is full of
groups with unequal rewards; :class:`InformativeGroupCollector` does that selection on
the host, round by round, and pads with zero-variance groups after ``max_rounds``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxrl_llm.tasks.curation.config import check_int


def zero_variance_groups(rewards_b: Any, group_size: int, tolerance: float = 0.0) -> np.ndarray:
  """Flags groups whose rewards are all equal: ``max_g - min_g <= tolerance``.

  The host-side twin of :func:`jaxrl_llm.advantages.group_zero_variance` (exact by
  default), for data selection before any array reaches the device.

  Args:
    rewards_b: float [G * N] rewards, groups contiguous.
    group_size: N >= 1.
    tolerance: >= 0.

  Returns:
    bool [G].
  """
  n = check_int("group_size", group_size, 1)
  r = np.asarray(rewards_b, np.float64)
  if r.ndim != 1 or r.shape[0] % n:
    raise ValueError(f"rewards_b must have shape [G * N] with N = group_size = {n}, got {r.shape}")
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards_b must be finite, got {r.tolist()}")
  r_gn = r.reshape(-1, n)
  return (r_gn.max(axis=1) - r_gn.min(axis=1)) <= tolerance


@dataclasses.dataclass(frozen=True)
class CollectedGroups:
  """The groups chosen by :class:`InformativeGroupCollector`, in arrival order.

  Attributes:
    rows_b: int64 [S * N] row indices into the concatenation of every round's rows
      (round 0's rows first), the N rows of each selected group contiguous.
    round_g: int64 [S] the round of each selected group.
    group_g: int64 [S] its group index within that round.
    zero_variance_g: bool [S] True for padding groups (all rewards equal).
    rounds: sampling rounds used.
    discarded_groups: zero-variance groups left out.
    surplus_groups: informative groups beyond the target, left out.
    padded_groups: zero-variance groups kept because ``max_rounds`` ran out.
    missing_groups: target minus S (> 0 only when all rounds together had too few groups).
  """

  rows_b: np.ndarray
  round_g: np.ndarray
  group_g: np.ndarray
  zero_variance_g: np.ndarray
  rounds: int
  discarded_groups: int
  surplus_groups: int
  padded_groups: int
  missing_groups: int

  def rows_of_round(self, round_index: int, group_size: int) -> np.ndarray:
    """Selected row indices local to one round's batch (for per-round Trajectories)."""
    groups = self.group_g[self.round_g == round_index]
    return (groups[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)

  def metrics(self) -> dict[str, float]:
    """``data/dynamic_*`` scalars for the metrics writer."""
    return {"data/dynamic_rounds": float(self.rounds),
            "data/dynamic_discarded_groups": float(self.discarded_groups),
            "data/dynamic_surplus_groups": float(self.surplus_groups),
            "data/dynamic_padded_groups": float(self.padded_groups),
            "data/dynamic_missing_groups": float(self.missing_groups)}


class InformativeGroupCollector:
  """Dynamic sampling (DAPO): over-sample until ``target_groups`` groups have reward variance.

  Each sampling round's rewards are passed to :meth:`add`; groups whose rewards are all
  equal (zero advantage, no gradient) are set aside. Once ``target_groups`` informative
  groups have arrived, :meth:`result` returns the first ``target_groups`` of them in
  arrival order (so the learner batch keeps its size and shape). After ``max_rounds``
  rounds it returns what it has, padded with the earliest zero-variance groups (counted
  in ``padded_groups``), instead of sampling forever.

  State: none across learner steps. A collector lives within one step; checkpoints are
  taken between steps, and a resumed step re-runs its rounds (derive the round's
  sampling key from (seed, step, round), e.g. ``fold_in(sampling_key(step), round)``,
  and draw the rounds' prompts from the resumable prompt source, so the re-run is
  identical).

  Args:
    target_groups: groups per learner batch (>= 1).
    group_size: N samples per group (>= 1).
    max_rounds: most sampling rounds (>= 1).
    tolerance: rewards within this of each other count as equal (default exact).

  Example::

    collector = InformativeGroupCollector(target_groups=8, group_size=4, max_rounds=3)
    while not collector.done:
      batch = source.next_batch()
      rewards_b = score(sample(batch))
      source.record(batch, rewards_b)
      collector.add(rewards_b)
    chosen = collector.result()   # chosen.rows_b indexes the concatenated rounds
  """

  def __init__(self, target_groups: int, group_size: int, max_rounds: int = 4, tolerance: float = 0.0):
    self.target_groups = check_int("target_groups", target_groups, 1)
    self.group_size = check_int("group_size", group_size, 1)
    self.max_rounds = check_int("max_rounds", max_rounds, 1)
    if not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < math.inf:
      raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    self.tolerance = float(tolerance)
    self.reset()

  def reset(self) -> None:
    """Forgets every round (start of a new learner step)."""
    self._informative: list[tuple[int, int, int]] = []  # (round, group, row offset)
    self._flat: list[tuple[int, int, int]] = []
    self._round_rows: list[int] = []

  @property
  def rounds(self) -> int:
    """Rounds added so far."""
    return len(self._round_rows)

  @property
  def groups_needed(self) -> int:
    """Informative groups still missing (what the next round should at least yield)."""
    return max(0, self.target_groups - len(self._informative))

  @property
  def done(self) -> bool:
    """Enough informative groups, or ``max_rounds`` rounds added."""
    return self.groups_needed == 0 or self.rounds >= self.max_rounds

  def add(self, rewards_b: Any) -> bool:
    """Adds one round's scored groups.

    Args:
      rewards_b: float [G_r * N] the round's rewards, groups contiguous.

    Returns:
      ``done`` after this round.

    Raises:
      ValueError: for a malformed ``rewards_b``, or when the collector is already done.
    """
    if self.done and self.rounds:
      raise ValueError(f"InformativeGroupCollector is done after {self.rounds} round(s); "
                       "call result(), then reset() for the next step")
    flags = zero_variance_groups(rewards_b, self.group_size, self.tolerance)
    r, offset = self.rounds, sum(self._round_rows)
    for g, flat in enumerate(flags.tolist()):
      (self._flat if flat else self._informative).append((r, g, offset + g * self.group_size))
    self._round_rows.append(flags.shape[0] * self.group_size)
    return self.done

  def result(self) -> CollectedGroups:
    """The selected groups (see :class:`CollectedGroups`).

    Raises:
      ValueError: before the first round.
    """
    if not self.rounds:
      raise ValueError("InformativeGroupCollector.result(): no round has been added")
    chosen = self._informative[:self.target_groups]
    surplus = len(self._informative) - len(chosen)
    pad = self._flat[:self.target_groups - len(chosen)]
    picked = sorted([(e, False) for e in chosen] + [(e, True) for e in pad])
    n = self.group_size
    rows = np.asarray([off + j for (_, _, off), _ in picked for j in range(n)], np.int64)
    return CollectedGroups(
        rows_b=rows,
        round_g=np.asarray([e[0] for e, _ in picked], np.int64),
        group_g=np.asarray([e[1] for e, _ in picked], np.int64),
        zero_variance_g=np.asarray([flat for _, flat in picked], bool),
        rounds=self.rounds,
        discarded_groups=len(self._flat) - len(pad),
        surplus_groups=surplus,
        padded_groups=len(pad),
        missing_groups=self.target_groups - len(picked))


__all__ = ["CollectedGroups", "InformativeGroupCollector", "zero_variance_groups"]
