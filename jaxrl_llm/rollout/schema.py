"""The versioned record that crosses the sampler -> learner queue, and its validation.

A sampler actor answers one :class:`WorkItem` (a slice of a step's prompt
groups) with one :class:`RolloutChunk`. Everything the learner needs travels
in it: the trajectory (numpy arrays, [B, T], B = G * n), the response token
lists, which work item it answers (so nothing is counted twice), which
sampler made it and with which tokenizer/model fingerprint.

:func:`validate_chunk` runs at the queue boundary, on the learner side, before
a chunk can reach a batch. It returns the list of reasons a chunk is unusable
(empty when it is fine); the pool rejects and counts such chunks. Checks:

* schema version and fingerprint equal the learner's;
* every [B, T] array has the same shape, B = G * n, dtypes as documented;
* prompt then response, contiguous, no overlap; ids in ``[0, vocab)``;
* behaviour log-probabilities finite and <= 0 on response tokens;
* every response token carries a policy version in ``[0, latest]``: a version
  from the future (a sampler that saw weights the learner never published, or
  a restarted learner) is rejected.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxrl_llm.bridge.fingerprint import Fingerprint, check_fingerprints
from jaxrl_llm.types import Trajectory, concat_trajectories

SCHEMA_VERSION = 1
"""Bumped whenever a field of RolloutChunk or its meaning changes."""


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """A request to a sampler: G prompts x n samples, with a reproducible key.

  Attributes:
    request_id: unique per dispatch of this work (a re-dispatch gets a new id).
    step: the data step the prompts belong to.
    chunk: index of this slice within the step.
    prompts: G token-id prompts.
    num_samples: n, responses per prompt.
    rng: raw ``jax.random`` key data (uint32 numpy) for this step.
    first_row: global row index of this chunk's first row within the step, so
      the per-row sampling keys match a single call over the whole step.
  """

  request_id: int
  step: int
  chunk: int
  prompts: tuple[tuple[int, ...], ...]
  num_samples: int
  rng: np.ndarray
  first_row: int = 0


@dataclasses.dataclass
class RolloutChunk:
  """A sampler's answer to one WorkItem.

  Attributes:
    schema_version: :data:`SCHEMA_VERSION` of the producer.
    request_id, step, chunk: copied from the WorkItem.
    sampler_id: which actor produced it (for logs and fault accounting).
    fingerprint: the sampler's tokenizer/model fingerprint (``Fingerprint.to_dict()``).
    trajectory: numpy Trajectory, B = G * n rows.
    response_tokens: per row, the sampled ids (stop token included).
    sample_seconds: time the sampler spent generating.
  """

  schema_version: int
  request_id: int
  step: int
  chunk: int
  sampler_id: str
  fingerprint: dict
  trajectory: Trajectory
  response_tokens: list[list[int]]
  sample_seconds: float = 0.0

  @property
  def num_rows(self) -> int:
    return int(np.asarray(self.trajectory.tokens_bt).shape[0])

  def oldest_version(self) -> int:
    """The smallest policy version among this chunk's response tokens (-1 when none)."""
    v = np.asarray(self.trajectory.policy_version_bt)[np.asarray(self.trajectory.response_mask_bt)]
    return int(v.min()) if v.size else -1


def validate_chunk(chunk: Any, *, fingerprint: Fingerprint, latest_version: int, vocab_size: int,
                   expected_rows: Optional[int] = None) -> list[str]:
  """Reasons ``chunk`` cannot be used (empty list: valid). See the module docstring.

  Args:
    chunk: what came out of the queue (anything; a non-RolloutChunk is rejected).
    fingerprint: the learner's Fingerprint.
    latest_version: the newest policy version the learner has published.
    vocab_size: V; token ids must be in ``[0, V)``.
    expected_rows: G * n of the WorkItem, when known.
  """
  if not isinstance(chunk, RolloutChunk):
    return [f"expected a RolloutChunk, got {type(chunk).__name__}"]
  reasons = []
  if chunk.schema_version != SCHEMA_VERSION:
    reasons.append(f"schema_version={chunk.schema_version}: expected {SCHEMA_VERSION}")
  try:
    check_fingerprints(fingerprint, Fingerprint.from_dict(chunk.fingerprint),
                       actual_name=f"sampler {chunk.sampler_id!r}")
  except (ValueError, TypeError) as e:  # FingerprintMismatchError is a ValueError
    reasons.append(f"fingerprint: {e}")
  traj = chunk.trajectory
  fields = ("tokens_bt", "prompt_mask_bt", "response_mask_bt", "behaviour_logp_bt", "policy_version_bt")
  try:
    arrays = {name: np.asarray(getattr(traj, name)) for name in fields}
  except AttributeError as e:
    return reasons + [f"trajectory lacks a field: {e}"]
  shapes = {name: a.shape for name, a in arrays.items()}
  if len(set(shapes.values())) != 1 or len(shapes["tokens_bt"]) != 2:
    return reasons + [f"trajectory arrays must share one [B, T] shape, got {shapes}"]
  rows = shapes["tokens_bt"][0]
  if expected_rows is not None and rows != expected_rows:
    reasons.append(f"{rows} rows: expected {expected_rows} (prompts x samples)")
  if len(chunk.response_tokens) != rows:
    reasons.append(f"{len(chunk.response_tokens)} response token lists for {rows} rows")
  for name, kinds in (("tokens_bt", "iu"), ("policy_version_bt", "iu"), ("prompt_mask_bt", "b"),
                      ("response_mask_bt", "b"), ("behaviour_logp_bt", "f")):
    if arrays[name].dtype.kind not in kinds:
      reasons.append(f"{name} has dtype {arrays[name].dtype}")
  if reasons:
    return reasons
  tokens, prompt, response = arrays["tokens_bt"], arrays["prompt_mask_bt"], arrays["response_mask_bt"]
  if (prompt & response).any():
    reasons.append("prompt and response masks overlap")
  used = prompt | response
  if tokens[used].size and (tokens[used].min() < 0 or tokens[used].max() >= vocab_size):
    reasons.append(f"token ids outside [0, {vocab_size})")
  # prompt from index 0, response right after it, both contiguous
  n_prompt, n_resp = prompt.sum(1), response.sum(1)
  index = np.arange(tokens.shape[1])[None]
  layout_ok = (prompt == (index < n_prompt[:, None])).all() and (
      response == ((index >= n_prompt[:, None]) & (index < (n_prompt + n_resp)[:, None]))).all()
  if not layout_ok:
    reasons.append("rows must hold the prompt from index 0 and the response right after it")
  logp = arrays["behaviour_logp_bt"][response]
  if logp.size and not (np.isfinite(logp).all() and (logp <= 0).all()):
    reasons.append("behaviour log-probabilities must be finite and <= 0 on response tokens")
  versions = arrays["policy_version_bt"][response]
  if versions.size and versions.max() > latest_version:
    reasons.append(f"policy version {int(versions.max())} is from the future (learner's latest is {latest_version})")
  if versions.size and versions.min() < 0:
    reasons.append("a response token has no policy version (< 0)")
  for b in range(min(rows, len(chunk.response_tokens))):
    if list(tokens[b][response[b]]) != list(chunk.response_tokens[b]):
      reasons.append(f"row {b}: response_tokens disagree with tokens_bt")
      break
  return reasons


def concat_chunks(chunks: Sequence[RolloutChunk], pad_id: int) -> tuple[Trajectory, list[list[int]]]:
  """Stacks chunks' rows (in the given order) into one Trajectory, right-padding T.

  Returns:
    ``(trajectory, response_tokens)`` with B = sum of the chunks' rows and
    T = the widest chunk's T.
  """
  if not chunks:
    raise ValueError("concat_chunks: no chunks")
  traj = concat_trajectories([c.trajectory for c in chunks], pad_id)
  return traj, [list(r) for c in chunks for r in c.response_tokens]
