"""The task interface: examples, deterministic resumable prompt streams, held-out splits.

A task owns three things: a stream of training prompts, a held-out evaluation set that
never overlaps it, and a verifiable reward. Everything here is pure Python (no JAX).

Determinism and resumption. The training stream is a pure function of ``(seed,
position)``: example ``i`` is computed from a counter-based random generator keyed by
``(task name, seed, i)`` (blake2b, so the same on every platform, Python and NumPy
version) and never from hidden iterator state. Saving ``{"seed", "position"}`` and
restoring it therefore resumes at exactly the next example, in O(1).

Held-out split. Each example has a canonical *split key* (``Task.split_key``; e.g. the
unordered operand pair for addition, so ``3+5`` and ``5+3`` fall on the same side). It is
held out when ``blake2b(split_salt || key) / 2**64 < eval_fraction``. Training streams
skip held-out keys and evaluation sets draw only held-out keys, so the two are disjoint by
construction, for any seed, and stay so when the dataset or generator grows.

What curation and reward models ask of a task. ``Task.difficulty(example)`` orders
problems for curriculum sampling, and ``Task.preference_pairs(example, rng, kinds)``
makes built-in preference pairs for reward-model training: the gold response against
responses corrupted in the ways ``Task.pair_kinds`` lists (``Task.rejected_response``),
kept only when the task's own verifier scores the gold response strictly higher. Both
have generic defaults that work for any task with a gold ``sft_target``; a task
overrides them with its own measure and its own near-miss errors (addition: operand
digits, carry errors). Pairs ordered by a verifier of the answer, correct preferred to
incorrect, as in Iterative Reasoning Preference Optimization (arXiv:2404.19733);
curriculum by difficulty as in Kimi k1.5 (arXiv:2501.12599).
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
from typing import Any, ClassVar, Iterator, Mapping, Optional, Sequence

from jaxrl_llm.tasks.pairs import TEXT_PAIR_KINDS, ResponsePair, corrupt_text
from jaxrl_llm.tasks.rng import CounterRng

DEFAULT_SPLIT_SALT = "jaxrl_llm-heldout-v1"


@dataclasses.dataclass(frozen=True)
class Example:
  """One prompt with its reference answer.

  Attributes:
    prompt: the text the policy is conditioned on (e.g. ``"23+58="``).
    answer: the reference answer the verifier checks against (e.g. ``"81"``). For
      dataset tasks this is the raw answer field (GSM8K: the full worked solution).
    meta: task-specific data (operands, source file and line, extracted gold answer);
      compared by ``==`` but not hashed, so examples can be used in sets.
  """

  prompt: str
  answer: str
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


def split_fraction(key: str, salt: str = DEFAULT_SPLIT_SALT) -> float:
  """Maps a split key to a uniform number in [0, 1) with a salted blake2b hash.

  Args:
    key: canonical text of a problem.
    salt: changes the split without changing the data.

  Returns:
    ``int(blake2b(salt + "\\x00" + key)[:8]) / 2**64``.
  """
  digest = hashlib.blake2b((salt + "\x00" + key).encode("utf-8"), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


def _check_seed(seed: Any) -> int:
  if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
    raise ValueError(f"seed must be a non-negative int, got {seed!r}")
  return seed


def check_reward_shaping(task: str, partial_credit: float, format_reward: float) -> None:
  """Validates shaping weights so that a correct answer always scores strictly best.

  Raises:
    ValueError: naming the field when a weight is negative or they sum to >= 1.
  """
  for field, value in (("partial_credit", partial_credit), ("format_reward", format_reward)):
    if not 0.0 <= value < 1.0:
      raise ValueError(f"{task}.{field} must be in [0, 1), got {value!r}")
  if partial_credit + format_reward >= 1.0:
    raise ValueError(
        f"{task}: partial_credit + format_reward must be < 1 so that a correct answer"
        f" scores highest, got {partial_credit} + {format_reward}")


def shaped_reward(*, correct: bool, well_formed: bool, partial: float,
                  partial_credit: float, format_reward: float) -> float:
  """Verifiable reward with optional shaping for wrong answers.

  reward = 1                                                  if correct
         = format_reward * well_formed + partial_credit * partial   otherwise

  With both weights 0 (the default everywhere) this is the plain 0/1 verifier.

  Args:
    correct: exact match with the reference.
    well_formed: the response has the expected format (e.g. digits only).
    partial: fraction in [0, 1] of the answer that is right (e.g. digits in place).
    partial_credit: weight of ``partial``.
    format_reward: weight of ``well_formed``.

  Returns:
    The reward, in [0, 1].
  """
  if correct:
    return 1.0
  return format_reward * float(well_formed) + partial_credit * float(partial)


def digits_reward(response: str, answer: str, *, partial_credit: float, format_reward: float) -> float:
  """:func:`shaped_reward` of a number written in digits: exact match (stripped), well formed when
  digits only, partial credit for digits in place (:func:`positional_match`)."""
  pred = response.strip()
  return shaped_reward(correct=pred == answer, well_formed=pred.isdigit() and pred.isascii(),
                       partial=positional_match(pred, answer), partial_credit=partial_credit,
                       format_reward=format_reward)


def positional_match(pred: str, gold: str) -> float:
  """Fraction of positions where ``pred`` and ``gold`` agree, over the longer length."""
  longest = max(len(pred), len(gold))
  if longest == 0:
    return 1.0
  return sum(p == g for p, g in zip(pred, gold)) / longest


class Task(abc.ABC):
  """A prompt distribution with a held-out split and a verifiable reward.

  Subclasses define ``name``, ``alphabet``, ``train_example``, ``eval_prompts``,
  ``reward`` and, when the canonical problem differs from the prompt text,
  ``split_key``. They carry the fields ``eval_fraction`` and ``split_salt``.

  Curation and reward models use two more methods, with defaults for any task:
  ``difficulty(example)`` (curriculum sampling) and ``preference_pairs(example, rng,
  kinds)`` (built-in preference pairs; a task adds its own kinds by overriding
  ``pair_kinds`` and ``rejected_response``).
  """

  name: ClassVar[str] = "task"
  pair_kinds: ClassVar[tuple[str, ...]] = TEXT_PAIR_KINDS
  eval_fraction: float
  split_salt: str

  @property
  @abc.abstractmethod
  def alphabet(self) -> str:
    """Sorted string of every character that prompts and answers can contain."""

  @abc.abstractmethod
  def train_example(self, seed: int, position: int) -> Example:
    """Returns example number ``position`` of the training stream for ``seed``."""

  @abc.abstractmethod
  def eval_prompts(self, n: int, seed: int = 0) -> list[Example]:
    """Returns ``n`` held-out examples with distinct prompts, deterministic in ``seed``."""

  @abc.abstractmethod
  def reward(self, example: Example, response: str) -> float:
    """Scores a response text (without the EOS token) against the example."""

  def sft_target(self, example: Example) -> str:
    """The gold response text for the supervised warm start (EOS added by the tokenizer)."""
    return example.answer

  def sft_segments(self, example: Example) -> list[tuple[str, bool]]:
    """The gold response as ``[(text, trained)]`` pieces whose texts join to ``sft_target``.

    A multi-turn task's demonstration alternates the model's turns (trained)
    with what its tools answered (``trained=False``: context the warm start
    reads but does not learn to write). Default: one trained piece.
    """
    return [(self.sft_target(example), True)]

  def split_key(self, example: Example) -> str:
    """Canonical problem text used by the held-out split."""
    return example.prompt

  def difficulty(self, example: Example) -> float:
    """How hard a problem is, for curriculum sampling (larger: harder; only the order matters).

    Default: ``example.meta["difficulty"]`` when the example declares one, else the
    length in characters of the gold response (``sft_target``): a longer answer needs
    more tokens right. Tasks override it with their own measure.
    """
    declared = example.meta.get("difficulty")
    if declared is not None:
      return float(declared)
    return float(len(self.sft_target(example)))

  def rejected_response(self, example: Example, kind: str, rng: CounterRng) -> Optional[str]:
    """A response to ``example`` made wrong the way ``kind`` (one of ``pair_kinds``) says.

    Default: :func:`corrupt_text` of the gold response with the task's alphabet (the
    ``TEXT_PAIR_KINDS``). Returns None when the kind cannot apply to this example.
    Whether the result is really worse is decided by :meth:`preference_pairs`.
    """
    return corrupt_text(self.sft_target(example), kind, rng, self.alphabet)

  def preference_pairs(self, example: Example, rng: CounterRng,
                       kinds: Optional[Sequence[str]] = None) -> list[ResponsePair]:
    """Built-in preference pairs for one problem: the gold response against worse ones.

    For each kind, in order, one rejected response from :meth:`rejected_response`
    (drawing from ``rng``); the pair is kept only when this task's ``reward`` scores
    the gold response strictly higher than the rejected one, so every pair is ordered
    by the task's own verifier (a corruption that is another correct answer, such as
    ``5+3`` for ``3+5`` in countdown, is dropped).

    Args:
      example: the problem.
      rng: the pair's random stream (the draws are a function of it alone).
      kinds: some of ``pair_kinds`` (default: all of them).

    Returns:
      The kept pairs, at most one per kind, in the order of ``kinds``.

    Raises:
      ValueError: for a kind not in ``pair_kinds``.
    """
    kinds = self.pair_kinds if kinds is None else tuple(kinds)
    unknown = [k for k in kinds if k not in self.pair_kinds]
    if unknown:
      raise ValueError(f"{self.name}: unknown pair kind(s) {unknown}; expected some of {self.pair_kinds}")
    chosen = self.sft_target(example)
    gold = self.reward(example, chosen)
    pairs = []
    for kind in kinds:
      rejected = self.rejected_response(example, kind, rng)
      if rejected is not None and self.reward(example, rejected) < gold:
        pairs.append(ResponsePair(chosen, rejected, kind))
    return pairs

  def is_eval(self, example: Example) -> bool:
    """True when the example belongs to the held-out evaluation split."""
    return split_fraction(self.split_key(example), self.split_salt) < self.eval_fraction

  def train_prompts(self, seed: int = 0, position: int = 0) -> "TaskIterator":
    """Returns a resumable iterator over the training stream.

    Args:
      seed: stream seed (non-negative int).
      position: index of the first example to yield (use ``get_state`` to resume).
    """
    return TaskIterator(self, seed, position)

  def _check_split_fields(self) -> None:
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"{self.name}.eval_fraction must be in [0, 1), got {self.eval_fraction!r}")
    if not isinstance(self.split_salt, str):
      raise ValueError(f"{self.name}.split_salt must be a str, got {self.split_salt!r}")


class TaskIterator(Iterator[Example]):
  """Deterministic, resumable iterator over a task's training stream.

  The state is ``{"task": name, "seed": int, "position": int}`` (JSON-serialisable);
  restoring it with ``set_state`` makes the next ``next()`` return exactly what the
  saved iterator would have returned.

  Example:
    >>> from jaxrl_llm.tasks import get_task
    >>> it = get_task("addition").train_prompts(seed=3)
    >>> _ = next(it); state = it.get_state(); a = next(it)
    >>> it.set_state(state); assert next(it) == a
  """

  def __init__(self, task: Task, seed: int = 0, position: int = 0):
    self.task = task
    self.seed = _check_seed(seed)
    if isinstance(position, bool) or not isinstance(position, int) or position < 0:
      raise ValueError(f"position must be a non-negative int, got {position!r}")
    self.position = position

  def __iter__(self) -> "TaskIterator":
    return self

  def __next__(self) -> Example:
    example = self.task.train_example(self.seed, self.position)
    self.position += 1
    return example

  def get_state(self) -> dict[str, Any]:
    """Returns the resumable state."""
    return {"task": self.task.name, "seed": self.seed, "position": self.position}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores a state from ``get_state``.

    Raises:
      ValueError: if a field is missing or the state belongs to another task.
    """
    for key in ("seed", "position"):
      if key not in state:
        raise ValueError(f"iterator state is missing field {key!r}: {dict(state)!r}")
    task = state.get("task", self.task.name)
    if task != self.task.name:
      raise ValueError(f"iterator state is for task {task!r}, not {self.task.name!r}")
    seed = _check_seed(int(state["seed"]))
    position = int(state["position"])
    if position < 0:
      raise ValueError(f"iterator state position must be >= 0, got {position}")
    self.seed, self.position = seed, position


class GeneratedTask(Task):
  """A task whose problems are generated from a random stream (``_sample``).

  Training example ``i`` is the first sample of stream ``(name, "train", seed, i,
  attempt)``, attempt = 0, 1, ..., whose split key is not held out. Evaluation sets
  draw from stream ``(name, "eval", seed)`` and keep held-out problems with distinct
  prompts (``3+5`` and ``5+3`` share a split key, so both are held out, and both may
  appear in an evaluation set).
  """

  _MAX_TRAIN_ATTEMPTS: ClassVar[int] = 10_000

  @abc.abstractmethod
  def _sample(self, rng: CounterRng) -> Example:
    """Draws one problem (any split)."""

  def train_example(self, seed: int, position: int) -> Example:
    seed = _check_seed(seed)
    for attempt in range(self._MAX_TRAIN_ATTEMPTS):
      example = self._sample(CounterRng(self.name, "train", seed, position, attempt))
      if not self.is_eval(example):
        return example
    raise RuntimeError(
        f"{self.name}: no training problem found in {self._MAX_TRAIN_ATTEMPTS} draws;"
        f" eval_fraction={self.eval_fraction} leaves too few training problems")

  def eval_prompts(self, n: int, seed: int = 0) -> list[Example]:
    seed = _check_seed(seed)
    if n < 0:
      raise ValueError(f"{self.name}.eval_prompts: n must be >= 0, got {n}")
    if n and self.eval_fraction == 0.0:
      raise ValueError(f"{self.name}: eval_fraction is 0, so there is no held-out split")
    rng = CounterRng(self.name, "eval", seed)
    max_draws = max(20_000, int(100 * n / max(self.eval_fraction, 1e-9)))
    seen: set[str] = set()
    out: list[Example] = []
    draws = 0
    while len(out) < n:
      if draws >= max_draws:
        raise ValueError(
            f"{self.name}: found only {len(out)} distinct held-out problems in {max_draws}"
            f" draws, asked for {n}; raise eval_fraction or enlarge the problem space")
      draws += 1
      example = self._sample(rng)
      if example.prompt in seen or not self.is_eval(example):
        continue
      seen.add(example.prompt)
      out.append(example)
    return out


def alphabet_of(texts: Sequence[str] | Iterator[str], extra: Optional[str] = None) -> str:
  """Sorted unique characters of ``texts`` (and ``extra``)."""
  chars: set[str] = set(extra or "")
  for text in texts:
    chars.update(text)
  return "".join(sorted(chars))
