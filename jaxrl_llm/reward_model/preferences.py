"""Preference pairs for reward-model training: JSONL files and built-in generated pairs.

A pair is a prompt with two responses, the preferred one (``chosen``) and the
other (``rejected``), and an optional margin (how strongly ``chosen`` is
preferred; Llama 2's margin loss).

JSONL format, one object per line (field names configurable)::

  {"prompt": "2+2=", "chosen": "4", "rejected": "5"}
  {"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello!"}],
   "rejected": "Go away.", "margin": 2.0}

``prompt`` is a string or a list of ``{"role", "content"}`` messages (rendered
with the tokenizer's chat template, see :mod:`.encoding`); ``chosen`` and
``rejected`` are strings or a one-message assistant list. Bad rows are errors
naming the file and the 1-based line (invalid JSON, not an object, a missing or
mistyped field). Rows whose chosen and rejected texts are identical (after
stripping surrounding whitespace) carry no preference: they are counted
(``stats["identical_skipped"]``), logged and skipped. Blank lines are skipped.

Held-out split: all pairs of a prompt fall on one side, held out when
``blake2b(salt, prompt) < eval_fraction`` (as the tasks do), or the rows of a
separate ``eval_data`` file are the held-out set (training pairs whose prompt
appears there are dropped).

Built-in pairs (no download, :class:`TaskPreferences`) come from any task's own
problems through the task protocol (``Task.preference_pairs``): the gold
response is preferred to one corrupted in one of the task's ``pair_kinds``
(addition: a digit changed, a carry error, a digit dropped or added, zero
padding; countdown: an operator changed; math JSONL: a wrong final answer;
any task: character edits and truncation), and a pair is kept only when the
task's own reward orders it. Training pairs come from the task's training
problems, held-out pairs from its held-out problems, so the reward model is
measured on problems it never saw (and that the RL run evaluates on).

References:
  arXiv:2203.02155 (reward models from pairwise comparisons, Bradley-Terry);
  arXiv:2307.09288 (Llama 2: the margin term); arXiv:2404.19733 (pairs ordered
  by the correctness of the final answer).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np

from jaxrl_llm.tasks import DEFAULT_SPLIT_SALT, CounterRng, Example, Task, split_fraction
from jaxrl_llm.tasks.rows import read_rows

log = logging.getLogger("jaxrl_llm")

Messages = tuple[Mapping[str, str], ...]
MAX_PAIR_ATTEMPTS = 16  # built-in pairs: draws of a kind and its rejected response per problem
MAX_PAIR_PROBLEMS = 64  # built-in pairs: problems tried, from the pair's own on, before an error


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """One preference: ``chosen`` is preferred to ``rejected`` as a response to ``prompt``.

  Attributes:
    prompt: the prompt text, or a tuple of chat messages.
    chosen: the preferred response text (no EOS; the encoder appends it).
    rejected: the other response text.
    margin: optional preference strength (None: the run's default margin).
    source: where the pair came from (``file:line`` or ``addition:train:17``),
      named in errors.
    kind: optional category (built-in pairs: how the rejected answer was made),
      reported per kind in the held-out metrics.
  """

  prompt: Union[str, Messages]
  chosen: str
  rejected: str
  margin: Optional[float] = None
  source: str = ""
  kind: str = ""


def prompt_key(prompt: Union[str, Messages]) -> str:
  """Canonical text of a prompt for the held-out split (whitespace-normalised)."""
  if not isinstance(prompt, str):
    prompt = "\n".join(f"{m['role']}: {m['content']}" for m in prompt)
  return " ".join(prompt.split())


# --------------------------------------------------------------------------- JSONL


def _messages(value: Any, where: str, field: str) -> Messages:
  if not value or not all(isinstance(m, Mapping) for m in value):
    raise ValueError(f"{where}: field {field!r} must be a non-empty list of {{'role', 'content'}} messages")
  for m in value:
    if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
      raise ValueError(f"{where}: field {field!r} has a message without a string 'role' and 'content': {m!r}")
  return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _prompt(value: Any, where: str, field: str) -> Union[str, Messages]:
  if isinstance(value, str):
    if not value.strip():
      raise ValueError(f"{where}: field {field!r} is an empty string")
    return value
  if isinstance(value, list):
    return _messages(value, where, field)
  raise ValueError(f"{where}: field {field!r} must be a string or a list of chat messages, "
                   f"got {type(value).__name__}")


def _response(value: Any, where: str, field: str) -> str:
  if isinstance(value, str):
    return value
  if isinstance(value, list):
    messages = _messages(value, where, field)
    if len(messages) != 1 or messages[0]["role"] != "assistant":
      raise ValueError(f"{where}: field {field!r} must be a string or one assistant message, got "
                       f"{len(messages)} message(s) with roles {[m['role'] for m in messages]}")
    return messages[0]["content"]
  raise ValueError(f"{where}: field {field!r} must be a string or one assistant message, "
                   f"got {type(value).__name__}")


def load_preference_jsonl(path: str, *, prompt_field: str = "prompt", chosen_field: str = "chosen",
                          rejected_field: str = "rejected", margin_field: str = "margin"
                          ) -> tuple[list[PreferencePair], dict[str, int]]:
  """Reads and validates a preference JSONL file.

  Args:
    path: the file.
    prompt_field / chosen_field / rejected_field: names of the required fields.
    margin_field: name of the optional numeric margin field.

  Returns:
    ``(pairs, stats)`` with stats ``rows`` (non-blank lines), ``kept`` and
    ``identical_skipped``.

  Raises:
    ValueError: ``path:line: ...`` naming the row's problem; or when no pair is
      left.
  """
  pairs: list[PreferencePair] = []
  rows = identical = 0
  for lineno, row in read_rows(path):
    rows += 1
    where = f"{path}:{lineno}"
    for field in (prompt_field, chosen_field, rejected_field):
      if field not in row:
        raise ValueError(f"{where}: preference row is missing field {field!r} (fields present: {sorted(row)})")
    prompt = _prompt(row[prompt_field], where, prompt_field)
    chosen = _response(row[chosen_field], where, chosen_field)
    rejected = _response(row[rejected_field], where, rejected_field)
    margin = row.get(margin_field)
    if margin is not None:
      if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise ValueError(f"{where}: field {margin_field!r} must be a finite number, got {margin!r}")
      margin = float(margin)
    if chosen.strip() == rejected.strip():
      identical += 1
      continue
    pairs.append(PreferencePair(prompt, chosen, rejected, margin, source=where))
  if identical:
    log.warning("%s: %d of %d preference rows have identical chosen and rejected texts; skipped",
                path, identical, rows)
  if not pairs:
    raise ValueError(f"{path}: no usable preference pairs ({rows} rows, {identical} with identical "
                     "chosen and rejected texts)")
  return pairs, {"rows": rows, "kept": len(pairs), "identical_skipped": identical}


def split_pairs(pairs: Sequence[PreferencePair], eval_fraction: float, salt: str = DEFAULT_SPLIT_SALT
                ) -> tuple[list[PreferencePair], list[PreferencePair]]:
  """Splits pairs by the salted hash of their prompt: ``(train, held_out)``."""
  if not 0.0 <= eval_fraction < 1.0:
    raise ValueError(f"reward_model.eval_fraction={eval_fraction}: expected a number in [0, 1)")
  held = [split_fraction(prompt_key(p.prompt), salt) < eval_fraction for p in pairs]
  return [p for p, h in zip(pairs, held) if not h], [p for p, h in zip(pairs, held) if h]


# --------------------------------------------------------------------------- data sources


class PreferenceData(abc.ABC):
  """A deterministic, resumable stream of training pairs and a fixed held-out list.

  ``train_pair(i)`` is a pure function of ``(seed, i)``, so a run saves only its
  position. Subclasses set ``eval_pairs`` and ``stats`` and define ``train_pair``.
  """

  eval_pairs: list[PreferencePair]
  stats: dict[str, int]

  @abc.abstractmethod
  def train_pair(self, position: int) -> PreferencePair:
    """Training pair number ``position`` (>= 0) of the stream."""


class ListPreferences(PreferenceData):
  """Pairs held in memory (from JSONL): epoch ``e`` visits them in a permutation keyed by (seed, e).

  Args:
    train: training pairs (non-empty).
    eval_pairs: held-out pairs.
    seed: order seed.
    stats: loading statistics to report.
  """

  def __init__(self, train: Sequence[PreferencePair], eval_pairs: Sequence[PreferencePair], seed: int,
               stats: Optional[dict[str, int]] = None):
    if not train:
      raise ValueError("no training preference pairs left after the held-out split")
    self.train = list(train)
    self.eval_pairs = list(eval_pairs)
    self.seed = int(seed)
    self.stats = dict(stats or {}, train_pairs=len(self.train), eval_pairs=len(self.eval_pairs))
    self._orders: dict[int, np.ndarray] = {}

  def train_pair(self, position: int) -> PreferencePair:
    epoch, offset = divmod(int(position), len(self.train))
    if epoch not in self._orders:
      if len(self._orders) > 2:
        self._orders.clear()
      self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(len(self.train))
    return self.train[int(self._orders[epoch][offset])]


def jsonl_preferences(path: str, *, eval_path: str = "", eval_fraction: float = 0.05, seed: int = 0,
                      fields: Optional[Mapping[str, str]] = None) -> ListPreferences:
  """Training and held-out pairs from JSONL file(s); see :func:`load_preference_jsonl`.

  Args:
    path: training file.
    eval_path: optional held-out file (else a hash split of ``path`` by prompt).
    eval_fraction: held-out share of prompts when there is no ``eval_path``.
    seed: order seed of the training stream.
    fields: overrides of the field names (``prompt_field``, ``chosen_field``, ...).
  """
  fields = dict(fields or {})
  pairs, stats = load_preference_jsonl(path, **fields)
  if eval_path:
    held, eval_stats = load_preference_jsonl(eval_path, **fields)
    keys = {prompt_key(p.prompt) for p in held}
    train = [p for p in pairs if prompt_key(p.prompt) not in keys]
    stats = {k: stats[k] + eval_stats[k] for k in stats}
  else:
    train, held = split_pairs(pairs, eval_fraction)
  return ListPreferences(train, held, seed, stats)


def select_kinds(task: Task, kinds: Sequence[str] = ()) -> tuple[str, ...]:
  """The pair kinds to draw (``reward_model.pair_kinds``): ``kinds``, or all of the task's own when empty.

  Raises:
    ValueError: naming the field when a kind is not one of ``task.pair_kinds``.
  """
  kinds = tuple(kinds) or tuple(task.pair_kinds)
  unknown = [k for k in kinds if k not in task.pair_kinds]
  if unknown:
    raise ValueError(f"reward_model.pair_kinds={','.join(kinds)!r}: expected a non-empty subset of "
                     f"{tuple(task.pair_kinds)} (the pair kinds of task {task.name!r}) or '' for all of them")
  return kinds


class TaskPreferences(PreferenceData):
  """Built-in preference pairs of any task: its gold response against a worse one.

  The pairs come from the task's own protocol (:meth:`~jaxrl_llm.tasks.Task.preference_pairs`):
  the gold response (``sft_target``) is preferred to a response corrupted in one of the
  task's ``pair_kinds``, and a pair is kept only when the task's reward scores the gold
  response strictly higher. Training pair ``i`` is made from training problem ``i`` of
  the task's stream (seed ``seed``); its kind and rejected response come from a
  counter-based stream keyed by ``(task, seed, i)``, redrawn until the verifier orders
  the pair (then the next problems, should a problem admit none). Held-out pairs:
  ``eval_pairs`` pairs spread over ``eval_prompts`` held-out problems (those of the RL
  run's evaluation set for the same seed and size), kinds in equal shares.

  Args:
    task: any :class:`~jaxrl_llm.tasks.Task` with a gold ``sft_target``.
    seed: stream seed.
    eval_prompts: number of held-out problems.
    eval_pairs: number of held-out pairs (spread over the problems, at least one each).
    kinds: which of ``task.pair_kinds`` to draw (uniformly); None or empty: all of them.
    eval_seed: seed of the held-out problem selection (the RL run uses ``config.seed``).

  Example::

    data = TaskPreferences(get_task("countdown"), seed=0, eval_prompts=64, eval_pairs=256)
    pair = data.train_pair(0)   # PreferencePair(prompt, chosen, rejected, None, "countdown:train:0", kind)
  """

  def __init__(self, task: Task, seed: int, eval_prompts: int, eval_pairs: int,
               kinds: Optional[Sequence[str]] = None, eval_seed: int = 0):
    self.task, self.seed = task, int(seed)
    self.kinds = select_kinds(task, kinds or ())
    if eval_prompts < 1 or eval_pairs < 1:
      raise ValueError(f"built-in {task.name} pairs: eval_prompts={eval_prompts} and eval_pairs={eval_pairs} "
                       "must be >= 1")
    problems = task.eval_prompts(eval_prompts, eval_seed)
    per_prompt = -(-int(eval_pairs) // len(problems))
    held, unpaired = [], 0
    for k in range(per_prompt):
      for j, example in enumerate(problems):
        rng = CounterRng(f"{task.name}_prefs", "eval", eval_seed, j, k)
        kinds = [self.kinds[(j + k + a) % len(self.kinds)] for a in range(MAX_PAIR_ATTEMPTS)]
        pair = self._pair(example, rng, f"{task.name}:eval:{j}:{k}", kinds)
        unpaired += pair is None
        held += [pair] if pair else []
    self.eval_pairs = held[:int(eval_pairs)]
    if not self.eval_pairs:
      raise ValueError(f"built-in {task.name} pairs: no held-out problem gave a pair that the task's reward orders "
                       f"(kinds {self.kinds}); check that the task's reward scores its sft_target highest")
    self.stats = {"eval_pairs": len(self.eval_pairs), "eval_prompts": len(problems), "eval_unpaired": unpaired}

  def _pair(self, example: Example, rng: CounterRng, source: str,
            kinds: Sequence[Optional[str]]) -> Optional[PreferencePair]:
    """The first pair the task keeps, trying ``kinds`` in order (None: a kind drawn from ``rng``)."""
    for kind in kinds:
      made = self.task.preference_pairs(example, rng, [kind or rng.choice(self.kinds)])
      if made:
        chosen, rejected, kind = made[0]
        return PreferencePair(example.prompt, chosen, rejected, None, source, kind)
    return None

  def train_pair(self, position: int) -> PreferencePair:
    position = int(position)
    rng = CounterRng(f"{self.task.name}_prefs", "train", self.seed, position)
    for offset in range(MAX_PAIR_PROBLEMS):
      example = self.task.train_example(self.seed, position + offset)
      pair = self._pair(example, rng, f"{self.task.name}:train:{position}", [None] * MAX_PAIR_ATTEMPTS)
      if pair is not None:
        return pair
    last = position + MAX_PAIR_PROBLEMS - 1
    raise ValueError(f"built-in {self.task.name} pairs: training problems {position}..{last} gave no pair that the "
                     f"task's reward orders (kinds {self.kinds}); check that the task's reward scores its sft_target "
                     "highest")


def build_preference_data(rm_config: Any, task: Task, seed: int, eval_size: int) -> PreferenceData:
  """The run's preference data: ``reward_model.data`` (JSONL) or the task's built-in pairs.

  Args:
    rm_config: the ``reward_model`` ConfigDict.
    task: the run's task (built-in pairs are made from it, see :class:`TaskPreferences`).
    seed: the run seed.
    eval_size: held-out problems for built-in pairs (``task.eval_size``).
  """
  if rm_config.data:
    fields = {k: rm_config[k] for k in ("prompt_field", "chosen_field", "rejected_field", "margin_field")}
    return jsonl_preferences(rm_config.data, eval_path=rm_config.eval_data, eval_fraction=rm_config.eval_fraction,
                             seed=seed, fields=fields)
  kinds = [k.strip() for k in rm_config.pair_kinds.split(",") if k.strip()]
  return TaskPreferences(task, seed, eval_size, rm_config.eval_pairs, kinds, eval_seed=seed)

