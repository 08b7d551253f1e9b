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

Curriculum difficulty: the digits of the longer operand. Built-in preference pairs
(``pair_kinds``): the correct sum against one with a digit changed (``wrong_digit``),
a carry error of +-1 or +-10 (``carry``), a digit dropped or added (``drop_digit``,
``extra_digit``), or the correct sum padded with zeros (``padded``: the shorter
correct answer is preferred).

References:
  arXiv:2307.03381 (reversed-output arithmetic for small transformers).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

from jaxrl_llm.tasks import base, pairs


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
  pair_kinds: ClassVar[tuple[str, ...]] = ("wrong_digit", "carry", "drop_digit", "extra_digit", "padded")

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

  def _operands(self, example: base.Example) -> tuple[int, int]:
    if "a" in example.meta and "b" in example.meta:
      return int(example.meta["a"]), int(example.meta["b"])
    a, b = example.prompt.rstrip("=").split("+")
    return int(a), int(b)

  def split_key(self, example: base.Example) -> str:
    lo, hi = sorted(self._operands(example))
    return f"{lo}+{hi}"

  def difficulty(self, example: base.Example) -> float:
    """Digits of the longer operand (``"123+4="`` -> 3)."""
    return float(max(len(str(v)) for v in self._operands(example)))

  def _write(self, value: int) -> str:
    """A number in the answer's format (reversed with ``reverse_answer``)."""
    return str(value)[::-1] if self.reverse_answer else str(value)

  def rejected_response(self, example: base.Example, kind: str, rng: base.CounterRng) -> Optional[str]:
    """A wrong (or zero-padded) answer made the way ``kind`` (one of ``pair_kinds``) says."""
    answer, total = example.answer, sum(self._operands(example))
    if kind == "drop_digit" and len(answer) < 2:
      kind = "wrong_digit"
    if kind == "wrong_digit":
      return pairs.change_digit(answer, rng)
    if kind == "carry":
      return self._write(total + rng.choice([d for d in (-10, -1, 1, 10) if total + d >= 0]))
    if kind == "drop_digit":
      i = rng.randint(0, len(answer) - 1)
      return answer[:i] + answer[i + 1:]
    if kind == "extra_digit":
      i = rng.randint(0, len(answer))
      leading = i == (len(answer) if self.reverse_answer else 0)  # no new leading zero
      return answer[:i] + str(rng.randint(1, 9) if leading else rng.randint(0, 9)) + answer[i:]
    if kind == "padded":
      zeros = "0" * rng.randint(1, 2)
      return answer + zeros if self.reverse_answer else zeros + answer
    return super().rejected_response(example, kind, rng)

  def reward(self, example: base.Example, response: str) -> float:
    return base.digits_reward(response, example.answer, partial_credit=self.partial_credit,
                              format_reward=self.format_reward)
