"""The sampler/learner consistency check when a batch has no fresh (lag-0) token.

The consistency check compares the learner's log pi with the sampler's log mu
on tokens sampled by the learner's *current* weights (lag 0): only there is
any difference numerical, i.e. a sampler fault. In asynchronous training
(PipelineRL with k >= 1, or ``rollout.simulated_lag``) every token of a step
may be stale, and the check would have nothing to look at exactly in the mode
where a broken sampler is most likely.

Design: the job keeps the parameters of the last versions of the lag window
(:class:`jaxrl_llm.rollout.lagged.ParamsWindow`, references to arrays the
learner made anyway). When a batch has no lag-0 token, up to
``diagnostics.stale_check_rows`` rows whose response was sampled by one
version still in the window are re-scored with *that version's* parameters
(one forward per version, on those rows only) and the usual statistics and
alerts are computed on them (``consistency/source = 1``; lag-0 tokens give
``consistency/source = 0``). When neither is possible (window empty after a
resume, rows mixing versions from in-flight weight updates, the check
disabled) the step counts as unchecked; ``consistency/unchecked_steps`` counts
such steps in a row and raises the alert ``consistency_unchecked_steps`` when
it reaches ``diagnostics.max_unchecked_steps``. Data sampled before the window
began (the steps a pipeline checkpoint restores, sampled by versions the
resumed learner no longer has) is not checkable and not counted as a gap.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from jaxrl_llm.diagnostics import offpolicy

__all__ = ["StaleConsistencyCheck", "own_version_rows"]


def own_version_rows(lag_bt: np.ndarray, mask_bt: np.ndarray, learner_version: int, kept: Callable[[int], bool],
                     max_rows: int) -> dict[int, np.ndarray]:
  """Rows to re-score, grouped by the version that sampled them.

  Args:
    lag_bt: int [B, T] version lags (learner version - sampling version).
    mask_bt: bool [B, T] response tokens to check.
    learner_version: the learner's version the lags count from.
    kept: whether a version's parameters are available.
    max_rows: most rows in total, taken in row order.

  Returns:
    ``{version: int64 row indices}``; rows whose response mixes versions are skipped.
  """
  out: dict[int, list[int]] = {}
  taken = 0
  for b in range(lag_bt.shape[0]):
    lags = np.unique(lag_bt[b][mask_bt[b]])
    if taken >= max_rows or lags.size != 1:
      continue
    version = int(learner_version - lags[0])
    if kept(version):
      out.setdefault(version, []).append(b)
      taken += 1
  return {v: np.asarray(rows, np.int64) for v, rows in out.items()}


class StaleConsistencyCheck:
  """Keeps the consistency check meaningful on stale batches (see the module docstring).

  Args:
    window: the :class:`~jaxrl_llm.rollout.lagged.ParamsWindow` of recent versions (or None).
    logp: ``logp(params, tokens_bt, seq_mask_bt) -> float32 [B, T]``.
    thresholds: the consistency limits.
    max_rows: rows re-scored per stale step (0: never).
    max_unchecked: alert when this many steps in a row had no check.
  """

  def __init__(self, window: Any, logp: Callable, thresholds: offpolicy.ConsistencyThresholds, *, max_rows: int,
               max_unchecked: int):
    self.window = window
    self.logp = logp
    self.thresholds = thresholds
    self.max_rows = max_rows
    self.max_unchecked = max_unchecked
    self.unchecked = 0

  def __call__(self, metrics: dict, batch: Any, mask_bt: np.ndarray, lag_bt: np.ndarray,
               learner_version: int) -> list:
    """Fills ``consistency/*`` of a stale batch in ``metrics``; returns the alerts.

    ``metrics`` already holds the lag-0 statistics; when the batch has lag-0
    tokens they stand (source 0).
    """
    alerts: list = []
    fresh = bool((mask_bt & (lag_bt == 0)).any())
    source: Optional[float] = 0.0 if fresh else None
    if not fresh and self.window is not None and self.max_rows:
      rows = own_version_rows(lag_bt, mask_bt, learner_version, lambda v: v in self.window, self.max_rows)
      if rows:
        logp, behaviour, mask = self._rescore(batch, rows, mask_bt)
        stats = offpolicy.consistency_stats(logp, behaviour, mask)
        metrics.update(stats)
        alerts += offpolicy.consistency_alerts(stats, self.thresholds)
        source = 1.0
    if source is not None:
      self.unchecked = 0
    elif not self._before_window(lag_bt, mask_bt, learner_version):
      self.unchecked += 1
    # else: every row was sampled before the window began (restored from a checkpoint): not a gap
    metrics["consistency/source"] = float("nan") if source is None else source
    metrics["consistency/unchecked_steps"] = float(self.unchecked)
    alerts += offpolicy.alert_if(metrics, "consistency/unchecked_steps", self.max_unchecked - 1, ">",
                                 "no lag-0 token and no kept version to re-score stale rows: raise "
                                 "diagnostics.stale_check_rows, or lower rollout.max_lag")
    return alerts

  def _before_window(self, lag_bt: np.ndarray, mask_bt: np.ndarray, learner_version: int) -> bool:
    """Every response token was sampled by a version older than the oldest kept one (data from before a resume)."""
    if self.window is None or not self.window.versions or not mask_bt.any():
      return False
    return bool((learner_version - lag_bt[mask_bt]).max() < min(self.window.versions))

  def _rescore(self, batch: Any, rows: dict[int, np.ndarray], mask_bt: np.ndarray):
    tokens, seq = np.asarray(batch.tokens_bt), np.asarray(batch.seq_mask_bt)
    behaviour = np.asarray(batch.behaviour_logp_bt)
    parts = [(np.asarray(self.logp(self.window.get(v), tokens[r], seq[r])), behaviour[r], mask_bt[r])
             for v, r in sorted(rows.items())]
    return tuple(np.concatenate(p) for p in zip(*parts))

  def get_state(self) -> dict:
    return {"unchecked": self.unchecked}

  def set_state(self, state: dict) -> None:
    self.unchecked = int(state.get("unchecked", 0))
