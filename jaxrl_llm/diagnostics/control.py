"""Closed-loop off-policy control: the clip range and the staleness window follow
the measured update drift and staleness.

The off-policy improvement bounds (TRPO, arXiv:1502.05477; GePPO,
arXiv:2111.00072) split "will this update improve the policy" into measured
quantities; two of them have a direct actuator:

* **update drift** U_k = TV(pi_{k+1}, pi_k) on the batch tokens
  (:func:`jaxrl_llm.diagnostics.drift.update_drift`). Its actuator is the
  clip range eps: a smaller eps clips more tokens and bounds the step. When
  U_k stays above ``drift_target * tolerance`` the controller multiplies the
  clip scale by ``tighten`` (< 1); below ``drift_target / tolerance`` by
  ``relax`` (> 1), within ``[min_clip_scale, max_clip_scale]``. This is the
  GePPO rule (Queeney et al., arXiv:2111.00072, which adapts the step size so
  the TV drift tracks a target) applied to eps instead of the learning rate.
* **staleness** S_k = TV(pi_k, mu) of the data the learner trains on
  (:func:`jaxrl_llm.diagnostics.drift.staleness`). Its actuator is the
  staleness window of the PipelineRL feeder (``rollout.max_lag``): above
  ``staleness_target * tolerance`` the window shrinks by one version, below
  ``staleness_target / tolerance`` it grows back by one, never beyond the
  configured ``rollout.max_lag``.

The clip scale reaches the jitted step as a :class:`~jaxrl_llm.objectives.Controlled`
hyper-parameter (objective state, no recompilation, checkpointed with the
arrays); the controller's own state (scale, window, counters) is a small JSON
dict saved in the run's progress record. A KL-coefficient controller
(:func:`jaxrl_llm.advantages.adaptive_kl_controller`, Ziegler et al.
arXiv:1909.08593) is kept alongside when a KL target is configured.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

from jaxrl_llm.settings import (BOOL, NONNEG, NONNEG_INT, POSITIVE, at_least, check, greater_than, in_range, require,
                                setting)

CLIP_KEY = "clip"  # Controlled key of the clip-range hyper-parameters
KL_KEY = "kl"  # Controlled key of the KL-loss coefficient


@dataclasses.dataclass(frozen=True)
class ControlSettings:
  """Targets and gains of :class:`OffPolicyController` (``config.control``).

  Each field is declared once with its meaning and check (:func:`jaxrl_llm.settings.setting`);
  ``max_lag`` is not a config field: a run fills in its ``rollout.max_lag``.
  """

  enabled: bool = setting(False, "closed-loop control of the clip range, staleness window and KL coefficient", BOOL)
  drift_target: float = setting(0.02, "target update drift U_k (TV distance between pi_k+1 and pi_k per step)",
                                POSITIVE)
  staleness_target: float = setting(0.05, "target staleness S_k (TV distance between pi_k and the sampler's mu)",
                                    POSITIVE)
  tolerance: float = setting(1.5, "dead band: act only above target * tolerance or below target / tolerance",
                             greater_than(1))
  tighten: float = setting(0.8, "clip-scale multiplier when the drift is too high",
                           in_range(0, 1, low_open=True, high_open=True))
  relax: float = setting(1.05, "clip-scale multiplier when the drift is low", at_least(1))
  min_clip_scale: float = setting(0.1, "smallest clip scale (eps = base eps * clip scale)", POSITIVE)
  max_clip_scale: float = setting(1.0, "largest clip scale", POSITIVE)
  max_lag: int = setting(0, "largest staleness window: the run's rollout.max_lag (0 unless rollout.mode='pipeline')",
                         NONNEG_INT, config=False)
  min_lag: int = setting(0, "smallest staleness window the controller may set", NONNEG_INT)
  kl_target: float = setting(0.0, "target per-token KL to the reference policy; > 0: adaptive coefficient of the "
                             "recipe's KL term (needs an effective kl_coef > 0)", NONNEG)
  kl_horizon: float = setting(10000.0, "episodes over which the KL coefficient changes by at most 20 %", POSITIVE)

  def __post_init__(self):
    check(self, "control")
    require(self, "control", self.min_clip_scale <= self.max_clip_scale, "min_clip_scale",
            f"<= control.max_clip_scale={self.max_clip_scale}")
    require(self, "control", self.min_lag <= self.max_lag, "min_lag", f"in [0, max_lag={self.max_lag}]")


@dataclasses.dataclass
class ControllerState:
  """JSON-serialisable controller state (saved in the progress record)."""

  clip_scale: float = 1.0
  max_lag: int = 0
  kl_coef: Optional[float] = None
  tightened: int = 0
  relaxed: int = 0
  lag_lowered: int = 0
  lag_raised: int = 0


class OffPolicyController:
  """Host-side proportional controller of the clip scale, staleness window and KL coefficient.

  ``update`` is called once per learner step with that step's measurements
  and returns the metrics to log; the loop applies ``state.clip_scale`` to the
  objective state (:func:`jaxrl_llm.objectives.set_control`), ``state.max_lag``
  to the pipeline feeder and ``state.kl_coef`` to the KL term.

  Example::

    ctl = OffPolicyController(ControlSettings(drift_target=0.02, max_lag=4))
    ctl.update(drift=0.05, staleness=0.01)     # drift too high: clip scale 0.8
  """

  def __init__(self, settings: ControlSettings, kl_coef: Optional[float] = None):
    self.settings = settings
    self.state = ControllerState(max_lag=settings.max_lag,
                                 kl_coef=kl_coef if settings.kl_target > 0 else None)

  def update(self, *, drift: Optional[float] = None, staleness: Optional[float] = None,
             kl: Optional[float] = None, episodes: int = 0) -> dict[str, float]:
    """One control step. A measurement that is None or NaN leaves its actuator alone.

    Args:
      drift: update drift U_k of the step just taken.
      staleness: staleness S_k of the batch it trained on.
      kl: mean per-token KL to the reference policy (for the KL coefficient).
      episodes: sequences behind ``kl`` (the KL controller's step size).

    Returns:
      ``control/*`` metrics after the update.
    """
    s, st = self.settings, self.state
    if _measured(drift):
      if drift > s.drift_target * s.tolerance and st.clip_scale > s.min_clip_scale:
        st.clip_scale = max(s.min_clip_scale, st.clip_scale * s.tighten)
        st.tightened += 1
      elif drift < s.drift_target / s.tolerance and st.clip_scale < s.max_clip_scale:
        st.clip_scale = min(s.max_clip_scale, st.clip_scale * s.relax)
        st.relaxed += 1
    if _measured(staleness):
      if staleness > s.staleness_target * s.tolerance and st.max_lag > s.min_lag:
        st.max_lag -= 1
        st.lag_lowered += 1
      elif staleness < s.staleness_target / s.tolerance and st.max_lag < s.max_lag:
        st.max_lag += 1
        st.lag_raised += 1
    if st.kl_coef is not None and _measured(kl):
      # Ziegler et al.: coef *= 1 + clip(KL / target - 1, +-0.2) * n / horizon
      error = min(0.2, max(-0.2, kl / s.kl_target - 1.0))
      st.kl_coef *= 1.0 + error * episodes / s.kl_horizon
    return self.metrics()

  def shrink_clip(self, factor: float) -> None:
    """Multiplies the clip scale by ``factor`` (used by the improvement guard)."""
    self.state.clip_scale = max(self.settings.min_clip_scale, self.state.clip_scale * factor)

  def metrics(self) -> dict[str, float]:
    st = self.state
    out = {"control/clip_scale": st.clip_scale, "control/max_lag": float(st.max_lag),
           "control/tightened": float(st.tightened), "control/relaxed": float(st.relaxed)}
    if st.kl_coef is not None:
      out["control/kl_coef"] = st.kl_coef
    return out

  def get_state(self) -> dict[str, Any]:
    return dataclasses.asdict(self.state)

  def set_state(self, state: Mapping[str, Any]) -> None:
    known = {f.name for f in dataclasses.fields(ControllerState)}
    unknown = set(state) - known
    if unknown:
      raise ValueError(f"controller state has unknown fields {sorted(unknown)} (expected {sorted(known)})")
    self.state = ControllerState(**dict(state))


def _measured(x: Optional[float]) -> bool:
  return x is not None and math.isfinite(x)
