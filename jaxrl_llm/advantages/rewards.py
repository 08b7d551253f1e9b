"""Reward processing: clipping, reference baselines, EOS placement, KL shaping.

All functions are element-wise or per row (shardable over the batch axis, same
bits for any batch composition); the only cross-example statistic,
:func:`mean_sequence_kl`, goes through :mod:`jaxrl_llm.reduce`. Whitening and
running z-scores live in :mod:`.normalize` and :mod:`.running`.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.advantages import checks


def clip_rewards(
    rewards: Float[ArrayLike, "..."],
    clip_range: float | tuple[float, float],
) -> Float[Array, "..."]:
  """Clips rewards to ``[-c, c]`` (``clip_range=c``) or ``[low, high]`` (a pair).

  Args:
    rewards: float array of any shape.
    clip_range: c > 0, or ``(low, high)`` with low < high.

  Returns:
    float32 ``clip(rewards, low, high)``.
  """
  who = "clip_rewards"
  if isinstance(clip_range, (tuple, list)):
    if len(clip_range) != 2:
      raise ValueError(f"{who}: clip_range must be c or (low, high); got {clip_range!r}")
    low, high = (float(v) for v in clip_range)
    if not low < high:
      raise ValueError(f"{who}: clip_range (low, high) needs low < high; got {clip_range!r}")
  else:
    checks.check_positive(who, "clip_range", clip_range)
    low, high = -float(clip_range), float(clip_range)
  return jnp.clip(jnp.asarray(rewards, jnp.float32), low, high)


def reference_baseline(
    rewards_b: Float[ArrayLike, "B"],
    ref_rewards_g: Float[ArrayLike, "G"],
) -> Float[Array, "B"]:
  """Subtracts the reward of each prompt's reference response: ``r_i - r_ref[g(i)]``.

  The reference response (e.g. the SFT model's greedy answer, or a dataset
  answer) is scored once per prompt; the B = G * N policy samples come in
  contiguous groups of N = B / G. With G = B the baseline is per row.

  Args:
    rewards_b: float [B] rewards of the policy samples.
    ref_rewards_g: float [G] reward of each prompt's reference response.

  Returns:
    float32 [B].

  References:
    Li et al., ReMax, arXiv:2310.10505 (the greedy response as baseline).
  """
  who = "reference_baseline"
  checks.check_rank(who, "rewards_b", rewards_b, 1, "[B]")
  checks.check_rank(who, "ref_rewards_g", ref_rewards_g, 1, "[G]")
  b, g = checks.shape_of(rewards_b)[0], checks.shape_of(ref_rewards_g)[0]
  if g == 0 or b % g:
    raise ValueError(f"{who}: rewards_b has {b} rows, not a whole number of samples for each "
                     f"of the {g} prompts in ref_rewards_g")
  ref_b = jnp.repeat(jnp.asarray(ref_rewards_g, jnp.float32), b // g)
  return jnp.asarray(rewards_b, jnp.float32) - ref_b


def last_token_mask(mask_bt: Bool[ArrayLike, "B T"]) -> Bool[Array, "B T"]:
  """One-hot of the last True position of each row (all False for an empty row).

  For a response mask this is the EOS token of a finished response, or the last
  generated token of a response truncated at the length limit.

  Args:
    mask_bt: bool [B, T] response mask.

  Returns:
    bool [B, T].
  """
  checks.check_bt("last_token_mask", mask_bt=mask_bt)
  mask = jnp.asarray(mask_bt).astype(bool)
  pos_t = jnp.arange(mask.shape[1], dtype=jnp.int32)
  last_b = jnp.max(jnp.where(mask, pos_t, -1), axis=1)
  return mask & (pos_t[None, :] == last_b[:, None])


def reward_at_eos(
    rewards_b: Float[ArrayLike, "B"],
    mask_bt: Bool[ArrayLike, "B T"],
) -> Float[Array, "B T"]:
  """Places each sequence's scalar reward on its last response token.

  ``out[b, t] = rewards_b[b]`` at the last True position of ``mask_bt[b]``, else
  0. The stop token is part of the response (it was sampled and is trained), so
  for a finished response this is the EOS token, where a reward model reading the
  EOS position scores the whole sequence; a response cut by the length limit
  has no EOS and the reward goes on its last generated token. A row with an
  empty mask gets no reward.

  Args:
    rewards_b: float [B] sequence rewards.
    mask_bt: bool [B, T] response mask (including the EOS token).

  Returns:
    float32 [B, T].

  References:
    Ouyang et al., InstructGPT, arXiv:2203.02155; Ziegler et al., arXiv:1909.08593.
  """
  who = "reward_at_eos"
  b, _ = checks.check_bt(who, mask_bt=mask_bt)
  checks.check_b(who, "rewards_b", rewards_b, b, "mask_bt")
  return jnp.where(last_token_mask(mask_bt), jnp.asarray(rewards_b, jnp.float32)[:, None], 0.0)


def kl_penalized_rewards(
    rewards_b: Float[ArrayLike, "B"],
    logp_bt: Float[ArrayLike, "B T"],
    ref_logp_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    kl_coef: float | Array,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
  """Token-level rewards with a per-token KL penalty against a reference policy::

    KL_t = log pi(a_t | s_t) - log pi_ref(a_t | s_t)          (k1 estimator)
    r_t  = 1[t = EOS] * r(x, y) - beta * KL_t

  ``logp_bt`` is the sampling policy's log-probability of the sampled token (the
  behaviour log-probability recorded at sampling time, i.e. pi_old in PPO) and
  ``ref_logp_bt`` the reference (SFT) policy's. "EOS" is the last response token,
  see :func:`reward_at_eos`. Feed ``r_t`` to :func:`jaxrl_llm.advantages.gae`.

  Args:
    rewards_b: float [B] sequence rewards r(x, y).
    logp_bt: float [B, T] policy log-probabilities of the sampled tokens.
    ref_logp_bt: float [B, T] reference log-probabilities of the same tokens.
    mask_bt: bool [B, T] response mask.
    kl_coef: beta >= 0 (a float, or the coefficient of a KL controller state).

  Returns:
    ``(rewards_bt, kl_bt)``, float32 [B, T], 0 outside the mask.

  References:
    Ziegler et al., arXiv:1909.08593; Ouyang et al., InstructGPT, arXiv:2203.02155.
  """
  who = "kl_penalized_rewards"
  b, _ = checks.check_bt(who, logp_bt=logp_bt, ref_logp_bt=ref_logp_bt, mask_bt=mask_bt)
  checks.check_b(who, "rewards_b", rewards_b, b, "logp_bt")
  checks.check_positive(who, "kl_coef", kl_coef, allow_zero=True)
  mask = jnp.asarray(mask_bt).astype(bool)
  kl = jnp.where(mask, jnp.asarray(logp_bt, jnp.float32) - jnp.asarray(ref_logp_bt, jnp.float32),
                 0.0)
  shaped = reward_at_eos(rewards_b, mask) - jnp.asarray(kl_coef, jnp.float32) * kl
  return jnp.where(mask, shaped, 0.0), kl


def mean_sequence_kl(
    kl_bt: Float[ArrayLike, "B T"],
    mask_bt: Bool[ArrayLike, "B T"],
    valid_b: Optional[Bool[ArrayLike, "B"]] = None,
    *,
    axis_name: Optional[str] = None,
) -> Float[Array, ""]:
  """Mean over sequences of the summed per-token KL: ``mean_b sum_t m_bt KL_bt``.

  This is the quantity the adaptive KL controller compares with its target
  (lm-human-preferences ``mean_kl``). Rows with an empty mask are left out
  unless ``valid_b`` says otherwise.

  Args:
    kl_bt: float [B, T] per-token KL (e.g. from :func:`kl_penalized_rewards`).
    mask_bt: bool [B, T] response mask.
    valid_b: optional bool [B]; default: rows with at least one masked token.
    axis_name: data-parallel axis inside ``shard_map``.

  Returns:
    float32 scalar (0 for an empty batch).
  """
  who = "mean_sequence_kl"
  b, _ = checks.check_bt(who, kl_bt=kl_bt, mask_bt=mask_bt)
  checks.optional_valid(valid_b, who, b, "kl_bt")
  mask = jnp.asarray(mask_bt).astype(bool)
  valid = reduce.row_count(mask) > 0 if valid_b is None else jnp.asarray(valid_b).astype(bool)
  return reduce.batch_mean(reduce.masked_row_sum(kl_bt, mask), valid, axis_name)

