"""Rejection-sampling fine-tuning (RFT, best of K): the best sample of each group -> an SFT step.

From the K = N samples of each prompt, keep the one with the highest reward when that
reward reaches ``min_reward``, and train on it with the supervised loss
(:mod:`jaxrl_llm.learner.sft`): ``L = -(1/|T|) sum_{(b,t) in T} log pi(y_bt | y_b,<t)``
over the kept responses' tokens and their stop token. Selection is host-side NumPy and
deterministic (ties go to the lowest row index).

Usage in the loop (every ``data.rft_every`` RL steps, on the step's scored samples)::

  rows = rft.select_best_of_k(rewards_b, n, min_reward=1.0, finished_b=traj.finished_b)
  if rows.size:
    batch = rft.rft_batch(prompt_ids_g, response_tokens, rows, eos_id, pad_id, max_len,
                          num_rows=G)   # fixed shape: one compilation
    state, metrics = sft_step(state, batch)

References:
  Rejection-sampling fine-tuning: Yuan et al., arXiv:2308.01825; RAFT, arXiv:2304.06767;
  expert iteration / best-of-K in Llama 2, arXiv:2307.09288.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Bool, Float

from jaxrl_llm.learner import sft


def _check_group_size(group_size: Any, b: int) -> int:
  if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
    raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
  if b % group_size:
    raise ValueError(f"rewards_b has {b} rows, not a whole number of groups of group_size={group_size}")
  return int(group_size)


def select_best_of_k(rewards_b: Float[ArrayLike, "B"], group_size: int, min_reward: float = 1.0,
                     finished_b: Optional[Bool[ArrayLike, "B"]] = None) -> np.ndarray:
  """Row of the best sample of each group whose best reward reaches ``min_reward``.

  ``row_g = min argmax_{i in group g, eligible} r_i``, kept when ``r_row >= min_reward``.
  A row is eligible when it finished (ended with its stop token) if ``finished_b`` is
  given: a truncated response must not be trained to stop where it was cut.

  Args:
    rewards_b: float [B] rewards, the K = group_size samples of a prompt contiguous.
    group_size: K >= 1 dividing B.
    min_reward: lowest reward worth imitating.
    finished_b: optional bool [B] rows that ended with the stop token.

  Returns:
    int64 [S] selected row indices, ascending (one per kept group, S <= G).

  Raises:
    ValueError: for a bad rank, group size, shape mismatch or non-finite reward.
  """
  r = np.asarray(rewards_b, np.float64)
  if r.ndim != 1:
    raise ValueError(f"rewards_b must have shape [B], got {r.shape}")
  k = _check_group_size(group_size, r.shape[0])
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards_b must be finite, got {r.tolist()}")
  if not isinstance(min_reward, (int, float, np.floating)) or not np.isfinite(min_reward):
    raise ValueError(f"min_reward must be a finite number, got {min_reward!r}")
  eligible = np.ones(r.shape, bool)
  if finished_b is not None:
    eligible = np.asarray(finished_b).astype(bool)
    if eligible.shape != r.shape:
      raise ValueError(f"finished_b must have shape {r.shape} like rewards_b, got {eligible.shape}")
  r_gk = np.where(eligible, r, -np.inf).reshape(-1, k)
  best_k = np.argmax(r_gk, axis=1)  # first maximum: the lowest row index
  best = r_gk[np.arange(r_gk.shape[0]), best_k]
  keep = best >= min_reward
  return (np.flatnonzero(keep) * k + best_k[keep]).astype(np.int64)


def _strip_stop(ids: Sequence[int], eos_id: int, pad_id: int) -> list[int]:
  """Drops trailing padding, then one trailing EOS (``sft.collate`` appends its own)."""
  out = [int(t) for t in ids]
  while out and out[-1] == pad_id and pad_id != eos_id:
    out.pop()
  if out and out[-1] == eos_id:
    out.pop()
  return out


def rft_batch(prompt_ids: Sequence[Sequence[int]], response_ids: Sequence[Sequence[int]], rows: Any,
              eos_id: int, pad_id: int, length: int, *, num_rows: Optional[int] = None,
              bucket: int = 16) -> sft.SftBatch:
  """SFT batch of the selected responses, each trained with exactly one stop token.

  Responses of finished samples already end with EOS (the sampler records the stop
  token); ``sft.collate`` appends one to every target, so a trailing EOS (after any
  trailing padding) is removed first.

  Args:
    prompt_ids: the prompts' token ids, either per row ([B] lists, like
      ``SampleResult.prompt_tokens``) or per group ([G] lists, row b -> prompt b // N
      with N = B / G).
    response_ids: [B] per row, the sampled ids (``SampleResult.response_tokens``).
    rows: int [S] selected rows (``select_best_of_k``), S >= 1.
    eos_id: the stop token.
    pad_id: the padding token.
    length: the longest allowed row (prompt + response + EOS).
    num_rows: pad the batch with untrained rows to this many rows (>= S), so every RFT
      step has the same shape (one compilation; a multiple of the micro-batch count).
      A padding row is one pad token, marked real so attention has a key, with no
      target, so it changes neither the loss nor the gradient.
    bucket: ``sft.collate``'s length bucket.

  Returns:
    An ``sft.SftBatch`` [S or num_rows, T].

  Raises:
    ValueError: for empty or out-of-range ``rows``, mismatched lengths, ``num_rows``
      below S, or a row longer than ``length`` (from ``sft.collate``).
  """
  b = len(response_ids)
  rows_s = np.asarray(rows).reshape(-1)
  if rows_s.size == 0:
    raise ValueError("rows is empty: no group reached min_reward; skip the RFT step")
  if not np.issubdtype(rows_s.dtype, np.integer) or rows_s.min() < 0 or rows_s.max() >= b:
    raise ValueError(f"rows must be ints in [0, {b}) (response_ids has {b} rows), got {rows_s.tolist()}")
  if len(prompt_ids) == b:
    per_row = [prompt_ids[int(i)] for i in rows_s]
  elif len(prompt_ids) and b % len(prompt_ids) == 0:
    n = b // len(prompt_ids)
    per_row = [prompt_ids[int(i) // n] for i in rows_s]
  else:
    raise ValueError(f"prompt_ids must have one entry per row ({b}) or per group (a divisor of {b}), "
                     f"got {len(prompt_ids)}")
  targets = [_strip_stop(response_ids[int(i)], eos_id, pad_id) for i in rows_s]
  batch = sft.collate(per_row, targets, eos_id, pad_id, length, bucket)
  if num_rows is None:
    return batch
  s = rows_s.size
  if isinstance(num_rows, bool) or not isinstance(num_rows, (int, np.integer)) or num_rows < s:
    raise ValueError(f"num_rows must be an int >= the {s} selected rows, got {num_rows!r}")
  extra = int(num_rows) - s
  t = batch.tokens_bt.shape[1]
  pad_tokens = jnp.full((extra, t), pad_id, jnp.int32)
  pad_seq = jnp.zeros((extra, t), bool).at[:, 0].set(True)
  pad_target = jnp.zeros((extra, t), bool)
  return sft.SftBatch(jnp.concatenate([batch.tokens_bt, pad_tokens]),
                      jnp.concatenate([batch.seq_mask_bt, pad_seq]),
                      jnp.concatenate([batch.target_mask_bt, pad_target]))


def best_of_k_metrics(rewards_b: Float[ArrayLike, "B"], rows: Any, group_size: int) -> dict[str, float]:
  """``rft/...`` scalars: groups kept, their share, and the mean reward of the kept rows."""
  r = np.asarray(rewards_b, np.float64)
  g = r.shape[0] // _check_group_size(group_size, r.shape[0])
  rows_s = np.asarray(rows, np.int64).reshape(-1)
  return {"rft/selected_groups": float(rows_s.size),
          "rft/selected_share": rows_s.size / g if g else 0.0,
          "rft/selected_reward_mean": float(r[rows_s].mean()) if rows_s.size else float("nan")}


__all__ = ["best_of_k_metrics", "rft_batch", "select_best_of_k"]
