"""Per-prompt pass rates over a window of recent attempts, keyed by the prompt text.

The pass rate of a prompt is what the curated source retires and prioritises on
(no-positive resampling, Skywork-OR1, arXiv:2505.22312; sampling proportional to
1 - pass rate, Kimi k1.5, arXiv:2501.12599).
"""

from __future__ import annotations

import collections
import hashlib
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.curation.config import check_int


def prompt_key(example: base.Example) -> str:
  """Stable, compact key of a prompt: 16 hex digits of ``blake2b(prompt text)``.

  Two examples share a key exactly when the policy sees the same prompt text, so the
  pass rate is that of what the policy is asked.
  """
  return hashlib.blake2b(example.prompt.encode("utf-8"), digest_size=8).hexdigest()


class PassRateTracker:
  """Per-prompt success over the last ``window`` attempts.

  ``pass_rate(key) = mean(last min(window, attempts) successes)``; ``None`` before the
  first attempt. Keys are kept in least-recently-recorded order; past ``capacity`` keys
  the oldest is forgotten, which bounds the state on endless generated streams.

  Args:
    window: attempts remembered per prompt (>= 1).
    capacity: most prompts remembered (0: unbounded).

  Example:
    >>> t = PassRateTracker(window=4)
    >>> t.record(["a", "a", "b"], [1.0, 0.0, 1.0])
    >>> t.pass_rate("a"), t.attempts("a"), t.pass_rate("zz")
    (0.5, 2, None)
  """

  def __init__(self, window: int, capacity: int = 0):
    self.window = check_int("window", window, 1)
    self.capacity = check_int("capacity", capacity, 0)
    self._recent: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
    self._attempts: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._recent)

  def __contains__(self, key: str) -> bool:
    return key in self._recent

  def keys(self) -> list[str]:
    """Tracked keys, least recently recorded first."""
    return list(self._recent)

  def record(self, keys: Sequence[str], success_b: Sequence[float]) -> None:
    """Appends one attempt per row.

    Args:
      keys: [B] prompt keys (repeated for the samples of a prompt).
      success_b: [B] success of each attempt in [0, 1] (usually 0/1: reward >= threshold).

    Raises:
      ValueError: when the lengths differ or a success is outside [0, 1] or not finite.
    """
    success = np.asarray(success_b, np.float64).reshape(-1)
    if len(keys) != success.shape[0]:
      raise ValueError(f"success_b has {success.shape[0]} entries but keys has {len(keys)}")
    if not np.all(np.isfinite(success)) or np.any((success < 0) | (success > 1)):
      raise ValueError(f"success_b must be finite and in [0, 1], got {success.tolist()}")
    for key, s in zip(keys, success.tolist()):
      recent = self._recent.get(key)
      if recent is None:
        recent = self._recent[key] = collections.deque(maxlen=self.window)
        self._attempts[key] = 0
      else:
        self._recent.move_to_end(key)
      recent.append(s)
      self._attempts[key] += 1
    while self.capacity and len(self._recent) > self.capacity:
      old, _ = self._recent.popitem(last=False)
      del self._attempts[old]

  def pass_rate(self, key: str) -> Optional[float]:
    """Mean success over the key's recent window, or ``None`` if never attempted."""
    recent = self._recent.get(key)
    if not recent:
      return None
    return math.fsum(recent) / len(recent)

  def attempts(self, key: str) -> int:
    """Attempts recorded for ``key`` since it was first (re-)tracked."""
    return self._attempts.get(key, 0)

  def forget(self, key: str) -> None:
    """Drops a key (e.g. a retired prompt), if present."""
    if self._recent.pop(key, None) is not None:
      del self._attempts[key]

  def mean_pass_rate(self) -> Optional[float]:
    """Mean over tracked keys of their pass rate, or ``None`` when nothing is tracked."""
    if not self._recent:
      return None
    return math.fsum(math.fsum(r) / len(r) for r in self._recent.values()) / len(self._recent)

  def get_state(self) -> dict[str, Any]:
    """``{"window", "entries": [[key, attempts, [recent...]], ...]}`` (JSON, LRU order)."""
    return {"window": self.window,
            "entries": [[k, self._attempts[k], list(r)] for k, r in self._recent.items()]}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores ``get_state``'s output; a smaller ``window`` keeps the latest attempts.

    Raises:
      ValueError: naming the malformed field.
    """
    entries = state.get("entries")
    if not isinstance(entries, list):
      raise ValueError(f"tracker state needs a list 'entries', got {type(entries).__name__}")
    recent: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
    attempts: dict[str, int] = {}
    for j, entry in enumerate(entries):
      if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)):
        raise ValueError(f"tracker state entries[{j}] must be [key, attempts, [successes]], got {entry!r}")
      key, count, values = entry
      recent[key] = collections.deque((float(v) for v in values), maxlen=self.window)
      attempts[key] = int(count)
    self._recent, self._attempts = recent, attempts


__all__ = ["PassRateTracker", "prompt_key"]
