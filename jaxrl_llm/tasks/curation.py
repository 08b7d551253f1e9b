"""Data curation for RL prompts: pass rates, retirement, prioritised and curriculum sampling,
and dynamic sampling (DAPO's informative-group filter). Host-side NumPy, no JAX.

Pieces:

* :class:`PassRateTracker`: per-prompt success over a window of recent attempts.
* :class:`CuratedPromptSource`: a drop-in replacement for
  :class:`~jaxrl_llm.tasks.prompts.PromptSource` (``next_batch``, ``get_state`` /
  ``set_state``, ``prompts_per_batch``, ``samples_per_prompt``) with ``record(batch,
  rewards_b)``, called by the loop after scoring, and ``metrics()``. Strategies:

  - ``"stream"``: the task's training stream in order;
  - ``"prioritized"``: a pool of ``pool_size`` prompts refilled from the stream; each
    batch draws G of them without replacement with probability
    ``p_i ∝ (1 - s_i) + floor``, ``s_i`` the prompt's windowed success rate
    (``prior_success`` before its first attempt);
  - ``"curriculum"``: the stream restricted to prompts of difficulty <= the ceiling of
    the current level (see :func:`default_difficulty`); the level rises either when the
    pass rate of the current level's prompts reaches ``promote_pass_rate`` over its last
    ``level_window`` attempts (``schedule="pass_rate"``), or every ``steps_per_level``
    batches (``schedule="steps"``).

  With ``retire_solved`` (all strategies), a prompt whose pass rate over its last
  ``window`` attempts is >= ``drop_pass_rate`` (default 0.9), once it has at least
  ``min_attempts`` attempts (default: ``window``), leaves the pool and is never drawn
  again (no-positive resampling: an always-solved prompt has zero advantage).
* :class:`InformativeGroupCollector`: accumulates scored groups over several sampling
  rounds, keeps those whose rewards are not all equal, and returns exactly the target
  number of groups (dynamic sampling), padding with zero-variance groups after
  ``max_rounds``.

Determinism and resumption. Every draw is a function of the state and of
``(seed, batch index)`` (a :class:`~jaxrl_llm.tasks.base.CounterRng`, blake2b, the same
on every platform and library version). The state holds stream positions, never
examples (``task.train_example(seed, position)`` rebuilds them), prompt keys (16 hex
digits of blake2b of the prompt text) and counters, so it is small JSON.
Batches drawn but not yet ``record``-ed are part of the state and are handed out again,
in order, after ``set_state``: a pipelined loop that checkpoints after recording step s
while steps s+1..s+k are in flight resumes with exactly those batches.

References:
  DAPO (dynamic sampling): arXiv:2503.14476. Kimi k1.5 (curriculum sampling and
  prioritised sampling ∝ 1 - s_i): arXiv:2501.12599. Skywork-OR1 (dropping prompts
  with a high pass rate): arXiv:2505.22312.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import math
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.addition import AdditionTask
from jaxrl_llm.tasks.prompts import PromptBatch

STRATEGIES = ("stream", "prioritized", "curriculum")
SCHEDULES = ("pass_rate", "steps")
STATE_VERSION = 1

KeyFn = Callable[[base.Example], str]
DifficultyFn = Callable[[base.Example], float]


def prompt_key(example: base.Example) -> str:
  """Stable, compact key of a prompt: 16 hex digits of ``blake2b(prompt text)``.

  Two examples share a key exactly when the policy sees the same prompt text, so the
  pass rate is that of what the policy is asked.
  """
  return hashlib.blake2b(example.prompt.encode("utf-8"), digest_size=8).hexdigest()


def _check_int(field: str, value: Any, low: int) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
    raise ValueError(f"{field} must be an int >= {low}, got {value!r}")
  return int(value)


def _check_unit(field: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
    raise ValueError(f"{field} must be a number in [0, 1], got {value!r}")
  return float(value)


# --------------------------------------------------------------------------- pass rates


class PassRateTracker:
  """Per-prompt success over the last ``window`` attempts.

  ``pass_rate(key) = mean(last min(window, attempts) successes)``; ``None`` before the
  first attempt. Keys are kept in least-recently-recorded order; past ``capacity`` keys
  the oldest is forgotten, which bounds the state on endless generated streams.

  Args:
    window: attempts remembered per prompt (>= 1).
    capacity: most prompts remembered (0: unbounded).

  Example:
    >>> t = PassRateTracker(window=4)
    >>> t.record(["a", "a", "b"], [1.0, 0.0, 1.0])
    >>> t.pass_rate("a"), t.attempts("a"), t.pass_rate("zz")
    (0.5, 2, None)
  """

  def __init__(self, window: int, capacity: int = 0):
    self.window = _check_int("window", window, 1)
    self.capacity = _check_int("capacity", capacity, 0)
    self._recent: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
    self._attempts: dict[str, int] = {}

  def __len__(self) -> int:
    return len(self._recent)

  def __contains__(self, key: str) -> bool:
    return key in self._recent

  def keys(self) -> list[str]:
    """Tracked keys, least recently recorded first."""
    return list(self._recent)

  def record(self, keys: Sequence[str], success_b: Sequence[float]) -> None:
    """Appends one attempt per row.

    Args:
      keys: [B] prompt keys (repeated for the samples of a prompt).
      success_b: [B] success of each attempt in [0, 1] (usually 0/1: reward >= threshold).

    Raises:
      ValueError: when the lengths differ or a success is outside [0, 1] or not finite.
    """
    success = np.asarray(success_b, np.float64).reshape(-1)
    if len(keys) != success.shape[0]:
      raise ValueError(f"success_b has {success.shape[0]} entries but keys has {len(keys)}")
    if not np.all(np.isfinite(success)) or np.any((success < 0) | (success > 1)):
      raise ValueError(f"success_b must be finite and in [0, 1], got {success.tolist()}")
    for key, s in zip(keys, success.tolist()):
      recent = self._recent.get(key)
      if recent is None:
        recent = self._recent[key] = collections.deque(maxlen=self.window)
        self._attempts[key] = 0
      else:
        self._recent.move_to_end(key)
      recent.append(s)
      self._attempts[key] += 1
    while self.capacity and len(self._recent) > self.capacity:
      old, _ = self._recent.popitem(last=False)
      del self._attempts[old]

  def pass_rate(self, key: str) -> Optional[float]:
    """Mean success over the key's recent window, or ``None`` if never attempted."""
    recent = self._recent.get(key)
    if not recent:
      return None
    return math.fsum(recent) / len(recent)

  def attempts(self, key: str) -> int:
    """Attempts recorded for ``key`` since it was first (re-)tracked."""
    return self._attempts.get(key, 0)

  def forget(self, key: str) -> None:
    """Drops a key (e.g. a retired prompt), if present."""
    if self._recent.pop(key, None) is not None:
      del self._attempts[key]

  def mean_pass_rate(self) -> Optional[float]:
    """Mean over tracked keys of their pass rate, or ``None`` when nothing is tracked."""
    if not self._recent:
      return None
    return math.fsum(math.fsum(r) / len(r) for r in self._recent.values()) / len(self._recent)

  def get_state(self) -> dict[str, Any]:
    """``{"window", "entries": [[key, attempts, [recent...]], ...]}`` (JSON, LRU order)."""
    return {"window": self.window,
            "entries": [[k, self._attempts[k], list(r)] for k, r in self._recent.items()]}

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores ``get_state``'s output; a smaller ``window`` keeps the latest attempts.

    Raises:
      ValueError: naming the malformed field.
    """
    entries = state.get("entries")
    if not isinstance(entries, list):
      raise ValueError(f"tracker state needs a list 'entries', got {type(entries).__name__}")
    recent: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
    attempts: dict[str, int] = {}
    for j, entry in enumerate(entries):
      if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)):
        raise ValueError(f"tracker state entries[{j}] must be [key, attempts, [successes]], got {entry!r}")
      key, count, values = entry
      recent[key] = collections.deque((float(v) for v in values), maxlen=self.window)
      attempts[key] = int(count)
    self._recent, self._attempts = recent, attempts


# --------------------------------------------------------------------------- difficulty


def addition_difficulty(example: base.Example) -> float:
  """Digits of the longer operand of an addition example (``"123+4="`` -> 3)."""
  if "a" in example.meta and "b" in example.meta:
    a, b = example.meta["a"], example.meta["b"]
  else:
    a, b = example.prompt.rstrip("=").split("+")
  return float(max(len(str(int(a))), len(str(int(b)))))


def answer_length_difficulty(example: base.Example) -> float:
  """Characters of the reference answer (a task-agnostic proxy for difficulty)."""
  return float(len(example.answer))


def default_difficulty(task: base.Task) -> DifficultyFn:
  """The task's own ``difficulty(example)`` if it has one; else digits for addition,
  else the length of the reference answer."""
  own = getattr(task, "difficulty", None)
  if callable(own):
    return own
  if isinstance(task, AdditionTask):
    return addition_difficulty
  return answer_length_difficulty


# --------------------------------------------------------------------------- the source


@dataclasses.dataclass(frozen=True)
class CurationConfig:
  """Settings of :class:`CuratedPromptSource` (plain values, so a config section maps onto it).

  Attributes:
    strategy: "stream", "prioritized" or "curriculum".
    success_threshold: a sample succeeds when its reward >= this.
    window: attempts per prompt in its pass rate.
    min_attempts: attempts needed before a prompt can retire (0: ``window``).
    retire_solved: drop prompts whose pass rate >= ``drop_pass_rate`` (no-positive
      resampling).
    drop_pass_rate: the retirement threshold, in [0, 1].
    max_tracked: most prompts whose pass rate is remembered (0: unbounded).
    pool_size: candidate pool of "prioritized" (>= prompts per batch).
    priority_floor: added to ``1 - success`` so solved-looking prompts keep a chance (>= 0).
    prior_success: success rate assumed before a prompt's first attempt, in [0, 1].
    max_uses: "prioritized": a prompt leaves the pool after this many draws (0: never),
      so the pool keeps turning over even when prompts are never solved (else
      unsolvable prompts, with the highest priority, would fill the pool for good).
    schedule: "curriculum": "pass_rate" (promote on success) or "steps" (by batch count).
    levels: "curriculum": ascending difficulty ceilings; empty: the distinct difficulties
      of the first ``probe_examples`` stream examples (quantiles if more than
      ``max_levels``). The last level admits everything.
    max_levels: most levels derived by probing.
    probe_examples: stream examples probed to derive the levels.
    promote_pass_rate: "pass_rate" schedule: promote when the current level's pass rate
      over its last ``level_window`` attempts reaches this.
    level_window: attempts (samples) of the current level in that pass rate.
    steps_per_level: "steps" schedule: batches drawn per level.
    max_skip: consecutive stream examples that may be skipped (retired, too hard,
      already pooled) before giving up with an error.
    max_outstanding: most drawn-but-unrecorded batches kept for replay.
  """

  strategy: str = "stream"
  success_threshold: float = 1.0
  window: int = 8
  min_attempts: int = 0
  retire_solved: bool = True
  drop_pass_rate: float = 0.9
  max_tracked: int = 65536
  pool_size: int = 256
  priority_floor: float = 0.05
  prior_success: float = 0.5
  max_uses: int = 8
  schedule: str = "pass_rate"
  levels: tuple = ()
  max_levels: int = 8
  probe_examples: int = 512
  promote_pass_rate: float = 0.8
  level_window: int = 64
  steps_per_level: int = 100
  max_skip: int = 100_000
  max_outstanding: int = 64

  def __post_init__(self):
    if self.strategy not in STRATEGIES:
      raise ValueError(f"curation.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"curation.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
    if not isinstance(self.success_threshold, (int, float)) or not math.isfinite(self.success_threshold):
      raise ValueError(f"curation.success_threshold must be a finite number, got {self.success_threshold!r}")
    for field in ("window", "pool_size", "max_levels", "probe_examples", "level_window",
                  "steps_per_level", "max_skip", "max_outstanding"):
      _check_int(f"curation.{field}", getattr(self, field), 1)
    for field in ("min_attempts", "max_tracked", "max_uses"):
      _check_int(f"curation.{field}", getattr(self, field), 0)
    for field in ("drop_pass_rate", "prior_success", "promote_pass_rate"):
      _check_unit(f"curation.{field}", getattr(self, field))
    if not isinstance(self.priority_floor, (int, float)) or not 0.0 <= self.priority_floor < math.inf:
      raise ValueError(f"curation.priority_floor must be a finite number >= 0, got {self.priority_floor!r}")
    levels = tuple(self.levels)
    if any(not isinstance(v, (int, float)) or not math.isfinite(v) for v in levels) or \
        any(b <= a for a, b in zip(levels, levels[1:])):
      raise ValueError(f"curation.levels must be strictly ascending finite numbers, got {self.levels!r}")
    object.__setattr__(self, "levels", tuple(float(v) for v in levels))

  @property
  def attempts_to_retire(self) -> int:
    """``min_attempts``, or ``window`` when it is 0."""
    return self.min_attempts or self.window


class CuratedPromptSource(Iterator[PromptBatch]):
  """Prompt batches chosen by a curation strategy, with retirement of solved prompts.

  Same interface as :class:`~jaxrl_llm.tasks.prompts.PromptSource`, plus ``record``
  (call it once per drawn batch, after scoring, with the G * N rewards in group order)
  and ``metrics``. See the module docstring for the strategies and the state.

  Args:
    task: the prompt task.
    prompts_per_batch: G >= 1.
    seed: training-stream seed (also keys the sampling draws).
    samples_per_prompt: N >= 1.
    config: a :class:`CurationConfig`; keyword overrides are also accepted.
    difficulty: "curriculum": ``example -> float``; default :func:`default_difficulty`.
    key_fn: ``example -> str`` prompt key; default :func:`prompt_key`.
    **overrides: fields of :class:`CurationConfig` (e.g. ``strategy="prioritized"``).

  Example::

    source = CuratedPromptSource(task, 8, seed=0, samples_per_prompt=4, strategy="prioritized")
    batch = source.next_batch()
    rewards_b = score(sample(batch))          # [8 * 4], group order
    source.record(batch, rewards_b)
    state = source.get_state()                # JSON, for the checkpoint
  """

  def __init__(self, task: base.Task, prompts_per_batch: int, seed: int = 0, samples_per_prompt: int = 1,
               config: Optional[CurationConfig] = None, *, difficulty: Optional[DifficultyFn] = None,
               key_fn: Optional[KeyFn] = None, **overrides: Any):
    self.task = task
    self.prompts_per_batch = _check_int("prompts_per_batch", prompts_per_batch, 1)
    self.samples_per_prompt = _check_int("samples_per_prompt", samples_per_prompt, 1)
    self.seed = _check_int("seed", seed, 0)
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(CurationConfig)})
    if unknown:
      raise ValueError(f"CuratedPromptSource: unknown curation field(s) {unknown}; "
                       f"accepted: {[f.name for f in dataclasses.fields(CurationConfig)]}")
    config = dataclasses.replace(config or CurationConfig(), **overrides)
    self.config = config
    if config.strategy == "prioritized" and config.pool_size < prompts_per_batch:
      raise ValueError(f"curation.pool_size ({config.pool_size}) must be >= prompts_per_batch "
                       f"({prompts_per_batch}) to draw a batch without replacement")
    self.key_fn = key_fn or prompt_key
    self.difficulty = difficulty or default_difficulty(task)
    self.tracker = PassRateTracker(config.window, config.max_tracked)
    self._position = 0
    self._batch_index = 0
    self._retired: set[str] = set()
    self._pool: list[list[int]] = []  # [position, uses], insertion order
    self._level = 0
    self._level_recent: collections.deque = collections.deque(maxlen=config.level_window)
    self._outstanding: list[tuple[int, ...]] = []
    self._replay: list[tuple[int, ...]] = []
    self._stats = {"retired": 0, "skipped": 0, "exhausted": 0, "unrecorded": 0, "promotions": 0}
    self._cache: dict[int, base.Example] = {}
    self.levels: tuple[float, ...] = ()
    if config.strategy == "curriculum":
      self.levels = config.levels or self._probe_levels()

  # ------------------------------------------------------------------ examples

  def example(self, position: int) -> base.Example:
    """The training example at a stream position (cached for pooled/outstanding ones)."""
    ex = self._cache.get(position)
    if ex is None:
      ex = self.task.train_example(self.seed, position)
      if len(self._cache) > 4 * (self.config.pool_size + self.prompts_per_batch * self.config.max_outstanding):
        self._cache.clear()
      self._cache[position] = ex
    return ex

  def _probe_levels(self) -> tuple[float, ...]:
    values = np.asarray([self.difficulty(self.task.train_example(self.seed, p))
                         for p in range(self.config.probe_examples)], np.float64)
    levels = np.unique(values)
    if levels.size > self.config.max_levels:
      qs = np.arange(1, self.config.max_levels + 1) / self.config.max_levels
      levels = np.unique(np.quantile(values, qs, method="inverted_cdf"))
    return tuple(float(v) for v in levels)

  def level_of(self, example: base.Example) -> int:
    """Curriculum level of an example: the first level whose ceiling >= its difficulty
    (the last level for anything harder)."""
    return min(bisect.bisect_left(self.levels, float(self.difficulty(example))), len(self.levels) - 1)

  @property
  def level(self) -> int:
    """Current curriculum level (0 for the other strategies)."""
    if self.config.strategy != "curriculum":
      return 0
    if self.config.schedule == "steps":
      return min(self._batch_index // self.config.steps_per_level, len(self.levels) - 1)
    return self._level

  def _pull(self, accept: Callable[[base.Example], bool]) -> int:
    """Advances the stream to the next acceptable, unretired example; returns its position."""
    for _ in range(self.config.max_skip):
      position = self._position
      self._position += 1
      ex = self.example(position)
      if self.key_fn(ex) not in self._retired and accept(ex):
        return position
      self._stats["skipped"] += 1
    raise RuntimeError(
        f"CuratedPromptSource({self.config.strategy}): skipped {self.config.max_skip} stream examples in a row "
        f"(retired: {len(self._retired)}, level {self.level}); the task has run out of usable prompts — "
        "lower drop_pass_rate's reach (retire_solved=False), widen the curriculum levels or raise max_skip")

  # ------------------------------------------------------------------ drawing

  def __iter__(self) -> "CuratedPromptSource":
    return self

  def __next__(self) -> PromptBatch:
    if self._replay:
      positions = self._replay.pop(0)
    else:
      positions = self._draw()
      self._batch_index += 1
    self._outstanding.append(positions)
    if len(self._outstanding) > self.config.max_outstanding:
      self._outstanding.pop(0)
      self._stats["unrecorded"] += 1
    return PromptBatch(tuple(self.example(p) for p in positions), positions, self.samples_per_prompt)

  def next_batch(self) -> PromptBatch:
    """Same as ``next(source)``."""
    return next(self)

  def _draw(self) -> tuple[int, ...]:
    g = self.prompts_per_batch
    if self.config.strategy == "stream":
      return tuple(self._pull(lambda ex: True) for _ in range(g))
    if self.config.strategy == "curriculum":
      ceiling = self.level
      return tuple(self._pull(lambda ex: self.level_of(ex) <= ceiling) for _ in range(g))
    return self._draw_prioritized()

  def priorities(self) -> np.ndarray:
    """float64 [pool] ``(1 - s_i) + floor`` of the pooled prompts, in pool order."""
    c = self.config
    out = np.empty(len(self._pool), np.float64)
    for i, (position, _) in enumerate(self._pool):
      rate = self.tracker.pass_rate(self.key_fn(self.example(position)))
      out[i] = (1.0 - (c.prior_success if rate is None else rate)) + c.priority_floor
    return out

  def _draw_prioritized(self) -> tuple[int, ...]:
    pooled = {self.key_fn(self.example(p)) for p, _ in self._pool}

    def fresh(ex: base.Example) -> bool:
      return self.key_fn(ex) not in pooled

    while len(self._pool) < self.config.pool_size:
      position = self._pull(fresh)
      pooled.add(self.key_fn(self.example(position)))
      self._pool.append([position, 0])
    weights = self.priorities()
    picks = weighted_sample_without_replacement(
        weights, self.prompts_per_batch, base.CounterRng("curation", self.task.name, self.seed, self._batch_index))
    positions = tuple(self._pool[i][0] for i in picks)
    for i in picks:
      self._pool[i][1] += 1
    if self.config.max_uses:
      kept = [e for e in self._pool if e[1] < self.config.max_uses]
      self._stats["exhausted"] += len(self._pool) - len(kept)
      self._pool = kept
    return positions

  # ------------------------------------------------------------------ feedback

  def record(self, batch: Union[PromptBatch, Sequence[base.Example]], rewards_b: Any) -> list[str]:
    """Records the scored samples of one drawn batch; retires solved prompts.

    Args:
      batch: the ``PromptBatch`` from ``next_batch`` (or its G examples).
      rewards_b: float [G * N] rewards, the N samples of each prompt contiguous, in
        the batch's prompt order.

    Returns:
      Keys of the prompts retired by this call.

    Raises:
      ValueError: when ``rewards_b`` does not hold G * N finite numbers.
    """
    if isinstance(batch, PromptBatch):
      examples, positions = list(batch.examples), tuple(batch.positions)
    else:
      examples, positions = list(batch), None
    g, n = len(examples), self.samples_per_prompt
    if g == 0:
      raise ValueError("record: the batch has no examples")
    rewards = np.asarray(rewards_b, np.float64)
    if rewards.ndim != 1 or rewards.shape[0] != g * n:
      raise ValueError(f"rewards_b must have shape [G * N] = [{g} * {n}] = [{g * n}], got {rewards.shape}")
    if not np.all(np.isfinite(rewards)):
      raise ValueError(f"rewards_b must be finite, got {rewards.tolist()}")
    keys = [self.key_fn(ex) for ex in examples]
    self._settle(positions, keys)
    success = (rewards >= self.config.success_threshold).astype(np.float64)
    self.tracker.record([k for k in keys for _ in range(n)], success)
    if self.config.strategy == "curriculum" and self.config.schedule == "pass_rate":
      self._update_level(examples, success.reshape(g, n))
    return self._retire(keys)

  def _settle(self, positions: Optional[tuple[int, ...]], keys: list[str]) -> None:
    """Removes the recorded batch from the outstanding ones (first match)."""
    for j, drawn in enumerate(self._outstanding):
      if positions is not None:
        match = drawn == positions
      else:
        match = [self.key_fn(self.example(p)) for p in drawn] == keys
      if match:
        del self._outstanding[j]
        return

  def _update_level(self, examples: list[base.Example], success_gn: np.ndarray) -> None:
    current = self._level
    for ex, row in zip(examples, success_gn):
      if self.level_of(ex) == current:
        self._level_recent.extend(row.tolist())
    window = self._level_recent
    if (current < len(self.levels) - 1 and len(window) == window.maxlen
        and math.fsum(window) / len(window) >= self.config.promote_pass_rate):
      self._level += 1
      self._level_recent.clear()
      self._stats["promotions"] += 1

  def _retire(self, keys: list[str]) -> list[str]:
    c = self.config
    if not c.retire_solved:
      return []
    retired = []
    for key in dict.fromkeys(keys):
      rate = self.tracker.pass_rate(key)
      if rate is not None and self.tracker.attempts(key) >= c.attempts_to_retire and rate >= c.drop_pass_rate:
        self._retired.add(key)
        self.tracker.forget(key)
        retired.append(key)
    if retired:
      gone = set(retired)
      self._pool = [e for e in self._pool if self.key_fn(self.example(e[0])) not in gone]
      self._stats["retired"] += len(retired)
    return retired

  def is_retired(self, example: base.Example) -> bool:
    """True when the example's prompt has been retired."""
    return self.key_fn(example) in self._retired

  # ------------------------------------------------------------------ reporting and state

  def metrics(self) -> dict[str, float]:
    """Scalars for the metrics writer (``curation/...``).

    ``mean_pass_rate`` is over the prompts still tracked: retired prompts are forgotten,
    so it reads lower than the pass rate of everything drawn.
    """
    mean = self.tracker.mean_pass_rate()
    out = {
        "curation/pool_size": float(len(self._pool)),
        "curation/retired_total": float(self._stats["retired"]),
        "curation/skipped_total": float(self._stats["skipped"]),
        "curation/tracked_prompts": float(len(self.tracker)),
        "curation/mean_pass_rate": float("nan") if mean is None else mean,
        "curation/stream_position": float(self._position),
        "curation/batches": float(self._batch_index),
        "curation/unrecorded_batches": float(self._stats["unrecorded"]),
    }
    if self.config.strategy == "prioritized":
      out["curation/exhausted_total"] = float(self._stats["exhausted"])
    if self.config.strategy == "curriculum":
      level = self.level
      out["curation/level"] = float(level)
      out["curation/ceiling"] = self.levels[level]
      recent = self._level_recent
      out["curation/level_pass_rate"] = math.fsum(recent) / len(recent) if recent else float("nan")
    return out

  def get_state(self) -> dict[str, Any]:
    """The resumable state (JSON-serialisable; see the module docstring)."""
    return {
        "version": STATE_VERSION,
        "strategy": self.config.strategy,
        "task": self.task.name,
        "seed": self.seed,
        "position": self._position,
        "batch_index": self._batch_index,
        "tracker": self.tracker.get_state(),
        "retired": sorted(self._retired),
        "pool": [list(e) for e in self._pool],
        "level": self._level,
        "level_recent": list(self._level_recent),
        "levels": list(self.levels),
        "outstanding": [list(p) for p in self._replay + self._outstanding],
        "stats": dict(self._stats),
    }

  def set_state(self, state: Mapping[str, Any]) -> None:
    """Restores ``get_state``'s output; unrecorded batches are handed out again first.

    A plain :class:`~jaxrl_llm.tasks.prompts.PromptSource` state (``{"task", "seed",
    "position"}``) is accepted too: the stream continues there with fresh curation state.

    Raises:
      ValueError: naming the field when the state belongs to another task, strategy,
        seed or level table, or is malformed.
    """
    task = state.get("task", self.task.name)
    if task != self.task.name:
      raise ValueError(f"prompt-source state is for task {task!r}, not {self.task.name!r}")
    if "seed" not in state or "position" not in state:
      raise ValueError(f"prompt-source state needs 'seed' and 'position', got fields {sorted(state)}")
    if int(state["seed"]) != self.seed:
      raise ValueError(f"prompt-source state has seed {state['seed']}, this source has seed {self.seed}")
    if "version" not in state:  # a plain PromptSource state
      self._position = _check_int("state.position", int(state["position"]), 0)
      return
    if state["version"] != STATE_VERSION:
      raise ValueError(f"prompt-source state version {state['version']!r} is not {STATE_VERSION}")
    missing = [f for f in ("strategy", "batch_index", "tracker", "retired", "pool", "level", "level_recent",
                           "levels", "outstanding", "stats") if f not in state]
    if missing:
      raise ValueError(f"prompt-source state is missing field(s) {missing}")
    if state["strategy"] != self.config.strategy:
      raise ValueError(f"prompt-source state is for strategy {state['strategy']!r}, "
                       f"this source uses {self.config.strategy!r}")
    levels = tuple(float(v) for v in state["levels"])
    if levels != self.levels:
      raise ValueError(f"prompt-source state has curriculum levels {list(levels)}, this source {list(self.levels)}")
    self._position = _check_int("state.position", int(state["position"]), 0)
    self._batch_index = _check_int("state.batch_index", int(state["batch_index"]), 0)
    self.tracker.set_state(state["tracker"])
    self._retired = set(state["retired"])
    self._pool = [[int(p), int(u)] for p, u in state["pool"]]
    self._level = _check_int("state.level", int(state["level"]), 0)
    self._level_recent = collections.deque((float(v) for v in state["level_recent"]),
                                           maxlen=self.config.level_window)
    self._replay = [tuple(int(p) for p in positions) for positions in state["outstanding"]]
    self._outstanding = []
    self._stats = {k: int(state["stats"].get(k, 0)) for k in self._stats}


def weighted_sample_without_replacement(weights: Any, k: int, rng: base.CounterRng) -> list[int]:
  """Draws ``k`` distinct indices, each draw ∝ the weights of the indices not yet drawn.

  Sequential draws: ``P(i at draw j) = w_i / sum_{l not drawn} w_l``; when every
  remaining weight is 0 the draw is uniform over the remaining indices. Uniforms are
  ``(u64 >> 11) / 2**53`` from a :class:`~jaxrl_llm.tasks.base.CounterRng`, so the
  result is the same on every platform.

  Args:
    weights: float [P] non-negative finite weights.
    k: draws, 0 <= k <= P.
    rng: the random stream.

  Returns:
    The k indices, in draw order.

  Raises:
    ValueError: for negative or non-finite weights, or k outside [0, P].
  """
  w = np.asarray(weights, np.float64).reshape(-1).copy()
  if not np.all(np.isfinite(w)) or np.any(w < 0):
    raise ValueError(f"weights must be finite and >= 0, got {w.tolist()}")
  if not 0 <= k <= w.shape[0]:
    raise ValueError(f"k must be in [0, {w.shape[0]}] (the number of weights), got {k}")
  alive = np.ones(w.shape[0], bool)
  out: list[int] = []
  for _ in range(k):
    u = (rng.next_u64() >> 11) / 2.0**53
    cur = np.where(alive, w, 0.0)
    if not np.any(cur > 0):
      cur = alive.astype(np.float64)
    cum = np.cumsum(cur)
    i = int(np.searchsorted(cum, u * cum[-1], side="right"))
    if i >= cur.shape[0] or cur[i] == 0.0:  # u * total rounded up to the total
      i = int(np.flatnonzero(cur > 0)[-1])
    alive[i] = False
    out.append(i)
  return out


# --------------------------------------------------------------------------- dynamic sampling


def zero_variance_groups(rewards_b: Any, group_size: int, tolerance: float = 0.0) -> np.ndarray:
  """Flags groups whose rewards are all equal: ``max_g - min_g <= tolerance``.

  The host-side twin of :func:`jaxrl_llm.advantages.group_zero_variance` (exact by
  default), for data selection before any array reaches the device.

  Args:
    rewards_b: float [G * N] rewards, groups contiguous.
    group_size: N >= 1.
    tolerance: >= 0.

  Returns:
    bool [G].
  """
  n = _check_int("group_size", group_size, 1)
  r = np.asarray(rewards_b, np.float64)
  if r.ndim != 1 or r.shape[0] % n:
    raise ValueError(f"rewards_b must have shape [G * N] with N = group_size = {n}, got {r.shape}")
  if not np.all(np.isfinite(r)):
    raise ValueError(f"rewards_b must be finite, got {r.tolist()}")
  r_gn = r.reshape(-1, n)
  return (r_gn.max(axis=1) - r_gn.min(axis=1)) <= tolerance


@dataclasses.dataclass(frozen=True)
class CollectedGroups:
  """The groups chosen by :class:`InformativeGroupCollector`, in arrival order.

  Attributes:
    rows_b: int64 [S * N] row indices into the concatenation of every round's rows
      (round 0's rows first), the N rows of each selected group contiguous.
    round_g: int64 [S] the round of each selected group.
    group_g: int64 [S] its group index within that round.
    zero_variance_g: bool [S] True for padding groups (all rewards equal).
    rounds: sampling rounds used.
    discarded_groups: zero-variance groups left out.
    surplus_groups: informative groups beyond the target, left out.
    padded_groups: zero-variance groups kept because ``max_rounds`` ran out.
    missing_groups: target minus S (> 0 only when all rounds together had too few groups).
  """

  rows_b: np.ndarray
  round_g: np.ndarray
  group_g: np.ndarray
  zero_variance_g: np.ndarray
  rounds: int
  discarded_groups: int
  surplus_groups: int
  padded_groups: int
  missing_groups: int

  def rows_of_round(self, round_index: int, group_size: int) -> np.ndarray:
    """Selected row indices local to one round's batch (for per-round Trajectories)."""
    groups = self.group_g[self.round_g == round_index]
    return (groups[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)

  def metrics(self) -> dict[str, float]:
    """``data/dynamic_*`` scalars for the metrics writer."""
    return {"data/dynamic_rounds": float(self.rounds),
            "data/dynamic_discarded_groups": float(self.discarded_groups),
            "data/dynamic_surplus_groups": float(self.surplus_groups),
            "data/dynamic_padded_groups": float(self.padded_groups),
            "data/dynamic_missing_groups": float(self.missing_groups)}


class InformativeGroupCollector:
  """Dynamic sampling (DAPO): over-sample until ``target_groups`` groups have reward variance.

  Each sampling round's rewards are passed to :meth:`add`; groups whose rewards are all
  equal (zero advantage, no gradient) are set aside. Once ``target_groups`` informative
  groups have arrived, :meth:`result` returns the first ``target_groups`` of them in
  arrival order (so the learner batch keeps its size and shape). After ``max_rounds``
  rounds it returns what it has, padded with the earliest zero-variance groups (counted
  in ``padded_groups``), instead of sampling forever.

  State: none across learner steps. A collector lives within one step; checkpoints are
  taken between steps, and a resumed step re-runs its rounds (derive the round's
  sampling key from (seed, step, round), e.g. ``fold_in(sampling_key(step), round)``,
  and draw the rounds' prompts from the resumable prompt source, so the re-run is
  identical).

  Args:
    target_groups: groups per learner batch (>= 1).
    group_size: N samples per group (>= 1).
    max_rounds: most sampling rounds (>= 1).
    tolerance: rewards within this of each other count as equal (default exact).

  Example::

    collector = InformativeGroupCollector(target_groups=8, group_size=4, max_rounds=3)
    while not collector.done:
      batch = source.next_batch()
      rewards_b = score(sample(batch))
      source.record(batch, rewards_b)
      collector.add(rewards_b)
    chosen = collector.result()   # chosen.rows_b indexes the concatenated rounds
  """

  def __init__(self, target_groups: int, group_size: int, max_rounds: int = 4, tolerance: float = 0.0):
    self.target_groups = _check_int("target_groups", target_groups, 1)
    self.group_size = _check_int("group_size", group_size, 1)
    self.max_rounds = _check_int("max_rounds", max_rounds, 1)
    if not isinstance(tolerance, (int, float)) or not 0.0 <= tolerance < math.inf:
      raise ValueError(f"tolerance must be a finite number >= 0, got {tolerance!r}")
    self.tolerance = float(tolerance)
    self.reset()

  def reset(self) -> None:
    """Forgets every round (start of a new learner step)."""
    self._informative: list[tuple[int, int, int]] = []  # (round, group, row offset)
    self._flat: list[tuple[int, int, int]] = []
    self._round_rows: list[int] = []

  @property
  def rounds(self) -> int:
    """Rounds added so far."""
    return len(self._round_rows)

  @property
  def groups_needed(self) -> int:
    """Informative groups still missing (what the next round should at least yield)."""
    return max(0, self.target_groups - len(self._informative))

  @property
  def done(self) -> bool:
    """Enough informative groups, or ``max_rounds`` rounds added."""
    return self.groups_needed == 0 or self.rounds >= self.max_rounds

  def add(self, rewards_b: Any) -> bool:
    """Adds one round's scored groups.

    Args:
      rewards_b: float [G_r * N] the round's rewards, groups contiguous.

    Returns:
      ``done`` after this round.

    Raises:
      ValueError: for a malformed ``rewards_b``, or when the collector is already done.
    """
    if self.done and self.rounds:
      raise ValueError(f"InformativeGroupCollector is done after {self.rounds} round(s); "
                       "call result(), then reset() for the next step")
    flags = zero_variance_groups(rewards_b, self.group_size, self.tolerance)
    r, offset = self.rounds, sum(self._round_rows)
    for g, flat in enumerate(flags.tolist()):
      (self._flat if flat else self._informative).append((r, g, offset + g * self.group_size))
    self._round_rows.append(flags.shape[0] * self.group_size)
    return self.done

  def result(self) -> CollectedGroups:
    """The selected groups (see :class:`CollectedGroups`).

    Raises:
      ValueError: before the first round.
    """
    if not self.rounds:
      raise ValueError("InformativeGroupCollector.result(): no round has been added")
    chosen = self._informative[:self.target_groups]
    surplus = len(self._informative) - len(chosen)
    pad = self._flat[:self.target_groups - len(chosen)]
    picked = sorted([(e, False) for e in chosen] + [(e, True) for e in pad])
    n = self.group_size
    rows = np.asarray([off + j for (_, _, off), _ in picked for j in range(n)], np.int64)
    return CollectedGroups(
        rows_b=rows,
        round_g=np.asarray([e[0] for e, _ in picked], np.int64),
        group_g=np.asarray([e[1] for e, _ in picked], np.int64),
        zero_variance_g=np.asarray([flat for _, flat in picked], bool),
        rounds=self.rounds,
        discarded_groups=len(self._flat) - len(pad),
        surplus_groups=surplus,
        padded_groups=len(pad),
        missing_groups=self.target_groups - len(picked))


__all__ = [
    "STRATEGIES", "SCHEDULES", "CollectedGroups", "CuratedPromptSource", "CurationConfig",
    "InformativeGroupCollector", "PassRateTracker", "addition_difficulty", "answer_length_difficulty",
    "default_difficulty", "prompt_key", "weighted_sample_without_replacement", "zero_variance_groups",
]
