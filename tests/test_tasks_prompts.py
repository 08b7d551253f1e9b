"""Prompt batching, grouping, held-out eval sets and the task registry."""

import json

import numpy as np
import pytest

from jaxrl_llm.tasks import registry
from jaxrl_llm.tasks import (DEFAULT_TASK, AdditionTask, Example, PromptSource, build_eval_set,
                             get_task, group_examples, list_tasks, register_task)


def test_group_examples_contiguous():
  a, b, c = (Example(p, "") for p in "abc")
  assert len({a, Example("a", ""), b}) == 2  # hashable
  assert hash(Example("a", "", {"x": [1]})) == hash(a)  # meta is not hashed
  repeated, group_id_b = group_examples([a, b, c], 2)
  assert [ex.prompt for ex in repeated] == ["a", "a", "b", "b", "c", "c"]
  assert group_id_b.dtype == np.int32
  np.testing.assert_array_equal(group_id_b, [0, 0, 1, 1, 2, 2])
  repeated, group_id_b = group_examples([a], 1)
  assert repeated == [a] and group_id_b.tolist() == [0]
  with pytest.raises(ValueError, match="samples_per_prompt"):
    group_examples([a], 0)


def test_prompt_source_batches_and_resume():
  task = get_task("addition")
  source = PromptSource(task, prompts_per_batch=4, seed=7, samples_per_prompt=3)
  first = next(source)
  assert first.num_prompts == 4 and first.positions == (0, 1, 2, 3)
  repeated, group_id_b = first.grouped()
  assert len(repeated) == 12 and group_id_b.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
  stream = task.train_prompts(seed=7)
  assert list(first.examples) == [next(stream) for _ in range(4)]
  next(source)
  state = json.loads(json.dumps(source.get_state()))
  assert state["position"] == 8
  expected = [source.next_batch() for _ in range(3)]
  resumed = PromptSource(task, prompts_per_batch=4, seed=0, samples_per_prompt=3)
  resumed.set_state(state)
  assert [next(resumed) for _ in range(3)] == expected
  assert expected[0].positions == (8, 9, 10, 11)
  with pytest.raises(ValueError, match="prompts_per_batch"):
    PromptSource(task, prompts_per_batch=0)
  with pytest.raises(ValueError, match="samples_per_prompt"):
    PromptSource(task, prompts_per_batch=2, samples_per_prompt=0)


def test_build_eval_set():
  task = get_task("addition")  # defaults must supply the default config's eval_size (256)
  eval_set = build_eval_set(task, 256, seed=0)
  assert len(eval_set) == 256 and eval_set.task_name == "addition"
  assert len({ex.prompt for ex in eval_set.examples}) == 256
  assert all(task.is_eval(ex) for ex in eval_set.examples)
  assert build_eval_set(task, 256, seed=0).fingerprint == eval_set.fingerprint
  assert build_eval_set(task, 256, seed=1).fingerprint != eval_set.fingerprint


def test_build_eval_set_rejects_training_examples():

  class Leaky(AdditionTask):
    def eval_prompts(self, n, seed=0):
      it = self.train_prompts(seed)
      return [next(it) for _ in range(n)]

  with pytest.raises(ValueError, match="not in the held-out split"):
    build_eval_set(Leaky(), 3)


def test_registry(monkeypatch):
  monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # keep registration local
  assert DEFAULT_TASK == "addition"
  assert {"addition", "sorting", "countdown", "jsonl"} <= set(list_tasks())
  task = get_task("addition", max_digits=3, reverse_answer=True)
  assert isinstance(task, AdditionTask) and task.max_digits == 3 and task.reverse_answer
  with pytest.raises(ValueError, match=r"unknown task 'adition'; known tasks: .*addition.*sorting"):
    get_task("adition")
  with pytest.raises(ValueError, match=r"task 'addition' has no field\(s\) \['digits'\]; accepted"):
    get_task("addition", digits=3)
  with pytest.raises(ValueError, match="already registered"):
    register_task("addition", AdditionTask)
  register_task("addition3", lambda **kw: AdditionTask(min_digits=3, max_digits=3, **kw))
  assert get_task("addition3", reverse_answer=True).min_digits == 3
  assert "addition3" in list_tasks()
