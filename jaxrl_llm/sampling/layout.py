"""Host-side rules every sampler shares: prompt checks, stop set, buckets, trajectory layout.

The built-in JAX sampler and the vLLM sampler must hand the learner the same
``SampleResult`` for the same tokens, so the pure parts of that contract live
here once:

  prepare_prompts     validate token ids; refuse, or left-truncate, prompts
                      that leave no room for ``max_new_tokens`` within
                      ``max_length`` (the oldest tokens are dropped)
  stop_token_ids      ``None`` -> (eos,), ``()`` -> never stop; the pad id is
                      never a stop id
  prompt_bucket       prompt length rounded up to a power of two (>= the
                      config's ``min_prompt_bucket``)
  fill_rows           prompt | response | pad rows in a ``[B, W]`` buffer, the
                      response log-probabilities at the response positions
  build_sample_result the ``Trajectory`` (masks, behaviour log-probabilities,
                      per-token policy version, group ids, finished flags) and
                      the list views of one batch

Layout of row b (prompt length ``Lb``, response length ``Rb``, width
``W = prompt_bucket + max_new_tokens``)::

  index      0 .. Lb-1 | Lb .. Lb+Rb-1              | Lb+Rb .. W-1
  tokens     prompt    | response (stop token last) | pad id
  logp       0         | log mu(token | prefix)     | 0
  version    -1        | policy version             | -1
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling.base import SampleResult, SamplerConfig
from jaxrl_llm.types import Trajectory


def next_power_of_two(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


def max_length(model_config: ModelConfig, config: SamplerConfig) -> int:
  """Cap on prompt + response tokens: ``min(config.max_length, max_position_embeddings)``."""
  limit = model_config.max_position_embeddings
  return limit if config.max_length is None else min(int(config.max_length), limit)


def prepare_prompts(prompts: Sequence[Sequence[int]], config: SamplerConfig, model_config: ModelConfig
                    ) -> tuple[list[list[int]], list[bool]]:
  """Validates the prompts and fits each into ``max_length - max_new_tokens`` tokens.

  Args:
    prompts: G token-id sequences (no padding).
    config: the sampling settings (``max_new_tokens``, ``max_length``,
      ``truncate_prompts``).
    model_config: gives the vocabulary size and ``max_position_embeddings``.

  Returns:
    ``(prompts, truncated)``: G lists of ints (the last ``budget`` tokens of a
    prompt that was too long, when ``truncate_prompts``) and G bools.

  Raises:
    ValueError: naming the prompt that is empty, has an id outside the
      vocabulary, or is too long (without ``truncate_prompts``).
  """
  if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError(f"generate: prompts must be a non-empty sequence of token-id sequences, got {type(prompts)}")
  vocab = model_config.vocab_size
  max_len = max_length(model_config, config)
  budget = max_len - config.max_new_tokens
  if budget < 1:
    raise ValueError(f"generate: max_new_tokens={config.max_new_tokens} leaves no room for a prompt within "
                     f"max length {max_len}")
  out, truncated = [], []
  for i, prompt in enumerate(prompts):
    ids = [int(t) for t in np.asarray(prompt, dtype=np.int64).reshape(-1)]
    if not ids:
      raise ValueError(f"generate: prompt {i} is empty (at least one token is needed)")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
    if len(ids) > budget:
      if not config.truncate_prompts:
        raise ValueError(
            f"generate: prompt {i} has {len(ids)} tokens; with max_new_tokens={config.max_new_tokens} it needs "
            f"{len(ids) + config.max_new_tokens} > max length {max_len} (max_position_embeddings="
            f"{model_config.max_position_embeddings}, max_length={config.max_length}). Shorten it or set "
            f"truncate_prompts=True to keep its last {budget} tokens.")
      ids = ids[len(ids) - budget:]
      truncated.append(True)
    else:
      truncated.append(False)
    out.append(ids)
  return out, truncated


def stop_token_ids(config: SamplerConfig, model_config: ModelConfig) -> tuple[int, ...]:
  """The ids that end a response: ``config.stop_token_ids``, or ``(eos,)`` when None.

  Raises:
    ValueError: when the pad id is among them (pad and stop must differ).
  """
  stops = config.stop_token_ids
  if stops is None:
    stops = (model_config.eos_token_id,)
  stops = tuple(int(s) for s in stops)
  pad_id = model_config.pad_token_id
  if pad_id in stops:
    raise ValueError(f"generate: stop_token_ids {stops} contain the pad id {pad_id}; pad and stop must differ")
  return stops


def prompt_bucket(prompt_lengths: Sequence[int], config: SamplerConfig) -> int:
  """Longest prompt rounded up to a power of two of at least ``min_prompt_bucket``."""
  return next_power_of_two(int(max(prompt_lengths)), config.min_prompt_bucket)


def fill_rows(prompt_rows: Sequence[Sequence[int]], response_rows: Sequence[Sequence[int]],
              logp_rows: Sequence[Sequence[float]], width: int, pad_id: int
              ) -> tuple[np.ndarray, np.ndarray]:
  """Writes prompt, response and padding rows into ``[B, width]`` buffers.

  Args:
    prompt_rows: B prompts (one per row).
    response_rows: B responses (stop token included when sampled).
    logp_rows: B sequences of behaviour log-probabilities, one per response token.
    width: W, at least ``len(prompt) + len(response)`` of every row.
    pad_id: the padding id.

  Returns:
    ``(tokens_bt int32 [B, W], logp_bt float32 [B, W])``; ``logp_bt`` is 0
    outside the responses.
  """
  batch = len(prompt_rows)
  if len(response_rows) != batch or len(logp_rows) != batch:
    raise ValueError(f"fill_rows: {batch} prompts, {len(response_rows)} responses and {len(logp_rows)} "
                     "log-probability rows; expected one of each per row")
  tokens = np.full((batch, width), pad_id, np.int32)
  logp = np.zeros((batch, width), np.float32)
  for b, (prompt, response, lp) in enumerate(zip(prompt_rows, response_rows, logp_rows)):
    start, stop = len(prompt), len(prompt) + len(response)
    if len(lp) != len(response):
      raise ValueError(f"fill_rows: row {b} has {len(response)} response tokens but {len(lp)} log-probabilities")
    if stop > width:
      raise ValueError(f"fill_rows: row {b} needs {stop} columns (prompt {start} + response "
                       f"{len(response)}) but the buffer has {width}")
    tokens[b, :start] = prompt
    tokens[b, start:stop] = response
    logp[b, start:stop] = lp
  return tokens, logp


def build_sample_result(tokens_bt: np.ndarray, logp_bt: np.ndarray, prompt_lengths_b: np.ndarray,
                        response_lengths_b: np.ndarray, finished_b: np.ndarray, *,
                        truncated_g: Sequence[bool], num_samples: int, version: int) -> SampleResult:
  """The ``SampleResult`` of B = G * num_samples rows laid out as in the module docstring.

  Args:
    tokens_bt: int [B, W] prompt (from index 0), response, pad.
    logp_bt: float [B, W] behaviour log-probabilities (read at response positions).
    prompt_lengths_b: int [B] Lb.
    response_lengths_b: int [B] Rb (stop token included).
    finished_b: bool [B] the response ended with a stop token.
    truncated_g: G bools, the prompt lost its oldest tokens.
    num_samples: N rows per prompt (contiguous).
    version: policy version of every sampled token.

  Returns:
    The SampleResult (numpy arrays; ``rewards_b`` zeros).
  """
  tokens_bt = np.asarray(tokens_bt)
  lengths = np.asarray(prompt_lengths_b).astype(np.int64)
  resp_len = np.asarray(response_lengths_b).astype(np.int64)
  num_rows = tokens_bt.shape[0]
  if num_rows != len(truncated_g) * num_samples:
    raise ValueError(f"build_sample_result: {num_rows} rows but {len(truncated_g)} prompts x "
                     f"{num_samples} samples")
  index = np.arange(tokens_bt.shape[1])[None]
  prompt_mask = index < lengths[:, None]
  response_mask = (index >= lengths[:, None]) & (index < (lengths + resp_len)[:, None])
  trajectory = Trajectory(
      tokens_bt=tokens_bt.astype(np.int32),
      prompt_mask_bt=prompt_mask,
      response_mask_bt=response_mask,
      observation_mask_bt=np.zeros_like(response_mask),
      behaviour_logp_bt=np.where(response_mask, logp_bt, 0.0).astype(np.float32),
      policy_version_bt=np.where(response_mask, version, -1).astype(np.int32),
      group_id_b=np.repeat(np.arange(len(truncated_g), dtype=np.int32), num_samples),
      rewards_b=np.zeros((num_rows,), np.float32),
      finished_b=np.asarray(finished_b).astype(bool),
  )
  prompt_tokens = [tokens_bt[r, :lengths[r]].tolist() for r in range(num_rows)]
  response_tokens = [tokens_bt[r, lengths[r]:lengths[r] + resp_len[r]].tolist() for r in range(num_rows)]
  return SampleResult(trajectory=trajectory, prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                      prompt_truncated_b=np.repeat(np.asarray(truncated_g, bool), num_samples),
                      policy_version=int(version))


__all__ = ["build_sample_result", "fill_rows", "max_length", "next_power_of_two", "prepare_prompts",
           "prompt_bucket", "stop_token_ids"]
