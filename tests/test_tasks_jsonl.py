"""JSONL prompt datasets: loading errors with file and line, split, resume, rewards."""

import json

import pytest

from jaxrl_llm.tasks import JsonlTask, build_eval_set, get_task


def _write(path, lines):
  path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
  return str(path)


def _gsm8k_rows(n):
  return [json.dumps({"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
                      "answer": f"{i} + {i + 1} = <<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1}\n"
                                f"#### {2 * i + 1:,}"})
          for i in range(n)]


@pytest.fixture
def gsm8k(tmp_path):
  return _write(tmp_path / "train.jsonl", _gsm8k_rows(400))


def test_loads_and_rewards(gsm8k):
  task = JsonlTask(path=gsm8k, prompt_template="Q: {prompt}\nA:")
  assert task.num_train + task.num_eval == 400 and task.num_eval > 0
  ex = next(task.train_prompts(seed=0))
  assert ex.prompt.startswith("Q: Tom has ") and ex.prompt.endswith("\nA:")
  assert task.sft_target(ex) == ex.answer and "####" in ex.answer
  gold = int(ex.meta["gold"].replace(",", ""))
  assert task.reward(ex, task.sft_target(ex)) == 1.0
  assert task.reward(ex, f"So the answer is {gold:,}.") == 1.0
  assert task.reward(ex, f"\\boxed{{{gold}}}") == 1.0
  assert task.reward(ex, f"The answer is {gold + 1}") == 0.0
  assert task.reward(ex, "no idea") == 0.0
  assert set(ex.prompt) | set(ex.answer) <= set(task.alphabet)
  assert ex.meta["source"] == gsm8k and ex.meta["line"] >= 1


def test_split_disjoint_and_resume(gsm8k):
  task = get_task("jsonl", path=gsm8k, eval_fraction=0.2)
  eval_set = build_eval_set(task, task.num_eval, seed=3)
  it = task.train_prompts(seed=1)
  train = [next(it) for _ in range(2 * task.num_train)]  # two epochs
  train_prompts = {ex.prompt for ex in train}
  assert len(train_prompts) == task.num_train  # each epoch visits every training row
  assert not train_prompts & {ex.prompt for ex in eval_set.examples}
  assert train[:task.num_train] != train[task.num_train:]  # reshuffled per epoch
  it.set_state({"task": "jsonl", "seed": 1, "position": task.num_train - 5})
  assert [next(it) for _ in range(10)] == train[task.num_train - 5:task.num_train + 5]
  fingerprint = build_eval_set(task, 10, seed=3).fingerprint
  assert build_eval_set(task, 10, seed=3).fingerprint == fingerprint
  assert build_eval_set(task, 10, seed=4).fingerprint != fingerprint
  with pytest.raises(ValueError, match="asked for 100000 held-out prompts"):
    task.eval_prompts(100_000)


def test_eval_path(tmp_path):
  rows = _gsm8k_rows(30)
  train = _write(tmp_path / "train.jsonl", rows)
  test = _write(tmp_path / "test.jsonl", rows[:5])
  task = JsonlTask(path=train, eval_path=test)
  assert (task.num_train, task.num_eval) == (25, 5)
  assert all(task.is_eval(ex) for ex in task.eval_prompts(5))
  it = task.train_prompts()
  assert not any(task.is_eval(next(it)) for _ in range(50))


def test_custom_fields_and_exact_verifier(tmp_path):
  path = _write(tmp_path / "d.jsonl", [json.dumps({"q": "2+2?", "a": 4}), "",
                                      json.dumps({"q": "capital of France?", "a": "Paris"})])
  task = JsonlTask(path=path, prompt_field="q", answer_field="a", verifier="exact",
                   eval_fraction=0.0)
  it = task.train_prompts()
  by_prompt = {ex.prompt: ex for ex in (next(it) for _ in range(4))}
  assert by_prompt["2+2?"].answer == "4"  # numbers become text
  assert by_prompt["capital of France?"].meta["line"] == 3  # blank line skipped, still counted
  assert task.reward(by_prompt["capital of France?"], " Paris\n") == 1.0
  assert task.reward(by_prompt["capital of France?"], "paris") == 0.0


@pytest.mark.parametrize("lines,message", [
    (['{"question": "q1", "answer": "#### 1"}', '{"question": "q2"}'],
     r"bad.jsonl:2: row is missing field 'answer'"),
    (['{"answer": "#### 1"}'], r"bad.jsonl:1: row is missing field 'question'"),
    (['{"question": "q1", "answer": "#### 1"}', "", '{"question": "q2", "answer": '],
     r"bad.jsonl:3: invalid JSON"),
    (["[1, 2]"], r"bad.jsonl:1: expected a JSON object, got list"),
    (['{"question": "", "answer": "#### 1"}'],
     r"bad.jsonl:1: field 'question' must be a non-empty"),
    (['{"question": "q", "answer": ["1"]}'],
     r"bad.jsonl:1: field 'answer' must be a string"),
    (['{"question": "q", "answer": "no final number"}'],
     r"bad.jsonl:1: cannot extract a final answer from field 'answer'"),
    ([], r"bad.jsonl: the file has no rows"),
    (["", "  "], r"bad.jsonl: the file has no rows"),
])
def test_bad_files_name_file_and_line(tmp_path, lines, message):
  path = _write(tmp_path / "bad.jsonl", lines)
  with pytest.raises(ValueError, match=message):
    JsonlTask(path=path)


def test_config_errors(gsm8k):
  with pytest.raises(ValueError, match="jsonl.path is required"):
    JsonlTask()
  with pytest.raises(ValueError, match="jsonl.verifier"):
    JsonlTask(path=gsm8k, verifier="llm")
  with pytest.raises(ValueError, match="prompt_template"):
    JsonlTask(path=gsm8k, prompt_template="Q: {question}")
  with pytest.raises(ValueError, match="prompt_template must contain"):
    JsonlTask(path=gsm8k, prompt_template="no field")
  with pytest.raises(ValueError, match="jsonl.percent"):
    JsonlTask(path=gsm8k, percent="x")
  with pytest.raises(FileNotFoundError, match="missing.jsonl"):
    JsonlTask(path=gsm8k + ".missing.jsonl")


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
  good = '{"question": "q1", "answer": "#### 1"}\n'.encode()
  bad = tmp_path / "latin1.jsonl"
  bad.write_bytes(good + '{"question": "caf\u00e9", "answer": "#### 2"}\n'.encode("latin-1"))
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8 \(byte 0xe9 at byte 18 of the line"):
    JsonlTask(path=str(bad))
  train = _write(tmp_path / "train.jsonl", ['{"question": "q1", "answer": "#### 1"}'])
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not valid UTF-8"):  # the held-out file too
    JsonlTask(path=train, eval_path=str(bad))
  bom = tmp_path / "bom.jsonl"
  bom.write_bytes(b"\xef\xbb\xbf" + good + '{"question": "caf\u00e9?", "answer": "#### 2"}\n'.encode())
  task = JsonlTask(path=str(bom), eval_fraction=0.0)
  assert sorted(e.prompt for e in task.examples()[0]) == ["caf\u00e9?", "q1"]


def test_with_examples_keeps_the_held_out_keys(gsm8k):
  task = JsonlTask(path=gsm8k, eval_fraction=0.2)
  train, held_out = task.examples()
  smaller = task.with_examples(train[:10], held_out[:3])
  assert (smaller.num_train, smaller.num_eval) == (10, 3) and (task.num_train, task.num_eval) == (len(train),
                                                                                                  len(held_out))
  assert {smaller.train_example(5, i) for i in range(30)} == set(train[:10])
  assert all(smaller.is_eval(e) for e in held_out)  # a dropped held-out row's prompt still never trains
  with pytest.raises(ValueError, match="no training rows left"):
    task.with_examples([], held_out)


def test_number_like_text_options_and_an_empty_eval_path_as_flags_give_them(tmp_path):
  """``--config.task.kwargs.<key>=<text>`` values are parsed as Python literals: text fields given a
  number arrive as numbers, and an empty value as ''."""
  path = _write(tmp_path / "d.jsonl", [json.dumps({"7": "2+2?", "a": "#### 4", "9": 3})])
  task = JsonlTask(path=path, prompt_field=7, answer_field="a", split_salt=2024, difficulty_field=9, eval_path="",
                   eval_fraction=0)
  assert (task.prompt_field, task.split_salt, task.difficulty_field, task.eval_path) == ("7", "2024", "9", None)
  assert task.examples()[0][0].meta["difficulty"] == 3.0


CLI_PROBE = """
import json, sys
from absl import flags
import launch.train  # defines jaxrl-train's flags (the config file flag and its overrides)
flags.FLAGS(sys.argv)
from jaxrl_llm import configuration, tasks
config = flags.FLAGS["config"].value
configuration.validate(config)
task = tasks.get_task(config.task.name, **dict(config.task.kwargs))
fields = ["path", "prompt_field", "answer_field", "prompt_template", "verifier", "eval_fraction", "eval_path",
          "split_salt", "rel_tol", "percent", "difficulty_field"]
print(json.dumps({"fields": {f: getattr(task, f) for f in fields}, "num_eval": task.num_eval,
                  "prompts": sorted(e.prompt for e in task.examples()[0])}))
"""


@pytest.mark.parametrize("config", ["default", "qwen2_5_gsm8k"])
def test_every_option_is_settable_through_the_command_line_flags(tmp_path, config):
  """The real flag parsing of ``launch.train``: every documented jsonl option reaches the task, from the
  default config (another task: its arguments dropped with ``--config.task.kwargs={}``) and from a config
  file whose task is jsonl (options it sets and options it does not)."""
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  rows = [json.dumps({"q": f"what is {i}?", "sol": f"#### {i}", "level": f"Level {i % 5}"}) for i in range(6)]
  train, held_out = _write(tmp_path / "train.jsonl", rows), _write(tmp_path / "eval.jsonl", rows[:2])
  start = (["--config.task.name=jsonl", "--config.task.kwargs={}"] if config == "default"
           else [f"--config={root}/configs/{config}.py"])
  args = start + [f"--config.task.kwargs.path={train}", "--config.task.kwargs.prompt_field=q",
                  "--config.task.kwargs.answer_field=sol", "--config.task.kwargs.prompt_template=Q: {prompt} A:",
                  "--config.task.kwargs.verifier=exact", "--config.task.kwargs.eval_fraction=0.5",
                  f"--config.task.kwargs.eval_path={held_out}", "--config.task.kwargs.split_salt=pepper",
                  "--config.task.kwargs.rel_tol=0.001", "--config.task.kwargs.percent=either",
                  "--config.task.kwargs.difficulty_field=level"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get(
      "PYTHONPATH")])))
  proc = subprocess.run([sys.executable, "-c", CLI_PROBE, *args], cwd=root, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["fields"] == {"path": train, "prompt_field": "q", "answer_field": "sol",
                           "prompt_template": "Q: {prompt} A:", "verifier": "exact", "eval_fraction": 0.5,
                           "eval_path": held_out, "split_salt": "pepper", "rel_tol": 0.001, "percent": "either",
                           "difficulty_field": "level"}
  assert got["num_eval"] == 2  # the eval_path file's rows
  assert got["prompts"] == [f"Q: what is {i}? A:" for i in range(2, 6)]  # held-out prompts dropped from training
