"""Prompts from a JSONL file (GSM8K-style ``{"question": ..., "answer": ...}`` rows), or the same
rows in a parquet or JSON file or a Hugging Face ``datasets`` folder (:mod:`jaxrl_llm.tasks.rows`).

Rows are read and validated once at construction; a bad row is an error that names the
file, the 1-based line number (the row number of a parquet file or dataset) and the problem
(bytes that are not UTF-8, invalid JSON, not
an object, missing or non-text field, no extractable final answer). Blank lines are
skipped; a file with no rows is an error. Whether each row fits the model's context is
checked when a job starts (``data.long_prompts``, :mod:`jaxrl_llm.jobs.prompt_check`,
through :meth:`JsonlTask.examples` and :meth:`JsonlTask.with_examples`), since only the
job knows the tokenizer and the context.

Command-line values: ``--config.task.kwargs.<name>=<value>`` parses the value as a Python
literal, so a text option given a number-like value (``split_salt=2024``) is converted back
to text, and an empty ``eval_path`` means none.

Held-out split: by the salted hash of the whitespace-normalised prompt field (so
duplicate questions fall on the same side), or, with ``eval_path``, the rows of that
file are the evaluation set and training rows whose prompt appears in it are dropped.

Training order: epoch ``e`` visits the training rows in the order of
``blake2b(seed, e, row index)``, so position ``i`` maps to a row in O(1) once the
epoch's order is computed (cached), and resumption needs only ``(seed, position)``.

Curriculum difficulty: the row's ``difficulty_field`` when one is named (a number, or
text ending in one such as MATH's ``"Level 3"``), else the length of the reference
answer. Built-in preference pairs: with the math verifier, the reference solution
against the same solution with a digit of its final answer changed (``wrong_answer``)
or cut short (``truncated``); with the exact verifier, the text kinds of
:mod:`jaxrl_llm.tasks.pairs`. The verifier keeps only pairs it orders.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import re
from typing import Any, ClassVar, Mapping, Optional, Sequence

from jaxrl_llm.tasks import base, math_verify, pairs
from jaxrl_llm.tasks.rows import read_rows

VERIFIERS = ("math", "exact")
MATH_PAIR_KINDS = ("wrong_answer", "truncated")
_TRAILING_NUMBER_RE = re.compile(r"(-?\d+(?:\.\d+)?)\s*$")
_TEXT_FIELDS = ("path", "prompt_field", "answer_field", "prompt_template", "eval_path", "split_salt",
                "difficulty_field")


def _order(n: int, *key: Any) -> list[int]:
  """A permutation of ``range(n)`` keyed by ``key`` (sort by salted blake2b)."""
  prefix = repr(key).encode("utf-8")

  def rank(i: int) -> bytes:
    return hashlib.blake2b(prefix + i.to_bytes(8, "little"), digest_size=8).digest()

  return sorted(range(n), key=rank)


def _key(prompt: str) -> str:
  return " ".join(prompt.split())



@dataclasses.dataclass(frozen=True)
class JsonlTask(base.Task):
  """A prompt dataset in JSONL with a verifiable answer field.

  Attributes:
    path: the JSONL file, or a parquet / JSON file or ``datasets`` folder with the same
      fields (:func:`jaxrl_llm.tasks.rows.read_rows`).
    prompt_field: field holding the prompt (``"question"`` for GSM8K).
    answer_field: field holding the reference (``"answer"``: worked solution ending in
      ``#### N``); numbers are accepted and converted to text.
    prompt_template: format string with ``{prompt}``, e.g. ``"Q: {prompt}\\nA:"``.
    verifier: ``"math"`` (final-answer extraction and numeric comparison, see
      ``math_verify``) or ``"exact"`` (response and answer equal after stripping
      surrounding whitespace).
    eval_fraction: share of distinct prompts held out (ignored with ``eval_path``).
    eval_path: optional file (or folder) with the same fields used as the held-out set (None or
      empty: split ``path`` by ``eval_fraction``).
    split_salt: salt of the held-out hash.
    rel_tol: relative tolerance of the math verifier.
    percent: percent mode of the math verifier (``"strip"`` or ``"either"``).
    difficulty_field: optional field holding each row's difficulty for curriculum
      sampling (a number, or text ending in a number); empty: the answer's length.
  """

  name: ClassVar[str] = "jsonl"

  path: str = ""
  prompt_field: str = "question"
  answer_field: str = "answer"
  prompt_template: str = "{prompt}"
  verifier: str = "math"
  eval_fraction: float = 0.05
  eval_path: Optional[str] = None
  split_salt: str = base.DEFAULT_SPLIT_SALT
  rel_tol: float = 1e-6
  percent: str = "strip"
  difficulty_field: str = ""

  _train: tuple[base.Example, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _eval: tuple[base.Example, ...] = dataclasses.field(init=False, repr=False, compare=False)
  _eval_keys: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
  _orders: dict = dataclasses.field(init=False, repr=False, compare=False)
  _alphabet: str = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    for name in _TEXT_FIELDS:  # a number-like text given on the command line arrives as a number
      value = getattr(self, name)
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        object.__setattr__(self, name, str(value))
    if self.eval_path == "":  # --config.task.kwargs.eval_path= (empty): no held-out file
      object.__setattr__(self, "eval_path", None)
    if not self.path:
      raise ValueError("jsonl.path is required (a JSONL file of prompts)")
    if self.verifier not in VERIFIERS:
      raise ValueError(f"jsonl.verifier must be one of {VERIFIERS}, got {self.verifier!r}")
    if self.percent not in math_verify.PERCENT_MODES:
      raise ValueError(
          f"jsonl.percent must be one of {math_verify.PERCENT_MODES}, got {self.percent!r}")
    try:
      self.prompt_template.format(prompt="")
    except (KeyError, IndexError, ValueError) as e:
      raise ValueError(
          f"jsonl.prompt_template must be a format string whose only field is {{prompt}},"
          f" got {self.prompt_template!r} ({e!r})") from None
    if "{prompt}" not in self.prompt_template:
      raise ValueError(
          f"jsonl.prompt_template must contain {{prompt}}, got {self.prompt_template!r}")
    self._check_split_fields()
    rows = self._load(self.path)
    if self.eval_path is not None:
      eval_rows = self._load(self.eval_path)
      eval_keys = frozenset(k for k, _ in eval_rows)
      train = tuple(ex for k, ex in rows if k not in eval_keys)
      held_out = tuple(ex for _, ex in eval_rows)
    else:
      eval_keys = frozenset(
          k for k, _ in rows if base.split_fraction(k, self.split_salt) < self.eval_fraction)
      train = tuple(ex for k, ex in rows if k not in eval_keys)
      held_out = tuple(ex for k, ex in rows if k in eval_keys)
    if not train:
      raise ValueError(f"{self.path}: no training rows left after the held-out split")
    object.__setattr__(self, "_train", train)
    object.__setattr__(self, "_eval", held_out)
    object.__setattr__(self, "_eval_keys", eval_keys)
    object.__setattr__(self, "_orders", {})
    texts = [ex.prompt for ex in train + held_out] + [ex.answer for ex in train + held_out]
    object.__setattr__(self, "_alphabet", base.alphabet_of(texts))

  def _load(self, path: str) -> list[tuple[str, base.Example]]:
    rows = [self._row_to_example(row, path, lineno) for lineno, row in read_rows(path)]
    if not rows:
      raise ValueError(f"{path}: the file has no rows (empty file or dataset)")
    return rows

  def _row_to_example(self, row: Mapping[str, Any], path: str,
                      lineno: int) -> tuple[str, base.Example]:
    for field in (self.prompt_field, self.answer_field):
      if field not in row:
        raise ValueError(
            f"{path}:{lineno}: row is missing field {field!r} (fields present:"
            f" {sorted(row)})")
    prompt, answer = row[self.prompt_field], row[self.answer_field]
    if not isinstance(prompt, str) or not prompt.strip():
      raise ValueError(f"{path}:{lineno}: field {self.prompt_field!r} must be a non-empty string,"
                       f" got {prompt!r}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
      answer = str(answer)
    if not isinstance(answer, str):
      raise ValueError(f"{path}:{lineno}: field {self.answer_field!r} must be a string or a"
                       f" number, got {type(answer).__name__}")
    gold = answer.strip()
    if self.verifier == "math":
      gold = math_verify.extract_answer(answer)
      if gold is None:
        raise ValueError(
            f"{path}:{lineno}: cannot extract a final answer from field {self.answer_field!r}"
            f" (expected '#### N', \\boxed{{...}} or a number): {answer[-80:]!r}")
    meta = {"source": path, "line": lineno, "gold": gold, "split_key": _key(prompt)}
    if self.difficulty_field:
      meta["difficulty"] = self._difficulty(row, path, lineno)
    example = base.Example(prompt=self.prompt_template.format(prompt=prompt), answer=answer, meta=meta)
    return _key(prompt), example

  def _difficulty(self, row: Mapping[str, Any], path: str, lineno: int) -> float:
    if self.difficulty_field not in row:
      raise ValueError(f"{path}:{lineno}: row is missing field {self.difficulty_field!r} (jsonl.difficulty_field;"
                       f" fields present: {sorted(row)})")
    value = row[self.difficulty_field]
    match = _TRAILING_NUMBER_RE.search(value) if isinstance(value, str) else None
    if match:
      value = float(match.group(1))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise ValueError(f"{path}:{lineno}: field {self.difficulty_field!r} (jsonl.difficulty_field) must be a finite"
                       f" number or text ending in one (e.g. 'Level 3'), got {value!r}")
    return float(value)

  @property
  def alphabet(self) -> str:
    return self._alphabet

  @property
  def pair_kinds(self) -> tuple[str, ...]:
    """``MATH_PAIR_KINDS`` with the math verifier, else the text kinds."""
    return MATH_PAIR_KINDS if self.verifier == "math" else pairs.TEXT_PAIR_KINDS

  def examples(self) -> tuple[tuple[base.Example, ...], tuple[base.Example, ...]]:
    """The training and the held-out rows, in file order (what start-up checks go through)."""
    return self._train, self._eval

  def with_examples(self, train: Sequence[base.Example], held_out: Sequence[base.Example]) -> "JsonlTask":
    """A copy of this task with other training and held-out rows (a subset of :meth:`examples`,
    possibly with shortened prompts); the held-out split keys are kept, so a dropped held-out
    row's prompt still never trains."""
    if not train:
      raise ValueError(f"{self.path}: no training rows left")
    task = copy.copy(self)
    object.__setattr__(task, "_train", tuple(train))
    object.__setattr__(task, "_eval", tuple(held_out))
    object.__setattr__(task, "_orders", {})
    return task

  @property
  def num_train(self) -> int:
    return len(self._train)

  @property
  def num_eval(self) -> int:
    return len(self._eval)

  def split_key(self, example: base.Example) -> str:
    """The whitespace-normalised prompt field (before the template)."""
    return example.meta.get("split_key", _key(example.prompt))

  def is_eval(self, example: base.Example) -> bool:
    return self.split_key(example) in self._eval_keys

  def train_example(self, seed: int, position: int) -> base.Example:
    epoch, offset = divmod(position, len(self._train))
    order = self._orders.get((seed, epoch))
    if order is None:
      if len(self._orders) > 4:
        self._orders.clear()
      order = self._orders[(seed, epoch)] = _order(len(self._train), "train", seed, epoch)
    return self._train[order[offset]]

  def eval_prompts(self, n: int, seed: int = 0) -> list[base.Example]:
    if not 0 <= n <= len(self._eval):
      raise ValueError(f"{self.path}: asked for {n} held-out prompts, the split has"
                       f" {len(self._eval)} (eval_fraction={self.eval_fraction},"
                       f" eval_path={self.eval_path})")
    return [self._eval[i] for i in _order(len(self._eval), "eval", seed)[:n]]

  def sft_target(self, example: base.Example) -> str:
    return example.answer

  def rejected_response(self, example: base.Example, kind: str, rng: base.CounterRng) -> Optional[str]:
    """``wrong_answer``: a digit of the final answer changed where the solution states it; else a text kind."""
    if kind != "wrong_answer":
      return super().rejected_response(example, kind, rng)
    text, gold = self.sft_target(example), example.meta.get("gold") or ""
    at = text.rfind(gold) if gold else -1
    wrong = pairs.change_digit(gold, rng) if at >= 0 else None
    return None if wrong is None else text[:at] + wrong + text[at + len(gold):]

  def reward(self, example: base.Example, response: str) -> float:
    gold = example.meta.get("gold")
    if self.verifier == "exact":
      return float(response.strip() == (gold if gold is not None else example.answer.strip()))
    if gold is None:
      gold = math_verify.extract_answer(example.answer)
    pred = math_verify.extract_answer(response)
    return float(math_verify.answers_match(pred, gold, rel_tol=self.rel_tol, percent=self.percent))
