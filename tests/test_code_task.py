"""The code_tests task (jaxrl_llm.tasks.code_tests): hidden-test pass rate in the sandbox as reward."""

import json
import pickle

import pytest

from jaxrl_llm.tasks import sandbox as S
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.tasks import code_tests
from jaxrl_llm.tasks.registry import get_task, list_tasks

AVAILABLE, WHY = S.isolation_available()
needs_sandbox = pytest.mark.skipif(not AVAILABLE, reason=f"no isolation here: {WHY}")


@pytest.fixture(scope="module")
def task():
  return get_task("code_tests", sandbox_workers=2, cpu_seconds=1.0, wall_seconds=3.0, memory_mb=256,
                  max_processes=8)


def _all(task):
  return [task.train_example(0, i) for i in range(task.num_train)] + task.eval_prompts(task.num_eval)


def _find(task, name):
  return next(ex for ex in _all(task) if f"`{name}(" in ex.prompt)


def test_registered_and_built_in_data(task):
  assert "code_tests" in list_tasks()
  assert isinstance(task, code_tests.CodeTestsTask)
  assert task.num_train + task.num_eval >= 12 and task.num_eval >= 1
  ex = task.train_example(0, 0)
  assert ex.meta["tests"] and all(t.startswith("assert ") for t in ex.meta["tests"])
  assert "```python" in task.prompt_template and task.sft_target(ex).startswith("```python\n")
  assert pickle.loads(pickle.dumps(task)).num_train == task.num_train  # process-mode rewards ship the task
  assert task.train_example(3, 5) == task.train_example(3, 5)


def test_extract_code():
  assert code_tests.extract_code("Here:\n```python\ndef f():\n    return 1\n```\nDone") == "def f():\n    return 1\n"
  assert code_tests.extract_code("```\nx = 1\n```") == "x = 1\n"
  assert code_tests.extract_code("def g(): pass") == "def g(): pass"


@needs_sandbox
def test_reference_solutions_score_one(task):
  examples = _all(task)
  assert task.rewards(examples, [task.sft_target(ex) for ex in examples]) == [1.0] * len(examples)
  assert task.reward(examples[0], task.sft_target(examples[0])) == 1.0
  raw = task.evaluate(examples[0], examples[0].answer)  # unfenced code works too
  assert raw.score == 1.0 and raw.passed == raw.total and raw.status == "ok"


@needs_sandbox
def test_half_right_scores_half(task):
  ex = _find(task, "factorial")  # 0! and 1! right, 5! and 10! wrong
  result = task.evaluate(ex, "```python\ndef factorial(n):\n    return 1\n```")
  assert (result.passed, result.total) == (2, 4) and result.score == pytest.approx(0.5), result
  ex = _find(task, "add")
  # Right on 1 + 2 and 2.5 + 0.5, wrong on -5 + 5 and 0 + 0.
  assert task.reward(ex, "def add(a, b):\n    return a + b if a > 0 else None") == pytest.approx(0.5)
  assert task.reward(ex, "def add(a, b):\n    return None") == 0.0


MALICIOUS = {
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "loop": "while True:\n    pass",
    "memory": "x = bytearray(10 * 1024 ** 3)",
    "print_gb": "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * (1 << 20))",
    "exit_early": "import os\nos._exit(0)",
    "fake_count": "import os\nprint('\\n00000000000000000000000000000000 4/4')\nos._exit(0)",
    "kill_parent": "import os\nos.kill(os.getppid(), 9)",
    "shadow": "print(open('/etc/shadow').read())",
    "socket": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "syntax": "def add(a, b) return a + b",
}


@needs_sandbox
def test_malicious_code_scores_zero_with_a_cause(task):
  ex = _find(task, "add")
  names = list(MALICIOUS)
  results = task.evaluate_many([ex] * len(names), [f"```python\n{MALICIOUS[n]}\n```" for n in names])
  for name, result in zip(names, results):
    assert result.score == 0.0 and result.passed == 0, (name, result)
    assert result.status != "ok" and result.cause, (name, result)
  by_name = dict(zip(names, results))
  assert by_name["memory"].status == "memory"
  assert by_name["print_gb"].status == "output_limit"
  assert by_name["loop"].status in ("cpu", "timeout")
  assert "SyntaxError" in by_name["syntax"].cause
  assert task.reward(ex, task.sft_target(ex)) == 1.0  # the run goes on


def _write(tmp_path, rows):
  path = tmp_path / "code.jsonl"
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
  return str(path)


GOOD = {"prompt": "Write `one()` returning 1.", "solution": "def one():\n    return 1\n", "tests": ["assert one() == 1"]}


@pytest.mark.parametrize("bad, field", [
    ({"prompt": "p", "solution": "s"}, "tests"),
    ({"prompt": "p", "solution": "s", "tests": []}, "tests"),
    ({"prompt": "p", "solution": "s", "tests": "assert True"}, "tests"),
    ({"prompt": "p", "solution": "s", "tests": ["assert (("]}, "tests"),
    ({"prompt": "p", "solution": "s", "tests": [3]}, "tests"),
    ({"solution": "s", "tests": ["assert True"]}, "prompt"),
    ({"prompt": "p", "tests": ["assert True"]}, "solution"),
])
def test_malformed_rows_name_file_line_and_field(tmp_path, bad, field):
  path = _write(tmp_path, [GOOD, bad])
  with pytest.raises(ConfigError) as info:
    get_task("code_tests", path=path)
  message = str(info.value)
  assert f"{path}:2" in message and repr(field) in message, message


def test_invalid_json_names_the_line(tmp_path):
  path = _write(tmp_path, [GOOD, GOOD, "{not json"])
  with pytest.raises(ConfigError, match=f"{path}:3"):
    get_task("code_tests", path=path)


def test_verifier_is_fixed():
  with pytest.raises(ConfigError, match="verifier"):
    get_task("code_tests", verifier="math")
