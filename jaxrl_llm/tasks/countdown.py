"""Countdown: combine the given numbers with + - * (and parentheses) to hit a target.

Prompt ``"3,5,8->29:"``; a correct response is any expression such as ``"8*3+5"`` that
uses the given numbers (each exactly once by default) and evaluates to the target. The
verifier parses the expression with a small recursive-descent parser over integers; it
never calls ``eval``, and it bounds the length and nesting of what it reads.

Curriculum difficulty: how many numbers a problem gives (``min_numbers`` < ``num_numbers``
mixes sizes in one stream). Built-in preference pairs: the generating expression
against one with an operator changed (``wrong_operator``: the numbers used right, the
value wrong) or a text corruption (:mod:`jaxrl_llm.tasks.pairs`); the verifier keeps
only pairs whose rejected expression really misses.

References:
  TinyZero's countdown task (Pan et al., 2025); arXiv:2501.12948 (rule-based rewards).
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import ClassVar, NamedTuple, Optional

from jaxrl_llm.tasks import base, pairs

MAX_EXPRESSION_CHARS = 200
MAX_NESTING = 16
_TOKEN_RE = re.compile(r"\s*(?:(\d+)|([-+*()]))")


class Parsed(NamedTuple):
  """A parsed expression: its integer value and the numbers it uses."""

  value: int
  numbers: tuple[int, ...]


class _Parser:
  """expr := term (('+'|'-') term)*; term := factor ('*' factor)*; factor := INT | '(' expr ')'."""

  def __init__(self, text: str):
    self.tokens: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
      match = _TOKEN_RE.match(text, pos)
      if not match:
        raise ValueError(f"unexpected character {text[pos]!r} at {pos}")
      number, op = match.groups()
      if number is not None and len(number) > 1 and number[0] == "0":
        raise ValueError(f"number with a leading zero: {number!r}")
      self.tokens.append(number if number is not None else op)
      pos = match.end()
    self.index = 0
    self.numbers: list[int] = []

  def _peek(self) -> Optional[str]:
    return self.tokens[self.index] if self.index < len(self.tokens) else None

  def _take(self) -> str:
    token = self._peek()
    if token is None:
      raise ValueError("unexpected end of expression")
    self.index += 1
    return token

  def expr(self, depth: int) -> int:
    value = self.term(depth)
    while self._peek() in ("+", "-"):
      value = value + self.term(depth) if self._take() == "+" else value - self.term(depth)
    return value

  def term(self, depth: int) -> int:
    value = self.factor(depth)
    while self._peek() == "*":
      self._take()
      value *= self.factor(depth)
    return value

  def factor(self, depth: int) -> int:
    token = self._take()
    if token == "(":
      if depth >= MAX_NESTING:
        raise ValueError(f"parentheses nested deeper than {MAX_NESTING}")
      value = self.expr(depth + 1)
      if self._take() != ")":
        raise ValueError("missing ')'")
      return value
    if token.isdigit():
      self.numbers.append(int(token))
      return int(token)
    raise ValueError(f"unexpected token {token!r}")


def parse_expression(text: str) -> Optional[Parsed]:
  """Safely evaluates an integer expression over + - * and parentheses.

  Args:
    text: e.g. ``"(8-3)*5"``. Whitespace between tokens is allowed; unary minus,
      division, exponentiation, names and leading zeros are not.

  Returns:
    ``Parsed(value, numbers)`` or None when the text is not such an expression or is
    longer than ``MAX_EXPRESSION_CHARS``.
  """
  text = text.strip()
  if not text or len(text) > MAX_EXPRESSION_CHARS:
    return None
  try:
    parser = _Parser(text)
    value = parser.expr(0)
    if parser._peek() is not None:
      return None
  except ValueError:
    return None
  return Parsed(value, tuple(parser.numbers))


_PRECEDENCE = {"+": 1, "-": 1, "*": 2}


@dataclasses.dataclass(frozen=True)
class CountdownTask(base.GeneratedTask):
  """Reach ``target`` from ``num_numbers`` numbers in ``[min_number, max_number]``.

  Problems are generated backwards: a random expression tree over the drawn numbers
  gives the target (kept when ``1 <= target <= max_target``), so every problem is
  solvable and the generating expression is the SFT target.

  Reward: 1 if the response parses, uses the numbers correctly (each exactly once with
  ``use_all_numbers``, else each at most once) and equals the target; otherwise
  ``format_reward`` if it parses and uses the numbers correctly; else 0.

  Attributes:
    num_numbers: how many numbers the prompt gives (>= 2); the most when ``min_numbers`` is set.
    min_numbers: fewest numbers a prompt gives, drawn uniformly up to ``num_numbers``
      (0: always ``num_numbers``).
    min_number: smallest number (>= 1).
    max_number: largest number.
    max_target: largest target.
    use_all_numbers: require every number exactly once.
    eval_fraction: share of (number multiset, target) problems held out.
    split_salt: salt of the held-out hash.
    format_reward: reward for a valid expression with the wrong value.
  """

  name: ClassVar[str] = "countdown"
  pair_kinds: ClassVar[tuple[str, ...]] = ("wrong_operator",) + pairs.TEXT_PAIR_KINDS

  num_numbers: int = 3
  min_numbers: int = 0
  min_number: int = 1
  max_number: int = 20
  max_target: int = 100
  use_all_numbers: bool = True
  eval_fraction: float = 0.05
  split_salt: str = base.DEFAULT_SPLIT_SALT
  format_reward: float = 0.0

  _MAX_TREE_ATTEMPTS: ClassVar[int] = 1000

  def __post_init__(self):
    if not isinstance(self.num_numbers, int) or self.num_numbers < 2:
      raise ValueError(f"countdown.num_numbers must be an int >= 2, got {self.num_numbers!r}")
    min_ok = self.min_numbers == 0 or 2 <= self.min_numbers <= self.num_numbers
    if not isinstance(self.min_numbers, int) or not min_ok:
      raise ValueError(f"countdown.min_numbers must be 0 or an int in [2, num_numbers={self.num_numbers}],"
                       f" got {self.min_numbers!r}")
    if not isinstance(self.min_number, int) or self.min_number < 1:
      raise ValueError(f"countdown.min_number must be an int >= 1, got {self.min_number!r}")
    if not isinstance(self.max_number, int) or self.max_number < self.min_number:
      raise ValueError(
          f"countdown.max_number must be an int >= min_number={self.min_number},"
          f" got {self.max_number!r}")
    if not isinstance(self.max_target, int) or self.max_target < 1:
      raise ValueError(f"countdown.max_target must be an int >= 1, got {self.max_target!r}")
    self._check_split_fields()
    base.check_reward_shaping(self.name, 0.0, self.format_reward)

  @property
  def alphabet(self) -> str:
    return base.alphabet_of(["0123456789", ",->:", "+-*()"])

  @staticmethod
  def _combine(left: tuple[int, str, int], op: str,
               right: tuple[int, str, int]) -> tuple[int, str, int]:
    """Joins (value, text, precedence) nodes, adding only the parentheses needed."""
    prec = _PRECEDENCE[op]
    l_text = f"({left[1]})" if left[2] < prec else left[1]
    needs_right = right[2] < prec or (op == "-" and right[2] == prec)
    r_text = f"({right[1]})" if needs_right else right[1]
    value = {"+": left[0] + right[0], "-": left[0] - right[0], "*": left[0] * right[0]}[op]
    return value, f"{l_text}{op}{r_text}", prec

  def _sample(self, rng: base.CounterRng) -> base.Example:
    for _ in range(self._MAX_TREE_ATTEMPTS):
      count = self.num_numbers
      if self.min_numbers and self.min_numbers < count:
        count = rng.randint(self.min_numbers, count)
      numbers = [rng.randint(self.min_number, self.max_number) for _ in range(count)]
      nodes = [(n, str(n), 3) for n in numbers]
      while len(nodes) > 1:
        left = nodes.pop(rng.randint(0, len(nodes) - 1))
        right = nodes.pop(rng.randint(0, len(nodes) - 1))
        nodes.append(self._combine(left, rng.choice("+-*"), right))
      target, expression, _ = nodes[0]
      if 1 <= target <= self.max_target:
        return self.make_example(numbers, target, expression)
    raise RuntimeError(
        f"countdown: no target in [1, {self.max_target}] after {self._MAX_TREE_ATTEMPTS}"
        " draws; raise max_target or lower max_number")

  def make_example(self, numbers: list[int], target: int, expression: str) -> base.Example:
    """Builds the example with a known solution ``expression``."""
    prompt = ",".join(map(str, numbers)) + f"->{target}:"
    return base.Example(prompt=prompt, answer=expression,
                        meta={"numbers": tuple(numbers), "target": target})

  def _problem(self, example: base.Example) -> tuple[list[int], int]:
    head, target = example.prompt.rstrip(":").split("->")
    return [int(n) for n in head.split(",")], int(target)

  def split_key(self, example: base.Example) -> str:
    numbers, target = self._problem(example)
    return ",".join(map(str, sorted(numbers))) + f"->{target}"

  def difficulty(self, example: base.Example) -> float:
    """How many numbers the problem gives (``"3,5,8->29:"`` -> 3)."""
    return float(len(self._problem(example)[0]))

  def rejected_response(self, example: base.Example, kind: str, rng: base.CounterRng) -> Optional[str]:
    """``wrong_operator``: one operator of the gold expression replaced by another; else a text kind."""
    if kind != "wrong_operator":
      return super().rejected_response(example, kind, rng)
    text = self.sft_target(example)
    positions = [i for i, ch in enumerate(text) if ch in _PRECEDENCE]
    if not positions:
      return None
    i = rng.choice(positions)
    return text[:i] + rng.choice([op for op in _PRECEDENCE if op != text[i]]) + text[i + 1:]

  def reward(self, example: base.Example, response: str) -> float:
    parsed = parse_expression(response)
    if parsed is None:
      return 0.0
    numbers, target = self._problem(example)
    given, used = Counter(numbers), Counter(parsed.numbers)
    numbers_ok = used == given if self.use_all_numbers else not used - given
    return base.shaped_reward(
        correct=numbers_ok and parsed.value == target, well_formed=numbers_ok, partial=0.0,
        partial_credit=0.0, format_reward=self.format_reward)
