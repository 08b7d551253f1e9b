"""How an observation's text becomes the text appended after a model turn (chat-template aware).

Two kinds:

* ``plain``: the observation is appended as it is (the tool environment already wraps tool
  results in ``<tool_response>`` blocks); for char-level and base models.
* ``chat``: the text a chat template would write between the model's turn and its next turn,
  learned once from the tokenizer's template. :meth:`ObservationFormat.from_tokenizer`
  renders ``[user "Q", assistant A, tool O]`` (sentinel strings for Q, A, O) with
  ``add_generation_prompt=True`` and splits it at the sentinels into

    - ``close``: what the template writes after an assistant turn's content (ChatML /
      Qwen: ``<|im_end|>\\n``; read from ``[user, assistant]`` rendered without a
      generation prompt),
    - ``prefix``: from there to the observation (Qwen2.5: ``<|im_start|>user\\n``),
    - ``suffix``: after the observation, through the next assistant header (Qwen2.5:
      ``<|im_end|>\\n<|im_start|>assistant\\n``).

  When the template itself wraps a tool message in ``<tool_response>\\n...\\n</tool_response>``
  (Qwen2.5, Qwen3, Hermes), those tags are taken out of ``prefix`` / ``suffix``
  (``template_wraps_responses``) since the environment's observation carries them: one tool
  response then gives exactly the template's text. A template without a ``tool`` role (it
  raises, or drops the message) is read with role ``user`` instead; ``role`` says which, and
  ``fallback`` why.

:meth:`ObservationFormat.wrap` returns what to append: the part of ``close`` that the turn
did not already write (a turn that stopped on EOS, e.g. ``<|im_end|>``, ends with it, so
only ``\\n`` remains), then ``prefix + observation + suffix``. The driver encodes it without
special-token insertion and masks it out of the loss (the model did not write it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from jaxrl_llm.tasks.tool_calls import TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN

KINDS = ("plain", "chat")
SENTINEL_USER = "JAXRLSENTINELUSER"
SENTINEL_ASSISTANT = "JAXRLSENTINELASSISTANT"
SENTINEL_OBSERVATION = "JAXRLSENTINELOBSERVATION"


@dataclasses.dataclass(frozen=True)
class ObservationFormat:
  """What goes around an observation appended after a model turn (see the module docstring).

  Attributes:
    kind: ``"plain"`` or ``"chat"``.
    close: the template's end of an assistant turn (chat).
    prefix / suffix: around the observation; ``suffix`` ends with the next assistant header.
    eos_token: the tokenizer's EOS text (a turn ending with it has written that much of ``close``).
    role: the message role the observation was rendered as (``"tool"`` or ``"user"``; chat).
    fallback: why ``role`` is ``"user"`` (the template has no tool role), else None.
    template_wraps_responses: the template writes ``<tool_response>`` tags itself (taken out).
  """

  kind: str = "plain"
  close: str = ""
  prefix: str = ""
  suffix: str = ""
  eos_token: Optional[str] = None
  role: Optional[str] = None
  fallback: Optional[str] = None
  template_wraps_responses: bool = False

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"ObservationFormat.kind={self.kind!r}: expected one of {KINDS}")

  @classmethod
  def plain(cls) -> "ObservationFormat":
    return cls("plain")

  @classmethod
  def build(cls, kind: str, tokenizer: Any = None) -> "ObservationFormat":
    """``plain``, or ``chat`` learned from ``tokenizer`` (required for ``chat``)."""
    if kind == "chat":
      if tokenizer is None:
        raise ValueError("ObservationFormat 'chat' needs a tokenizer with a chat template")
      return cls.from_tokenizer(tokenizer)
    return cls(kind)

  @classmethod
  def from_tokenizer(cls, tokenizer: Any) -> "ObservationFormat":
    """The ``chat`` format of ``tokenizer.apply_chat_template`` (see the module docstring).

    Raises:
      ValueError: the tokenizer has no chat template, or the template renders neither a
        tool nor a user message after an assistant turn with their contents intact.
    """
    source = getattr(tokenizer, "source", type(tokenizer).__name__)
    if getattr(tokenizer, "chat_template", None) is None:
      raise ValueError(f"{source}: no chat template, so the 'chat' observation format cannot be learned; "
                       "use 'plain'")
    user = {"role": "user", "content": SENTINEL_USER}
    assistant = {"role": "assistant", "content": SENTINEL_ASSISTANT}
    role, fallback, text = "tool", None, None
    try:
      text = tokenizer.apply_chat_template([user, assistant, {"role": "tool", "content": SENTINEL_OBSERVATION}],
                                           add_generation_prompt=True)
      if SENTINEL_OBSERVATION not in text:
        fallback = "the chat template drops messages of role 'tool'"
    except Exception as e:  # pylint: disable=broad-except
      fallback = f"the chat template raised on a message of role 'tool' ({type(e).__name__}: {e})"
    if fallback is not None:
      role = "user"
      text = tokenizer.apply_chat_template([user, assistant, {"role": "user", "content": SENTINEL_OBSERVATION}],
                                           add_generation_prompt=True)
    a_at, o_at = text.find(SENTINEL_ASSISTANT), text.find(SENTINEL_OBSERVATION)
    if a_at < 0 or o_at < a_at:
      raise ValueError(f"{source}: the chat template does not render an assistant turn followed by a {role} "
                       f"message with their contents intact; use the 'plain' observation format")
    between = text[a_at + len(SENTINEL_ASSISTANT):o_at]
    suffix = text[o_at + len(SENTINEL_OBSERVATION):]
    closed = tokenizer.apply_chat_template([user, assistant], add_generation_prompt=False)
    after = closed[closed.find(SENTINEL_ASSISTANT) + len(SENTINEL_ASSISTANT):]
    close = os.path.commonprefix([after, between])
    prefix = between[len(close):]
    wraps = False
    for open_tag, close_tag in ((TOOL_RESPONSE_OPEN + "\n", "\n" + TOOL_RESPONSE_CLOSE),
                                (TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)):
      if prefix.endswith(open_tag) and suffix.startswith(close_tag):
        prefix, suffix, wraps = prefix[:-len(open_tag)], suffix[len(close_tag):], True
        break
    return cls("chat", close=close, prefix=prefix, suffix=suffix, eos_token=getattr(tokenizer, "eos_token", None),
               role=role, fallback=fallback, template_wraps_responses=wraps)

  def closing(self, turn_text: str) -> str:
    """The part of ``close`` that ``turn_text`` has not written yet."""
    if not self.close or turn_text.endswith(self.close):
      return ""
    eos = self.eos_token
    if eos and self.close.startswith(eos) and turn_text.endswith(eos):
      return self.close[len(eos):]
    return self.close

  def wrap(self, observation: str, turn_text: str) -> str:
    """The text to append after the model turn ``turn_text`` (decoded, special tokens kept)."""
    if self.kind == "plain":
      return observation
    return self.closing(turn_text) + self.prefix + observation + self.suffix


__all__ = ["KINDS", "ObservationFormat", "SENTINEL_ASSISTANT", "SENTINEL_OBSERVATION", "SENTINEL_USER"]
