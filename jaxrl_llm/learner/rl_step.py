"""The pure, jitted RL update: recompute log pi, run the objective chain, aggregate,
differentiate, and apply the guarded optax step (policy and optional critic).

Structure of one step (all inside one ``jit``)::

  normaliser = loss_normaliser(per_example_partials(objective, logp=prox))  # no forward
  for each micro-batch (lax.scan, fixed order):
    logp_bt  = sequence_logprobs(params, tokens, temperature)            # FP32 logits / tau
    values   = critic(critic_params, tokens)          (PPO path only)
    partials = per_example_partials(objective, logp_bt, ...)
    grads   += grad(micro_batch_loss(partials, normaliser))
  metrics = finalize(concat(partials))      # same bits as the whole batch
  params  = guarded optax update (skipped when non-finite)

The loss denominators do not depend on the parameters, so dividing each
micro-batch's numerator by the whole batch's denominator makes the micro-batch
losses add up to the full-batch loss (see :mod:`jaxrl_llm.objectives.loss`).

pi_k (the objective's ``prox_logp_bt``) is set by ``RLStepSpec.proximal``
(:data:`PROXIMAL_SOURCES`): with "forward" (one micro-batch, one update per
batch) it is ``stop_gradient(logp_bt)`` of the forward above, and the
normaliser is computed from the same partials; with "batch" it is the
precomputed ``batch.prox_logp_bt``; with "behaviour" it is mu.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from jaxrl_llm import models, objectives as O
from jaxrl_llm.learner import update
from jaxrl_llm.learner.state import TrainState
from jaxrl_llm.models.config import ModelConfig


@struct.dataclass
class RLBatch:
  """Everything one update reads, [B, T] unless noted (right-padded, prompt first).

  Attributes:
    tokens_bt: int32 prompt + response + padding.
    seq_mask_bt: bool real tokens (prompt and response).
    response_mask_bt: bool sampled tokens, stop token included (the loss mask).
    behaviour_logp_bt: float32 log mu recorded by the sampler.
    advantages_bt: float32.
    ref_logp_bt: float32 reference-policy log-probabilities (zeros without KL).
    lag_bt: int32 policy-version lag of each token (current - sampling version).
    old_values_bt: float32 critic values at sampling time (zeros without critic).
    returns_bt: float32 critic targets (zeros without critic).
    prox_logp_bt: float32 log pi_k, the learner's log-probabilities before
      the batch's first update, or None. Filled by
      :class:`jaxrl_llm.jobs.update.PolicyUpdate` when the step's
      ``proximal`` is "batch" (several updates per batch, micro-batches or
      the batch-invariant path); unused otherwise.
    sft_mask_bt: bool tokens that get the SFT loss (demonstration rows mixed
      into the batch, ``data.sft_mix``), or None.
  """

  tokens_bt: jax.Array
  seq_mask_bt: jax.Array
  response_mask_bt: jax.Array
  behaviour_logp_bt: jax.Array
  advantages_bt: jax.Array
  ref_logp_bt: jax.Array
  lag_bt: jax.Array
  old_values_bt: jax.Array
  returns_bt: jax.Array
  prox_logp_bt: Optional[jax.Array] = None
  sft_mask_bt: Optional[jax.Array] = None


def informative_rows(zero_variance_b: np.ndarray, group_size: int, granule: int) -> np.ndarray:
  """Rows to train on when zero-variance groups are filtered: informative groups first.

  A group whose rewards are all equal has zero advantage everywhere; with
  ``rl.filter_zero_variance`` its tokens are masked out of the loss, so it adds
  no gradient and does not count in the aggregation's denominators. Its rows
  still cost a forward and backward pass, though, and late in training most
  groups are solved (measured on the default job: 50-80 % of groups). This
  keeps the informative groups (in order) and pads with filtered groups up to
  ``granule * 2**j`` rows, so the loss and gradient are those of the whole
  masked batch while the learner compiles for a few batch sizes only.

  Args:
    zero_variance_b: bool [B] the group's flag on each row (groups contiguous).
    group_size: n rows per group.
    granule: the smallest batch (a multiple of n, of the micro-batch count and
      of the data-parallel size).

  Returns:
    int64 row indices, informative groups' rows first; all rows when no
    smaller bucket fits.
  """
  flags = np.asarray(zero_variance_b).reshape(-1, group_size)[:, 0]
  num_groups = flags.shape[0]
  keep = np.flatnonzero(~flags)
  rows = max(int(keep.size) * group_size, granule)
  bucket = granule
  while bucket < rows:
    bucket *= 2
  if bucket >= num_groups * group_size or bucket % group_size:
    return np.arange(num_groups * group_size)
  groups = np.concatenate([keep, np.flatnonzero(flags)])[:bucket // group_size]
  return (groups[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)


def shifted_values(critic_params: Any, critic_config: ModelConfig, tokens_bt: jax.Array,
                   seq_mask_bt: jax.Array) -> jax.Array:
  """Critic values aligned like log-probabilities: ``V[:, t]`` is the value of the
  state *before* token t, i.e. the value head read at position t - 1 (0 at t = 0).

  Returns:
    float32 [B, T].
  """
  out = models.forward(critic_params, critic_config, tokens_bt, models.positions_from_mask(seq_mask_bt),
                       seq_mask_bt)
  v = out["values_bt"].astype(jnp.float32)
  return jnp.concatenate([jnp.zeros_like(v[:, :1]), v[:, :-1]], axis=1)


PROXIMAL_SOURCES = ("forward", "batch", "behaviour")
"""Where the step's pi_k (the objective's ``prox_logp_bt``) comes from:

* "forward": the stop-gradient of the log-probabilities of the forward pass
  the step runs anyway (one update per batch, one micro-batch: the parameters
  of that forward *are* pi_k). No extra forward; the loss normaliser is then
  computed from the same partials (it never depends on the parameters).
* "batch": ``batch.prox_logp_bt``, computed once before the first update by a
  separate forward and held fixed over ``rl.updates_per_batch`` updates and
  across micro-batches or atoms.
* "behaviour": pi_k := mu, the sampler's log-probabilities (plain PPO against
  the behaviour policy; what the library did before pi_k was wired in).
"""


@dataclasses.dataclass(frozen=True)
class RLStepSpec:
  """Static description of an RL step (hashable; one compilation per spec).

  Attributes:
    model: the policy's ModelConfig.
    temperature: sampling temperature tau; log pi uses logits / tau.
    group_size: N samples per prompt (contiguous rows).
    micro_batches: gradient-accumulation splits of the batch.
    use_ref: feed ref_logp_bt to the objective (KL terms).
    use_entropy: compute per-token entropy (entropy bonus).
    critic: the critic's ModelConfig (value head) or None.
    train_actor: False during critic warm-up (actor frozen).
    grad_atoms: 0 for the default path; A > 0 for the batch-invariant path
      (``update.accumulate_atoms`` over A atoms; needs ``mesh`` in make_rl_step).
    proximal: where the objective's pi_k (``prox_logp_bt``) comes from, see
      :data:`PROXIMAL_SOURCES`.
  """

  model: ModelConfig
  temperature: float
  group_size: int
  micro_batches: int = 1
  use_ref: bool = False
  use_entropy: bool = False
  critic: Optional[ModelConfig] = None
  train_actor: bool = True
  grad_atoms: int = 0
  proximal: str = "forward"

  def __post_init__(self):
    if self.proximal not in PROXIMAL_SOURCES:
      raise ValueError(f"RLStepSpec.proximal={self.proximal!r}: expected one of {PROXIMAL_SOURCES}")
    if self.proximal == "forward" and (self.micro_batches > 1 or self.grad_atoms):
      raise ValueError("RLStepSpec.proximal='forward' needs the whole batch in one forward pass (micro_batches=1, "
                       "grad_atoms=0); use 'batch' with a precomputed prox_logp_bt")


def _partials(spec: RLStepSpec, objective: O.ObjectiveTransform, params: Any, critic_params: Any,
              batch: RLBatch, obj_state: Any, logp_bt: Optional[jax.Array] = None):
  entropy_bt = None
  if logp_bt is None:
    if spec.use_entropy:
      logp_bt, entropy_bt = models.sequence_logprobs_and_entropy(
          params, spec.model, batch.tokens_bt, batch.seq_mask_bt, spec.temperature)
    else:
      logp_bt = models.sequence_logprobs(params, spec.model, batch.tokens_bt, batch.seq_mask_bt,
                                         spec.temperature)
  elif spec.use_entropy:
    entropy_bt = jnp.zeros_like(logp_bt)
  critic_fields = {}
  if spec.critic is not None:
    values = (batch.old_values_bt if critic_params is None
              else shifted_values(critic_params, spec.critic, batch.tokens_bt, batch.seq_mask_bt))
    critic_fields = dict(values_bt=values, old_values_bt=batch.old_values_bt, returns_bt=batch.returns_bt)
  prox = None
  if spec.proximal == "forward":
    prox = jax.lax.stop_gradient(logp_bt)
  elif spec.proximal == "batch":
    if batch.prox_logp_bt is None:
      raise ValueError("RLStepSpec.proximal='batch' needs batch.prox_logp_bt (pi_k before the first update)")
    prox = batch.prox_logp_bt
  partials, new_state = O.per_example_partials(
      objective, logp_bt, mask_bt=batch.response_mask_bt, advantages_bt=batch.advantages_bt,
      behaviour_logp_bt=batch.behaviour_logp_bt, state=obj_state, prox_logp_bt=prox,
      sft_mask_bt=batch.sft_mask_bt,
      ref_logp_bt=batch.ref_logp_bt if spec.use_ref else None, lag_bt=batch.lag_bt,
      entropy_bt=entropy_bt, group_size=spec.group_size, **critic_fields)
  return partials, new_state, logp_bt


def make_rl_step(spec: RLStepSpec, objective: O.ObjectiveTransform, optimizer: optax.GradientTransformation,
                 critic_optimizer: Optional[optax.GradientTransformation] = None, mesh: Optional[Mesh] = None):
  """Returns a jitted ``step(state, obj_state, batch) -> (state, obj_state, metrics)``.

  Metrics: the objective's (loss, clip fractions, ratio statistics, KL
  estimates, ESS, masked share, ...), ``grad_norm``,
  ``update/skipped_nonfinite`` and, with a critic, ``critic/grad_norm``; plus
  ``logp_bt`` (float32 [B, T]), the learner's log-probabilities of the batch
  under the parameters *before* the update (pi_k), which the loop's
  consistency check and off-policy diagnostics read (it is popped from the
  metrics before logging).

  With ``spec.grad_atoms`` the step is batch invariant on ``mesh`` (same bits
  for any micro-batch count, mesh layout and process count; see
  :mod:`jaxrl_llm.learner.update`) and keeps the state's shardings.
  """
  if spec.critic is not None and critic_optimizer is None:
    raise ValueError("make_rl_step: a critic needs critic_optimizer")
  if spec.grad_atoms and mesh is None:
    raise ValueError("make_rl_step: spec.grad_atoms > 0 (batch-invariant path) needs the learner mesh")
  adapters_only = spec.model.lora_rank > 0  # LoRA: only adapters (and the critic's value head) train

  def loss_fn(trainable, mb, normaliser, obj_state):
    params, critic_params = trainable
    partials, new_state, logp_bt = _partials(spec, objective, params, critic_params, mb, obj_state)
    if normaliser is None:  # proximal="forward": the whole batch is this forward; pi_k is a constant
      normaliser = jax.lax.stop_gradient(O.loss_normaliser(partials))
    return O.micro_batch_loss(partials, normaliser), (partials, new_state, jax.lax.stop_gradient(logp_bt))

  def normaliser_fn(batch, obj_state):
    # Denominators do not depend on the parameters: evaluate them once, forward-free
    # (pi_k is data here: the precomputed prox_logp_bt, or mu).
    if spec.proximal == "forward":
      return None
    if spec.proximal == "batch" and batch.prox_logp_bt is None:
      raise ValueError("RLStepSpec.proximal='batch' needs batch.prox_logp_bt (pi_k before the first update)")
    partials0, _, _ = _partials(spec, objective, None, None, batch, obj_state,
                                logp_bt=batch.prox_logp_bt if spec.proximal == "batch" else batch.behaviour_logp_bt)
    return O.loss_normaliser(partials0)

  def gradients(state: TrainState, obj_state: Any, batch: RLBatch):
    normaliser = update.replicated(normaliser_fn, mesh)(batch, obj_state)
    return update.accumulate_atoms(loss_fn, (state.params, state.critic_params), batch, spec.grad_atoms, mesh,
                                   normaliser, obj_state, adapters_only=adapters_only)

  def step(state: TrainState, obj_state: Any, batch: RLBatch):
    trainable = (state.params, state.critic_params)
    normaliser = normaliser_fn(batch, obj_state)
    loss, grads, aux = update.accumulate(loss_fn, trainable, batch, spec.micro_batches, normaliser, obj_state,
                                         adapters_only=adapters_only)
    return finish(state, loss, grads, aux)

  def finish(state: TrainState, loss, grads, aux):
    partials, new_states, logp_mbt = aux
    new_obj_state = jax.tree.map(lambda x: x[-1], new_states)
    flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), partials)
    _, metrics = O.finalize(flat)
    policy_grads, critic_grads = grads
    if spec.train_actor:
      state, upd = update.apply_policy_update(state, policy_grads, loss, optimizer)
      metrics.update(upd)
    if spec.critic is not None:
      cparams, copt, _, cmetrics = update.guarded_apply(state.critic_params, state.critic_opt_state,
                                                        critic_grads, loss, critic_optimizer)
      state = state.replace(critic_params=cparams, critic_opt_state=copt)
      metrics.update({f"critic/{k}": v for k, v in cmetrics.items()})
    metrics["logp_bt"] = logp_mbt.reshape((-1,) + logp_mbt.shape[2:])
    return state, new_obj_state, metrics

  if spec.grad_atoms:
    return update.invariant_step(gradients, finish, mesh)
  return jax.jit(step)
