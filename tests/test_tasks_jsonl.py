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
