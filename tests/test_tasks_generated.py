"""Generated tasks (addition, sorting, countdown): verifiers, streams, resume, splits."""

import json

import pytest

from jaxrl_llm.tasks import (AdditionTask, CountdownTask, CounterRng, SortingTask, get_task,
                             parse_expression, split_fraction)

GENERATED = ["addition", "sorting", "countdown"]


# Addition.

def test_addition_example_and_reward():
  task = AdditionTask()
  ex = task.make_example(23, 58)
  assert (ex.prompt, ex.answer, task.sft_target(ex)) == ("23+58=", "81", "81")
  assert task.reward(ex, "81") == 1.0
  assert task.reward(ex, " 81\n") == 1.0  # surrounding whitespace stripped
  for wrong in ("80", "18", "081", "", "8 1", "81.0", "eighty-one"):
    assert task.reward(ex, wrong) == 0.0, wrong


def test_addition_reverse_answer():
  task = AdditionTask(reverse_answer=True)
  ex = task.make_example(23, 58)
  assert (ex.prompt, ex.answer) == ("23+58=", "18")
  assert task.reward(ex, "18") == 1.0 and task.reward(ex, "81") == 0.0
  assert task.make_example(999, 1).answer == "0001"  # 1000 reversed


def test_addition_shaping_options():
  task = AdditionTask(partial_credit=0.5, format_reward=0.1)
  ex = task.make_example(23, 58)
  assert task.reward(ex, "81") == 1.0
  assert task.reward(ex, "80") == pytest.approx(0.1 + 0.5 * 1 / 2)  # digits, 1 of 2 in place
  assert task.reward(ex, "8x") == pytest.approx(0.5 * 1 / 2)  # not digits: no format reward
  assert task.reward(ex, "123") == pytest.approx(0.1)  # digits, none in place
  with pytest.raises(ValueError, match="partial_credit \\+ format_reward"):
    AdditionTask(partial_credit=0.6, format_reward=0.5)
  with pytest.raises(ValueError, match="addition.format_reward"):
    AdditionTask(format_reward=-0.1)


def test_addition_config_errors():
  with pytest.raises(ValueError, match="addition.min_digits"):
    AdditionTask(min_digits=0)
  with pytest.raises(ValueError, match="addition.max_digits"):
    AdditionTask(min_digits=3, max_digits=2)
  with pytest.raises(ValueError, match="addition.eval_fraction"):
    AdditionTask(eval_fraction=1.0)


def test_addition_digit_range():
  task = AdditionTask(min_digits=3, max_digits=3)
  it = task.train_prompts(seed=1)
  for _ in range(300):
    ex = next(it)
    assert 100 <= ex.meta["a"] <= 999 and 100 <= ex.meta["b"] <= 999
    assert ex.answer == str(ex.meta["a"] + ex.meta["b"])
  lengths = {len(str(next(it).meta["a"])) for _ in range(300)}
  assert lengths == {3}
  mixed = AdditionTask(min_digits=1, max_digits=3).train_prompts(seed=1)
  assert {len(str(next(mixed).meta["a"])) for _ in range(300)} == {1, 2, 3}


def test_addition_split_is_commutative():
  task = AdditionTask(eval_fraction=0.3)
  for a, b in [(3, 5), (12, 97), (40, 4), (0, 99)]:
    assert task.is_eval(task.make_example(a, b)) == task.is_eval(task.make_example(b, a))


# Sorting.

def test_sorting_example_and_reward():
  task = SortingTask()
  ex = task.make_example("52913")
  assert (ex.prompt, ex.answer) == ("sort:52913=", "12359")
  assert task.reward(ex, "12359") == 1.0 and task.reward(ex, "12359 ") == 1.0
  assert task.reward(ex, "12395") == 0.0 and task.reward(ex, "1235") == 0.0
  assert SortingTask(descending=True).make_example("52913").answer == "95321"
  shaped = SortingTask(partial_credit=0.5, format_reward=0.2)
  assert shaped.reward(ex, "12395") == pytest.approx(0.2 + 0.5 * 3 / 5)  # a permutation
  assert shaped.reward(ex, "12358") == pytest.approx(0.5 * 4 / 5)  # not a permutation
  with pytest.raises(ValueError, match="sorting.max_length"):
    SortingTask(min_length=4, max_length=3)


# Countdown.

@pytest.mark.parametrize("text,value,numbers", [
    ("8*3+5", 29, (8, 3, 5)),
    ("(8-3)*5", 25, (8, 3, 5)),
    ("8-3-5", 0, (8, 3, 5)),  # left associative
    ("8-(3-5)", 10, (8, 3, 5)),
    (" 2 * (3 + 4) ", 14, (2, 3, 4)),
    ("3+4*5", 23, (3, 4, 5)),  # precedence
    ("((7))", 7, (7,)),
])
def test_parse_expression_values(text, value, numbers):
  parsed = parse_expression(text)
  assert parsed is not None and parsed.value == value and parsed.numbers == numbers


@pytest.mark.parametrize("text", [
    "", "8/2", "2**3", "-3+5", "08+1", "(1+2", "1+", "1 2", "__import__('os')",
    "eval('1')", "1+2=3", "x", "(" * 20 + "1" + ")" * 20, "1+" * 150 + "1",
])
def test_parse_expression_rejects(text):
  assert parse_expression(text) is None


def test_countdown_reward():
  task = CountdownTask()
  ex = task.make_example([3, 5, 8], 29, "8*3+5")
  assert ex.prompt == "3,5,8->29:"
  assert task.reward(ex, "8*3+5") == 1.0
  assert task.reward(ex, "5+3*8") == 1.0  # any correct expression
  assert task.reward(ex, "8*3+5*1") == 0.0  # 1 is not given
  assert task.reward(ex, "8*3") == 0.0  # must use every number
  assert task.reward(ex, "8+3+5") == 0.0  # wrong value
  assert task.reward(ex, "29") == 0.0
  assert task.reward(ex, "8*3+5+5") == 0.0  # 5 used twice
  shaped = CountdownTask(format_reward=0.1)
  assert shaped.reward(ex, "8+3+5") == pytest.approx(0.1)
  assert shaped.reward(ex, "8+3") == 0.0
  subset = CountdownTask(use_all_numbers=False)
  ex8 = subset.make_example([3, 5, 8], 8, "3+5")
  assert subset.reward(ex8, "3+5") == 1.0 and subset.reward(ex8, "8") == 1.0
  assert subset.reward(ex8, "8+5-5") == 0.0


def test_countdown_generated_problems_are_solvable():
  task = CountdownTask(num_numbers=4, max_target=50)
  it = task.train_prompts(seed=2)
  for _ in range(200):
    ex = next(it)
    assert 1 <= ex.meta["target"] <= 50 and len(ex.meta["numbers"]) == 4
    assert task.reward(ex, task.sft_target(ex)) == 1.0, ex


def test_counter_rng():
  a = [CounterRng("x", 1).randint(0, 9) for _ in range(3)]
  assert a[0] == a[1] == a[2]  # fresh generator, same first draw
  rng = CounterRng("x", 1)
  draws = [rng.randint(-2, 2) for _ in range(500)]
  assert set(draws) == {-2, -1, 0, 1, 2}
  with pytest.raises(ValueError, match="high"):
    rng.randint(3, 2)


# Every generated task: streams, resume, split.

@pytest.mark.parametrize("name", GENERATED)
def test_gold_answers_score_one_and_alphabet_covers(name):
  task = get_task(name)
  it = task.train_prompts(seed=0)
  examples = [next(it) for _ in range(300)] + task.eval_prompts(30, seed=0)
  chars = set(task.alphabet)
  assert list(task.alphabet) == sorted(chars)
  for ex in examples:
    assert task.reward(ex, task.sft_target(ex)) == 1.0
    assert set(ex.prompt) | set(ex.answer) <= chars, ex


@pytest.mark.parametrize("name", GENERATED)
def test_stream_deterministic_and_seeded(name):
  task = get_task(name)
  a = [next(task.train_prompts(seed=5, position=i)) for i in range(50)]
  it = task.train_prompts(seed=5)
  assert [next(it) for _ in range(50)] == a
  it6 = task.train_prompts(seed=6)
  assert [next(it6) for _ in range(50)] != a


@pytest.mark.parametrize("name", GENERATED)
def test_resume_mid_stream(name):
  task = get_task(name)
  it = task.train_prompts(seed=11)
  for _ in range(37):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # survives a JSON checkpoint
  assert state == {"task": name, "seed": 11, "position": 37}
  expected = [next(it) for _ in range(25)]
  resumed = task.train_prompts(seed=0)
  resumed.set_state(state)
  assert [next(resumed) for _ in range(25)] == expected


def test_set_state_errors():
  it = get_task("addition").train_prompts()
  with pytest.raises(ValueError, match="task 'sorting'"):
    it.set_state({"task": "sorting", "seed": 0, "position": 1})
  with pytest.raises(ValueError, match="'position'"):
    it.set_state({"seed": 0})
  with pytest.raises(ValueError, match="seed"):
    get_task("addition").train_prompts(seed=-1)


@pytest.mark.parametrize("name", GENERATED)
def test_train_and_eval_are_disjoint(name):
  task = get_task(name, eval_fraction=0.1)
  it = task.train_prompts(seed=0)
  train_keys = {task.split_key(next(it)) for _ in range(3000)}
  eval_set = task.eval_prompts(100, seed=0)
  eval_keys = {task.split_key(ex) for ex in eval_set}
  assert len({ex.prompt for ex in eval_set}) == 100  # distinct prompts
  assert not train_keys & eval_keys
  assert all(task.is_eval(ex) for ex in eval_set)
  assert task.eval_prompts(100, seed=0) == eval_set  # deterministic
  assert task.eval_prompts(100, seed=1) != eval_set


def test_split_fraction_is_uniform_and_salted():
  keys = [f"{a}+{b}" for a in range(100) for b in range(a, 100)]
  share = sum(split_fraction(k) < 0.1 for k in keys) / len(keys)
  assert 0.08 < share < 0.12
  salted = sum(split_fraction(k, "other") < 0.1 for k in keys) / len(keys)
  assert 0.08 < salted < 0.12
  assert [split_fraction(k) < 0.1 for k in keys] != [split_fraction(k, "other") < 0.1 for k in keys]


def test_eval_errors():
  tiny = AdditionTask(min_digits=1, max_digits=1, eval_fraction=0.05)  # ~3 held-out pairs of 55
  with pytest.raises(ValueError, match="distinct held-out problems"):
    tiny.eval_prompts(50)
  with pytest.raises(ValueError, match="eval_fraction is 0"):
    AdditionTask(eval_fraction=0.0).eval_prompts(1)
  assert AdditionTask(eval_fraction=0.0).eval_prompts(0) == []
