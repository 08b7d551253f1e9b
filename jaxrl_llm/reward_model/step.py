"""The reward model's training step: Bradley-Terry loss on preference pairs, micro-batched and guarded.

Used by :class:`jaxrl_llm.jobs.RewardModelJob` (``jaxrl-train`` with ``job="reward_model"``).
References: Bradley & Terry (1952); Ouyang et al., arXiv:2203.02155 (reward models for RLHF).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_llm import models, reduce
from jaxrl_llm.learner import update
from jaxrl_llm.learner.state import TrainState
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.reward_model import loss as rm_loss
from jaxrl_llm.reward_model.encoding import PreferenceBatch

__all__ = ["make_rm_step", "pair_scores"]


def pair_scores(params: Any, config: ModelConfig, batch: PreferenceBatch) -> tuple[jax.Array, jax.Array]:
  """Scores of both sides of every pair in one forward pass over ``[2B, T]`` rows.

  Returns:
    ``(chosen_b, rejected_b)``, float32 [B] each.
  """
  tokens = jnp.concatenate([batch.chosen_bt, batch.rejected_bt], axis=0)
  mask = jnp.concatenate([batch.chosen_mask_bt, batch.rejected_mask_bt], axis=0)
  scores = models.reward_scores(params, config, tokens, mask).astype(jnp.float32)
  half = batch.chosen_bt.shape[0]
  return scores[:half], scores[half:]


def make_rm_step(config: ModelConfig, optimizer, micro_batches: int = 1, lm_coef: float = 0.0):
  """Returns a jitted ``step(state, batch) -> (state, metrics)`` of the Bradley-Terry loss.

  ``loss = mean_pairs BT + lm_coef * token-mean NLL of the chosen responses`` (the
  optional language-model term keeps the trunk predicting good responses, which
  is what a verifier-like reward model reads; 0 drops it). Each micro-batch's
  sums are divided by the whole batch's pair and target-token counts, so
  micro-batch losses add up to the full-batch loss; the gradients are summed in
  a fixed order (:func:`jaxrl_llm.learner.update.accumulate`) and applied by the
  guarded update (skipped when non-finite).

  Metrics: ``rm/loss`` (the total), ``rm/bt_loss``, ``rm/lm_loss``,
  ``rm/accuracy``, ``rm/margin``, ``rm/chosen``, ``rm/rejected``, ``rm/pairs``,
  ``grad_norm``, ``update/skipped_nonfinite``, ``update/param_norm``.
  """

  def loss_fn(params, mb: PreferenceBatch, counts):
    pairs, tokens = counts
    chosen, rejected = pair_scores(params, config, mb)
    bt = reduce.safe_div(reduce.batch_sum(rm_loss.pairwise_losses(chosen, rejected, mb.margin_b), mb.valid_b),
                         pairs)
    lm = jnp.zeros((), jnp.float32)
    if lm_coef:
      logp = models.sequence_logprobs(params, config, mb.chosen_bt, mb.chosen_mask_bt)
      lm = reduce.safe_div(reduce.token_sum(-logp, mb.chosen_target_mask_bt & mb.valid_b[:, None]), tokens)
    return bt + lm_coef * lm, (chosen, rejected, bt, lm)

  @jax.jit
  def step(state: TrainState, batch: PreferenceBatch):
    counts = (reduce.batch_count(batch.valid_b),
              reduce.token_count(batch.chosen_target_mask_bt & batch.valid_b[:, None]))
    total, grads, (chosen, rejected, bt, lm) = update.accumulate(loss_fn, state.params, batch, micro_batches,
                                                                 counts, adapters_only=config.lora_rank > 0)
    state, metrics = update.apply_policy_update(state, grads, total, optimizer)
    pm = rm_loss.preference_metrics(chosen.reshape(-1), rejected.reshape(-1), batch.valid_b)
    metrics.update({"rm/loss": total, "rm/bt_loss": jnp.sum(bt), "rm/lm_loss": jnp.sum(lm),
                    **{f"rm/{k}": v for k, v in pm.items()}})
    return state, metrics

  return step
