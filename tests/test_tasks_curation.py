"""Data curation: pass rates, retirement, prioritised and curriculum sampling, dynamic sampling."""

import collections
import dataclasses
import hashlib
import json

import numpy as np
import pytest

from jaxrl_llm import settings
from jaxrl_llm.tasks import AdditionTask, CountdownTask, Example, JsonlTask, PromptSource, SortingTask
from jaxrl_llm.tasks.base import CounterRng
from jaxrl_llm.tasks.curation import (CuratedPromptSource, CurationConfig, InformativeGroupCollector,
                                      PassRateTracker, prompt_key, weighted_sample_without_replacement,
                                      zero_variance_groups)

ONE_DIGIT = AdditionTask(min_digits=1, max_digits=1)  # ~95 training problems: prompts recur


def fake_rewards(batch, n, salt=0):
  """Deterministic 0/1 rewards from the prompt text and sample index."""
  out = []
  for ex in batch.examples:
    for j in range(n):
      h = hashlib.blake2b(f"{salt}|{ex.prompt}|{j}".encode(), digest_size=1).digest()[0]
      out.append(float(h % 3 != 0))
  return np.asarray(out, np.float32)


def prompts(batch):
  return [ex.prompt for ex in batch.examples]


# --------------------------------------------------------------------------- tracker


def test_tracker_window_attempts_capacity_and_state():
  t = PassRateTracker(window=3)
  assert t.pass_rate("a") is None and t.attempts("a") == 0
  t.record(["a", "a", "b"], [1.0, 0.0, 1.0])
  assert t.pass_rate("a") == 0.5 and t.attempts("a") == 2 and t.pass_rate("b") == 1.0
  t.record(["a", "a"], [1, 1])  # window keeps the last 3: [0, 1, 1]
  assert t.pass_rate("a") == pytest.approx(2 / 3) and t.attempts("a") == 4
  assert t.mean_pass_rate() == pytest.approx((2 / 3 + 1) / 2)
  restored = PassRateTracker(window=3)
  restored.set_state(json.loads(json.dumps(t.get_state())))
  assert restored.get_state() == t.get_state() and restored.pass_rate("a") == t.pass_rate("a")
  small = PassRateTracker(window=1)
  small.set_state(t.get_state())  # a smaller window keeps the latest attempt
  assert small.pass_rate("a") == 1.0 and small.attempts("a") == 4
  t.forget("a")
  assert "a" not in t and t.keys() == ["b"]
  lru = PassRateTracker(window=2, capacity=2)
  lru.record(["x", "y"], [0, 0])
  lru.record(["x", "z"], [1, 1])  # y is the least recently recorded
  assert lru.keys() == ["x", "z"] and lru.pass_rate("y") is None


def test_tracker_bad_input():
  with pytest.raises(ValueError, match="window"):
    PassRateTracker(window=0)
  t = PassRateTracker(window=2)
  with pytest.raises(ValueError, match="success_b"):
    t.record(["a"], [1.5])
  with pytest.raises(ValueError, match="success_b"):
    t.record(["a", "b"], [1.0])
  with pytest.raises(ValueError, match="entries"):
    t.set_state({"entries": [["a", 1]]})


# --------------------------------------------------------------------------- retirement


def test_retirement_needs_a_full_window_and_pass_rate_at_least_drop():
  source = CuratedPromptSource(ONE_DIGIT, 1, seed=0, samples_per_prompt=4, window=8)
  assert source.config.attempts_to_retire == 8  # min_attempts defaults to the window
  batch = source.next_batch()
  assert source.record(batch, [1, 1, 1, 1]) == []  # 4 attempts < 8, although 4/4 solved
  assert source.record(batch, [1, 1, 1, 0]) == []  # 7/8 = 0.875 < 0.9
  assert source.record(batch, [1, 1, 1, 1]) == []  # last 8: [1,1,1,0,1,1,1,1] -> 0.875
  assert source.record(batch, [1, 1, 1, 1]) == [prompt_key(batch.examples[0])]  # 8/8
  assert source.is_retired(batch.examples[0])
  assert source.metrics()["curation/retired_total"] == 1.0
  assert source.tracker.pass_rate(prompt_key(batch.examples[0])) is None  # forgotten
  # 9/10 with window 10 reaches 0.9 exactly: retired
  other = CuratedPromptSource(ONE_DIGIT, 1, seed=0, samples_per_prompt=5, window=10)
  b = other.next_batch()
  assert other.record(b, [1, 1, 1, 1, 0]) == []
  assert len(other.record(b, [1, 1, 1, 1, 1])) == 1
  # a threshold above 1.0 means partial rewards never count as success
  strict = CuratedPromptSource(ONE_DIGIT, 1, seed=0, samples_per_prompt=4, window=4, success_threshold=1.0)
  b = strict.next_batch()
  assert strict.record(b, [0.99] * 4) == [] and strict.tracker.pass_rate(prompt_key(b.examples[0])) == 0.0
  disabled = CuratedPromptSource(ONE_DIGIT, 1, seed=0, samples_per_prompt=4, window=4, retire_solved=False)
  b = disabled.next_batch()
  assert disabled.record(b, [1] * 4) == [] and not disabled.is_retired(b.examples[0])


@pytest.mark.parametrize("strategy", ["stream", "prioritized", "curriculum"])
def test_retired_prompts_are_never_drawn_again(strategy):
  source = CuratedPromptSource(ONE_DIGIT, 4, seed=1, samples_per_prompt=2, strategy=strategy, window=2,
                               pool_size=8, levels=(1.0,))
  retired = set()
  for step in range(60):
    batch = source.next_batch()
    assert not retired & set(prompts(batch)), f"step {step}: a retired prompt was drawn"
    # prompts whose first operand is even are always solved, the others never
    rewards = np.repeat([float(ex.meta["a"] % 2 == 0) for ex in batch.examples], 2)
    keys = set(source.record(batch, rewards))
    retired |= {ex.prompt for ex in batch.examples if prompt_key(ex) in keys}
    assert all(ex.meta["a"] % 2 == 0 for ex in batch.examples if ex.prompt in retired)
  assert len(retired) >= 10
  assert source.metrics()["curation/retired_total"] == len(retired)
  if strategy == "prioritized":
    pooled = {source.example(p).prompt for p, _ in source.get_state()["pool"]}
    assert not pooled & retired and 0 < len(pooled) <= 8  # refilled at the next draw


def test_running_out_of_prompts_is_a_clear_error():
  source = CuratedPromptSource(ONE_DIGIT, 4, seed=0, samples_per_prompt=1, window=1, max_skip=500)
  with pytest.raises(RuntimeError, match="run out of usable prompts"):
    for _ in range(200):
      batch = source.next_batch()
      source.record(batch, [1.0] * 4)


# --------------------------------------------------------------------------- prioritised sampling


def test_weighted_sample_without_replacement():
  rng = CounterRng("t", 0)
  for _ in range(50):
    picks = weighted_sample_without_replacement([0.0, 2.0, 0.0, 1.0, 3.0], 3, rng)
    assert sorted(picks) == [1, 3, 4]  # zero weights only when nothing else is left
  assert sorted(weighted_sample_without_replacement([0.0, 0.0, 1.0], 3, rng)) == [0, 1, 2]
  first = collections.Counter(weighted_sample_without_replacement([1.0, 3.0], 1, rng)[0] for _ in range(4000))
  assert abs(first[1] / 4000 - 0.75) < 0.03
  with pytest.raises(ValueError, match="weights"):
    weighted_sample_without_replacement([1.0, -1.0], 1, rng)
  with pytest.raises(ValueError, match="k must be"):
    weighted_sample_without_replacement([1.0], 2, rng)


def test_prioritized_draw_frequencies_follow_one_minus_success():
  source = CuratedPromptSource(ONE_DIGIT, 1, seed=3, samples_per_prompt=4, strategy="prioritized", pool_size=5,
                               window=4, retire_solved=False, max_uses=0, priority_floor=0.05, prior_success=0.5)
  source.next_batch()  # fills the pool
  pool = [source.example(p) for p, _ in source.get_state()["pool"]]
  successes = {0: [0, 0, 0, 0], 1: [1, 0, 0, 0], 2: [1, 1, 0, 0], 3: [1, 1, 1, 1]}  # pool[4]: unseen
  for i, s in successes.items():
    source.tracker.record([prompt_key(pool[i])] * 4, s)
  weights = np.array([1.0, 0.75, 0.5, 0.0, 0.5]) + 0.05  # 1 - success + floor (prior 0.5 for unseen)
  np.testing.assert_allclose(source.priorities(), weights)
  draws = 5000
  counts = collections.Counter(source.next_batch().examples[0].prompt for _ in range(draws))
  expected = weights / weights.sum()
  for ex, p in zip(pool, expected):
    assert abs(counts[ex.prompt] / draws - p) < 0.025, (ex.prompt, counts[ex.prompt] / draws, p)
  assert set(counts) == {ex.prompt for ex in pool}


def test_prioritized_batches_are_distinct_and_max_uses_turns_the_pool_over():
  source = CuratedPromptSource(AdditionTask(), 4, seed=0, samples_per_prompt=2, strategy="prioritized",
                               pool_size=6, max_uses=2, retire_solved=False)
  seen_positions = set()
  uses = collections.Counter()
  for _ in range(30):
    batch = source.next_batch()
    assert len(set(batch.positions)) == 4
    uses.update(batch.positions)
    seen_positions |= set(batch.positions)
    source.record(batch, fake_rewards(batch, 2))
  assert max(uses.values()) <= 2 and len(seen_positions) > 30
  m = source.metrics()
  assert m["curation/pool_size"] <= 6 and m["curation/exhausted_total"] > 0


# --------------------------------------------------------------------------- curriculum


def test_curriculum_promotes_on_pass_rate():
  task = AdditionTask(min_digits=1, max_digits=3)
  assert task.difficulty(task.make_example(123, 4)) == 3.0  # digits of the longer operand
  source = CuratedPromptSource(task, 2, seed=0, samples_per_prompt=4, strategy="curriculum", level_window=8,
                               promote_pass_rate=0.75, retire_solved=False)
  assert source.levels == (1.0, 2.0, 3.0)
  level_of = lambda ex: int(task.difficulty(ex))
  batch = source.next_batch()
  assert all(level_of(ex) == 1 for ex in batch.examples)
  source.record(batch, [1, 1, 1, 0, 1, 0, 0, 0])  # 4/8 < 0.75: stays
  assert source.level == 0
  batch = source.next_batch()
  source.record(batch, [1, 1, 1, 1, 1, 1, 0, 1])  # last 8 attempts: 7/8 >= 0.75
  assert source.level == 1 and source.metrics()["curation/level"] == 1.0
  digits = collections.Counter()
  for _ in range(20):
    batch = source.next_batch()
    digits.update(level_of(ex) for ex in batch.examples)
    source.record(batch, [0.0] * 8)  # failing: no promotion
  assert set(digits) == {1, 2} and source.level == 1
  for _ in range(40):  # successes on easier (level-1) prompts do not promote
    batch = source.next_batch()
    source.record(batch, np.repeat([float(level_of(ex) == 1) for ex in batch.examples], 4))
  assert source.level == 1
  for _ in range(20):  # only level-2 prompts count towards promotion
    batch = source.next_batch()
    source.record(batch, np.repeat([float(level_of(ex) == 2) for ex in batch.examples], 4))
    if source.level == 2:
      break
  assert source.level == 2
  assert {level_of(ex) for _ in range(20) for ex in source.next_batch().examples} == {1, 2, 3}
  assert source.metrics()["curation/level"] == 2.0  # the last level: no further promotion


def test_curriculum_step_schedule_custom_difficulty_and_levels():
  task = AdditionTask(min_digits=1, max_digits=3)
  source = CuratedPromptSource(task, 4, seed=2, strategy="curriculum", schedule="steps", steps_per_level=2,
                               difficulty=lambda ex: len(ex.answer), levels=(2, 3))
  lengths = [max(len(ex.answer) for ex in source.next_batch().examples) for _ in range(8)]
  assert max(lengths[:2]) <= 2 and max(lengths) == 4  # the last level admits everything
  assert source.level == 1
  assert source.level_of(Example("1+1=", "12345")) == 1  # harder than every ceiling: last level


def level_rows(n):
  return [{"question": f"q{i}", "answer": f"#### {i}", "level": f"Level {1 + i % 3}"} for i in range(n)]


@pytest.mark.parametrize("name", ["sorting", "countdown", "jsonl"])
def test_curriculum_orders_any_task_by_its_difficulty(name, tmp_path):
  if name == "jsonl":
    path = tmp_path / "levels.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in level_rows(90)))
    task, expected = JsonlTask(path=str(path), difficulty_field="level", eval_fraction=0.1), (1.0, 2.0, 3.0)
  else:
    task, expected = {"sorting": (SortingTask(min_length=2, max_length=5), (2.0, 3.0, 4.0, 5.0)),
                      "countdown": (CountdownTask(num_numbers=4, min_numbers=2), (2.0, 3.0, 4.0))}[name]
  source = CuratedPromptSource(task, 4, seed=0, samples_per_prompt=2, strategy="curriculum", level_window=8,
                               promote_pass_rate=1.0, retire_solved=False)
  assert source.levels == expected  # probed from task.difficulty
  seen = []
  for _ in range(200):
    batch = source.next_batch()
    ceiling = source.levels[source.level]
    assert all(task.difficulty(ex) <= ceiling for ex in batch.examples)
    seen.append((source.level, max(task.difficulty(ex) for ex in batch.examples)))
    # the policy solves exactly the problems at or below the current ceiling: the level rises one at a time
    source.record(batch, np.repeat([float(task.difficulty(ex) <= ceiling) for ex in batch.examples], 2))
    if source.level == len(expected) - 1:
      break
  assert source.level == len(expected) - 1 and source.metrics()["curation/ceiling"] == expected[-1]
  assert seen[0] == (0, expected[0])  # the first batch holds only the easiest problems
  assert [lv for lv, _ in seen] == sorted(lv for lv, _ in seen)


# --------------------------------------------------------------------------- state and determinism


def run_steps(source, steps, n, salt=0):
  out = []
  for _ in range(steps):
    batch = source.next_batch()
    out.append((batch.positions, prompts(batch)))
    source.record(batch, fake_rewards(batch, n, salt))
  return out


CONFIGS = {
    "stream": dict(strategy="stream", window=2),
    "prioritized": dict(strategy="prioritized", window=2, pool_size=12, max_uses=3),
    "curriculum": dict(strategy="curriculum", window=2, level_window=4, promote_pass_rate=0.5),
}


@pytest.mark.parametrize("strategy", sorted(CONFIGS))
def test_state_round_trip_and_determinism(strategy):
  task = AdditionTask(min_digits=1, max_digits=2)
  make = lambda seed=5: CuratedPromptSource(task, 3, seed=seed, samples_per_prompt=2, **CONFIGS[strategy])
  a, b = make(), make()
  assert run_steps(a, 12, 2) == run_steps(b, 12, 2)  # two instances, same seed
  assert run_steps(make(seed=6), 12, 2) != run_steps(make(), 12, 2)
  state = json.loads(json.dumps(a.get_state()))
  resumed = make()
  resumed.set_state(state)
  assert resumed.get_state() == a.get_state()
  assert run_steps(resumed, 10, 2, salt=1) == run_steps(a, 10, 2, salt=1)
  assert resumed.metrics() == a.metrics()
  # batches drawn but not recorded are handed out again, in order, after a restore
  first, second = a.next_batch(), a.next_batch()
  a.record(first, fake_rewards(first, 2))
  state = json.loads(json.dumps(a.get_state()))
  resumed = make()
  resumed.set_state(state)
  replayed = resumed.next_batch()
  assert replayed == second
  for src, batch in ((a, second), (resumed, replayed)):
    src.record(batch, fake_rewards(batch, 2))
  assert run_steps(resumed, 5, 2) == run_steps(a, 5, 2)


def test_record_accepts_examples_and_a_plain_prompt_source_state():
  task = AdditionTask()
  source = CuratedPromptSource(task, 2, seed=0, samples_per_prompt=2)
  batch = source.next_batch()
  source.record(list(batch.examples), [1, 0, 1, 1])  # matched by prompt keys
  assert source.get_state()["outstanding"] == []
  plain = PromptSource(task, 2, seed=0)
  for _ in range(3):
    plain.next_batch()
  curated = CuratedPromptSource(task, 2, seed=0)
  curated.set_state(plain.get_state())
  assert curated.next_batch() == plain.next_batch()


def test_source_bad_input():
  task = AdditionTask()
  with pytest.raises(ValueError, match="strategy"):
    CuratedPromptSource(task, 2, strategy="random")
  with pytest.raises(ValueError, match="window"):
    CuratedPromptSource(task, 2, window=0)
  with pytest.raises(ValueError, match="drop_pass_rate"):
    CurationConfig(drop_pass_rate=1.5)
  with pytest.raises(ValueError, match="pool_size"):
    CuratedPromptSource(task, 8, strategy="prioritized", pool_size=4)
  with pytest.raises(ValueError, match="levels"):
    CurationConfig(strategy="curriculum", levels=(2, 1))
  with pytest.raises(ValueError, match="unknown curation field"):
    CuratedPromptSource(task, 2, windw=3)
  source = CuratedPromptSource(task, 2, samples_per_prompt=3)
  batch = source.next_batch()
  with pytest.raises(ValueError, match=r"rewards_b must have shape \[G \* N\]"):
    source.record(batch, [1.0] * 5)
  with pytest.raises(ValueError, match="finite"):
    source.record(batch, [1.0] * 5 + [float("nan")])
  with pytest.raises(ValueError, match="strategy"):
    CuratedPromptSource(task, 2, strategy="prioritized").set_state(source.get_state())
  with pytest.raises(ValueError, match="task"):
    CuratedPromptSource(task, 2).set_state({**source.get_state(), "task": "sorting"})
  with pytest.raises(ValueError, match="seed"):
    CuratedPromptSource(task, 2, seed=9).set_state(source.get_state())


def test_curation_settings_are_declared_once_with_meaning_and_check():
  fields = dataclasses.fields(CurationConfig)
  assert [f.name for f in settings.config_fields(CurationConfig)] == [f.name for f in fields]
  for f in fields:
    assert f.metadata["doc"] and "\n" not in f.metadata["doc"], f.name
    assert f.metadata["check"](settings.default_of(f)), f.name  # every default passes its own check
  bad = {"strategy": "random", "success_threshold": float("nan"), "window": 0, "min_attempts": -1,
         "retire_solved": 1, "drop_pass_rate": 1.5, "priority_floor": float("inf"), "max_uses": 2.5,
         "schedule": "daily", "levels": (2, 1), "level_window": True}
  errors = settings.field_errors(CurationConfig, bad, "data")
  assert {e.split("=")[0] for e in errors if "missing" not in e} == {f"data.{k}" for k in bad}
  assert "data.levels=(2, 1): expected a strictly ascending list of finite numbers" in "; ".join(errors)
  with pytest.raises(ValueError, match=r"data.window=0: expected a positive integer"):
    CurationConfig(window=0)
  assert CurationConfig(levels=[1, 2.5]).levels == (1.0, 2.5)
  assert CurationConfig(min_attempts=0, window=5).attempts_to_retire == 5


# --------------------------------------------------------------------------- dynamic sampling


def test_zero_variance_groups():
  np.testing.assert_array_equal(zero_variance_groups([1, 1, 0, 1, 0.5, 0.5], 2), [True, False, True])
  np.testing.assert_array_equal(zero_variance_groups([1, 0.999], 2, tolerance=0.01), [True])
  with pytest.raises(ValueError, match="rewards_b"):
    zero_variance_groups([1, 1, 1], 2)


def test_collector_hand_checked_rounds():
  c = InformativeGroupCollector(target_groups=3, group_size=2, max_rounds=4)
  assert not c.add([1, 1, 0, 1, 0, 0, 1, 0])  # round 0: groups 1 and 3 informative
  assert c.groups_needed == 1
  assert c.add([1, 1, 1, 0, 0, 1])  # round 1: groups 1 and 2 informative; one is surplus
  out = c.result()
  np.testing.assert_array_equal(out.rows_b, [2, 3, 6, 7, 10, 11])  # round 1 starts at row 8
  np.testing.assert_array_equal(out.round_g, [0, 0, 1])
  np.testing.assert_array_equal(out.group_g, [1, 3, 1])
  assert not out.zero_variance_g.any()
  assert (out.rounds, out.discarded_groups, out.surplus_groups, out.padded_groups) == (2, 3, 1, 0)
  np.testing.assert_array_equal(out.rows_of_round(0, 2), [2, 3, 6, 7])
  np.testing.assert_array_equal(out.rows_of_round(1, 2), [2, 3])
  assert out.metrics()["data/dynamic_rounds"] == 2.0
  with pytest.raises(ValueError, match="done"):
    c.add([1, 0])
  c.reset()
  assert c.rounds == 0 and c.groups_needed == 3


def test_collector_pads_after_max_rounds_and_reports_shortfall():
  c = InformativeGroupCollector(target_groups=3, group_size=2, max_rounds=2)
  c.add([1, 1, 0, 1, 0, 0])
  assert c.add([1, 0, 1, 1, 1, 1])
  out = c.result()
  # two informative groups (round 0 group 1, round 1 group 0) + the earliest flat one
  np.testing.assert_array_equal(out.rows_b, [0, 1, 2, 3, 6, 7])
  np.testing.assert_array_equal(out.zero_variance_g, [True, False, False])
  assert (out.padded_groups, out.discarded_groups, out.missing_groups) == (1, 3, 0)
  short = InformativeGroupCollector(target_groups=5, group_size=2, max_rounds=1)
  short.add([1, 0, 1, 1])
  assert short.result().missing_groups == 3
  with pytest.raises(ValueError, match="no round"):
    InformativeGroupCollector(2, 2).result()
  with pytest.raises(ValueError, match="target_groups"):
    InformativeGroupCollector(0, 2)


def test_collector_never_returns_a_flat_group_when_enough_exist():
  rng = np.random.default_rng(0)
  for trial in range(200):
    n, target = int(rng.integers(2, 5)), int(rng.integers(1, 6))
    c = InformativeGroupCollector(target, n, max_rounds=50)
    rounds = []
    while not c.done:
      r = rng.integers(0, 2, size=int(rng.integers(1, 8)) * n).astype(np.float32)
      r[rng.random(r.shape) < 0.5] = 1.0  # many flat groups
      rounds.append(r)
      c.add(r)
    out = c.result()
    rewards = np.concatenate(rounds)
    assert out.rows_b.shape == (target * n,), trial
    assert not zero_variance_groups(rewards[out.rows_b], n).any(), trial
    assert np.all(np.diff(out.rows_b) > 0)  # arrival order
