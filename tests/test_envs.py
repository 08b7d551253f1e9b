"""Environments and tools: the tool-call format, the calculator and python tools, the registry,
the tool environment, the environment loader, episode limits and the observation format."""

from __future__ import annotations

import dataclasses
import importlib
import json
import string
import sys
import types
from typing import Optional

import pytest

from jaxrl_llm.bridge.tokenizer import build_char_tokenizer
from jaxrl_llm.envs import base
from jaxrl_llm.envs.base import Environment, EpisodeLimits, StepResult, load_environment_factory, register_environment
from jaxrl_llm.envs.observation import ObservationFormat
from jaxrl_llm.tasks.tool_calls import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolCall, format_tool_call,
                                       format_tool_response, parse_tool_calls)
from jaxrl_llm.envs.tool_env import ToolEnvironment, answer_of
from jaxrl_llm.envs.tools import (CALCULATOR, Tool, ToolError, ToolRegistry, calculate, function_tool, make_registry,
                                  python_tool)
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.tasks.base import Example


def call(name, **arguments):
  return ToolCall(name, arguments)


# ------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expression, expected", [
    ("12*34", "408"), ("2**100", str(2**100)), ("7/2", "3.5"), ("6/3", "2"), ("-(3+4)*2", "-14"),
    ("7//2", "3"), ("7%3", "1"), ("-7//2", "-4"), ("1.5*2", "3"), ("0.1+0.2", "0.30000000000000004"),
    (" ( 1 + 2 ) * +3 ", "9"), ("2**-1", "0.5"), ("123456789*987654321", "121932631112635269"),
    ("-" * 499 + "1", "-1"),
])
def test_calculator_results(expression, expected):
  assert calculate(expression) == expected
  assert calculate(expr=expression) == expected


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os').system('true')", "function calls are not allowed"),
    ("x+1", "names are not allowed"), ("(1).real", "attributes are not allowed"),
    ("'a'*3", "constants other than numbers"), ("True+1", "constants other than numbers"),
    ("[1][0]", "not allowed"), ("lambda: 1", "not allowed"), ("2**5000", "exponent 5000 is too large"),
    ("99999**999", "too large"), ("9**999*9**999*9**999", "too large"), ("10.0**999", "too large"),
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("(-8)**0.5", "not a real number"),
    ("1+", "invalid expression"), ("1" * 600, "too long"), ("(" * 240 + "1" + ")" * 240, "invalid expression"),
])
def test_calculator_refuses(expression, reason):
  outcome = make_registry(["calculator"]).call(call("calculator", expression=expression))
  assert outcome.error is not None and reason in outcome.error, outcome
  assert outcome.text == "error: " + outcome.error


def test_calculator_arguments():
  with pytest.raises(ToolError, match="expression"):
    calculate()
  with pytest.raises(ToolError, match="not both"):
    calculate("1", "2")
  with pytest.raises(ToolError, match="must be a string"):
    calculate(12)


def test_calculator_alias_as_the_task_calls_it():
  registry = make_registry(["calculator"], aliases={"calculator": "calc"})
  assert registry.names() == ["calc"]
  outcome = registry.call(ToolCall("calc", {"expr": "12*34"}))
  assert (outcome.text, outcome.error) == ("408", None) and outcome.seconds >= 0
  assert registry.call(ToolCall("calc", {"expression": "1+1"})).text == "2"
  assert registry.schemas()[0]["function"]["name"] == "calc"
  assert registry.schemas()[0]["function"]["parameters"]["required"] == ["expression"]


# ------------------------------------------------------------ tool-call format
def test_parse_one_call_and_content():
  text = f'Let me compute.{TOOL_CALL_OPEN}\n{{"name": "calc", "arguments": {{"expr": "1+2"}}}}\n{TOOL_CALL_CLOSE} ok'
  parsed = parse_tool_calls(text)
  assert parsed.calls == [ToolCall("calc", {"expr": "1+2"})] and parsed.errors == []
  assert parsed.content == "Let me compute. ok" and parsed.has_tool_calls


def test_parse_two_calls_and_roundtrip():
  calls = [ToolCall("calc", {"expr": "1+2"}), ToolCall("python", {"code": "print(1)"})]
  parsed = parse_tool_calls("a" + format_tool_call(calls[0]) + "b" + format_tool_call(calls[1]))
  assert parsed.calls == calls and parsed.errors == [] and parsed.content == "ab"


def test_parse_without_tags():
  parsed = parse_tool_calls("The answer is 42.<|im_end|>")
  assert parsed.calls == [] and parsed.errors == [] and not parsed.has_tool_calls
  assert parsed.content == "The answer is 42.<|im_end|>"


@pytest.mark.parametrize("body, reason", [
    ("{name: calc}", "invalid JSON"), ("", "invalid JSON"), ("[1, 2]", "expected a JSON object"),
    ('{"arguments": {}}', 'missing "name"'), ('{"name": 3}', '"name" must be a non-empty string'),
    ('{"name": "calc", "arguments": [1]}', '"arguments" must be a JSON object, got list'),
    ('{"name": "calc", "arguments": "12*34"}', '"arguments" must be a JSON object'),
])
def test_parse_bad_blocks(body, reason):
  parsed = parse_tool_calls(f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}")
  assert parsed.calls == [] and len(parsed.errors) == 1 and reason in parsed.errors[0], parsed.errors
  assert parsed.errors[0].startswith("tool call 1:") and parsed.has_tool_calls


def test_parse_lenient_forms():
  assert parse_tool_calls('<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"1\\"}"}</tool_call>').calls == [
      ToolCall("calc", {"expr": "1"})]
  assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>').calls == [
      ToolCall("f", {"a": 1})]
  assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>').calls == [ToolCall("f", {})]


def test_parse_unclosed_and_stray_tags():
  parsed = parse_tool_calls('x <tool_call>{"name": "calc", "arguments": {}}')
  assert parsed.calls == [] and "unclosed <tool_call>" in parsed.errors[0] and parsed.content == "x "
  parsed = parse_tool_calls('<tool_call>{"name": "a"<tool_call>{"name": "b"}</tool_call>')
  assert parsed.calls == [ToolCall("b", {})] and len(parsed.errors) == 1 and "unclosed" in parsed.errors[0]
  parsed = parse_tool_calls("done </tool_call>")
  assert parsed.calls == [] and "without an opening" in parsed.errors[0] and parsed.content == "done "
  assert parse_tool_calls(None).errors  # never raises


def test_format_tool_response():
  assert format_tool_response("408") == "<tool_response>\n408\n</tool_response>"


# -------------------------------------------------------------------- registry
def shout(text: str, times: int = 1) -> str:
  """Repeats text in capitals.

  More detail that is not part of the description.
  """
  return " ".join([text.upper()] * times)


def broken(x: int) -> str:
  raise RuntimeError("disk on fire")


def not_text(x: int) -> int:
  return x


def test_registry_error_outcomes():
  registry = make_registry(["calculator", "python"], aliases={"calculator": "calc"}, python_runner=object())
  registry.register(function_tool(broken))
  registry.register(function_tool(not_text))
  cases = [
      (call("foo"), "unknown tool 'foo' (available: broken, calc, not_text, python)"),
      (call("calc", x=1), "bad arguments for tool 'calc'"),
      (call("broken"), "bad arguments for tool 'broken': missing a required argument: 'x'"),
      (call("broken", x=1), "tool 'broken' raised RuntimeError: disk on fire"),
      (call("not_text", x=1), "tool 'not_text' returned int, not str"),
  ]
  for c, reason in cases:
    outcome = registry.call(c)
    assert outcome.error is not None and reason in outcome.error, (c, outcome)
    assert outcome.text.startswith("error: ")


def test_registry_clips_and_rejects_duplicates():
  registry = ToolRegistry([function_tool(shout)], max_output_chars=10)
  outcome = registry.call(call("shout", text="abcdefghij", times=2))
  assert outcome.error is None and outcome.text.startswith("ABCDEFGHIJ\n... [11 more characters]")
  with pytest.raises(ValueError, match="already registered"):
    registry.register(function_tool(shout))
  with pytest.raises(ConfigError, match="bogus"):
    make_registry(["bogus"])
  with pytest.raises(ConfigError, match="name no listed tool"):
    make_registry(["calculator"], aliases={"python": "py"})
  with pytest.raises(ConfigError, match="already registered"):
    make_registry(["calculator", "python"], aliases={"python": "calculator"})


def test_function_tool_schema_and_import_path():
  tool = function_tool(shout)
  assert tool.name == "shout" and tool.description == "Repeats text in capitals."
  assert tool.parameters == {"type": "object", "properties": {"text": {"type": "string"}, "times": {"type": "integer"}},
                             "required": ["text"]}
  assert tool.schema()["type"] == "function"
  renamed = function_tool("os.path:basename", name="base", description="Last path part.")
  assert ToolRegistry([renamed]).call(call("base", p="/a/b.txt")).text == "b.txt"
  with pytest.raises(ConfigError, match="no attribute 'nope'"):
    function_tool("os.path:nope")
  with pytest.raises(ValueError):
    Tool("not an identifier", "", {}, shout)


# --------------------------------------------------------------------- python
@dataclasses.dataclass
class FakeResult:
  status: str
  stdout: str = ""
  stderr: str = ""
  cause: Optional[str] = None


class FakeRunner:

  def __init__(self, result):
    self.result, self.codes = result, []

  def run(self, code):
    self.codes.append(code)
    return self.result


@pytest.mark.parametrize("result, text, error", [
    (FakeResult("ok", "42\n"), "42", False),
    (FakeResult("ok"), "(no output)", False),
    (FakeResult("ok", "1\n", "warn\n"), "1\nstderr:\nwarn", False),
    (FakeResult("error", "", "Traceback...\nZeroDivisionError: division by zero\n", "exit code 1"),
     "error: python error: exit code 1\nstderr:\nTraceback...\nZeroDivisionError: division by zero", True),
    (FakeResult("timeout", "partial\n", "", "wall-clock limit 10 s"),
     "error: python timeout: wall-clock limit 10 s\npartial", True),
])
def test_python_tool_with_a_fake_runner(result, text, error):
  runner = FakeRunner(result)
  registry = make_registry(["python"], python_runner=runner)
  outcome = registry.call(call("python", code="print(6*7)"))
  assert outcome.text == text and (outcome.error is not None) == error
  assert runner.codes == ["print(6*7)"]


def test_python_tool_without_isolation_never_runs_code(monkeypatch):
  built = []
  fake = types.ModuleType("jaxrl_llm.tasks.sandbox")
  fake.isolation_available = lambda: (False, "bubblewrap is not installed")
  fake.Sandbox = lambda: built.append(1)
  monkeypatch.setitem(sys.modules, "jaxrl_llm.tasks.sandbox", fake)
  tool = python_tool()
  for _ in range(2):
    outcome = ToolRegistry([tool]).call(call("python", code="print(1)"))
    assert outcome.error is not None and "sandbox is unavailable (bubblewrap is not installed)" in outcome.text
  assert built == []
  assert "'code' must be a string" in ToolRegistry([python_tool(FakeRunner(None))]).call(call("python", code=1)).text


def _real_sandbox_available() -> bool:
  try:
    sandbox = importlib.import_module("jaxrl_llm.tasks.sandbox")
    return bool(sandbox.isolation_available()[0])
  except Exception:  # pylint: disable=broad-except
    return False


@pytest.mark.skipif(not _real_sandbox_available(), reason="jaxrl_llm.tasks.sandbox is absent or has no isolation")
def test_python_tool_with_the_real_sandbox():
  tool = python_tool()
  registry = ToolRegistry([tool])
  assert registry.call(call("python", code="print(6*7)")).text == "42"
  failed = registry.call(call("python", code="1/0"))
  assert failed.error is not None and failed.text.startswith("error: python error")
  assert "ZeroDivisionError" in failed.text


# ------------------------------------------------------------- tool environment
class ExactTask:
  name = "exact"

  def __init__(self):
    self.scored = []

  def reward(self, example, response):
    self.scored.append(response)
    return 1.0 if response == example.answer else 0.0


def calc_turn(expr: str, eos: str = "<|im_end|>") -> str:
  return "I need " + format_tool_call(ToolCall("calc", {"expr": expr})) + eos


def test_tool_environment_episode():
  task = ExactTask()
  registry = make_registry(["calculator"], aliases={"calculator": "calc"})
  env = load_environment_factory("tools")(task=task, tools=registry)
  assert isinstance(env, ToolEnvironment) and isinstance(env, Environment)
  assert env.reset(Example("What is 12*34?", "408")) == "What is 12*34?"
  first = env.step(calc_turn("12*34"))
  assert first == StepResult("<tool_response>\n408\n</tool_response>", 0.0, False,
                             {"tool_calls": 1, "tool_errors": 0, "tool_seconds": first.info["tool_seconds"]})
  last = env.step(" 408<|im_end|>")
  assert last.done and last.reward == 1.0 and last.observation == ""
  assert last.info == {"tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "answer": "408"}
  assert task.scored == ["408"]
  with pytest.raises(RuntimeError, match="episode is over"):
    env.step("again")
  env.reset(Example("What is 1+1?", "2"))  # a new episode on the same object starts clean
  assert env.step("3<eos>").reward == 0.0 and task.scored[-1] == "3"


def test_tool_environment_errors_and_call_limit():
  env = ToolEnvironment(ExactTask(), make_registry(["calculator"], aliases={"calculator": "calc"}))
  with pytest.raises(RuntimeError, match="reset"):
    env.step("x")
  env.reset(Example("q", "a"))
  two = env.step(calc_turn("1+1", "") + calc_turn("2+2", ""))
  assert not two.done and two.info["tool_calls"] == 2 and two.info["tool_errors"] == 1  # written 2, ran 1
  responses = two.observation.split("\n<tool_response>")
  assert responses[0] == "<tool_response>\n2\n</tool_response>" and "the other 1 were not run" in responses[1]
  bad = env.step("<tool_call>{oops</tool_call>")
  assert not bad.done and bad.info == {"tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.0}
  assert bad.observation.startswith("<tool_response>\nerror: tool call 1: invalid JSON")
  unclosed = env.step('<tool_call>{"name": "calc"')
  assert not unclosed.done and "unclosed" in unclosed.observation
  failing = env.step(calc_turn("1/0"))
  assert failing.info["tool_errors"] == 1 and "error: division by zero" in failing.observation
  env2 = ToolEnvironment(ExactTask(), make_registry(["calculator"]), max_calls_per_turn=2)
  env2.reset(Example("q", "a"))
  both = env2.step(calc_turn("1", "") + calc_turn("2", ""))  # "calc" is not registered: "calculator" is
  assert both.info["tool_calls"] == 2 and both.info["tool_errors"] == 2 and "unknown tool" in both.observation
  with pytest.raises(ValueError, match="max_calls_per_turn"):
    ToolEnvironment(ExactTask(), ToolRegistry(), max_calls_per_turn=0)


def test_final_answer_hook():
  assert answer_of(" 42 <|im_end|>") == "42" and answer_of("12<eos><pad><pad>") == "12"
  assert answer_of("<answer>4</answer></s>") == "<answer>4</answer>"
  task = ExactTask()
  env = ToolEnvironment(task, ToolRegistry(), final_answer=lambda text: text.split("=")[-1].strip())
  env.reset(Example("q", "7"))
  assert env.step("3+4 = 7").reward == 1.0
  env = ToolEnvironment(task, ToolRegistry(), final_answer="jaxrl_llm.envs.tool_env:answer_of")
  env.reset(Example("q", "7"))
  assert env.step("7<|endoftext|>").reward == 1.0


# ---------------------------------------------------------------------- loader
def make_echo_env(task, tools, greeting="hi"):
  return ToolEnvironment(task, tools)


def test_load_environment_factory():
  assert load_environment_factory("jaxrl_llm.envs.tool_env:ToolEnvironment") is ToolEnvironment
  for name, match in [("nope", "env.name='nope' is not a registered environment"),
                      ("tool", "did you mean 'tools'"),
                      ("jaxrl_llm.envs.tool_env:Nope", "env.name='jaxrl_llm.envs.tool_env:Nope'.*no attribute"),
                      ("no_such_module_xyz:make", "env.name=.*does not import"),
                      ("jaxrl_llm.tasks.tool_calls:TOOL_CALL_OPEN", "is a str, not a callable; expected"),
                      ("", "env.name=''")]:
    with pytest.raises(ConfigError, match=match):
      load_environment_factory(name)


def test_register_environment(monkeypatch):
  monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))  # pylint: disable=protected-access
  register_environment("echo", make_echo_env)
  assert load_environment_factory("echo") is make_echo_env and "echo" in base.environment_names()
  with pytest.raises(ValueError, match="already registered"):
    register_environment("echo", ToolEnvironment)
  register_environment("echo", ToolEnvironment, replace=True)
  for bad in ("", "a:b"):
    with pytest.raises(ValueError):
      register_environment(bad, make_echo_env)
  with pytest.raises(ValueError, match="callable"):
    register_environment("x", 3)


def test_episode_limits():
  assert EpisodeLimits() == EpisodeLimits(4, 256, 64)
  for kwargs, field in [({"max_turns": 0}, "max_turns"), ({"max_tokens": -1}, "max_tokens"),
                        ({"max_turn_tokens": 1.5}, "max_turn_tokens"), ({"max_turns": True}, "max_turns"),
                        ({"max_tokens": 32, "max_turn_tokens": 64}, "max_turn_tokens")]:
    with pytest.raises(ValueError, match=f"EpisodeLimits.{field}"):
      EpisodeLimits(**kwargs)


# ---------------------------------------------------------- observation format
# Qwen2.5's handling of roles, as its template writes them (consecutive tool messages share one user turn).
QWEN_LIKE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Plain ChatML that knows no tool role.
CHATML_NO_TOOL = (
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHATML_DROPS_TOOL = CHATML_NO_TOOL.replace("{{ raise_exception('unknown role') }}", "{%- continue %}")
ALPHABET = "".join(sorted(set(string.ascii_letters + string.digits + " \n<>/_{}\":,.*+?=")))


def chatml_tokenizer(template):
  return build_char_tokenizer(ALPHABET, ("<pad>", "<|im_end|>", "<bos>", "<|im_start|>"), chat_template=template)


def test_observation_format_qwen_like_matches_the_template():
  tok = chatml_tokenizer(QWEN_LIKE)
  fmt = ObservationFormat.from_tokenizer(tok)
  assert (fmt.kind, fmt.role, fmt.fallback, fmt.template_wraps_responses) == ("chat", "tool", None, True)
  assert (fmt.close, fmt.prefix, fmt.suffix) == ("<|im_end|>\n", "<|im_start|>user\n",
                                                 "<|im_end|>\n<|im_start|>assistant\n")
  question, call_text = "What is 12*34?", format_tool_call(ToolCall("calc", {"expr": "12*34"}))
  prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
  expected = tok.apply_chat_template([{"role": "user", "content": question},
                                      {"role": "assistant", "content": call_text},
                                      {"role": "tool", "content": "408"}], add_generation_prompt=True)
  for turn in (call_text + "<|im_end|>", call_text):  # stopped on EOS, or cut short: close written once
    episode = prompt + turn + fmt.wrap(format_tool_response("408"), turn)
    assert episode == expected
    tok.encode(episode)  # the appended text tokenises
  assert fmt.wrap("R", "x<|im_end|>\n") == "<|im_start|>user\nR<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("template, why", [(CHATML_NO_TOOL, "raised"), (CHATML_DROPS_TOOL, "drops")])
def test_observation_format_falls_back_to_user(template, why):
  fmt = ObservationFormat.from_tokenizer(chatml_tokenizer(template))
  assert fmt.role == "user" and why in fmt.fallback and not fmt.template_wraps_responses
  assert (fmt.close, fmt.prefix, fmt.suffix) == ("<|im_end|>\n", "<|im_start|>user\n",
                                                 "<|im_end|>\n<|im_start|>assistant\n")
  assert fmt.wrap("<tool_response>\n1\n</tool_response>", "a<|im_end|>") == (
      "\n<|im_start|>user\n<tool_response>\n1\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_observation_format_default_char_template_and_plain():
  tok = build_char_tokenizer("0123456789+=")
  fmt = ObservationFormat.build("chat", tok)
  assert (fmt.close, fmt.prefix, fmt.suffix, fmt.role) == ("<eos>", "", "", "tool")
  assert fmt.wrap("7", "12<eos>") == "7" and fmt.wrap("7", "12") == "<eos>7"
  plain = ObservationFormat.build("plain")
  assert plain == ObservationFormat.plain() and plain.wrap("<tool_response>\n7\n</tool_response>", "x") == (
      "<tool_response>\n7\n</tool_response>")
  with pytest.raises(ValueError, match="kind"):
    ObservationFormat.build("xml")
  with pytest.raises(ValueError, match="needs a tokenizer"):
    ObservationFormat.build("chat")
  with pytest.raises(ValueError, match="no chat template"):
    ObservationFormat.from_tokenizer(build_char_tokenizer("01", chat_template=None))


def test_schemas_render_in_a_template():
  registry = make_registry(["calculator", "python"], aliases={"calculator": "calc"}, python_runner=object())
  tok = chatml_tokenizer("{{ tools | tojson }}")
  rendered = json.loads(tok.apply_chat_template([], tools=registry.schemas()))
  assert [t["function"]["name"] for t in rendered] == ["calc", "python"]
  assert CALCULATOR.schema()["function"]["parameters"]["properties"] == {"expression": {"type": "string"}}
