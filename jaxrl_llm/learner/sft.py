"""Supervised fine-tuning on the learner's machinery (warm start, rejection sampling).

The loss is the token mean of ``-log p(target token | prefix)`` over target
positions (the response and its stop token), through the deterministic
reductions, so SFT and RL share the same numerics, micro-batching and guarded
update.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh

from jaxrl_llm import models, reduce
from jaxrl_llm.learner import update
from jaxrl_llm.learner.state import TrainState
from jaxrl_llm.models.config import ModelConfig


@struct.dataclass
class SftBatch:
  """A right-padded SFT batch.

  Attributes:
    tokens_bt: int32 [B, T] prompt, target, EOS, then padding.
    seq_mask_bt: bool [B, T] real tokens (prompt, target and EOS).
    target_mask_bt: bool [B, T] positions whose token is trained (target and EOS).
  """

  tokens_bt: jax.Array
  seq_mask_bt: jax.Array
  target_mask_bt: jax.Array


def collate(prompts: Sequence[Sequence[int]], targets: Sequence[Sequence[int]], eos_id: int,
            pad_id: int, length: int, bucket: int = 16,
            context_only: Optional[Sequence[Sequence[bool]]] = None) -> SftBatch:
  """Builds a right-padded batch; the EOS appended to each target is trained.

  The padded length is the longest row rounded up to a multiple of ``bucket``
  (few distinct shapes, so few compilations), at most ``length``.

  ``context_only[i][j]`` True marks target token j of row i as context that is
  not trained: a multi-turn demonstration's environment observations
  (:meth:`jaxrl_llm.tasks.Task.sft_segments`), which the policy reads but never writes.

  Raises:
    ValueError: naming the row when prompt + target + EOS exceeds ``length``.
  """
  b = len(prompts)
  longest = max(len(p) + len(t) + 1 for p, t in zip(prompts, targets))
  if longest <= length:
    length = min(length, -(-longest // bucket) * bucket)
  tokens = np.full((b, length), pad_id, np.int32)
  mask = np.zeros((b, length), bool)
  seq = np.zeros((b, length), bool)
  for i, (p, t) in enumerate(zip(prompts, targets)):
    row = list(p) + list(t) + [eos_id]
    if len(row) > length:
      raise ValueError(f"SFT example {i}: prompt ({len(p)}) + target ({len(t)}) + EOS = {len(row)} tokens "
                       f"exceeds the context length {length}")
    tokens[i, :len(row)] = row
    mask[i, len(p):len(row)] = True
    if context_only is not None:
      if len(context_only[i]) != len(t):
        raise ValueError(f"SFT example {i}: {len(context_only[i])} context_only flags for {len(t)} target tokens")
      mask[i, len(p):len(p) + len(t)] &= ~np.asarray(context_only[i], bool)
    seq[i, :len(row)] = True
  return SftBatch(jnp.asarray(tokens), jnp.asarray(seq), jnp.asarray(mask))


def sft_token_loss(params, batch: SftBatch, num_target_tokens: jax.Array, config: ModelConfig):
  """Negative log-likelihood summed over this (micro-)batch / global target-token count.

  The loss of an SFT step (a token mean once the micro-batches are summed);
  not to be confused with :func:`jaxrl_llm.objectives.sft_loss`, the objective
  transform that adds an SFT term to an RL loss (PPO-ptx).

  Returns:
    ``(loss, {"nll_sum": float32 scalar})``.
  """
  mask = batch.target_mask_bt
  logp_bt = models.sequence_logprobs(params, config, batch.tokens_bt, batch.seq_mask_bt, 1.0)
  nll = reduce.token_sum(-logp_bt, mask)
  return reduce.safe_div(nll, num_target_tokens), {"nll_sum": nll}


def make_sft_step(config: ModelConfig, optimizer: optax.GradientTransformation, micro_batches: int = 1,
                  grad_atoms: int = 0, mesh: Optional[Mesh] = None):
  """Returns a jitted ``step(state, batch) -> (state, metrics)``.

  Args:
    config: the policy's ModelConfig.
    optimizer: the SFT optimizer.
    micro_batches: gradient-accumulation splits (default path).
    grad_atoms: 0 for the default path; A > 0 for the batch-invariant path
      (``update.accumulate_atoms`` over A atoms on ``mesh``; same bits for any
      micro-batch count, mesh layout and process count).
    mesh: the learner mesh (needed with ``grad_atoms``).

  With LoRA (``config.lora_rank`` > 0) only the adapters are differentiated.
  """
  loss_fn = functools.partial(sft_token_loss, config=config)
  if grad_atoms and mesh is None:
    raise ValueError("make_sft_step: grad_atoms > 0 (batch-invariant path) needs the learner mesh")

  def finish(state: TrainState, grads, loss, count):
    state, metrics = update.apply_policy_update(state, grads, loss, optimizer)
    metrics.update({"sft/loss": loss, "sft/target_tokens": count})
    return state, metrics

  def gradients(state: TrainState, batch: SftBatch):
    count = update.replicated(reduce.token_count, mesh)(batch.target_mask_bt)
    loss, grads, _ = update.accumulate_atoms(loss_fn, state.params, batch, grad_atoms, mesh, count,
                                             adapters_only=config.lora_rank > 0)
    return grads, loss, count

  def step(state: TrainState, batch: SftBatch):
    count = reduce.token_count(batch.target_mask_bt)
    loss, grads, _ = update.accumulate(loss_fn, state.params, batch, micro_batches, count,
                                       adapters_only=config.lora_rank > 0)
    return finish(state, grads, loss, count)

  if grad_atoms:
    return update.invariant_step(gradients, finish, mesh)
  return jax.jit(step)
