"""Corrupted responses for built-in preference pairs: the gold answer against a worse one.

A task's ``preference_pairs`` (see :class:`jaxrl_llm.tasks.base.Task`) prefers its gold
response to a response corrupted in one of the task's ``pair_kinds``; the generic
kinds here are character-level edits that apply to any text answer, and a task adds
its own near-miss errors (addition: a carry error). Whether a corruption is really
worse is decided by the task's verifier, never assumed.

References:
  arXiv:2404.19733 (preference pairs ordered by the correctness of the final answer);
  arXiv:2203.02155 (reward models trained on pairwise comparisons).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from jaxrl_llm.tasks.rng import CounterRng

TEXT_PAIR_KINDS = ("wrong_char", "drop_char", "swap_chars", "truncated")
DIGITS = "0123456789"


class ResponsePair(NamedTuple):
  """A gold response and a worse one to the same prompt (one built-in preference pair).

  Attributes:
    chosen: the preferred response (the task's gold response, ``sft_target``).
    rejected: a response the task's ``reward`` scores strictly lower.
    kind: how ``rejected`` was made (one of the task's ``pair_kinds``).
  """

  chosen: str
  rejected: str
  kind: str


def change_digit(text: str, rng: CounterRng) -> Optional[str]:
  """``text`` with one of its ASCII digits (uniformly chosen) replaced by another digit; None without digits."""
  positions = [i for i, ch in enumerate(text) if ch in DIGITS]
  if not positions:
    return None
  i = rng.choice(positions)
  return text[:i] + str((int(text[i]) + rng.randint(1, 9)) % 10) + text[i + 1:]


def corrupt_text(text: str, kind: str, rng: CounterRng, alphabet: str) -> Optional[str]:
  """A character-level corruption of a response, one of ``TEXT_PAIR_KINDS``.

  Kinds: ``wrong_char`` (one character replaced by another character of ``alphabet``),
  ``drop_char`` (one character deleted), ``swap_chars`` (two adjacent, different
  characters exchanged), ``truncated`` (the response cut before its end, as when
  generation stops at the length limit).

  Args:
    text: the response to corrupt (usually the gold response).
    kind: one of ``TEXT_PAIR_KINDS``.
    rng: the pair's random stream.
    alphabet: the characters a replacement may use (the task's alphabet).

  Returns:
    The corrupted text (always different from ``text``), or None when ``kind`` cannot
    change this text (empty text, no two adjacent different characters, one-letter alphabet).

  Raises:
    ValueError: for an unknown kind.
  """
  if kind not in TEXT_PAIR_KINDS:
    raise ValueError(f"unknown pair kind {kind!r}; the text kinds are {TEXT_PAIR_KINDS}")
  if not text:
    return None
  if kind == "wrong_char":
    i = rng.randint(0, len(text) - 1)
    others = [ch for ch in alphabet if ch != text[i]]
    return text[:i] + rng.choice(others) + text[i + 1:] if others else None
  if kind == "drop_char":
    i = rng.randint(0, len(text) - 1)
    return text[:i] + text[i + 1:]
  if kind == "swap_chars":
    positions = [i for i in range(len(text) - 1) if text[i] != text[i + 1]]
    if not positions:
      return None
    i = rng.choice(positions)
    return text[:i] + text[i + 1] + text[i] + text[i + 2:]
  return text[:rng.randint(0, len(text) - 1)]


__all__ = ["DIGITS", "TEXT_PAIR_KINDS", "ResponsePair", "change_digit", "corrupt_text"]
