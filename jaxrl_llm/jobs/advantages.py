"""The advantages stage of an RL step: scored samples in, the learner's ``RLBatch`` out.

One pure function, :func:`compute_advantages`, of the sampled trajectory, the
sequence rewards and (for GAE) the critic's values and the reference policy's
log-probabilities, computed beforehand by the job. In order:

1. advantages: GAE on token rewards (the reward at the stop token, minus
   beta * KL_t against the reference when the KL penalty is on; Schulman et
   al., arXiv:1506.02438; Ziegler et al., arXiv:1909.08593), or group-relative
   (GRPO / Dr.GRPO / RLOO: :func:`jaxrl_llm.advantages.group_advantages`);
2. normalisation (``advantage.normalization``);
3. the zero-variance filter (``rl.filter_zero_variance``): groups whose samples
   all got the same reward carry no gradient; their tokens leave the loss mask
   and their rows leave the batch (:func:`jaxrl_llm.learner.rl_step.informative_rows`);
4. the policy-version lag of every token and the data metrics.

Dimensions: B rows (G groups of n), T tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_llm import advantages as A
from jaxrl_llm.diagnostics import offpolicy
from jaxrl_llm.learner.mesh import BATCH_AXES
from jaxrl_llm.learner.rl_step import RLBatch, informative_rows
from jaxrl_llm.types import Trajectory

__all__ = ["AdvantageSpec", "AdvantageInputs", "AdvantageOutput", "compute_advantages", "gae_advantages",
           "normalize"]


@dataclasses.dataclass(frozen=True)
class AdvantageSpec:
  """How a run turns rewards into advantages (from ``config.advantage`` and ``config.rl``).

  Attributes:
    estimator: "gae" or a group estimator name of :mod:`jaxrl_llm.advantages`.
    normalization: "none" or a normaliser of :func:`jaxrl_llm.advantages.make_advantage_normalizer`.
    group_size: n samples per prompt.
    gamma, lam: GAE discount and lambda.
    filter_zero_variance: drop zero-variance groups (group estimators only).
    row_granule: the smallest learner batch (rows) after filtering.
    kl_shaper: the token-level KL penalty in the reward (GAE path), or None.
    norm_level: "token" or "sequence" statistics of the normalisation.
    norm_shift_mean: subtract the mean before scaling.
    mesh: the learner mesh; "global" normalisation reduces over its batch axes
      (data, fsdp) with the batch's rows split over them.
  """

  estimator: str
  normalization: str = "none"
  group_size: int = 1
  gamma: float = 1.0
  lam: float = 1.0
  filter_zero_variance: bool = False
  row_granule: int = 1
  kl_shaper: Any = None
  norm_level: str = "token"
  norm_shift_mean: bool = True
  mesh: Any = None


@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
  """One step's scored samples.

  Attributes:
    trajectory: B rows, numpy, trimmed of all-padding columns.
    rewards_b: float32 [B] sequence rewards.
    learner_version: the policy version that will train on the batch (for the lags).
    old_values_bt: float32 [B, T] critic values at sampling time (GAE), else None.
    ref_logp_bt: float32 [B, T] reference log-probabilities when the KL penalty is on, else None.
    kl_coef: the KL penalty's current beta (None: the shaper's initial one).
  """

  trajectory: Trajectory
  rewards_b: np.ndarray
  learner_version: int
  old_values_bt: Optional[Any] = None
  ref_logp_bt: Optional[Any] = None
  kl_coef: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class AdvantageOutput:
  """The batch to train on and what the stage measured.

  Attributes:
    batch: the RLBatch (``ref_logp_bt`` is the input's, or zeros: the job fills
      it after filtering when the objective needs a reference).
    metrics: ``data/*``, ``reward/*``, ``response/*``, ``kl_reward/*`` and the
      GAE path's advantage-substitution error (``offpolicy/*``).
    rewards_bt: float32 [B, T] the token rewards of the GAE path (None otherwise),
      for the advantage drift after the update.
    kl_coef: the KL penalty's beta for the next batch (None without the penalty).
  """

  batch: RLBatch
  metrics: dict
  rewards_bt: Optional[Any] = None
  kl_coef: Optional[float] = None


def gae_advantages(spec: AdvantageSpec, rewards_bt: Any, values_bt: Any, response_bt: Any) -> tuple[Any, Any]:
  """GAE advantages (normalised as configured) and returns, float32 [B, T] each."""
  adv, returns = A.gae(rewards_bt, jnp.where(response_bt, values_bt, 0.0), response_bt, gamma=spec.gamma,
                       lam=spec.lam)
  return normalize(spec, adv, response_bt), returns


def normalize(spec: AdvantageSpec, adv_bt: Any, mask_bt: Any) -> Any:
  """``advantage.normalization`` of float32 [B, T] advantages over the mask (identity for "none").

  "global" runs the normaliser inside ``shard_map`` with the rows split over
  the mesh's batch axes, so its statistics are the ``psum`` over the shards
  (the whole batch's, on any mesh; with one process it equals "batch").
  """
  if spec.normalization == "none":
    return adv_bt
  axes = ()
  if spec.normalization == "global":
    if spec.mesh is None:
      raise ValueError("advantage.normalization='global' needs the learner mesh (AdvantageSpec.mesh)")
    axes = tuple(a for a in BATCH_AXES if a in spec.mesh.axis_names)
  norm = A.make_advantage_normalizer(spec.normalization, group_size=spec.group_size, level=spec.norm_level,
                                     shift_mean=spec.norm_shift_mean, axis_name=axes or None)
  if spec.normalization != "global":
    return norm(adv_bt, mask_bt)
  shards = int(np.prod([spec.mesh.shape[a] for a in axes]))
  if adv_bt.shape[0] % shards:
    raise ValueError(f"advantage.normalization='global': the batch's {adv_bt.shape[0]} rows do not split over the "
                     f"mesh's {shards} batch shards (learner.mesh {dict(spec.mesh.shape)}); expected "
                     "rl.prompts_per_step * rl.samples_per_prompt to be a multiple of it")
  rows = P(axes)
  return jax.jit(jax.shard_map(norm, mesh=spec.mesh, in_specs=(rows, rows), out_specs=rows))(
      jnp.asarray(adv_bt, jnp.float32), jnp.asarray(mask_bt, bool))


def compute_advantages(spec: AdvantageSpec, inputs: AdvantageInputs) -> AdvantageOutput:
  """Advantages, normalisation, zero-variance filter and lags of one step (see the module docstring)."""
  traj, rewards = inputs.trajectory, inputs.rewards_b
  tokens = jnp.asarray(traj.tokens_bt)
  response = jnp.asarray(traj.response_mask_bt)
  seq = jnp.asarray(traj.sequence_mask_bt)
  behaviour = jnp.asarray(traj.behaviour_logp_bt)
  zeros = jnp.zeros(tokens.shape, jnp.float32)
  old_values, returns, rewards_bt, kl_coef = zeros, zeros, None, None
  metrics: dict[str, Any] = {}
  versions = np.asarray(traj.policy_version_bt)
  if spec.estimator == "gae":
    old_values = inputs.old_values_bt
    if spec.kl_shaper is not None:  # r_t = 1[EOS] r - beta KL_t against the reference
      rewards_bt, kl_coef, kl_metrics = spec.kl_shaper(rewards, behaviour, inputs.ref_logp_bt, response,
                                                       inputs.kl_coef)
      metrics.update(kl_metrics)
    else:
      rewards_bt = A.reward_at_eos(rewards, response)
    adv, returns = gae_advantages(spec, rewards_bt, old_values, response)
    metrics.update(offpolicy.advantage_substitution_error(
        np.asarray(old_values), offpolicy.monte_carlo_returns(np.asarray(rewards_bt), np.asarray(response),
                                                              spec.gamma), np.asarray(response)))
  else:
    out = A.group_advantages(rewards, spec.group_size, estimator=spec.estimator)
    adv = A.sequence_to_tokens(out.advantages_b, response)
    metrics["data/zero_variance_groups"] = float(jnp.mean(out.zero_variance_g.astype(jnp.float32)))
    if spec.filter_zero_variance:
      response = response & ~out.zero_variance_b[:, None]
    adv = normalize(spec, adv, response)
    if spec.filter_zero_variance:
      rows = informative_rows(np.asarray(out.zero_variance_b), spec.group_size, spec.row_granule)
      tokens, seq, response, behaviour, adv = (jnp.asarray(a)[rows] for a in (tokens, seq, response, behaviour, adv))
      old_values = returns = zeros = zeros[rows]
      versions = versions[rows]
      metrics["data/rows_trained"] = float(len(rows))
  ref = inputs.ref_logp_bt if inputs.ref_logp_bt is not None else zeros
  lag = jnp.where(response, inputs.learner_version - jnp.asarray(versions), 0)
  batch = RLBatch(tokens_bt=tokens, seq_mask_bt=seq, response_mask_bt=response, behaviour_logp_bt=behaviour,
                  advantages_bt=adv, ref_logp_bt=ref, lag_bt=lag, old_values_bt=old_values, returns_bt=returns)
  metrics.update(_data_metrics(traj, rewards, np.asarray(lag)[np.asarray(response)]))
  return AdvantageOutput(batch, metrics, rewards_bt, kl_coef)


def _data_metrics(traj: Trajectory, rewards: np.ndarray, lags: np.ndarray) -> dict[str, float]:
  lengths = np.asarray(traj.response_mask_bt).sum(1)
  return {"data/lag_max": float(lags.max()) if lags.size else 0.0,
          "data/lag_mean": float(lags.mean()) if lags.size else 0.0,
          "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
          "response/length_mean": float(lengths.mean()),
          "response/finished_share": float(np.asarray(traj.finished_b).mean())}
