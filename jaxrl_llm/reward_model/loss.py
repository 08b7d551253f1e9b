"""The Bradley-Terry pairwise loss of a reward model and its held-out metrics.

Pure functions of score arrays (the learner computes the scores), jit-able and
shardable over pairs. Cross-pair reductions go through :mod:`jaxrl_llm.reduce`,
so a loss or metric has the same bits for any micro-batching or padding of the
pair axis. Here ``B`` counts *pairs*: ``chosen_b[i]`` and ``rejected_b[i]`` are
the scores of the two responses of pair ``i``.

Loss of one pair, with an optional margin ``m`` (Llama 2's margin loss)::

  l_i = -log sigma(r_chosen - r_rejected - m) = softplus(-(r_chosen - r_rejected - m))

Example::

  >>> import jax.numpy as jnp
  >>> from jaxrl_llm.reward_model import loss
  >>> total, metrics = loss.bradley_terry_loss(jnp.array([2.0, 0.0]), jnp.array([0.0, 0.0]))
  >>> round(float(total), 4)   # (softplus(-2) + softplus(0)) / 2
  0.41

References:
  Bradley & Terry, Rank Analysis of Incomplete Block Designs (1952);
  Ouyang et al., InstructGPT, arXiv:2203.02155 (the pairwise RM loss);
  Touvron et al., Llama 2, arXiv:2307.09288 (the margin term).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.objectives import preference
# The pairwise metrics are shared with the preference-optimisation losses (DPO, IPO, SimPO).
from jaxrl_llm.objectives.preference import mean_margin, pairwise_accuracy, preference_metrics

__all__ = ["bradley_terry_loss", "mean_margin", "pairwise_accuracy", "pairwise_losses", "preference_metrics"]


def _check_pairs(who: str, chosen_b, rejected_b, margin_b=None, valid_b=None) -> int:
  return preference.check_pairs(who, chosen_b=chosen_b, rejected_b=rejected_b, margin_b=margin_b, valid_b=valid_b)


def pairwise_losses(
    chosen_b: Float[ArrayLike, "B"],
    rejected_b: Float[ArrayLike, "B"],
    margin_b: Optional[Float[ArrayLike, "B"]] = None,
) -> Float[Array, "B"]:
  """Per-pair Bradley-Terry loss ``softplus(-(r_c - r_r - m))`` (= ``-log sigma(r_c - r_r - m)``).

  ``softplus`` is the numerically stable form: no overflow for large score gaps.

  Args:
    chosen_b: float [B] scores of the preferred responses.
    rejected_b: float [B] scores of the other responses.
    margin_b: optional float [B] margins m (0 when None); a pair then counts as
      learned only once ``r_c - r_r`` exceeds its margin.

  Returns:
    float32 [B] losses (>= 0).
  """
  _check_pairs("pairwise_losses", chosen_b, rejected_b, margin_b)
  gap = jnp.asarray(chosen_b, jnp.float32) - jnp.asarray(rejected_b, jnp.float32)
  if margin_b is not None:
    gap = gap - jnp.asarray(margin_b, jnp.float32)
  return jax.nn.softplus(-gap)


def bradley_terry_loss(
    chosen_b: Float[ArrayLike, "B"],
    rejected_b: Float[ArrayLike, "B"],
    margin_b: Optional[Float[ArrayLike, "B"]] = None,
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
    *,
    normaliser: Optional[Float[ArrayLike, ""]] = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
  """Mean Bradley-Terry loss over valid pairs, with the pairwise metrics.

  ``loss = sum_{i valid} l_i / n`` where ``n`` is the number of valid pairs, or
  ``normaliser`` when given (the whole batch's count, so that micro-batch losses
  add up to the full-batch loss).

  Args:
    chosen_b: float [B] scores of the preferred responses.
    rejected_b: float [B] scores of the other responses.
    margin_b: optional float [B] margins.
    valid_b: optional bool [B]; False rows (padding pairs) contribute nothing.
    normaliser: optional float scalar denominator.

  Returns:
    ``(loss, metrics)``: float32 scalar and :func:`preference_metrics`.
  """
  _check_pairs("bradley_terry_loss", chosen_b, rejected_b, margin_b, valid_b)
  valid = preference.pair_mask(chosen_b, valid_b)
  losses = pairwise_losses(chosen_b, rejected_b, margin_b)
  den = reduce.batch_count(valid) if normaliser is None else jnp.asarray(normaliser, jnp.float32)
  loss = reduce.safe_div(reduce.batch_sum(losses, valid), den)
  return loss, preference_metrics(chosen_b, rejected_b, valid)
