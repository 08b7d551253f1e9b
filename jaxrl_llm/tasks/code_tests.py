"""Code task: write a Python function; the reward is the pass rate of hidden unit tests in the sandbox.

Rows (JSONL, one object a line; MBPP-style, after Austin et al., "Program Synthesis with Large
Language Models", arXiv:2108.07732)::

  {"prompt": "Write a function `add(a, b)` ...", "solution": "def add(a, b): ...",
   "tests": ["assert add(1, 2) == 3", ...]}

``prompt`` is what the model sees (through ``prompt_template``), ``solution`` a reference
solution (the SFT target; never shown to the reward), ``tests`` the hidden tests: Python
statements, usually one ``assert`` each. The built-in set (``data/code_tests.jsonl``, 18
problems written for this package) is the default ``path``; any file with these fields works.
Rows are read and checked by :class:`jaxrl_llm.tasks.jsonl.JsonlTask` (a bad row names the
file, the line and the field); ``tests`` must be a non-empty list of statements that compile.

Reward: the response's code (the first fenced ```python block if there is one, else the whole
response) runs in a :class:`jaxrl_llm.tasks.sandbox.Sandbox` (bubblewrap, no network, limits),
then each test runs in the same namespace; the reward is ``passed / len(tests)``. A sandbox
failure (wall-clock or CPU limit, memory, output limit, a signal, a syntax error or an exception
while loading the code, ``exit`` before the tests finish) scores 0; :meth:`CodeTestsTask.evaluate`
returns the count and the cause. The harness reports its count on a line tagged with a random
nonce, so printing a fake count does not work; code that inspects the harness's own frames could
still forge it (the sandbox protects the machine, not the reward, from such code).

One sandbox pool per process and per (``sandbox_workers``, limits) is started on the first
reward and kept (``reward.mode='inline'`` is the natural mode: the sandbox is the guard).
:meth:`CodeTestsTask.rewards` scores a batch over the pool's workers.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import threading
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.jsonl import JsonlTask

__all__ = ["CodeResult", "CodeTestsTask", "DEFAULT_PATH", "extract_code", "harness"]

DEFAULT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "code_tests.jsonl")
_FENCE_RE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_SANDBOXES: dict = {}
_SANDBOX_LOCK = threading.Lock()


class CodeResult(NamedTuple):
  """One response's verdict: ``score`` = ``passed / total`` (0 when the sandbox call failed),
  the sandbox ``status`` and the ``cause`` of a failure (empty when the tests ran)."""

  score: float
  passed: int
  total: int
  status: str
  cause: str


def extract_code(response: str) -> str:
  """The first fenced code block (```python or bare ```) of ``response``, else ``response`` itself."""
  match = _FENCE_RE.search(response)
  return match.group(1) if match else response


def harness(code: str, tests: Sequence[str], nonce: str) -> str:
  """A program that loads ``code`` as ``__main__`` and runs each test, then prints ``<nonce> passed/total``.

  A test passes when it runs without raising (``SystemExit`` included); an exception while
  loading the code exits with status 1 before any test.
  """
  return (
      "def _jaxrl_harness(source, tests):\n"
      "    namespace = {'__name__': '__main__'}\n"
      "    exec(compile(source, '<solution>', 'exec'), namespace)\n"
      "    passed = 0\n"
      "    for i, test in enumerate(tests):\n"
      "        try:\n"
      "            exec(compile(test, '<test %d>' % i, 'exec'), namespace)\n"
      "            passed += 1\n"
      "        except BaseException:\n"
      "            pass\n"
      "    return passed\n"
      f"_passed = _jaxrl_harness({code!r}, {list(tests)!r})\n"
      "import sys as _sys\n"
      f"_sys.stdout.write('\\n{nonce} %d/{len(tests)}\\n' % _passed)\n")


def _shared_sandbox(workers: int, limits):
  """This process's pool for ``(workers, limits)`` (started on first use, kept until exit)."""
  from jaxrl_llm.tasks import sandbox  # pylint: disable=import-outside-toplevel
  key = (workers, limits)
  with _SANDBOX_LOCK:
    if key not in _SANDBOXES:
      _SANDBOXES[key] = sandbox.Sandbox(workers=workers, limits=limits)
    return _SANDBOXES[key]


@dataclasses.dataclass(frozen=True)
class CodeTestsTask(JsonlTask):
  """Python functions with hidden unit tests; reward = the tests' pass rate in the sandbox.

  Attributes (besides :class:`JsonlTask`'s; ``verifier`` is always ``"exact"`` here, used only
  for the built-in text preference pairs):
    path: JSONL of ``prompt``/``solution``/``tests`` rows; empty (the default): the built-in set,
      ``jaxrl_llm/tasks/data/code_tests.jsonl``.
    tests_field: field holding the list of hidden tests.
    sandbox_workers: warm sandboxes of this process's pool.
    cpu_seconds, wall_seconds, memory_mb, max_processes: limits of one response's run
      (:class:`jaxrl_llm.tasks.sandbox.SandboxLimits`).
  """

  name: ClassVar[str] = "code_tests"

  path: str = ""
  prompt_field: str = "prompt"
  answer_field: str = "solution"
  prompt_template: str = "{prompt}\nAnswer with the Python code in a ```python block.\n"
  verifier: str = "exact"
  eval_fraction: float = 0.2
  tests_field: str = "tests"
  sandbox_workers: int = 2
  cpu_seconds: float = 5.0
  wall_seconds: float = 10.0
  memory_mb: int = 512
  max_processes: int = 16

  def __post_init__(self):
    if self.verifier != "exact":
      raise ValueError(f"code_tests.verifier must be 'exact' (the reward runs the tests), got {self.verifier!r}")
    if self.sandbox_workers < 1:
      raise ValueError(f"code_tests.sandbox_workers must be >= 1, got {self.sandbox_workers!r}")
    if not self.path:  # the built-in set (its absolute path differs per install, so it is not the default)
      object.__setattr__(self, "path", DEFAULT_PATH)
    super().__post_init__()

  def _row_to_example(self, row: Mapping[str, Any], path: str, lineno: int) -> tuple[str, base.Example]:
    key, example = super()._row_to_example(row, path, lineno)
    tests = row.get(self.tests_field)
    if not isinstance(tests, list) or not tests:
      raise ValueError(f"{path}:{lineno}: field {self.tests_field!r} must be a non-empty list of test statements, "
                       f"got {tests!r}"[:400])
    for i, test in enumerate(tests):
      if not isinstance(test, str) or not test.strip():
        raise ValueError(f"{path}:{lineno}: field {self.tests_field!r}[{i}] must be a non-empty string, got {test!r}")
      try:
        compile(test, f"{path}:{lineno}:{self.tests_field}[{i}]", "exec")
      except SyntaxError as e:
        raise ValueError(f"{path}:{lineno}: field {self.tests_field!r}[{i}] is not valid Python ({e.msg}): "
                         f"{test!r}") from None
    meta = dict(example.meta, tests=tuple(tests))
    return key, dataclasses.replace(example, meta=meta)

  def limits(self):
    """The :class:`~jaxrl_llm.tasks.sandbox.SandboxLimits` of one response's run."""
    from jaxrl_llm.tasks.sandbox import SandboxLimits  # pylint: disable=import-outside-toplevel
    return SandboxLimits(cpu_seconds=self.cpu_seconds, wall_seconds=self.wall_seconds, memory_mb=self.memory_mb,
                         max_processes=self.max_processes)

  def evaluate_many(self, examples: Sequence[base.Example], responses: Sequence[str]) -> list[CodeResult]:
    """A :class:`CodeResult` per ``(example, response)``, the runs spread over the pool's workers."""
    if len(examples) != len(responses):
      raise ValueError(f"evaluate_many: {len(examples)} examples but {len(responses)} responses")
    nonces = [secrets.token_hex(16) for _ in examples]
    programs = [harness(extract_code(r), ex.meta["tests"], n) for ex, r, n in zip(examples, responses, nonces)]
    limits = self.limits()
    results = _shared_sandbox(self.sandbox_workers, limits).run_many(programs, limits=limits)
    return [self._verdict(ex, res, n) for ex, res, n in zip(examples, results, nonces)]

  @staticmethod
  def _verdict(example: base.Example, result, nonce: str) -> CodeResult:
    total = len(example.meta["tests"])
    if not result.ok:
      return CodeResult(0.0, 0, total, result.status, result.cause or result.status)
    lines = result.stdout.rstrip("\n").splitlines()
    match = re.fullmatch(re.escape(nonce) + r" (\d+)/(\d+)", lines[-1]) if lines else None
    if match is None or int(match.group(2)) != total:
      return CodeResult(0.0, 0, total, "error", "the tests did not finish (the code exited early)")
    passed = int(match.group(1))
    return CodeResult(passed / total, passed, total, result.status, "")

  def evaluate(self, example: base.Example, response: str) -> CodeResult:
    """The verdict on one response (score, tests passed, sandbox status and cause)."""
    return self.evaluate_many([example], [response])[0]

  def rewards(self, examples: Sequence[base.Example], responses: Sequence[str]) -> list[float]:
    """``reward`` for a batch, run in parallel over the sandbox pool."""
    return [r.score for r in self.evaluate_many(examples, responses)]

  def reward(self, example: base.Example, response: str) -> float:
    """The fraction of ``example``'s hidden tests that pass with the response's code (0 on any failure)."""
    return self.evaluate(example, response).score

  def sft_target(self, example: base.Example) -> str:
    """The reference solution in a ```python block."""
    return f"```python\n{example.answer.rstrip()}\n```"
