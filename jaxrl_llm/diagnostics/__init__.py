"""Metrics sinks, plots and run summaries; consistency and off-policy diagnostics; alerts.

Modules:
  writers          JSONL / TensorBoard / progress-bar sinks, curves, summaries.
  consistency      sampler-vs-learner ratio statistics and alerts before an update.
  drift            update drift U_k and sampling staleness S_k (TV estimated from
                   the sampled tokens).
  advantage_error  advantage substitution error against Monte Carlo returns, and
                   advantage drift between recomputations.
  offpolicy        the per-step data checks and ``StepDiagnostics`` (runs all the
                   above with one configuration); re-exports their measures.
  alerts           ``Alert``, ``alert_if`` and ``AlertReporter`` (first occurrence
                   with its cause, then rate-limited, counted over the run).
  control          the adaptive controller of off-policy knobs.
  guard            the monotonic-improvement guard (validate, roll back).
  estimates        unbiased pass@k and 95 % intervals of evaluation figures (import the module).

See docs/off_policy.md for formulas, healthy ranges and troubleshooting.
"""

from jaxrl_llm.diagnostics.advantage_error import (
    advantage_drift,
    advantage_substitution_error,
    monte_carlo_returns,
)
from jaxrl_llm.diagnostics.alerts import Alert, AlertReporter, alert_if
from jaxrl_llm.diagnostics.consistency import (
    ConsistencyThresholds,
    consistency_alerts,
    consistency_stats,
)
from jaxrl_llm.diagnostics.drift import staleness, update_drift
from jaxrl_llm.diagnostics.offpolicy import StepDiagnostics, data_alerts

__all__ = [
    "Alert", "AlertReporter", "ConsistencyThresholds", "StepDiagnostics", "advantage_drift",
    "advantage_substitution_error", "alert_if", "consistency_alerts", "consistency_stats", "data_alerts",
    "monte_carlo_returns", "staleness", "update_drift",
]
