"""A tool-using environment: the model calls tools until it answers, and the answer is scored.

Each model turn is parsed for ``<tool_call>`` blocks (:mod:`jaxrl_llm.tasks.tool_calls`, the
Hermes / Qwen2.5 format):

* a turn with at least one block (well-formed or not) is a *tool turn*: the calls run through
  the :class:`~jaxrl_llm.envs.tools.ToolRegistry` (at most ``max_calls_per_turn``; extra ones
  get one error note), and the observation is their ``<tool_response>`` blocks, joined by
  newlines: each call's result or error text, then one per malformed block (its parse error),
  then the note. ``done`` is False and the reward 0.
* a turn without any is the *answer turn*: ``done`` is True and the reward is
  ``task.reward(example, final_answer(text))``; ``final_answer`` defaults to :func:`answer_of`
  (trailing end-of-turn special-token text such as ``<|im_end|>``, ``<eos>``, ``</s>`` and
  whitespace removed, as the single-turn path's ``skip_special_tokens=True`` decode does).

``info`` of every step: ``tool_calls`` (the calls the model wrote: run, malformed or beyond
``max_calls_per_turn``), ``tool_errors`` (those that failed, were malformed or were not run), ``tool_seconds`` (time in tools); the answer
turn adds ``answer`` (the scored text, so a driver may score it with its own guarded reward
runner instead). Registered as the built-in environment ``"tools"``. The loop is ReAct's
(Yao et al., arXiv:2210.03629); rewarding the final answer only lets RL learn when a call
helps, the question Toolformer (Schick et al., arXiv:2302.04761) answered with self-supervision.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from jaxrl_llm.envs.base import StepResult, register_environment, resolve_callable
from jaxrl_llm.tasks.tool_calls import format_tool_response, parse_tool_calls
from jaxrl_llm.envs.tools import ToolRegistry

# End-of-turn / end-of-text special tokens a turn may end with: <|...|> (Qwen, Llama 3, GPT),
# and the SentencePiece / Gemma / char-level ones. Task tags such as </answer> are kept.
_TRAILING_SPECIAL = re.compile(r"(?:<\|[^<>|\s]{1,40}\|>|</s>|<eos>|<end_of_turn>|<pad>)\s*$")


def answer_of(text: str) -> str:
  """The answer of a final turn: ``text`` without trailing special-token text, stripped."""
  text = text.strip()
  while True:
    shorter = _TRAILING_SPECIAL.sub("", text).strip()
    if shorter == text:
      return text
    text = shorter


class ToolEnvironment:
  """One episode of tool calls ending in a scored answer (see the module docstring).

  Args:
    task: the task whose ``reward(example, answer)`` scores the episode.
    tools: the tools the model may call.
    max_calls_per_turn: calls run per turn (>= 1); later ones in the turn are not run.
    final_answer: ``fn(turn_text) -> answer`` (a callable or an import path
      ``"pkg.mod:fn"``), default :func:`answer_of`.
  """

  def __init__(self, task: Any, tools: ToolRegistry, *, max_calls_per_turn: int = 1,
               final_answer: Optional[Callable[[str], str] | str] = None):
    if isinstance(max_calls_per_turn, bool) or not isinstance(max_calls_per_turn, int) or max_calls_per_turn < 1:
      raise ValueError(f"ToolEnvironment.max_calls_per_turn must be an int >= 1, got {max_calls_per_turn!r}")
    if isinstance(final_answer, str):
      final_answer = resolve_callable(final_answer, f"ToolEnvironment.final_answer={final_answer!r}",
                                      "a function fn(turn_text) -> answer text")
    if final_answer is not None and not callable(final_answer):
      raise ValueError(f"ToolEnvironment.final_answer must be callable, got {type(final_answer).__name__}")
    self.task, self.tools, self.max_calls_per_turn = task, tools, max_calls_per_turn
    self.final_answer = final_answer or answer_of
    self.example: Any = None
    self.done = False

  def reset(self, example: Any) -> str:
    """Starts an episode on ``example``; returns ``example.prompt``."""
    self.example, self.done = example, False
    return example.prompt

  def step(self, text: str) -> StepResult:
    """Runs the turn's tool calls, or scores its answer when it has none."""
    if self.example is None or self.done:
      raise RuntimeError("ToolEnvironment.step: call reset(example) first" if self.example is None else
                         "ToolEnvironment.step: the episode is over (the last turn answered)")
    parsed = parse_tool_calls(text)
    if not parsed.has_tool_calls:
      self.done = True
      answer = self.final_answer(text)
      reward = float(self.task.reward(self.example, answer))
      return StepResult("", reward, True, {"tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0,
                                           "answer": answer})
    responses, errors, seconds = [], 0, 0.0
    run = parsed.calls[:self.max_calls_per_turn]
    for call in run:
      outcome = self.tools.call(call)
      responses.append(outcome.text)
      errors += outcome.error is not None
      seconds += outcome.seconds
    responses += [f"error: {e}" for e in parsed.errors]
    errors += len(parsed.errors)
    extra = len(parsed.calls) - len(run)
    if extra > 0:
      responses.append(f"error: at most {self.max_calls_per_turn} tool call(s) per turn; the other {extra} "
                       "were not run")
      errors += extra
    observation = "\n".join(format_tool_response(r) for r in responses)
    attempts = len(parsed.calls) + len(parsed.errors)  # every call the model wrote, well formed or not
    return StepResult(observation, 0.0, False, {"tool_calls": attempts, "tool_errors": errors,
                                                "tool_seconds": seconds})


register_environment("tools", ToolEnvironment, replace=True)

__all__ = ["ToolEnvironment", "answer_of"]
