"""The update stage of an RL step: the jitted update(s), bracketed by the consistency check.

``rl.updates_per_batch`` jitted steps (:func:`jaxrl_llm.learner.rl_step.make_rl_step`)
on one batch. The first also returns the learner's log-probabilities pi_k of
the batch before any update (from the forward pass it runs anyway), which the
consistency check compares with the sampler's behaviour log-probabilities mu;
with ``diagnostics.consistency_action="skip"`` an update that fails the check
is discarded and the run state before it kept. Then the off-policy
diagnostics (:mod:`jaxrl_llm.diagnostics.offpolicy`): ratio statistics and
staleness S_k = TV(pi_k, mu) before the update, and every
``diagnostics.drift_every`` steps the update drift U_k = TV(pi_{k+1}, pi_k)
from one more forward pass (and, on the GAE path, how much the advantages
move when recomputed with the updated critic).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import struct

from jaxrl_llm.diagnostics import offpolicy
from jaxrl_llm.learner import mesh as mesh_lib, rl_step
from jaxrl_llm.learner.state import TrainState

__all__ = ["RunState", "PolicyUpdate", "UpdateResult"]


@struct.dataclass
class RunState:
  """The arrays of an RL run (a checkpoint's array item).

  Attributes:
    train: policy (and critic) parameters, optimizer state, version, RNG.
    objective: the objective chain's state (controlled hyper-parameter scales, counters).
    ref_params: the frozen reference policy (the warm start), or None.
    good: ``(train, objective)`` of the improvement guard's last good version, or None.
  """

  train: TrainState
  objective: Any
  ref_params: Any = None
  good: Any = None


@dataclasses.dataclass
class UpdateResult:
  """What one update stage did.

  Attributes:
    state: the run state after the update (the state before it when skipped).
    metrics: objective, optimizer, ``consistency/*`` and ``offpolicy/*`` metrics.
    alerts: the diagnostics' alerts (:class:`jaxrl_llm.diagnostics.Alert`).
    skipped: True when the consistency check discarded the update.
  """

  state: RunState
  metrics: dict
  alerts: list
  skipped: bool


class PolicyUpdate:
  """Builds (once per actor mode) and runs the jitted RL update of one batch.

  Args:
    spec: the step's static description (with ``train_actor`` ignored: both
      modes are compiled on demand).
    objective, optimizer, critic_optimizer: as for :func:`~jaxrl_llm.learner.rl_step.make_rl_step`.
    mesh: the learner mesh.
    updates_per_batch: jitted steps per batch.
    diagnostics: a :class:`jaxrl_llm.diagnostics.offpolicy.StepDiagnostics`.
    logp: ``logp(params, tokens_bt, seq_mask_bt) -> float32 [B, T]`` (the post-update forward).
    consistency_action: "warn" or "skip".
    drift_every: post-update forward every this many steps (0: never).
    track_nonfinite: called with each update's metrics (counts skipped non-finite updates).
    stale_check: a :class:`jaxrl_llm.jobs.stale_check.StaleConsistencyCheck` for batches
      without lag-0 tokens, or None.

  pi_k: with ``spec.proximal == "batch"`` it is computed here by one forward
  (``logp``) before the first update and held fixed in ``batch.prox_logp_bt``;
  with "forward" it comes out of the first update's own forward pass. Either
  way it is what the diagnostics compare with mu and with pi_{k+1}.
  Demonstration rows (``batch.sft_mask_bt``) were not sampled: they are left
  out of the consistency check and the off-policy diagnostics.
  """

  def __init__(self, spec: rl_step.RLStepSpec, objective: Any, optimizer: Any, critic_optimizer: Any, *, mesh: Any,
               updates_per_batch: int, diagnostics: Any, logp: Callable, consistency_action: str = "warn",
               drift_every: int = 1, track_nonfinite: Callable[[dict], None] = lambda m: None,
               stale_check: Any = None):
    self.spec = spec
    self.objective, self.optimizer, self.critic_optimizer = objective, optimizer, critic_optimizer
    self.mesh = mesh
    self.updates_per_batch = updates_per_batch
    self.diagnostics = diagnostics
    self.logp = logp
    self.consistency_action = consistency_action
    self.drift_every = drift_every
    self.track_nonfinite = track_nonfinite
    self.stale_check = stale_check
    self._steps: dict[bool, Callable] = {}

  def step_fn(self, train_actor: bool) -> Callable:
    """The jitted ``step(train, objective_state, batch) -> (train, objective_state, metrics)``."""
    if train_actor not in self._steps:
      spec = dataclasses.replace(self.spec, train_actor=train_actor)
      self._steps[train_actor] = rl_step.make_rl_step(spec, self.objective, self.optimizer, self.critic_optimizer,
                                                      mesh=self.mesh)
    return self._steps[train_actor]

  def shard(self, batch: rl_step.RLBatch) -> rl_step.RLBatch:
    """Default path: rows split over the mesh's batch axes (data x fsdp), so each device computes
    its share instead of the whole batch. Invariant mode places its atoms itself."""
    shards = mesh_lib.batch_divisor(self.mesh)
    if self.spec.grad_atoms or shards == 1 or batch.tokens_bt.shape[0] % shards:
      return batch
    return jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(self.mesh, x.ndim)), batch)

  def __call__(self, state: RunState, batch: rl_step.RLBatch, *, step: int, train_actor: bool,
               filter_rate: float = 0.0,
               recompute_advantages: Optional[Callable[[RunState], Any]] = None) -> UpdateResult:
    """Trains on ``batch`` and measures the update.

    Args:
      state: the run state before the update.
      batch: the step's RLBatch.
      step: the RL step index (for ``drift_every``).
      train_actor: False during critic warm-up (the actor is frozen: nothing to skip or drift).
      filter_rate: share of the sampled groups the zero-variance filter removed.
      recompute_advantages: GAE path: ``state -> advantages_bt`` with the updated critic
        (for the advantage drift), or None.
    """
    step_fn = self.step_fn(train_actor)
    batch = self.shard(batch)
    logp_k = None
    if self.spec.proximal == "batch":
      logp_k = self.logp(state.train.params, batch.tokens_bt, batch.seq_mask_bt)
      batch = batch.replace(prox_logp_bt=logp_k)
    before = state
    for _ in range(self.updates_per_batch):
      train, objective, m = step_fn(state.train, state.objective, batch)
      logp = m.pop("logp_bt")
      logp_k = logp if logp_k is None else logp_k
      state = state.replace(train=train, objective=objective)
      if train_actor:
        self.track_nonfinite(m)
    metrics = dict(m)
    logp_k = np.asarray(logp_k)
    mask = np.asarray(batch.response_mask_bt)
    if batch.sft_mask_bt is not None:
      mask = mask & ~np.asarray(batch.sft_mask_bt).any(axis=1, keepdims=True)
    behaviour = np.asarray(batch.behaviour_logp_bt)
    lag = np.asarray(batch.lag_bt)
    out, alerts = self.diagnostics.before_update(logp_k, behaviour, mask, lag, np.asarray(batch.advantages_bt),
                                                 filter_rate)
    if self.stale_check is not None:
      alerts += self.stale_check(out, batch, mask, lag, int(before.train.policy_version))
    inconsistent = any(a.metric.startswith("consistency/") and a.metric != "consistency/unchecked_steps"
                       for a in alerts)
    skipped = inconsistent and self.consistency_action == "skip" and train_actor
    if skipped:
      state = before
    out["consistency/update_skipped"] = float(skipped)
    if train_actor and not skipped and self.drift_every and step % self.drift_every == 0:
      after = np.asarray(self.logp(state.train.params, batch.tokens_bt, batch.seq_mask_bt))
      drift, drift_alerts = self.diagnostics.after_update(logp_k, after, behaviour, mask)
      out.update(drift)
      alerts += drift_alerts
      if recompute_advantages is not None:
        out.update(_advantage_drift(batch, recompute_advantages(state)))
    metrics.update(out)
    return UpdateResult(state, metrics, alerts, skipped)


def _advantage_drift(batch: rl_step.RLBatch, recomputed_bt: Any) -> dict:
  return offpolicy.advantage_drift(np.asarray(batch.advantages_bt), np.asarray(recomputed_bt),
                                   np.asarray(batch.response_mask_bt))
