"""Prioritised sampling: a pool of prompts drawn with probability ∝ (1 - pass rate) + floor.

Kimi k1.5 (arXiv:2501.12599) samples training prompts in proportion to how often
they fail, ``p_i ∝ 1 - s_i``; the floor keeps solved-looking prompts drawable (their
pass rate is an estimate over a few samples), and ``max_uses`` turns the pool over so
that prompts that are never solved cannot hold it for good.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.curation.config import CurationConfig


def weighted_sample_without_replacement(weights: Any, k: int, rng: base.CounterRng) -> list[int]:
  """Draws ``k`` distinct indices, each draw ∝ the weights of the indices not yet drawn.

  Sequential draws: ``P(i at draw j) = w_i / sum_{l not drawn} w_l``; when every
  remaining weight is 0 the draw is uniform over the remaining indices. Uniforms are
  ``(u64 >> 11) / 2**53`` from a :class:`~jaxrl_llm.tasks.base.CounterRng`, so the
  result is the same on every platform.

  Args:
    weights: float [P] non-negative finite weights.
    k: draws, 0 <= k <= P.
    rng: the random stream.

  Returns:
    The k indices, in draw order.

  Raises:
    ValueError: for negative or non-finite weights, or k outside [0, P].
  """
  w = np.asarray(weights, np.float64).reshape(-1).copy()
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be finite and >= 0, got {w.tolist()}")
  if not 0 <= k <= w.shape[0]:
    raise ValueError(f"k must be in [0, {w.shape[0]}] (the number of weights), got {k}")
  alive = np.ones(w.shape[0], bool)
  out: list[int] = []
  for _ in range(k):
    u = (rng.next_u64() >> 11) / 2.0**53
    cur = np.where(alive, w, 0.0)
    if not np.any(cur > 0):
      cur = alive.astype(np.float64)
    cum = np.cumsum(cur)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    if i >= cur.shape[0] or cur[i] == 0.0:  # u * total rounded up to the total
      i = int(np.flatnonzero(cur > 0)[-1])
    alive[i] = False
    out.append(i)
  return out


class PrioritizedPool:
  """``config.pool_size`` stream positions, each with the number of times it was drawn.

  Args:
    config: the curation settings (``pool_size``, ``priority_floor``, ``prior_success``,
      ``max_uses``).
    key_of: stream position -> prompt key (a pool never holds two positions with one key).

  Example::

    pool = PrioritizedPool(config, key_of)
    pool.refill(lambda pooled: next_position_whose_key_is_not_in(pooled))
    positions = pool.draw(8, tracker.pass_rate, rng)
  """

  def __init__(self, config: CurationConfig, key_of: Callable[[int], str]):
    self.config = config
    self.key_of = key_of
    self.entries: list[list[int]] = []  # [position, uses], insertion order
    self.exhausted = 0  # prompts that left after max_uses draws

  def __len__(self) -> int:
    return len(self.entries)

  @property
  def positions(self) -> list[int]:
    """Pooled stream positions, in insertion order."""
    return [p for p, _ in self.entries]

  def refill(self, pull_fresh: Callable[[set[str]], int]) -> None:
    """Tops the pool up to ``pool_size`` with ``pull_fresh(keys already pooled) -> position``."""
    pooled = {self.key_of(p) for p in self.positions}
    while len(self.entries) < self.config.pool_size:
      position = pull_fresh(pooled)
      pooled.add(self.key_of(position))
      self.entries.append([position, 0])

  def priorities(self, pass_rate: Callable[[str], Optional[float]]) -> np.ndarray:
    """float64 [pool] ``(1 - s_i) + floor`` in pool order (``prior_success`` for unseen prompts)."""
    c = self.config
    out = np.empty(len(self.entries), np.float64)
    for i, position in enumerate(self.positions):
      rate = pass_rate(self.key_of(position))
      out[i] = (1.0 - (c.prior_success if rate is None else rate)) + c.priority_floor
    return out

  def draw(self, k: int, pass_rate: Callable[[str], Optional[float]], rng: base.CounterRng) -> tuple[int, ...]:
    """Draws ``k`` distinct pooled positions by priority; prompts used ``max_uses`` times leave."""
    picks = weighted_sample_without_replacement(self.priorities(pass_rate), k, rng)
    positions = tuple(self.entries[i][0] for i in picks)
    for i in picks:
      self.entries[i][1] += 1
    if self.config.max_uses:
      kept = [e for e in self.entries if e[1] < self.config.max_uses]
      self.exhausted += len(self.entries) - len(kept)
      self.entries = kept
    return positions

  def discard(self, keys: set[str]) -> None:
    """Removes the pooled prompts with these keys (retired prompts)."""
    self.entries = [e for e in self.entries if self.key_of(e[0]) not in keys]

  def get_state(self) -> list[list[int]]:
    """``[[position, uses], ...]`` (JSON)."""
    return [list(e) for e in self.entries]

  def set_state(self, entries: list, exhausted: int) -> None:
    """Restores ``get_state``'s output and the count of exhausted prompts."""
    self.entries = [[int(p), int(u)] for p, u in entries]
    self.exhausted = int(exhausted)


__all__ = ["PrioritizedPool", "weighted_sample_without_replacement"]
