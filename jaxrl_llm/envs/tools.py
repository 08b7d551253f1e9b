"""Tools a model calls in a multi-turn episode, and the registry that runs them safely.

A :class:`Tool` is a name, a description, a JSON-schema ``parameters`` object and
``fn(**arguments) -> str``. :meth:`ToolRegistry.call` never raises: an unknown tool, wrong
arguments, an exception, a non-string result each become a :class:`ToolOutcome` with
``error`` set and ``text`` (what the model sees) ``"error: ..."``, e.g. ``error: unknown tool
'foo' (available: calc, python)``; a tool raises :class:`ToolError` to report a failure to the
model. :meth:`ToolRegistry.schemas` is the ``tools=`` list of chat templates (Qwen2.5, Hermes).

Built-in tools (:func:`make_registry` names):

* ``calculator`` (:func:`calculate`, argument ``expression`` or ``expr``): ``+ - * / // % **``,
  unary minus, parentheses on int and float literals, walked on the ``ast`` (no names, calls or
  attributes, nothing ``eval``-ed), exponents and integer sizes bounded, integers printed exactly.
* ``python`` (:func:`python_tool`): runs ``code`` in ``jaxrl_llm.tasks.sandbox.Sandbox`` or an
  injected runner; without a sandbox the call is an error saying why, never an unsandboxed run.

Any other name is an import path ``"pkg.mod:fn"`` (:func:`function_tool`). Tool use learned
from outcomes: Toolformer (Schick et al., arXiv:2302.04761), ReAct (Yao et al., arXiv:2210.03629).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import math
import operator
import time
from typing import Any, Callable, Mapping, Optional, Sequence

from jaxrl_llm.tasks.tool_calls import ToolCall
from jaxrl_llm.errors import ConfigError

# Calculator bounds, and the characters of a tool's text the model sees (the rest is clipped).
MAX_EXPRESSION_CHARS, MAX_EXPONENT, MAX_INT_BITS, MAX_OUTPUT_CHARS = 500, 1000, 4096, 2000


class ToolError(Exception):
  """A failure a tool reports to the model: the outcome's text is ``"error: " + message``."""


@dataclasses.dataclass(frozen=True)
class ToolOutcome:
  """The result of one call: ``text`` for the model, ``error`` (None on success), wall seconds."""

  text: str
  error: Optional[str] = None
  seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Tool:
  """A callable tool: ``name``, ``description``, JSON-schema ``parameters`` and ``fn(**arguments) -> str``."""

  name: str
  description: str
  parameters: Mapping[str, Any]
  fn: Callable[..., Any]

  def __post_init__(self):
    if not isinstance(self.name, str) or not self.name.isidentifier() or not callable(self.fn):
      raise ValueError(f"tool {self.name!r}: expected an identifier name and a callable fn, got {self.fn!r}")

  def __call__(self, **arguments: Any) -> Any:
    return self.fn(**arguments)

  def schema(self) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


class ToolRegistry:
  """Tools by name; :meth:`call` runs one call and never raises."""

  def __init__(self, tools: Sequence[Tool] = (), *, max_output_chars: int = MAX_OUTPUT_CHARS):
    self._tools: dict[str, Tool] = {}
    self.max_output_chars = max_output_chars
    for tool in tools:
      self.register(tool)

  def register(self, tool: Tool, name: Optional[str] = None) -> Tool:
    """Adds ``tool`` (under ``name`` when given: an alias). Raises ValueError on a taken name."""
    if name is not None and name != tool.name:
      tool = dataclasses.replace(tool, name=name)
    if tool.name in self._tools:
      raise ValueError(f"tool {tool.name!r} is already registered")
    self._tools[tool.name] = tool
    return tool

  def get(self, name: str) -> Tool:
    return self._tools[name]  # KeyError for an unknown name

  def names(self) -> list[str]:
    """The tools' names, sorted."""
    return sorted(self._tools)

  def schemas(self) -> list[dict[str, Any]]:
    """Each tool's ``{"type": "function", "function": {name, description, parameters}}``."""
    return [self._tools[n].schema() for n in self.names()]

  def call(self, call: ToolCall) -> ToolOutcome:
    """Runs ``call``; every failure is an error outcome whose text starts with ``error:``."""
    start = time.perf_counter()

    def failed(reason: str) -> ToolOutcome:
      text = _clip(f"error: {reason}", self.max_output_chars)
      return ToolOutcome(text, text[len("error: "):], time.perf_counter() - start)

    tool = self._tools.get(call.name)
    if tool is None:
      return failed(f"unknown tool {call.name!r} (available: {', '.join(self.names()) or 'none'})")
    try:
      inspect.signature(tool.fn).bind(**call.arguments)
    except TypeError as e:
      return failed(f"bad arguments for tool {tool.name!r}: {e} (parameters: "
                    f"{', '.join(tool.parameters.get('properties', {})) or 'none'})")
    except ValueError:  # a builtin without a signature: let the call decide
      pass
    try:
      result = tool(**call.arguments)
    except ToolError as e:
      return failed(str(e))
    except Exception as e:  # pylint: disable=broad-except
      return failed(f"tool {tool.name!r} raised {type(e).__name__}: {e}")
    if not isinstance(result, str):
      return failed(f"tool {tool.name!r} returned {type(result).__name__}, not str")
    return ToolOutcome(_clip(result, self.max_output_chars), None, time.perf_counter() - start)


def _clip(text: str, limit: int) -> str:
  return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} more characters]"


# ------------------------------------------------------------------ calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_REFUSED = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes", ast.Subscript: "subscripts",
            ast.Constant: "constants other than numbers"}


def _evaluate(node: ast.AST) -> int | float:
  if isinstance(node, ast.Constant) and type(node.value) in (int, float):
    return node.value
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _UNARY[type(node.op)](_evaluate(node.operand))
  if not (isinstance(node, ast.BinOp) and type(node.op) in _BINARY):
    what = _REFUSED.get(type(node), f"{type(node).__name__} nodes")
    raise ToolError(f"{what} are not allowed; use numbers, + - * / // % **, parentheses")
  left, right = _evaluate(node.left), _evaluate(node.right)
  ints = isinstance(left, int) and isinstance(right, int)
  if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
    raise ToolError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
  if ints and ((isinstance(node.op, ast.Pow) and left.bit_length() * right > MAX_INT_BITS) or (
      isinstance(node.op, ast.Mult) and left.bit_length() + right.bit_length() > MAX_INT_BITS + 1)):
    raise ToolError(f"the result is too large (more than {MAX_INT_BITS} bits)")
  try:
    value = _BINARY[type(node.op)](left, right)
  except (ZeroDivisionError, OverflowError) as e:
    raise ToolError("division by zero" if isinstance(e, ZeroDivisionError) else "the result is too large") from None
  if isinstance(value, complex) or (isinstance(value, int) and value.bit_length() > MAX_INT_BITS):
    raise ToolError("the result is not a real number" if isinstance(value, complex) else "the result is too large")
  return value


def format_number(value: int | float) -> str:
  """Integers exactly; integral floats below 2**53 as integers; other floats by ``repr``."""
  if isinstance(value, float) and not math.isfinite(value):
    raise ToolError("the result is not finite")
  if isinstance(value, float) and value.is_integer() and abs(value) < 2.0**53:
    return str(int(value))
  return repr(value) if isinstance(value, float) else str(value)


def calculate(expression: Optional[str] = None, expr: Optional[str] = None) -> str:
  """Evaluates an arithmetic expression safely (``expr`` is an alias of ``expression``)."""
  text = expression if expression is not None else expr
  if (expression is None) == (expr is None):
    raise ToolError("give one argument 'expression' (or 'expr', not both), e.g. {\"expression\": \"12*34\"}")
  if not isinstance(text, str):
    raise ToolError(f"'expression' must be a string, got {type(text).__name__}")
  if len(text) > MAX_EXPRESSION_CHARS:
    raise ToolError(f"the expression is too long ({len(text)} > {MAX_EXPRESSION_CHARS} characters)")
  try:
    return format_number(_evaluate(ast.parse(text.strip(), mode="eval").body))
  except SyntaxError as e:
    raise ToolError(f"invalid expression {text!r} ({e.msg})") from None
  except (RecursionError, MemoryError):
    raise ToolError("the expression is nested too deeply") from None


CALCULATOR = Tool("calculator", "Evaluates an arithmetic expression: numbers, + - * / // % **, unary minus and "
                  "parentheses; integer results are exact. The argument 'expression' may also be given as 'expr'.",
                  {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                  calculate)


# ---------------------------------------------------------------------- python
class _LazySandbox:
  """The default runner: ``jaxrl_llm.tasks.sandbox.Sandbox()``, made on first use if isolation is available."""

  sandbox: Any = None
  unavailable: Optional[str] = None  # why there is no sandbox, once known

  def run(self, code: str) -> Any:
    if self.sandbox is None and self.unavailable is None:
      try:
        sandbox = importlib.import_module("jaxrl_llm.tasks.sandbox")  # lazily: it may be absent
        ok, why = sandbox.isolation_available()
        self.sandbox, self.unavailable = (sandbox.Sandbox(), None) if ok else (None, str(why) or "no isolation")
      except Exception as e:  # pylint: disable=broad-except
        self.unavailable = f"jaxrl_llm.tasks.sandbox: {type(e).__name__}: {e}"
    if self.sandbox is None:
      raise ToolError(f"the python sandbox is unavailable ({self.unavailable}); the code was not run")
    return self.sandbox.run(code)


def python_tool(runner: Any = None, name: str = "python") -> Tool:
  """Runs ``code`` by ``runner.run(code)`` -> result with ``status``, ``stdout``, ``stderr``, ``cause``.

  ``runner`` None: the sandbox, made on first use. Status ``"ok"`` returns stdout (and stderr);
  any other (``error``, ``timeout``, ...) is an error outcome with status, cause and output.
  """
  runner = _LazySandbox() if runner is None else runner

  def python(code: str) -> str:
    if not isinstance(code, str):
      raise ToolError(f"'code' must be a string, got {type(code).__name__}")
    result = runner.run(code)
    stdout, stderr = getattr(result, "stdout", "") or "", getattr(result, "stderr", "") or ""
    output = "\n".join(part for part in (stdout.rstrip("\n"), stderr and f"stderr:\n{stderr.rstrip()}") if part)
    if result.status == "ok":
      return output or "(no output)"
    cause = f": {result.cause}" if getattr(result, "cause", None) else ""
    raise ToolError(f"python {result.status}{cause}" + (f"\n{output}" if output else ""))

  return Tool(name, "Runs Python code in a sandbox and returns what it prints (use print).",
              {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}, python)


_JSON_TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "list": "array",
               "dict": "object"}


def function_tool(fn: str | Callable[..., Any], name: Optional[str] = None,
                  description: Optional[str] = None) -> Tool:
  """A tool of a user function (a callable or an import path ``"pkg.mod:fn"``).

  Name: ``__name__``; description: the docstring's first paragraph; ``parameters`` from the
  signature (int, float, str, bool, list, dict annotations give JSON types; no default: required).
  """
  if isinstance(fn, str):
    from jaxrl_llm.envs.base import resolve_callable  # pylint: disable=import-outside-toplevel
    fn = resolve_callable(fn, f"tool {fn!r}", "a function fn(**arguments) -> str")
  if not callable(fn):
    raise ConfigError(f"tool {fn!r}: expected a callable or an import path 'package.module:function'")
  properties, required = {}, []
  for p in inspect.signature(fn).parameters.values():
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      continue
    kind = _JSON_TYPES.get(p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", ""))
    properties[p.name] = {"type": kind} if kind else {}
    if p.default is p.empty:
      required.append(p.name)
  doc = (description if description is not None else inspect.getdoc(fn) or "").split("\n\n")[0].strip()
  return Tool(name or fn.__name__, doc, {"type": "object", "properties": properties, "required": required}, fn)


def make_registry(names: Sequence[str], *, aliases: Mapping[str, str] = {},  # pylint: disable=dangerous-default-value
                  python_runner: Any = None) -> ToolRegistry:
  """A registry of built-in tools (``calculator``, ``python``) and import paths ``"pkg.mod:fn"``.

  ``aliases``: ``{listed name: name the model calls it by}``, e.g. ``{"calculator": "calc"}``;
  ``python_runner``: the ``python`` tool's runner (default: the sandbox). ConfigError for an
  unknown name, an alias of a name not listed, or two tools with one name.
  """
  unknown = [a for a in aliases if a not in names]
  if unknown:
    raise ConfigError(f"tool aliases {unknown} name no listed tool (tools: {list(names)})")
  registry, builtins = ToolRegistry(), {"calculator": lambda: CALCULATOR, "python": lambda: python_tool(python_runner)}
  for name in names:
    if name in builtins:
      tool = builtins[name]()
    elif isinstance(name, str) and ":" in name:
      tool = function_tool(name)
    else:
      raise ConfigError(f"tool {name!r}: expected a built-in tool ({', '.join(builtins)}) or an import path "
                        "'package.module:function'")
    try:
      registry.register(tool, aliases.get(name))
    except ValueError as e:
      raise ConfigError(f"tool {name!r}: {e}") from None
  return registry


__all__ = ["CALCULATOR", "Tool", "ToolError", "ToolOutcome", "ToolRegistry",
           "calculate", "format_number", "function_tool", "make_registry", "python_tool"]
