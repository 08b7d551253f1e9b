"""Alerts: a threshold crossing that means a fault, and a reporter that says it once.

An alert is raised only for a condition that should not happen in a healthy run
(a sampler that disagrees with the learner, an exploding advantage, an update
that moves most tokens' probabilities); conditions that are expected, such as
the zero-variance filter removing solved groups, are metrics and never alerts.

:class:`Alert` is one crossing (its message, metric, value, threshold and a
hint at the usual cause); :func:`alert_if` makes one from a metrics dict.
:class:`AlertReporter` turns the alerts of each step into log lines: the first
occurrence of each alert with its cause, then at most one "raised K more times
since step S" line per alert every ``every`` steps, and it counts every
occurrence (for ``alerts/*`` metrics and ``summary.json``) with a JSON state
that survives a resume.

Example (one RL step of a job)::

  reporter = AlertReporter(every=50)                 # once per run
  m, alerts = diag.before_update(...)                # StepDiagnostics
  for line in reporter.report(step, alerts):
    log.warning("%s", line)
  metrics.update(reporter.metrics())                 # alerts/total, alerts/<name>
  checkpoint_extra["alerts"] = reporter.state_dict()
  summary["alerts"] = reporter.counts                # at the end, after reporter.flush(step)
"""

from __future__ import annotations

import math
from typing import Any, Sequence

DOC = "docs/off_policy.md (Troubleshooting)"


class Alert(str):
  """One threshold crossing: a human-readable message that also carries its fields.

  An ``Alert`` *is* its message (a ``str`` subclass), so lists of alerts print,
  log and JSON-serialise as lists of strings, e.g. ``consistency/kl_k3 =
  0.0042 > maximum 0.001 (sampler and learner disagree ...)``, while code can
  read the fields.

  Attributes:
    name: the alert's identifier, the metric name with ``/`` replaced by ``_``
      (e.g. ``consistency_kl_k3``); counted per run by :class:`AlertReporter`
      as ``alerts/<name>``.
    metric: the metric that crossed the threshold (``consistency/kl_k3``).
    value: its value this step.
    threshold: the limit it crossed.
    relation: ``">"`` (value above a maximum) or ``"<"`` (below a minimum).
    hint: what usually causes it, in a few words (see docs/off_policy.md).
  """

  def __new__(cls, name: str, metric: str, value: float, threshold: float, relation: str,
              hint: str = ""):
    if relation not in (">", "<"):
      raise ValueError(f"Alert: relation must be '>' or '<'; got {relation!r}")
    self = super().__new__(cls, _crossing(metric, value, threshold, relation, hint))
    self.name, self.metric, self.value = name, metric, float(value)
    self.threshold, self.relation, self.hint = float(threshold), relation, hint
    return self

  def __getnewargs__(self):
    return (self.name, self.metric, self.value, self.threshold, self.relation, self.hint)

  @property
  def message(self) -> str:
    return str.__str__(self)


def _crossing(metric: str, value: float, threshold: float, relation: str, hint: str = "") -> str:
  limit = "maximum" if relation == ">" else "minimum"
  text = f"{metric} = {value:.6g} {relation} {limit} {threshold:.6g}"
  return f"{text} ({hint})" if hint else text


def alert_if(metrics: dict[str, float], metric: str, threshold: float | None, relation: str,
             hint: str = "") -> list[Alert]:
  """A one-element list with an :class:`Alert` when ``metrics[metric]`` crosses ``threshold``.

  ``relation`` is ``">"`` (alert when the value exceeds a maximum) or ``"<"``
  (alert when it is below a minimum). A ``None`` threshold disables the check;
  a NaN value (empty selection) never alerts.
  """
  if threshold is None:
    return []
  value = float(metrics[metric])
  if math.isnan(value):
    return []
  crossed = value > threshold if relation == ">" else value < threshold
  if not crossed:
    return []
  return [Alert(metric.replace("/", "_"), metric, value, float(threshold), relation, hint)]


class AlertReporter:
  """Counts alerts over a run and rate-limits their log lines.

  Per alert name:

  * the first occurrence of the run gives one line with the metric, its value,
    the threshold, the likely cause (the alert's hint) and where to read more::

      step 12: alert consistency_kl_k3: consistency/kl_k3 = 0.0042 > maximum 0.001;
      likely cause: sampler and learner disagree on log pi ...; see docs/off_policy.md (Troubleshooting)

  * later occurrences are counted silently; once ``every`` steps have passed
    since the alert's last line, the next :meth:`report` call gives one summary
    line (whether or not the alert fired in that step)::

      step 62: alert consistency_kl_k3 raised 37 more times since step 13
      (38 in all; last: consistency/kl_k3 = 0.002 > maximum 0.001)

  * :meth:`flush` gives the summaries still pending (at the end of a run).

  So an alert that fires on every step of an R-step run logs about R / every
  lines, and a run without faults logs none. Everything is a function of the
  ``(step, alerts)`` calls (no clock), and :meth:`state_dict` /
  :meth:`load_state_dict` carry the counts and the pending summaries across a
  resume.

  Attributes:
    every: steps between two lines of one alert (>= 1).
    counts: alert name -> times raised in the run (sorted by name on output).
  """

  def __init__(self, every: int = 50, doc: str = DOC):
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
      raise ValueError(f"AlertReporter: every must be an int >= 1; got {every!r}")
    self.every = every
    self.doc = doc
    self.counts: dict[str, int] = {}
    self._last_line: dict[str, int] = {}      # name -> step of its last line
    self._pending: dict[str, dict[str, Any]] = {}  # name -> {"times", "since", "last"} not yet reported

  def report(self, step: int, alerts: Sequence[Alert]) -> list[str]:
    """Counts this step's ``alerts``; returns the lines to log now (maybe none).

    Args:
      step: the step the alerts belong to (non-decreasing over calls).
      alerts: the step's alerts (:class:`Alert`), in any number.

    Returns:
      first-occurrence lines in the order of ``alerts``, then the summary
      lines that fall due, by alert name.
    """
    lines = []
    for a in alerts:
      self.counts[a.name] = self.counts.get(a.name, 0) + 1
      if a.name not in self._last_line:  # first of the run (or of a resume from bare counts)
        lines.append(self._first_line(step, a))
        self._last_line[a.name] = step
        continue
      pending = self._pending.setdefault(a.name, {"times": 0, "since": step, "last": ""})
      pending["times"] += 1
      pending["last"] = _crossing(a.metric, a.value, a.threshold, a.relation)
    due = [name for name in sorted(self._pending) if step - self._last_line[name] >= self.every]
    return lines + [self._summary_line(step, name) for name in due]

  def flush(self, step: int) -> list[str]:
    """The summary lines of every alert raised since its last line (e.g. at the end of a run)."""
    return [self._summary_line(step, name) for name in sorted(self._pending)]

  def metrics(self) -> dict[str, float]:
    """Cumulative counts: ``alerts/<name>`` for every name seen so far and ``alerts/total``."""
    out = {f"alerts/{k}": float(v) for k, v in sorted(self.counts.items())}
    out["alerts/total"] = float(sum(self.counts.values()))
    return out

  def _first_line(self, step: int, a: Alert) -> str:
    cause = f"; likely cause: {a.hint}" if a.hint else ""
    return (f"step {step}: alert {a.name}: {_crossing(a.metric, a.value, a.threshold, a.relation)}{cause}; "
            f"see {self.doc}")

  def _summary_line(self, step: int, name: str) -> str:
    pending = self._pending.pop(name)
    self._last_line[name] = step
    times = pending["times"]
    return (f"step {step}: alert {name} raised {times} more time{'s' if times > 1 else ''} since step "
            f"{pending['since']} ({self.counts[name]} in all; last: {pending['last']})")

  def state_dict(self) -> dict[str, Any]:
    """JSON-serialisable state: counts, step of each alert's last line and pending summaries."""
    return {"counts": dict(sorted(self.counts.items())), "last_line": dict(sorted(self._last_line.items())),
            "pending": {k: dict(v) for k, v in sorted(self._pending.items())}}

  def load_state_dict(self, state: dict[str, Any]) -> None:
    """Restores :meth:`state_dict`'s output (a bare ``{"counts": ...}`` is accepted too).

    Raises:
      ValueError: when the state is malformed (nothing is changed then).
    """
    def counts_ok(d: Any) -> bool:
      return isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                                         and v >= 0 for k, v in d.items())

    ok = isinstance(state, dict) and counts_ok(state.get("counts")) and counts_ok(state.get("last_line", {}))
    pending = state.get("pending", {}) if ok else None
    ok = ok and isinstance(pending, dict) and set(pending) <= set(state.get("last_line", {})) and all(
        isinstance(v, dict) and counts_ok({"times": v.get("times"), "since": v.get("since")})
        and isinstance(v.get("last"), str) for v in pending.values())
    if not ok:
      raise ValueError("AlertReporter.load_state_dict: expected {'counts': {name: int >= 0}, 'last_line': "
                       f"{{name: step}}, 'pending': {{name: {{'times', 'since', 'last'}}}}}}; got {state!r}")
    self.counts = dict(state["counts"])
    self._last_line = dict(state.get("last_line", {}))
    self._pending = {k: dict(v) for k, v in pending.items()}


__all__ = ["Alert", "AlertReporter", "alert_if"]
