"""The tool-call format: Hermes / Qwen ``<tool_call>`` JSON blocks and ``<tool_response>`` replies.

A model turn asks for a tool by writing, anywhere in its text, one block per call::

  <tool_call>
  {"name": "calc", "arguments": {"expr": "12*34"}}
  </tool_call>

and the environment answers each call with a block appended after the turn::

  <tool_response>
  408
  </tool_response>

This is the format of NousResearch's Hermes function calling (Hermes 2 Pro and later;
github.com/NousResearch/Hermes-Function-Calling) that Qwen2.5 adopted (Qwen docs,
"Function Calling", qwen.readthedocs.io/en/latest/framework/function_call.html): the Qwen2.5
chat template lists the tools' JSON schemas in the system prompt, tells the model to return
calls inside ``<tool_call></tool_call>`` tags, and renders a ``role="tool"`` message as a
``<tool_response>`` block inside a user turn. The Qwen2.5 tokenizer has ``<tool_call>`` and
``</tool_call>`` as single added tokens (ids 151657 / 151658, not marked special, so decoding
with ``skip_special_tokens=True`` keeps them); ``</tool_call>`` is therefore a natural stop
string for a tool turn. The interleaving of reasoning, action and observation is ReAct (Yao
et al., arXiv:2210.03629); learning when to call a tool from the outcome is in the spirit of
Toolformer (Schick et al., arXiv:2302.04761).

Parsing (:func:`parse_tool_calls`) never raises. Each well-formed block becomes a
:class:`ToolCall`; each malformed one becomes an error string with a short reason, which the
environment returns to the model as that call's response:

* the body is not valid JSON, or not a JSON object;
* ``"name"`` is missing or not a non-empty string;
* ``"arguments"`` is not an object (a JSON *string* holding an object, as OpenAI-style
  clients write it, is accepted; ``"parameters"``, Llama 3's key, is read when
  ``"arguments"`` is absent; neither: no arguments);
* ``<tool_call>`` without a closing ``</tool_call>`` (before the end or the next opening tag);
* ``</tool_call>`` without an opening tag.

``ParsedTurn.content`` is the text outside the blocks (what the model said besides calling).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
_SHOWN = 60  # characters of a bad block quoted in its error


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: the tool's name and its keyword arguments."""

  name: str
  arguments: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """What a model turn holds.

  Attributes:
    calls: the well-formed calls, in the order written.
    errors: one short reason per malformed block (``"tool call 2: invalid JSON: ..."``).
    content: the text outside the ``<tool_call>`` blocks.
  """

  calls: list[ToolCall]
  errors: list[str]
  content: str

  @property
  def has_tool_calls(self) -> bool:
    """True when the turn tried to call a tool (a well-formed or malformed block)."""
    return bool(self.calls or self.errors)


def _short(text: str) -> str:
  text = text.strip()
  return repr(text if len(text) <= _SHOWN else text[:_SHOWN] + "...")


def _parse_block(body: str, index: int) -> ToolCall | str:
  """A ToolCall, or the error string of block number ``index`` (1-based)."""
  where = f"tool call {index}"
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    return f"{where}: invalid JSON ({e.msg} at char {e.pos}) in {_short(body)}"
  except RecursionError:
    return f"{where}: invalid JSON (nested too deeply)"
  if not isinstance(obj, dict):
    return f"{where}: expected a JSON object {{\"name\": ..., \"arguments\": {{...}}}}, got {type(obj).__name__}"
  name = obj.get("name")
  if not isinstance(name, str) or not name.strip():
    return f"{where}: missing \"name\" (a non-empty string)" if name is None else (
        f"{where}: \"name\" must be a non-empty string, got {name!r}")
  arguments = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
  if isinstance(arguments, str):
    try:
      arguments = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
      return f"{where}: \"arguments\" must be a JSON object, got the string {_short(arguments)}"
  if arguments is None:
    arguments = {}
  if not isinstance(arguments, dict):
    return f"{where}: \"arguments\" must be a JSON object, got {type(arguments).__name__}"
  return ToolCall(name.strip(), arguments)


def parse_tool_calls(text: str) -> ParsedTurn:
  """Splits a model turn into tool calls, per-block errors and the remaining content.

  Never raises (a non-string ``text`` is one error). See the module docstring for the
  format and the errors.
  """
  if not isinstance(text, str):
    return ParsedTurn([], [f"expected the turn's text, got {type(text).__name__}"], "")
  calls: list[ToolCall] = []
  errors: list[str] = []
  content: list[str] = []

  def outside(segment: str) -> None:
    if TOOL_CALL_CLOSE in segment:
      errors.append(f"{TOOL_CALL_CLOSE} without an opening {TOOL_CALL_OPEN}")
      segment = segment.replace(TOOL_CALL_CLOSE, "")
    content.append(segment)

  pos, index = 0, 0
  while True:
    start = text.find(TOOL_CALL_OPEN, pos)
    if start < 0:
      outside(text[pos:])
      break
    outside(text[pos:start])
    index += 1
    body_start = start + len(TOOL_CALL_OPEN)
    end = text.find(TOOL_CALL_CLOSE, body_start)
    following = text.find(TOOL_CALL_OPEN, body_start)
    if end < 0 or 0 <= following < end:
      errors.append(f"tool call {index}: unclosed {TOOL_CALL_OPEN} (no {TOOL_CALL_CLOSE} after "
                    f"{_short(text[body_start:following if following >= 0 else len(text)])})")
      if following < 0:
        break
      pos = following
      continue
    parsed = _parse_block(text[body_start:end], index)
    (calls if isinstance(parsed, ToolCall) else errors).append(parsed)
    pos = end + len(TOOL_CALL_CLOSE)
  return ParsedTurn(calls, errors, "".join(content))


def format_tool_response(result: str) -> str:
  """``<tool_response>\\n{result}\\n</tool_response>``, as the Qwen2.5 template renders a tool message."""
  return f"{TOOL_RESPONSE_OPEN}\n{result}\n{TOOL_RESPONSE_CLOSE}"


def format_tool_call(call: ToolCall) -> str:
  """The text of a call in this format (for SFT targets and tests)."""
  payload = json.dumps({"name": call.name, "arguments": dict(call.arguments)}, ensure_ascii=False)
  return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


__all__ = ["ParsedTurn", "TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "TOOL_RESPONSE_CLOSE", "TOOL_RESPONSE_OPEN",
           "ToolCall", "format_tool_call", "format_tool_response", "parse_tool_calls"]
