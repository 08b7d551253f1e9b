"""Rendering Hugging Face chat templates (jinja2) the way transformers does.

The environment mirrors transformers' ``_compile_jinja_template``: a sandboxed,
immutable jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension (``{% break %}``, ``{% continue %}``), the
``{% generation %}...{% endgeneration %}`` block tag (rendered as its body),
and the helpers templates use:

  raise_exception(message)   raises :class:`ChatTemplateError`
  strftime_now(format)       current local time formatted (Llama 3.1 dates)
  x | tojson(indent=None, ensure_ascii=False, separators=None, sort_keys=False)

Variables passed to the template: ``messages``, ``add_generation_prompt``,
``tools`` and ``documents`` (None unless given), the special-token strings
(``bos_token``, ``eos_token``, ``pad_token``, ``unk_token``), and any extra
keyword (e.g. ``enable_thinking=False`` for Qwen3).
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any, Mapping, Optional, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
  """Raised by a template's ``raise_exception`` or on a template syntax error."""


class _GenerationBlock(Extension):
  """``{% generation %}body{% endgeneration %}`` renders ``body`` (HF marks assistant spans)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
  raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value: Any, indent: Optional[int] = None, ensure_ascii: bool = False,
            separators: Optional[Sequence[str]] = None, sort_keys: bool = False) -> str:
  return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                    separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
  """Compiles (and caches) a chat template."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(source)
  except jinja2.TemplateSyntaxError as e:
    raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True,
                         special_tokens: Optional[Mapping[str, Optional[str]]] = None,
                         tools: Optional[Sequence[Any]] = None, documents: Optional[Sequence[Any]] = None,
                         **kwargs: Any) -> str:
  """Renders ``messages`` with a chat template.

  Args:
    source: the jinja2 template text.
    messages: list of {"role": ..., "content": ...} dicts.
    add_generation_prompt: append the assistant-turn header.
    special_tokens: e.g. {"bos_token": "<s>", "eos_token": "</s>"}.
    tools: tool schemas for templates that support them.
    documents: retrieval documents for templates that support them.
    **kwargs: extra template variables.

  Returns:
    The rendered prompt text.
  """
  if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
    raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
  for i, message in enumerate(messages):
    if not isinstance(message, Mapping) or "role" not in message:
      raise ValueError(f"messages[{i}] must be a dict with a 'role' (and usually 'content'), got {message!r}")
  variables = dict(special_tokens or {})
  variables.update(kwargs)
  return compile_template(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=documents, **variables)
