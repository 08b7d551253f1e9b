"""Multi-digit multiplication with a calculator tool: a task the tiny model can only solve with the tool.

Prompt ``"482*37="``, answer ``"17834"``. A decoder of about 1M parameters
cannot multiply three-digit numbers in its head, but it can learn to ask the
calculator (:mod:`jaxrl_llm.envs.tools`) and copy its answer::

  model   <tool_call>{"name":"calc","arguments":{"expr":"482*37"}}</tool_call>
  tool    <tool_response>\n17834\n</tool_response>
  model   17834<eos>

It is played by the built-in ``"tools"`` environment
(:class:`~jaxrl_llm.envs.tool_env.ToolEnvironment`) with the calculator
registered as ``calc`` (``configs/tool_multiply.py``). The reward scores the
final answer only, exactly like the addition task (1 for the exact product;
``partial_credit`` for digits in the right place): whether and how to call the
tool is left to RL. :meth:`sft_segments` gives the demonstration above with
the tool's answer marked as context, so the warm start never learns to write
tool responses itself.

The tokenizer's alphabet is printable ASCII and the newline (tool errors are English text the
model must be able to read) and the four tool tags are single special tokens
(``special_tokens``), as they are in Qwen2.5's vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

from jaxrl_llm.tasks.tool_calls import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                                       format_tool_response)
from jaxrl_llm.tasks import base

__all__ = ["ToolMultiplyTask"]

PRINTABLE = "\n" + "".join(chr(c) for c in range(32, 127))


@dataclasses.dataclass(frozen=True)
class ToolMultiplyTask(base.GeneratedTask):
  """``a*b=`` with operands of ``min_digits..max_digits`` digits, answered with a calculator.

  Attributes:
    min_digits: fewest digits per operand (>= 1).
    max_digits: most digits per operand (>= min_digits, <= 9).
    tool_demo_fraction: share of the warm start's demonstrations that use the tool; the others
      answer directly (a gold answer the model cannot compute), so the warm-started policy
      calls the tool on only some problems and RL has to learn when calling pays (which
      demonstration a problem gets is a hash of its prompt).
    tool_name: the calculator's name in the demonstrations (``make_registry`` alias).
    argument: the calculator's argument name in the demonstrations.
    eval_fraction: share of (unordered) operand pairs held out.
    split_salt: salt of the held-out hash.
    partial_credit: weight of per-digit partial credit for wrong answers.
    format_reward: reward for a wrong but well-formed (digits-only) answer.
  """

  name: ClassVar[str] = "tool_multiply"
  special_tokens: ClassVar[tuple[str, ...]] = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN,
                                               TOOL_RESPONSE_CLOSE)

  min_digits: int = 2
  max_digits: int = 3
  tool_demo_fraction: float = 1.0
  tool_name: str = "calc"
  argument: str = "expr"
  eval_fraction: float = 0.05
  split_salt: str = base.DEFAULT_SPLIT_SALT
  partial_credit: float = 0.0
  format_reward: float = 0.0

  def __post_init__(self):
    if not isinstance(self.min_digits, int) or self.min_digits < 1:
      raise ValueError(f"tool_multiply.min_digits must be an int >= 1, got {self.min_digits!r}")
    if not isinstance(self.max_digits, int) or not self.min_digits <= self.max_digits <= 9:
      raise ValueError(f"tool_multiply.max_digits must be an int in [min_digits={self.min_digits}, 9], "
                       f"got {self.max_digits!r}")
    if not 0.0 <= self.tool_demo_fraction <= 1.0:
      raise ValueError(f"tool_multiply.tool_demo_fraction must be in [0, 1], got {self.tool_demo_fraction!r}")
    self._check_split_fields()
    base.check_reward_shaping(self.name, self.partial_credit, self.format_reward)

  @property
  def alphabet(self) -> str:
    return PRINTABLE

  def _sample(self, rng: base.CounterRng) -> base.Example:
    a, b = (rng.randint(10 ** (d - 1) if d > 1 else 0, 10**d - 1)
            for d in (rng.randint(self.min_digits, self.max_digits) for _ in range(2)))
    return base.Example(prompt=f"{a}*{b}=", answer=str(a * b), meta={"a": a, "b": b})

  def _operands(self, example: base.Example) -> tuple[int, int]:
    a, b = example.prompt.rstrip("=").split("*")
    return int(a), int(b)

  def split_key(self, example: base.Example) -> str:
    lo, hi = sorted(self._operands(example))
    return f"{lo}*{hi}"

  def difficulty(self, example: base.Example) -> float:
    return float(sum(len(str(v)) for v in self._operands(example)))

  def tool_call(self, example: base.Example) -> str:
    """The demonstration's call: ``<tool_call>{"name":"calc","arguments":{"expr":"a*b"}}</tool_call>``."""
    body = {"name": self.tool_name, "arguments": {self.argument: example.prompt.rstrip("=")}}
    return TOOL_CALL_OPEN + json.dumps(body, separators=(",", ":")) + TOOL_CALL_CLOSE

  def uses_tool_in_demonstration(self, example: base.Example) -> bool:
    """Whether the warm start's demonstration of ``example`` calls the tool (``tool_demo_fraction``)."""
    return base.split_fraction(example.prompt, "tool_multiply-demo") < self.tool_demo_fraction

  def sft_segments(self, example: base.Example) -> list[tuple[str, bool]]:
    """Call (trained), the calculator's answer (context), the final answer (trained); or, for the
    demonstrations without the tool, the answer alone."""
    if not self.uses_tool_in_demonstration(example):
      return [(example.answer, True)]
    return [(self.tool_call(example), True), (format_tool_response(example.answer), False), (example.answer, True)]

  def sft_target(self, example: base.Example) -> str:
    return "".join(text for text, _ in self.sft_segments(example))

  def reward(self, example: base.Example, response: str) -> float:
    return base.digits_reward(response, example.answer, partial_credit=self.partial_credit,
                              format_reward=self.format_reward)
