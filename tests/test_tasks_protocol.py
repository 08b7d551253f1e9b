"""The task protocol that curation and reward models use: difficulty, pair kinds, preference pairs."""

import ast
import collections
import json
import pathlib

import pytest

from jaxrl_llm.tasks import (TEXT_PAIR_KINDS, AdditionTask, CountdownTask, CounterRng, Example, JsonlTask,
                             SortingTask, Task, pairs)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return str(path)


def gsm8k_rows(n):
  return [{"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
           "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}", "level": f"Level {1 + i % 4}"}
          for i in range(n)]


@pytest.fixture
def math_jsonl(tmp_path):
  return JsonlTask(path=write_jsonl(tmp_path / "m.jsonl", gsm8k_rows(120)), difficulty_field="level")


@pytest.fixture
def exact_jsonl(tmp_path):
  rows = [{"question": f"spell {w}", "answer": w[::-1]} for w in ("apple", "river", "stone", "cloud", "amber")] * 3
  rows = [dict(r, question=f"{r['question']} #{i}") for i, r in enumerate(rows)]
  return JsonlTask(path=write_jsonl(tmp_path / "e.jsonl", rows), verifier="exact", eval_fraction=0.0)


# --------------------------------------------------------------------------- difficulty


def test_difficulty_is_each_tasks_own_measure(tmp_path, math_jsonl):
  addition = AdditionTask(max_digits=3)
  assert addition.difficulty(addition.make_example(123, 4)) == 3.0
  assert addition.difficulty(Example("7+12=", "19")) == 2.0  # from the prompt when meta is absent
  sorting = SortingTask()
  assert sorting.difficulty(sorting.make_example("52913")) == 5.0
  countdown = CountdownTask()
  assert countdown.difficulty(countdown.make_example([3, 5, 8], 29, "8*3+5")) == 3.0
  # JSONL: a declared field (a number or text ending in one), else the reference answer's length
  levels = {math_jsonl.train_example(0, i).meta["line"]: math_jsonl.difficulty(math_jsonl.train_example(0, i))
            for i in range(20)}
  assert all(level == 1 + (line - 1) % 4 for line, level in levels.items())
  plain = JsonlTask(path=math_jsonl.path)
  ex = plain.train_example(0, 0)
  assert plain.difficulty(ex) == float(len(ex.answer))
  # the generic default reads a declared meta["difficulty"]
  assert Task.difficulty(sorting, Example("p", "abc", {"difficulty": 7})) == 7.0
  assert Task.difficulty(sorting, Example("p", "abc")) == 3.0


@pytest.mark.parametrize("value, message", [
    ("hard", "field 'level' .*must be a finite number or text ending in one"),
    (None, "field 'level' .*must be a finite number"),
    ("missing", "row is missing field 'level'"),
])
def test_bad_difficulty_field_names_file_and_line(tmp_path, value, message):
  rows = gsm8k_rows(3)
  if value == "missing":
    del rows[1]["level"]
  else:
    rows[1]["level"] = value
  with pytest.raises(ValueError, match=r"d.jsonl:2: " + message):
    JsonlTask(path=write_jsonl(tmp_path / "d.jsonl", rows), difficulty_field="level")


def test_countdown_min_numbers_mixes_sizes_and_keeps_the_default_stream():
  default = CountdownTask()
  first = default.train_example(0, 0)
  assert (first.prompt, first.answer) == ("6,17,20->9:", "20+6-17")  # unchanged by the min_numbers option
  mixed = CountdownTask(num_numbers=4, min_numbers=2)
  sizes = collections.Counter(mixed.difficulty(mixed.train_example(0, i)) for i in range(300))
  assert set(sizes) == {2.0, 3.0, 4.0}
  for i in range(50):
    ex = mixed.train_example(1, i)
    assert mixed.reward(ex, ex.answer) == 1.0
  for bad in (1, 5):
    with pytest.raises(ValueError, match="countdown.min_numbers"):
      CountdownTask(num_numbers=4, min_numbers=bad)


# --------------------------------------------------------------------------- preference pairs


def task_cases(math_jsonl, exact_jsonl):
  return {
      "addition": AdditionTask(max_digits=3, reverse_answer=True),
      "addition_shaped": AdditionTask(max_digits=2, partial_credit=0.5, format_reward=0.3),
      "sorting": SortingTask(),
      "sorting_shaped": SortingTask(min_length=1, max_length=4, partial_credit=0.4, format_reward=0.5),
      "countdown": CountdownTask(),
      "countdown_shaped": CountdownTask(num_numbers=4, min_numbers=2, format_reward=0.5),
      "jsonl_math": math_jsonl,
      "jsonl_exact": exact_jsonl,
  }


@pytest.mark.parametrize("name", ["addition", "addition_shaped", "sorting", "sorting_shaped", "countdown",
                                  "countdown_shaped", "jsonl_math", "jsonl_exact"])
def test_every_pair_is_ordered_by_the_tasks_own_reward(name, math_jsonl, exact_jsonl):
  task = task_cases(math_jsonl, exact_jsonl)[name]
  kinds = collections.Counter()
  for i in range(60):
    example = task.train_example(0, i)
    made = task.preference_pairs(example, CounterRng("test", i))
    assert made, f"{name}: no pair for {example.prompt!r}"
    for chosen, rejected, kind in made:
      assert chosen == task.sft_target(example)
      assert task.reward(example, chosen) > task.reward(example, rejected), (example.prompt, rejected, kind)
      kinds[kind] += 1
  assert set(kinds) == set(task.pair_kinds), kinds  # every kind of the task applies somewhere
  # a pair is a function of the example and the random stream alone
  example = task.train_example(0, 7)
  assert task.preference_pairs(example, CounterRng("x")) == task.preference_pairs(example, CounterRng("x"))


def test_task_pair_kinds():
  assert AdditionTask.pair_kinds == ("wrong_digit", "carry", "drop_digit", "extra_digit", "padded")
  assert SortingTask.pair_kinds == TEXT_PAIR_KINDS
  assert CountdownTask.pair_kinds == ("wrong_operator",) + TEXT_PAIR_KINDS


def test_jsonl_pair_kinds_follow_the_verifier(math_jsonl, exact_jsonl):
  assert math_jsonl.pair_kinds == ("wrong_answer", "truncated")
  assert exact_jsonl.pair_kinds == TEXT_PAIR_KINDS
  example = math_jsonl.train_example(0, 3)
  (chosen, rejected, kind), = math_jsonl.preference_pairs(example, CounterRng("w"), ["wrong_answer"])
  # the solution is the same up to the final answer, which has one digit changed
  head = chosen[:chosen.rindex("#### ") + 5]
  assert rejected.startswith(head) and rejected != chosen and len(rejected) == len(chosen)


def test_pairs_the_verifier_does_not_order_are_dropped():
  class Lenient(SortingTask):
    def reward(self, example, response):  # every response is right: no pair can be ordered
      return 1.0

  task = Lenient()
  assert task.preference_pairs(task.train_example(0, 0), CounterRng("l")) == []
  # countdown: changing the operator of 2*2 to + still reaches 4, so that pair is dropped
  countdown = CountdownTask()
  example = countdown.make_example([2, 2], 4, "2*2")
  made = [countdown.preference_pairs(example, CounterRng("c", i), ["wrong_operator"]) for i in range(40)]
  assert [] in made and all(p[0].rejected == "2-2" for p in made if p)
  with pytest.raises(ValueError, match="unknown pair kind"):
    countdown.preference_pairs(example, CounterRng("c"), ["padded"])


def test_text_corruptions():
  rng = CounterRng("t")
  for _ in range(50):
    assert len(pairs.corrupt_text("abcd", "drop_char", rng, "abcd")) == 3
    swapped = pairs.corrupt_text("aabb", "swap_chars", rng, "ab")
    assert swapped == "abab"  # the only adjacent pair of different characters
    wrong = pairs.corrupt_text("abcd", "wrong_char", rng, "abcdxy")
    assert len(wrong) == 4 and sum(a != b for a, b in zip(wrong, "abcd")) == 1
    assert "abcd".startswith(pairs.corrupt_text("abcd", "truncated", rng, "")) and len(
        pairs.corrupt_text("abcd", "truncated", rng, "")) < 4
    changed = pairs.change_digit("x=12", rng)
    assert changed[:2] == "x=" and changed != "x=12" and changed[2:].isdigit()
  assert pairs.corrupt_text("", "drop_char", rng, "ab") is None
  assert pairs.corrupt_text("aaa", "swap_chars", rng, "a") is None
  assert pairs.corrupt_text("aaa", "wrong_char", rng, "a") is None
  assert pairs.change_digit("no digits", rng) is None
  with pytest.raises(ValueError, match="unknown pair kind"):
    pairs.corrupt_text("abc", "bogus", rng, "abc")


# --------------------------------------------------------------------------- extension by protocol, not by name


def test_no_module_checks_for_the_addition_task_by_type():
  """Curation and reward-model pairs go through the Task protocol: no isinstance(..., AdditionTask)."""
  offenders = []
  for path in sorted((ROOT / "jaxrl_llm").rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
          and len(node.args) == 2 and "AdditionTask" in ast.unparse(node.args[1]):
        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not offenders, offenders
