"""Sorting a short list of digits.

Prompt ``"sort:52913="``, answer ``"12359"`` (``"95321"`` with ``descending=True``).
Curriculum difficulty: the length of the list. Built-in preference pairs use the text
kinds of :mod:`jaxrl_llm.tasks.pairs` (``swap_chars`` is a near-miss: the right digits
in a wrong order).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import ClassVar

from jaxrl_llm.tasks import base

_PREFIX = "sort:"


@dataclasses.dataclass(frozen=True)
class SortingTask(base.GeneratedTask):
  """Sort ``min_length..max_length`` random digits.

  The held-out split is over the multiset of digits (the sorted list), so no
  permutation of a held-out list is ever trained on.

  Reward (response stripped of leading/trailing whitespace, compared exactly):
    1 if correct, else ``format_reward * [response is a permutation of the input] +
    partial_credit * (fraction of digits in the right place)``; weights default to 0.

  Attributes:
    min_length: fewest digits in a list (>= 1).
    max_length: most digits in a list (>= min_length).
    descending: sort largest first.
    eval_fraction: share of digit multisets held out.
    split_salt: salt of the held-out hash.
    partial_credit: weight of positional partial credit for wrong answers.
    format_reward: reward for a wrong answer that is a permutation of the input.
  """

  name: ClassVar[str] = "sorting"

  min_length: int = 3
  max_length: int = 6
  descending: bool = False
  eval_fraction: float = 0.05
  split_salt: str = base.DEFAULT_SPLIT_SALT
  partial_credit: float = 0.0
  format_reward: float = 0.0

  def __post_init__(self):
    if not isinstance(self.min_length, int) or self.min_length < 1:
      raise ValueError(f"sorting.min_length must be an int >= 1, got {self.min_length!r}")
    if not isinstance(self.max_length, int) or self.max_length < self.min_length:
      raise ValueError(
          f"sorting.max_length must be an int >= min_length={self.min_length},"
          f" got {self.max_length!r}")
    self._check_split_fields()
    base.check_reward_shaping(self.name, self.partial_credit, self.format_reward)

  @property
  def alphabet(self) -> str:
    return base.alphabet_of([_PREFIX, "=", "0123456789"])

  def make_example(self, digits: str) -> base.Example:
    """Builds the example that sorts the digit string ``digits``."""
    answer = "".join(sorted(digits, reverse=self.descending))
    return base.Example(prompt=f"{_PREFIX}{digits}=", answer=answer, meta={"digits": digits})

  def _sample(self, rng: base.CounterRng) -> base.Example:
    length = rng.randint(self.min_length, self.max_length)
    return self.make_example("".join(str(rng.randint(0, 9)) for _ in range(length)))

  def _digits(self, example: base.Example) -> str:
    return example.meta.get("digits") or example.prompt[len(_PREFIX):-1]

  def split_key(self, example: base.Example) -> str:
    return "".join(sorted(self._digits(example)))

  def difficulty(self, example: base.Example) -> float:
    """Digits in the list (``"sort:52913="`` -> 5)."""
    return float(len(self._digits(example)))

  def reward(self, example: base.Example, response: str) -> float:
    pred = response.strip()
    return base.shaped_reward(
        correct=pred == example.answer,
        well_formed=Counter(pred) == Counter(example.answer),
        partial=base.positional_match(pred, example.answer),
        partial_credit=self.partial_credit,
        format_reward=self.format_reward)
