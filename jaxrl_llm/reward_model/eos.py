"""Where a reward model reads its score: the EOS (last real) token of each row.

The reward head sits on top of the decoder and is read at one position per
sequence. For a causal decoder only the last token has seen the whole prompt and
response, so that is the position (the EOS-token reward model of InstructGPT,
arXiv:2203.02155, and Anthropic's HH-RLHF, arXiv:2204.05862).

The choice, for every layout a batch can have:

* **right-padded** (``prompt | response | EOS | pad ...``, the learner's and the
  samplers' layout): the last True of the row's mask, i.e. the EOS token;
* **left-padded** (``pad ... | prompt | response | EOS``): the same rule gives the
  last column; RoPE positions count real tokens only and attention never sees
  the padding, so the score equals the right-padded one;
* **truncated** (the response hit the length limit without an EOS): still the
  last real token, i.e. the last generated token. Such a row is flagged
  (``ends_with_eos`` is False): a reward model trained on finished responses
  never saw that ending, so the RL reward can subtract a fixed penalty from its
  score (``reward_model.no_eos_penalty``, TRL's ``missing_eos_penalty``)
  instead of trusting it;
* **empty** rows (no real token) read index 0 and should be masked out by the
  caller.

:func:`jaxrl_llm.models.reward_scores` reads the head at :func:`score_index`.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from jaxrl_llm import models
from jaxrl_llm.advantages import checks


def score_index(mask_bt: Bool[ArrayLike, "B T"]) -> Int[Array, "B"]:
  """Column read by the reward head: the last real token of each row (0 for an empty row).

  Args:
    mask_bt: bool [B, T] real tokens (prompt and response), right- or left-padded.

  Returns:
    int32 [B].
  """
  checks.check_bt("score_index", mask_bt=mask_bt)
  return models.last_true_index(jnp.asarray(mask_bt).astype(bool))


def ends_with_eos(tokens_bt: Int[ArrayLike, "B T"], mask_bt: Bool[ArrayLike, "B T"],
                  eos_ids: int | Sequence[int]) -> Bool[Array, "B"]:
  """True where the row's score position holds a stop token (False for truncated or empty rows).

  Args:
    tokens_bt: int [B, T] token ids.
    mask_bt: bool [B, T] real tokens.
    eos_ids: the stop id, or several (e.g. ``<|im_end|>`` and ``<|endoftext|>``).

  Returns:
    bool [B].
  """
  checks.check_bt("ends_with_eos", tokens_bt=tokens_bt, mask_bt=mask_bt)
  tokens = jnp.asarray(tokens_bt)
  mask = jnp.asarray(mask_bt).astype(bool)
  idx = score_index(mask)
  last = tokens[jnp.arange(tokens.shape[0]), idx]
  ids = jnp.asarray([eos_ids] if isinstance(eos_ids, int) else list(eos_ids), tokens.dtype)
  return jnp.any(mask, axis=1) & jnp.isin(last, ids)


def apply_no_eos_penalty(scores_b: Float[ArrayLike, "B"], has_eos_b: Bool[ArrayLike, "B"],
                         penalty: float) -> Float[Array, "B"]:
  """``score - penalty`` on rows without an EOS, the score unchanged elsewhere.

  Args:
    scores_b: float [B] reward-model scores.
    has_eos_b: bool [B] the row ended with a stop token.
    penalty: amount subtracted (>= 0; 0 leaves every score unchanged).

  Returns:
    float32 [B].
  """
  who = "apply_no_eos_penalty"
  checks.check_rank(who, "scores_b", scores_b, 1, "[B]")
  checks.check_b(who, "has_eos_b", has_eos_b, checks.shape_of(scores_b)[0], "scores_b")
  checks.check_positive(who, "penalty", penalty, allow_zero=True)
  scores = jnp.asarray(scores_b, jnp.float32)
  return jnp.where(jnp.asarray(has_eos_b).astype(bool), scores, scores - float(penalty))
