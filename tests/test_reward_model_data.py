"""Preference data: JSONL validation (file:line), identical pairs, held-out split, chat template,
built-in pairs of every task (through the task protocol) and pair batches."""

import json

import ml_collections
import numpy as np
import pytest

from jaxrl_llm import bridge
from jaxrl_llm.reward_model import encoding, preferences as P
from jaxrl_llm.tasks import AdditionTask, CountdownTask, JsonlTask, SortingTask


def write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


GOOD = {"prompt": "1+1=", "chosen": "2", "rejected": "3"}


@pytest.mark.parametrize("row, message", [
    ({"prompt": "1+1=", "chosen": "2"}, r"prefs.jsonl:3: preference row is missing field 'rejected'"),
    ({"chosen": "2", "rejected": "3"}, r"prefs.jsonl:3: preference row is missing field 'prompt'"),
    ('{"prompt": "1+1=", "chosen": ', r"prefs.jsonl:3: invalid JSON"),
    ('["a", "b"]', r"prefs.jsonl:3: expected a JSON object, got list"),
    ({"prompt": 5, "chosen": "2", "rejected": "3"}, r"prefs.jsonl:3: field 'prompt' must be a string or a list"),
    ({"prompt": "x", "chosen": 2, "rejected": "3"}, r"prefs.jsonl:3: field 'chosen' must be a string or one"),
    ({"prompt": "x", "chosen": "2", "rejected": "3", "margin": "big"},
     r"prefs.jsonl:3: field 'margin' must be a finite number"),
    ({"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "3"},
     r"prefs.jsonl:3: field 'chosen' must be a string or one assistant message"),
])
def test_bad_rows_name_file_and_line(tmp_path, row, message):
  path = write(tmp_path / "prefs.jsonl", [GOOD, "", row])  # line 2 is blank, the bad row is on line 3
  with pytest.raises(ValueError, match=message):
    P.load_preference_jsonl(path)


def test_identical_pairs_are_counted_and_skipped(tmp_path, caplog):
  rows = [GOOD, {"prompt": "2+2=", "chosen": "4", "rejected": " 4 "}, {"prompt": "a", "chosen": "b", "rejected": "b"},
          {"prompt": "3+3=", "chosen": "6", "rejected": "7", "margin": 1.5}]
  pairs, stats = P.load_preference_jsonl(write(tmp_path / "p.jsonl", rows))
  assert stats == {"rows": 4, "kept": 2, "identical_skipped": 2}
  assert [p.prompt for p in pairs] == ["1+1=", "3+3="]
  assert pairs[1].margin == 1.5 and pairs[0].margin is None
  assert pairs[1].source.endswith("p.jsonl:4")
  assert "2 of 4 preference rows have identical chosen and rejected texts" in caplog.text
  with pytest.raises(ValueError, match="no usable preference pairs"):
    P.load_preference_jsonl(write(tmp_path / "q.jsonl", [rows[2]]))


def test_custom_field_names_and_chat_messages(tmp_path):
  rows = [{"q": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}],
           "good": [{"role": "assistant", "content": "hello"}], "bad": "go"}]
  pairs, _ = P.load_preference_jsonl(write(tmp_path / "p.jsonl", rows), prompt_field="q", chosen_field="good",
                                     rejected_field="bad")
  assert pairs[0].prompt == ({"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"})
  assert pairs[0].chosen == "hello" and pairs[0].rejected == "go"


def test_held_out_split_by_prompt_and_eval_file(tmp_path):
  rows = [{"prompt": f"q{i % 40}", "chosen": "a", "rejected": f"b{i}"} for i in range(200)]
  data = P.jsonl_preferences(write(tmp_path / "p.jsonl", rows), eval_fraction=0.3, seed=1)
  train_prompts = {p.prompt for p in data.train}
  eval_prompts = {p.prompt for p in data.eval_pairs}
  assert train_prompts and eval_prompts and not train_prompts & eval_prompts
  assert len(data.train) + len(data.eval_pairs) == 200
  # the stream is a deterministic function of (seed, position) and visits each pair once per epoch
  n = len(data.train)
  epoch = [data.train_pair(i) for i in range(n)]
  assert sorted(p.rejected for p in epoch) == sorted(p.rejected for p in data.train)
  again = P.jsonl_preferences(str(tmp_path / "p.jsonl"), eval_fraction=0.3, seed=1)
  assert [again.train_pair(i) for i in range(n + 5)] == epoch + [data.train_pair(n + i) for i in range(5)]
  held = P.jsonl_preferences(str(tmp_path / "p.jsonl"), seed=1,
                             eval_path=write(tmp_path / "e.jsonl", [{"prompt": "q3", "chosen": "a", "rejected": "z"}]))
  assert [p.prompt for p in held.eval_pairs] == ["q3"]
  assert "q3" not in {p.prompt for p in held.train} and len(held.train) == 195


def test_builtin_addition_pairs():
  task = AdditionTask(max_digits=2, reverse_answer=True)
  data = P.TaskPreferences(task, seed=0, eval_prompts=64, eval_pairs=100)
  assert len(data.eval_pairs) == 100 and data.stats["eval_prompts"] == 64
  pairs = [data.train_pair(i) for i in range(300)] + data.eval_pairs
  for p in pairs:
    example = task.make_example(*map(int, p.prompt.rstrip("=").split("+")))
    assert task.reward(example, p.chosen) == 1.0, p
    assert task.reward(example, p.rejected) < 1.0, p
    assert p.chosen != p.rejected and p.rejected.isdigit()
  assert {p.kind for p in pairs} == set(task.pair_kinds)
  padded = [p for p in pairs if p.kind == "padded"]
  assert all(p.rejected.startswith(p.chosen) and set(p.rejected[len(p.chosen):]) == {"0"} for p in padded)
  # training pairs come from training problems, held-out pairs from held-out problems
  assert not any(task.is_eval(task.make_example(*map(int, p.prompt.rstrip("=").split("+")))) for p in pairs[:300])
  assert all(task.is_eval(task.make_example(*map(int, p.prompt.rstrip("=").split("+")))) for p in data.eval_pairs)
  # deterministic
  again = P.TaskPreferences(task, seed=0, eval_prompts=64, eval_pairs=100)
  assert [again.train_pair(i) for i in range(300)] == pairs[:300] and again.eval_pairs == data.eval_pairs
  only = P.TaskPreferences(task, seed=0, eval_prompts=8, eval_pairs=8, kinds=["padded"])
  assert {only.train_pair(i).kind for i in range(20)} == {"padded"}
  with pytest.raises(ValueError, match="pair_kinds='bogus'"):
    P.TaskPreferences(task, seed=0, eval_prompts=8, eval_pairs=8, kinds=["bogus"])


def _jsonl_task(tmp_path, verifier):
  rows = [{"question": f"Ann has {i} pens and finds {3 * i + 2} more. How many now?",
           "answer": f"{i} + {3 * i + 2} = {4 * i + 2}\n#### {4 * i + 2}"} for i in range(300)]
  return JsonlTask(path=write(tmp_path / "q.jsonl", rows), verifier=verifier, eval_fraction=0.2)


@pytest.mark.parametrize("name", ["countdown", "countdown_shaped", "sorting", "sorting_shaped", "jsonl_math",
                                  "jsonl_exact"])
def test_builtin_pairs_of_any_task_are_ordered_by_its_reward(name, tmp_path):
  task = {"countdown": lambda: CountdownTask(),
          "countdown_shaped": lambda: CountdownTask(num_numbers=4, min_numbers=2, format_reward=0.5),
          "sorting": lambda: SortingTask(),
          "sorting_shaped": lambda: SortingTask(partial_credit=0.5, format_reward=0.4),
          "jsonl_math": lambda: _jsonl_task(tmp_path, "math"),
          "jsonl_exact": lambda: _jsonl_task(tmp_path, "exact")}[name]()
  data = P.TaskPreferences(task, seed=1, eval_prompts=16, eval_pairs=40, eval_seed=1)
  train = [data.train_pair(i) for i in range(150)]
  assert len(data.eval_pairs) == 40 and data.stats["eval_prompts"] == 16
  for split, pairs in (("train", train), ("eval", data.eval_pairs)):
    for p in pairs:
      source_split, j = p.source.split(":")[1:3]
      assert p.source.startswith(f"{task.name}:{split}:") and source_split == split
      example = task.train_example(1, int(j)) if split == "train" else task.eval_prompts(16, 1)[int(j)]
      assert p.prompt == example.prompt and p.chosen == task.sft_target(example)
      # every kept pair is ordered by the task's own verifier
      assert task.reward(example, p.chosen) > task.reward(example, p.rejected), p
      assert task.is_eval(example) == (split == "eval")
  assert {p.kind for p in train} == set(task.pair_kinds)
  assert [data.train_pair(i) for i in range(150)] == train  # a pure function of (seed, position)


def test_build_preference_data_uses_the_tasks_kinds():
  rc = ml_collections.ConfigDict({"data": "", "pair_kinds": "", "eval_pairs": 12})
  countdown = P.build_preference_data(rc, CountdownTask(), seed=0, eval_size=6)
  assert isinstance(countdown, P.TaskPreferences) and countdown.kinds == CountdownTask.pair_kinds
  rc.pair_kinds = " wrong_operator , truncated"
  assert {P.build_preference_data(rc, CountdownTask(), 0, 6).train_pair(i).kind for i in range(30)} <= {
      "wrong_operator", "truncated"}
  rc.pair_kinds = "carry"  # an addition kind asked of the sorting task
  with pytest.raises(ValueError, match=r"reward_model.pair_kinds='carry': expected a non-empty subset of .* "
                                       r"\(the pair kinds of task 'sorting'\)"):
    P.build_preference_data(rc, SortingTask(), seed=0, eval_size=6)


def test_encoding_applies_the_chat_template_and_appends_eos():
  tok = bridge.build_char_tokenizer("+0123456789=")
  enc = encoding.PairEncoder(tok, use_chat_template=True, max_length=64)
  ids = enc.sequence("1+1=", "2")
  chat = tok.apply_chat_template([{"role": "user", "content": "1+1="}], add_generation_prompt=True)
  assert ids == tok.encode(chat, add_special_tokens=False) + tok.encode("2", add_special_tokens=False) + [tok.eos_id]
  plain = encoding.PairEncoder(tok, use_chat_template=False, max_length=64)
  assert plain.sequence("1+1=", "2") == tok.encode("1+1=2", add_special_tokens=False) + [tok.eos_id]
  assert plain.sequence("1+1=", "2", eos=False)[-1] != tok.eos_id
  with pytest.raises(ValueError, match="p.jsonl:7: the prompt is a list of chat messages but task.use_chat_template"):
    plain.sequence(({"role": "user", "content": "1+1="},), "2", where="p.jsonl:7")
  short = encoding.PairEncoder(tok, use_chat_template=False, max_length=5)
  assert short.pair(P.PreferencePair("1+1=", "2", "3")) is None  # 6 tokens with EOS
  pair = plain.pair(P.PreferencePair("1+1=", "2", "34"))
  assert pair.chosen == plain.sequence("1+1=", "2") and pair.rejected == plain.sequence("1+1=", "34")
  assert pair.prompt_length == 4


def test_collate_pairs_right_pads_both_sides_to_one_width():
  pairs = [encoding.EncodedPair([3, 4, 1], [3, 5, 6, 1], 1), encoding.EncodedPair([7, 2, 1], [7, 1], 2)]
  batch = encoding.collate_pairs(pairs, [0.0, 2.0], pad_id=0, num_pairs=4, max_length=64, bucket=8)
  assert batch.chosen_bt.shape == batch.rejected_bt.shape == (4, 8)
  np.testing.assert_array_equal(batch.chosen_bt[0], [3, 4, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(batch.rejected_mask_bt[0], [1, 1, 1, 1, 0, 0, 0, 0])
  # the chosen response and its EOS are the language-model targets (the prompt is not)
  np.testing.assert_array_equal(batch.chosen_target_mask_bt[:2], [[0, 1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(batch.valid_b, [True, True, False, False])
  np.testing.assert_array_equal(batch.margin_b, [0.0, 2.0, 0.0, 0.0])
