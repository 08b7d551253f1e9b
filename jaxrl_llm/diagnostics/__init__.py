"""Metrics sinks, plots and run summaries; consistency and off-policy diagnostics.

Modules:
  writers      JSONL / TensorBoard / progress-bar sinks, curves, summaries.
  consistency  sampler-vs-learner ratio statistics and alerts before an update.
  offpolicy    the seeds' diagnostics: update drift U_k, staleness S_k, advantage
               substitution error and drift, data alerts; ``StepDiagnostics``.

See docs/off_policy.md for formulas, healthy ranges and troubleshooting.
"""

from jaxrl_llm.diagnostics._host import Alert
from jaxrl_llm.diagnostics.consistency import (
    ConsistencyThresholds,
    consistency_alerts,
    consistency_stats,
)
from jaxrl_llm.diagnostics.offpolicy import (
    StepDiagnostics,
    advantage_drift,
    advantage_substitution_error,
    data_alerts,
    monte_carlo_returns,
    staleness,
    update_drift,
)

__all__ = [
    "Alert", "ConsistencyThresholds", "StepDiagnostics", "advantage_drift",
    "advantage_substitution_error", "consistency_alerts", "consistency_stats", "data_alerts",
    "monte_carlo_returns", "staleness", "update_drift",
]
