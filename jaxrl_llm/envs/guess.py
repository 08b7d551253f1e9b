"""A tool-free multi-turn environment: guess the task's answer from "higher" / "lower" hints.

The smallest complete example of the :class:`~jaxrl_llm.envs.base.Environment`
protocol (docs/agents.md, "Writing an environment"), registered as ``"guess"``::

  prompt   7*8=
  model    50              observation  "\nhigher\n"
  model    60              observation  "\nlower\n"
  model    56              done, reward 1

The secret is the example's numeric answer (any task whose answers are integers:
``tool_multiply``, ``addition`` without reversed answers, ...). Each turn's text is
read as an integer; a turn that is not one gets ``"\nnot a number\n"``. The reward
is 1 for the right number (``done``), else 0 on every step; an episode that runs out
of turns ends with ``turn_limit`` and reward 0.
"""

from __future__ import annotations

from typing import Any

from jaxrl_llm.envs.base import StepResult, register_environment
from jaxrl_llm.envs.tool_env import answer_of

__all__ = ["GuessEnvironment"]


class GuessEnvironment:
  """Hints towards the example's integer answer (see the module docstring).

  Args:
    task: the run's task (unused: the secret is ``example.answer``).
    tools: the tool registry (unused).
  """

  def __init__(self, task: Any = None, tools: Any = None):
    del task, tools
    self.secret: int | None = None

  def reset(self, example: Any) -> str:
    try:
      self.secret = int(str(example.answer).strip())
    except ValueError:
      raise ValueError(f"guess: the example's answer {example.answer!r} is not an integer") from None
    return example.prompt

  def step(self, text: str) -> StepResult:
    if self.secret is None:
      raise RuntimeError("GuessEnvironment.step: call reset(example) first")
    answer = answer_of(text)
    try:
      guess = int(answer)
    except ValueError:
      return StepResult("\nnot a number\n")
    if guess == self.secret:
      return StepResult("", reward=1.0, done=True)
    return StepResult("\nhigher\n" if guess < self.secret else "\nlower\n")


register_environment("guess", GuessEnvironment, replace=True)
