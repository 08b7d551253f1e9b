"""The versioned record that crosses the sampler -> learner queue, and its validation.

A sampler actor answers one :class:`WorkItem` (a slice of a step's prompt
groups) with one :class:`RolloutChunk`. Everything the learner needs travels
in it: the trajectory (numpy arrays, [B, T], B = G * n), the response token
lists, which work item it answers (so nothing is counted twice), which
sampler made it and with which tokenizer/model fingerprint.

:func:`validate_chunk` runs at the queue boundary, on the learner side, before
a chunk can reach a batch. It returns the list of reasons a chunk is unusable
(empty when it is fine), split in two (:class:`ChunkReasons`):

whole-chunk problems (the pool rejects the chunk and re-samples all of it):

* not a RolloutChunk; schema version or fingerprint differ from the learner's;
* the [B, T] arrays do not share one shape, dtypes not as documented, B is
  not G * n, or not B response token lists;

per-row problems (:func:`validate_rows`; the pool drops just those rows and
re-samples each alone with its own key, see :mod:`jaxrl_llm.rollout.repair`):

* prompt from index 0, then model and observation tokens (multi-turn rows)
  as one contiguous run starting with a model token, no overlap; ids in
  ``[0, vocab)``;
* behaviour log-probabilities finite and <= 0 on response tokens;
* observation tokens carry no behaviour log-probability (0) and no policy
  version (-1);
* every response token carries a policy version in ``[0, latest]``: a version
  from the future (a sampler that saw weights the learner never published, or
  a restarted learner) is rejected;
* ``response_tokens[r]`` equals the response tokens of row r of ``tokens_bt``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxrl_llm.bridge.fingerprint import Fingerprint, check_fingerprints
from jaxrl_llm.types import Trajectory, concat_trajectories

SCHEMA_VERSION = 2
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
    version: the exact policy version to sample with (``rollout.exact_versions``:
      the actor uses that version's weights from the recent ones it keeps, even
      when it already holds newer ones); -1: any version it holds, at least the
      ``min_version`` the item was submitted with.
    examples: the G task examples of ``prompts`` when the actor plays multi-turn
      episodes (``config.env``: each episode's environment resets from its
      example); empty for single-turn sampling.
  """

  request_id: int
  step: int
  chunk: int
  prompts: tuple[tuple[int, ...], ...]
  num_samples: int
  rng: np.ndarray
  first_row: int = 0
  version: int = -1
  examples: tuple = ()


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
    rewards: float32 [B] the episodes' rewards when the actor played multi-turn
      episodes (the rows come scored), else None.
    episode_stats: ``{name: [B] array}`` of :data:`jaxrl_llm.envs.episodes.STAT_FIELDS`
      for episode rows, else None.
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
  rewards: Optional[np.ndarray] = None
  episode_stats: Optional[dict] = None

  @property
  def num_rows(self) -> int:
    return int(np.asarray(self.trajectory.tokens_bt).shape[0])

  def oldest_version(self) -> int:
    """The smallest policy version among this chunk's response tokens (-1 when none)."""
    v = np.asarray(self.trajectory.policy_version_bt)[np.asarray(self.trajectory.response_mask_bt)]
    return int(v.min()) if v.size else -1


class ChunkReasons(list):
  """Why a chunk is unusable: the flat list of reasons, plus the same reasons kept apart.

  It is a ``list[str]`` (empty: valid), so callers that only need the reasons
  use it as one: whole-chunk reasons first, then ``"row {r}: {reason}"`` for
  each bad row. The pool reads the two parts:

  Attributes:
    chunk: reasons that make the whole chunk unusable (type, schema version,
      fingerprint, shapes, dtypes, row counts).
    rows: ``{local row r: its reasons}`` for rows that alone are unusable
      (empty when ``chunk`` is not: rows are then not checked).
  """

  def __init__(self, chunk: Sequence[str] = (), rows: Optional[dict[int, list[str]]] = None):
    self.chunk = list(chunk)
    self.rows = {int(r): list(v) for r, v in sorted((rows or {}).items()) if v}
    super().__init__(self.chunk + [f"row {r}: {reason}" for r, reasons in self.rows.items() for reason in reasons])


_FIELDS = ("tokens_bt", "prompt_mask_bt", "response_mask_bt", "observation_mask_bt", "behaviour_logp_bt",
           "policy_version_bt")
_DTYPE_KINDS = {"tokens_bt": "iu", "policy_version_bt": "iu", "prompt_mask_bt": "b", "response_mask_bt": "b",
                "observation_mask_bt": "b", "behaviour_logp_bt": "f"}


def _structure(chunk: Any, expected_rows: Optional[int]) -> tuple[list[str], dict[str, np.ndarray]]:
  """Chunk-level shape/dtype/count problems of ``chunk`` and its [B, T] arrays (by field name)."""
  if not isinstance(chunk, RolloutChunk):
    return [f"expected a RolloutChunk, got {type(chunk).__name__}"], {}
  try:
    arrays = {name: np.asarray(getattr(chunk.trajectory, name)) for name in _FIELDS}
  except AttributeError as e:
    return [f"trajectory lacks a field: {e}"], {}
  shapes = {name: a.shape for name, a in arrays.items()}
  if len(set(shapes.values())) != 1 or len(shapes["tokens_bt"]) != 2:
    return [f"trajectory arrays must share one [B, T] shape, got {shapes}"], arrays
  reasons = []
  rows = shapes["tokens_bt"][0]
  if expected_rows is not None and rows != expected_rows:
    reasons.append(f"{rows} rows: expected {expected_rows} (prompts x samples)")
  if len(chunk.response_tokens) != rows:
    reasons.append(f"{len(chunk.response_tokens)} response token lists for {rows} rows")
  for name, kinds in _DTYPE_KINDS.items():
    if arrays[name].dtype.kind not in kinds:
      reasons.append(f"{name} has dtype {arrays[name].dtype}")
  return reasons, arrays


def validate_chunk(chunk: Any, *, fingerprint: Fingerprint, latest_version: int, vocab_size: int,
                   expected_rows: Optional[int] = None) -> ChunkReasons:
  """Reasons ``chunk`` cannot be used (empty: valid). See the module docstring.

  Args:
    chunk: what came out of the queue (anything; a non-RolloutChunk is rejected).
    fingerprint: the learner's Fingerprint.
    latest_version: the newest policy version the learner has published.
    vocab_size: V; token ids must be in ``[0, V)``.
    expected_rows: G * n of the WorkItem, when known.

  Returns:
    A :class:`ChunkReasons` (a list of str): whole-chunk reasons, or, when
    there are none, the per-row reasons of :func:`validate_rows`.
  """
  if not isinstance(chunk, RolloutChunk):
    return ChunkReasons([f"expected a RolloutChunk, got {type(chunk).__name__}"])
  reasons = []
  if chunk.schema_version != SCHEMA_VERSION:
    reasons.append(f"schema_version={chunk.schema_version}: expected {SCHEMA_VERSION}")
  try:
    check_fingerprints(fingerprint, Fingerprint.from_dict(chunk.fingerprint),
                       actual_name=f"sampler {chunk.sampler_id!r}")
  except (ValueError, TypeError) as e:  # FingerprintMismatchError is a ValueError
    reasons.append(f"fingerprint: {e}")
  reasons += _structure(chunk, expected_rows)[0]
  if reasons:
    return ChunkReasons(reasons)
  return ChunkReasons([], validate_rows(chunk, latest_version=latest_version, vocab_size=vocab_size))


def validate_rows(chunk: RolloutChunk, *, latest_version: int, vocab_size: int) -> dict[int, list[str]]:
  """Per-row reasons: ``{local row r: reasons}`` for each unusable row (no key: the row is fine).

  Row ``r`` of ``chunk.trajectory`` ([B, T] arrays) and ``chunk.response_tokens[r]``
  are checked on their own (see the module docstring for the checks), so a
  bad row can be dropped and re-sampled alone.

  Args:
    chunk: a RolloutChunk whose arrays share one [B, T] shape with the
      documented dtypes and B response token lists (the chunk-level checks of
      :func:`validate_chunk`).
    latest_version: the newest policy version the learner has published.
    vocab_size: V; token ids must be in ``[0, V)``.

  Raises:
    ValueError: when ``chunk`` fails those chunk-level checks.
  """
  problems, arrays = _structure(chunk, None)
  if problems:
    raise ValueError("validate_rows: a chunk-level problem (see validate_chunk): " + "; ".join(problems))
  tokens, prompt, response = arrays["tokens_bt"], arrays["prompt_mask_bt"], arrays["response_mask_bt"]
  observation = arrays["observation_mask_bt"]
  logp, versions = arrays["behaviour_logp_bt"], arrays["policy_version_bt"]
  after = response | observation  # everything after the prompt: model turns and observations
  used = prompt | after
  # prompt from index 0, then model turns and observations as one contiguous run starting with a model token
  n_prompt, n_after = prompt.sum(1), after.sum(1)
  index = np.arange(tokens.shape[1])[None]
  first = np.minimum(n_prompt, tokens.shape[1] - 1)
  starts_with_model = (n_after == 0) | response[np.arange(tokens.shape[0]), first]
  layout_ok = (prompt == (index < n_prompt[:, None])).all(1) & (
      after == ((index >= n_prompt[:, None]) & (index < (n_prompt + n_after)[:, None]))).all(1) & starts_with_model
  with np.errstate(invalid="ignore"):
    bad_logp = (response & ~(np.isfinite(logp) & (logp <= 0))).any(1)
  lowest = np.iinfo(np.int64).min
  newest = np.where(response, versions.astype(np.int64), lowest).max(1, initial=lowest)  # per row
  checks = [
      ((prompt & response).any(1) | (prompt & observation).any(1) | (response & observation).any(1),
       lambda b: "prompt, response and observation masks overlap"),
      ((used & ((tokens < 0) | (tokens >= vocab_size))).any(1), lambda b: f"token ids outside [0, {vocab_size})"),
      (~layout_ok, lambda b: "rows must hold the prompt from index 0 and the response (model turns and "
                             "observations, starting with a model turn) right after it"),
      ((observation & ((logp != 0) | (versions != -1))).any(1),
       lambda b: "observation tokens must carry no behaviour log-probability (0) and no policy version (-1)"),
      (bad_logp, lambda b: "behaviour log-probabilities must be finite and <= 0 on response tokens"),
      (newest > latest_version,
       lambda b: f"policy version from the future: {int(newest[b])} > the learner's latest {latest_version}"),
      ((response & (versions < 0)).any(1), lambda b: "a response token has no policy version (< 0)"),
  ]
  out: dict[int, list[str]] = {}
  for b in range(tokens.shape[0]):
    reasons = [reason(b) for bad, reason in checks if bad[b]]
    if list(tokens[b][response[b]]) != list(chunk.response_tokens[b]):
      reasons.append("response_tokens disagree with tokens_bt")
    if reasons:
      out[b] = reasons
  return out


def concat_episode_fields(chunks: Sequence[RolloutChunk]) -> tuple[Optional[np.ndarray], Optional[dict]]:
  """``(rewards [B], episode_stats)`` of the chunks' rows in order, or ``(None, None)`` unless every
  chunk holds scored episode rows."""
  if not chunks or any(c.rewards is None or c.episode_stats is None for c in chunks):
    return None, None
  rewards = np.concatenate([np.asarray(c.rewards, np.float32) for c in chunks])
  stats = {k: np.concatenate([np.asarray(c.episode_stats[k]) for c in chunks]) for k in chunks[0].episode_stats}
  return rewards, stats


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
