"""Chunk repair: hold a partly bad chunk, re-sample its bad rows alone, merge them back.

Rows of a :class:`~jaxrl_llm.rollout.schema.RolloutChunk` are prompt-major:
local row ``r`` of a WorkItem of G prompts x n samples is sample ``r % n`` of
prompt ``r // n``, sampled with the key ``fold_in(rng, item.first_row + r)``.
:func:`row_item` is the WorkItem that samples that one row alone (prompt
``r // n``, n = 1, ``first_row = item.first_row + r``, the same ``rng``), so
it uses exactly the row's key: a healthy sampler gives the row a good one
would have given in the first place (bit for bit in batch-invariant mode).

:class:`RepairBook` keeps each partly bad chunk as it arrived, with its bad
rows still in place, and collects the re-sampled rows; when the last one is
in, :func:`merge_rows` writes each into its row position and the chunk is
whole again, under the original request id, step and chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping, Optional

import numpy as np

from jaxrl_llm.rollout.schema import RolloutChunk, WorkItem
from jaxrl_llm.types import concat_trajectories


def row_item(item: WorkItem, row: int, request_id: int) -> WorkItem:
  """The WorkItem that re-samples local row ``row`` of ``item`` alone (same key, one row)."""
  if not 0 <= row < len(item.prompts) * item.num_samples:
    raise ValueError(f"row_item: row {row} outside the {len(item.prompts) * item.num_samples} rows of the item")
  examples = (item.examples[row // item.num_samples],) if item.examples else ()
  return dataclasses.replace(item, request_id=request_id, prompts=(item.prompts[row // item.num_samples],),
                             num_samples=1, first_row=item.first_row + row, examples=examples)


def merge_rows(chunk: RolloutChunk, rows: Mapping[int, RolloutChunk], pad_id: int) -> RolloutChunk:
  """``chunk`` with each row ``r`` of ``rows`` replaced by the single row of ``rows[r]``.

  Args:
    chunk: B rows, trajectory arrays [B, T].
    rows: ``{local row r: a one-row chunk}`` (trajectory arrays [1, T_r]).
    pad_id: token id of padding columns.

  Returns:
    A chunk of B rows and T' = max(T, every T_r) columns, right-padded as
    :func:`~jaxrl_llm.types.concat_trajectories` pads. Replaced rows take
    every per-row field (tokens, masks, log-probabilities, versions,
    ``finished_b``, ``rewards_b``, response tokens) from their one-row chunk;
    ``group_id_b`` and the chunk's identity (request id, step, chunk, sampler,
    fingerprint) stay the original's; ``sample_seconds`` is the sum.
  """
  if not rows:
    return chunk
  num_rows, order = chunk.num_rows, sorted(rows)
  if any(not 0 <= r < num_rows for r in order) or any(rows[r].num_rows != 1 for r in order):
    raise ValueError(f"merge_rows: expected one-row chunks for rows in [0, {num_rows}), got rows {order} "
                     f"of {[rows[r].num_rows for r in order]} rows")
  stacked = concat_trajectories([chunk.trajectory] + [rows[r].trajectory for r in order], pad_id)
  index = np.arange(num_rows)
  index[order] = num_rows + np.arange(len(order))
  trajectory = stacked.take(index).replace(group_id_b=np.asarray(chunk.trajectory.group_id_b))
  responses = [list(r) for r in chunk.response_tokens]
  for r in order:
    responses[r] = list(rows[r].response_tokens[0])
  rewards, stats = chunk.rewards, chunk.episode_stats
  if rewards is not None and stats is not None:  # episode rows: their rewards and statistics travel with them
    rewards = np.asarray(rewards, np.float32).copy()
    stats = {k: np.asarray(v).copy() for k, v in stats.items()}
    for r in order:
      rewards[r] = np.asarray(rows[r].rewards)[0]
      for k in stats:
        stats[k][r] = np.asarray(rows[r].episode_stats[k])[0]
  return dataclasses.replace(chunk, trajectory=trajectory, response_tokens=responses, rewards=rewards,
                             episode_stats=stats,
                             sample_seconds=chunk.sample_seconds + sum(rows[r].sample_seconds for r in order))


@dataclasses.dataclass
class _Partial:
  chunk: RolloutChunk  # as it arrived, bad rows included
  missing: set[int]  # local rows still to re-sample
  rows: dict[int, RolloutChunk]  # re-sampled one-row chunks by local row


class RepairBook:
  """Partly bad chunks waiting for their re-sampled rows.

  A chunk is held under the request id of the WorkItem it answers; every row
  re-sample is known by its own request id (``renamed`` when it is re-queued).

  Args:
    pad_id: token id of padding columns (for :func:`merge_rows`).
  """

  def __init__(self, pad_id: int):
    self.pad_id = pad_id
    self._partials: dict[int, _Partial] = {}
    self._requests: dict[int, tuple[WorkItem, int]] = {}  # row request id -> (original item, local row)

  def __len__(self) -> int:
    """Chunks held."""
    return len(self._partials)

  def hold(self, item: WorkItem, chunk: RolloutChunk, bad_rows: Iterable[int],
           new_request_id: Callable[[], int]) -> list[WorkItem]:
    """Keeps ``chunk`` (the answer to ``item``); returns one :func:`row_item` per bad row, to submit."""
    bad = sorted({int(r) for r in bad_rows})
    if not bad:
      raise ValueError("RepairBook.hold: no bad rows")
    self._partials[item.request_id] = _Partial(chunk=chunk, missing=set(bad), rows={})
    out = []
    for r in bad:
      out.append(row_item(item, r, new_request_id()))
      self._requests[out[-1].request_id] = (item, r)
    return out

  def origin(self, request_id: int) -> Optional[tuple[WorkItem, int]]:
    """``(original item, local row)`` when ``request_id`` re-samples a row of a held chunk, else None."""
    return self._requests.get(request_id)

  def renamed(self, old_request_id: int, new_request_id: int) -> None:
    """A row re-sample was re-queued under a new request id (no-op for other requests)."""
    if old_request_id in self._requests:
      self._requests[new_request_id] = self._requests.pop(old_request_id)

  def put(self, request_id: int, row_chunk: RolloutChunk) -> Optional[RolloutChunk]:
    """Stores a valid re-sampled row; returns the merged chunk once its last row is in, else None."""
    item, r = self._requests.pop(request_id)
    partial = self._partials[item.request_id]
    partial.rows[r] = row_chunk
    partial.missing.discard(r)
    if partial.missing:
      return None
    del self._partials[item.request_id]
    return merge_rows(partial.chunk, partial.rows, self.pad_id)
