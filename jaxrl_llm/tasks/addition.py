"""Multi-digit addition: the default task of the embedded CPU run.

Prompt ``"23+58="``, answer ``"81"``; the policy's response is the digits of the sum
followed by the EOS token (added by the tokenizer layer, not part of the text here).

With ``reverse_answer=True`` the sum is written least-significant digit first
(``"23+58="`` -> ``"18"``). A left-to-right decoder then emits each digit after the
carry that produces it, which small transformers learn much faster (Lee et al., 2023,
"Teaching Arithmetic to Small Transformers", arXiv:2307.03381).

Default difficulty: operands of 1 to 2 digits (10^4 ordered problems, ~5 % of the
unordered pairs held out, sums of at most 3 digits), sized for the embedded CPU run of a
decoder of about 1M parameters after a short supervised warm start; raise ``max_digits``
(and consider ``reverse_answer``) for a harder job.

References:
  arXiv:2307.03381 (reversed-output arithmetic for small transformers).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from jaxrl_llm.tasks import base


@dataclasses.dataclass(frozen=True)
class AdditionTask(base.GeneratedTask):
  """``a+b=`` with operands of ``min_digits..max_digits`` digits.

  Each operand draws its digit count uniformly, then its value uniformly among numbers
  with that many digits (1 digit: 0..9), so short problems are not swamped by long ones.

  Reward (response stripped of leading/trailing whitespace, compared exactly):
    1 if the response equals the answer, else
    ``format_reward * [response is non-empty digits] + partial_credit * (fraction of
    answer digits in the right place)``; both weights default to 0 (plain 0/1).

  Attributes:
    min_digits: fewest digits per operand (>= 1).
    max_digits: most digits per operand (>= min_digits, <= 18).
    reverse_answer: write the sum least-significant digit first.
    eval_fraction: share of (unordered) operand pairs held out for evaluation.
    split_salt: salt of the held-out hash.
    partial_credit: weight of per-digit partial credit for wrong answers.
    format_reward: reward for a wrong but well-formed (digits-only) answer.
  """

  name: ClassVar[str] = "addition"

  min_digits: int = 1
  max_digits: int = 2
  reverse_answer: bool = False
  eval_fraction: float = 0.05
  split_salt: str = base.DEFAULT_SPLIT_SALT
  partial_credit: float = 0.0
  format_reward: float = 0.0

  def __post_init__(self):
    if not isinstance(self.min_digits, int) or self.min_digits < 1:
      raise ValueError(f"addition.min_digits must be an int >= 1, got {self.min_digits!r}")
    if not isinstance(self.max_digits, int) or not self.min_digits <= self.max_digits <= 18:
      raise ValueError(
          f"addition.max_digits must be an int in [min_digits={self.min_digits}, 18],"
          f" got {self.max_digits!r}")
    self._check_split_fields()
    base.check_reward_shaping(self.name, self.partial_credit, self.format_reward)

  @property
  def alphabet(self) -> str:
    return "+0123456789="

  def _operand(self, rng: base.CounterRng) -> int:
    digits = rng.randint(self.min_digits, self.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)

  def make_example(self, a: int, b: int) -> base.Example:
    """Builds the example for ``a + b``."""
    total = str(a + b)
    answer = total[::-1] if self.reverse_answer else total
    return base.Example(prompt=f"{a}+{b}=", answer=answer, meta={"a": a, "b": b, "sum": a + b})

  def _sample(self, rng: base.CounterRng) -> base.Example:
    a = self._operand(rng)
    b = self._operand(rng)
    return self.make_example(a, b)

  def split_key(self, example: base.Example) -> str:
    a, b = example.prompt.rstrip("=").split("+")
    lo, hi = sorted((int(a), int(b)))
    return f"{lo}+{hi}"

  def reward(self, example: base.Example, response: str) -> float:
    pred = response.strip()
    return base.shaped_reward(
        correct=pred == example.answer,
        well_formed=pred.isdigit() and pred.isascii(),
        partial=base.positional_match(pred, example.answer),
        partial_credit=self.partial_credit,
        format_reward=self.format_reward)

