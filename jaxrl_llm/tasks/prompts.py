"""Prompt batches for the learner: G prompts per step, N samples per prompt, resumable.

``PromptSource`` draws G prompts per batch from a task's training stream and can save and
restore its position (``get_state``/``set_state``), so a resumed run sees exactly the same
prompts. ``group_examples`` repeats each prompt N times, contiguously, with group ids
0..G-1, the layout ``Trajectory.group_id_b`` expects (B = G * N).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from jaxrl_llm.tasks import base


def _check_count(field: str, value: object) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{field} must be an int >= 1, got {value!r}")


def group_examples(examples: Sequence[base.Example],
                   samples_per_prompt: int) -> tuple[list[base.Example], np.ndarray]:
  """Repeats each of G examples N times, contiguously.

  Args:
    examples: G examples.
    samples_per_prompt: N >= 1.

  Returns:
    ``(repeated, group_id_b)``: the G*N examples ``[e0]*N + [e1]*N + ...`` and int32
    [G*N] group ids ``[0]*N + [1]*N + ...``.
  """
  _check_count("samples_per_prompt", samples_per_prompt)
  repeated = [ex for ex in examples for _ in range(samples_per_prompt)]
  group_id_b = np.repeat(np.arange(len(examples), dtype=np.int32), samples_per_prompt)
  return repeated, group_id_b


@dataclasses.dataclass(frozen=True)
class PromptBatch:
  """G prompts drawn together.

  Attributes:
    examples: the G distinct draws, in stream order.
    positions: their positions in the training stream (for logging and replay).
    samples_per_prompt: N, the samples to draw per prompt.
  """

  examples: tuple[base.Example, ...]
  positions: tuple[int, ...]
  samples_per_prompt: int

  @property
  def num_prompts(self) -> int:
    return len(self.examples)

  def grouped(self) -> tuple[list[base.Example], np.ndarray]:
    """Returns ``group_examples(self.examples, self.samples_per_prompt)`` (B = G * N)."""
    return group_examples(self.examples, self.samples_per_prompt)


class PromptSource(Iterator[PromptBatch]):
  """Yields ``PromptBatch`` es of G prompts from a task, deterministically and resumably.

  Batch ``k`` holds stream positions ``[k*G, (k+1)*G)`` (from the start position), so
  the state is the underlying ``TaskIterator`` state.

  Args:
    task: the prompt task.
    prompts_per_batch: G >= 1.
    seed: training-stream seed.
    samples_per_prompt: N >= 1 (carried on each batch).
  """

  def __init__(self, task: base.Task, prompts_per_batch: int, seed: int = 0,
               samples_per_prompt: int = 1):
    _check_count("prompts_per_batch", prompts_per_batch)
    _check_count("samples_per_prompt", samples_per_prompt)
    self.task = task
    self.prompts_per_batch = prompts_per_batch
    self.samples_per_prompt = samples_per_prompt
    self._iterator = task.train_prompts(seed)

  def __iter__(self) -> "PromptSource":
    return self

  def __next__(self) -> PromptBatch:
    start = self._iterator.position
    examples = tuple(next(self._iterator) for _ in range(self.prompts_per_batch))
    positions = tuple(range(start, start + self.prompts_per_batch))
    return PromptBatch(examples, positions, self.samples_per_prompt)

  def next_batch(self) -> PromptBatch:
    """Same as ``next(source)``."""
    return next(self)

  def get_state(self) -> dict[str, Any]:
    """``{"task", "seed", "position"}``: JSON-serialisable, for checkpoints."""
    return self._iterator.get_state()

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores a state from ``get_state`` (same task required)."""
    self._iterator.set_state(state)


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """A fixed held-out evaluation set.

  Attributes:
    task_name: the task it was drawn from.
    examples: the held-out examples.
    fingerprint: blake2b of the prompts and answers, to check that two runs (or a run
      and its resumption) evaluate on the same set.
  """

  task_name: str
  examples: tuple[base.Example, ...]
  fingerprint: str

  def __len__(self) -> int:
    return len(self.examples)


def build_eval_set(task: base.Task, n: int, seed: int = 0) -> EvalSet:
  """Draws ``n`` held-out examples and checks that none can appear in training.

  Args:
    task: the task.
    n: number of examples.
    seed: selection seed (independent of the training seed).

  Returns:
    An ``EvalSet``.

  Raises:
    ValueError: if the task returns an example outside its held-out split.
  """
  examples = tuple(task.eval_prompts(n, seed))
  if len(examples) != n:
    raise ValueError(f"{task.name}.eval_prompts({n}) returned {len(examples)} examples")
  h = hashlib.blake2b(digest_size=16)
  for j, ex in enumerate(examples):
    if not task.is_eval(ex):
      raise ValueError(f"{task.name}: eval example {j} ({ex.prompt!r}) is not in the held-out"
                       " split, so it may also be trained on")
    h.update(ex.prompt.encode("utf-8") + b"\x00" + ex.answer.encode("utf-8") + b"\x01")
  return EvalSet(task.name, examples, h.hexdigest())
