"""The curated prompt source: a drop-in :class:`~jaxrl_llm.tasks.prompts.PromptSource` that
chooses prompts by a curation strategy and retires solved ones.

Strategies (``config.strategy``):

- ``"stream"``: the task's training stream in order;
- ``"prioritized"``: a :class:`~.pool.PrioritizedPool` refilled from the stream;
- ``"curriculum"``: the stream restricted to the current :class:`~.curriculum.Curriculum`
  level (by ``task.difficulty``).

With ``retire_solved`` (all strategies), a prompt whose pass rate over its last
``window`` attempts is >= ``drop_pass_rate``, once it has at least ``min_attempts``
attempts (default: ``window``), leaves the pool and is never drawn again: an
always-solved prompt has zero group-relative advantage (no-positive resampling,
Skywork-OR1, arXiv:2505.22312).

Determinism and resumption. Every draw is a function of the state and of ``(seed,
batch index)`` (a :class:`~jaxrl_llm.tasks.base.CounterRng`, blake2b, the same on every
platform and library version). The state holds stream positions, never examples
(``task.train_example(seed, position)`` rebuilds them), prompt keys and counters, so it
is small JSON. Batches drawn but not yet ``record``-ed are part of the state and are
handed out again, in order, after ``set_state``: a pipelined loop that checkpoints after
recording step s while steps s+1..s+k are in flight resumes with exactly those batches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from jaxrl_llm.tasks import base
from jaxrl_llm.tasks.curation.config import CurationConfig, check_int
from jaxrl_llm.tasks.curation.curriculum import Curriculum, DifficultyFn, probe_levels
from jaxrl_llm.tasks.curation.pool import PrioritizedPool
from jaxrl_llm.tasks.curation.tracker import PassRateTracker, prompt_key
from jaxrl_llm.tasks.prompts import PromptBatch

STATE_VERSION = 1
STATE_FIELDS = ("strategy", "batch_index", "tracker", "retired", "pool", "level", "level_recent", "levels",
                "outstanding", "stats")

KeyFn = Callable[[base.Example], str]


class CuratedPromptSource(Iterator[PromptBatch]):
  """Prompt batches chosen by a curation strategy, with retirement of solved prompts.

  Same interface as :class:`~jaxrl_llm.tasks.prompts.PromptSource` (``next_batch``,
  ``get_state`` / ``set_state``, ``prompts_per_batch``, ``samples_per_prompt``), plus
  ``record`` (call it once per drawn batch, after scoring, with the G * N rewards in
  group order) and ``metrics``. See the module docstring for the strategies and state.

  Args:
    task: the prompt task.
    prompts_per_batch: G >= 1.
    seed: training-stream seed (also keys the sampling draws).
    samples_per_prompt: N >= 1.
    config: a :class:`CurationConfig`; keyword overrides are also accepted.
    difficulty: "curriculum": ``example -> float``; default ``task.difficulty``.
    key_fn: ``example -> str`` prompt key; default :func:`~.tracker.prompt_key`.
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
    self.prompts_per_batch = check_int("prompts_per_batch", prompts_per_batch, 1)
    self.samples_per_prompt = check_int("samples_per_prompt", samples_per_prompt, 1)
    self.seed = check_int("seed", seed, 0)
    names = [f.name for f in dataclasses.fields(CurationConfig)]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
      raise ValueError(f"CuratedPromptSource: unknown curation field(s) {unknown}; accepted: {names}")
    config = dataclasses.replace(config or CurationConfig(), **overrides)
    self.config = config
    if config.strategy == "prioritized" and config.pool_size < prompts_per_batch:
      raise ValueError(f"data.pool_size={config.pool_size}: expected an integer >= the prompts per batch "
                       f"({prompts_per_batch}) to draw a batch without replacement")
    self.key_fn = key_fn or prompt_key
    self.difficulty = difficulty or task.difficulty
    self.tracker = PassRateTracker(config.window, config.max_tracked)
    self.pool = PrioritizedPool(config, lambda position: self.key_fn(self.example(position)))
    self._position = 0
    self._batch_index = 0
    self._retired: set[str] = set()
    self._outstanding: list[tuple[int, ...]] = []
    self._replay: list[tuple[int, ...]] = []
    self._stats = {"retired": 0, "skipped": 0, "unrecorded": 0}
    self._cache: dict[int, base.Example] = {}
    self.curriculum: Optional[Curriculum] = None
    if config.strategy == "curriculum":
      self.curriculum = Curriculum(config, config.levels or self._probe_levels(), self.difficulty)

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
    return probe_levels([self.difficulty(self.task.train_example(self.seed, p))
                         for p in range(self.config.probe_examples)], self.config.max_levels)

  @property
  def levels(self) -> tuple[float, ...]:
    """Curriculum difficulty ceilings (empty for the other strategies)."""
    return self.curriculum.levels if self.curriculum else ()

  def level_of(self, example: base.Example) -> int:
    """Curriculum level of an example (see :meth:`Curriculum.level_of`)."""
    if self.curriculum is None:
      return 0
    return self.curriculum.level_of(example)

  @property
  def level(self) -> int:
    """Current curriculum level (0 for the other strategies)."""
    return self.curriculum.level(self._batch_index) if self.curriculum else 0

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
    if self.curriculum is not None:
      ceiling = self.level
      return tuple(self._pull(lambda ex: self.curriculum.level_of(ex) <= ceiling) for _ in range(g))
    if self.config.strategy == "prioritized":
      self.pool.refill(lambda pooled: self._pull(lambda ex: self.key_fn(ex) not in pooled))
      rng = base.CounterRng("curation", self.task.name, self.seed, self._batch_index)
      return self.pool.draw(g, self.tracker.pass_rate, rng)
    return tuple(self._pull(lambda ex: True) for _ in range(g))

  def priorities(self) -> np.ndarray:
    """float64 [pool] ``(1 - s_i) + floor`` of the pooled prompts, in pool order."""
    return self.pool.priorities(self.tracker.pass_rate)

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
    if self.curriculum is not None:
      self.curriculum.observe(examples, success.reshape(g, n))
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
      self.pool.discard(set(retired))
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
        "curation/pool_size": float(len(self.pool)),
        "curation/retired_total": float(self._stats["retired"]),
        "curation/skipped_total": float(self._stats["skipped"]),
        "curation/tracked_prompts": float(len(self.tracker)),
        "curation/mean_pass_rate": float("nan") if mean is None else mean,
        "curation/stream_position": float(self._position),
        "curation/batches": float(self._batch_index),
        "curation/unrecorded_batches": float(self._stats["unrecorded"]),
    }
    if self.config.strategy == "prioritized":
      out["curation/exhausted_total"] = float(self.pool.exhausted)
    if self.curriculum is not None:
      out.update(self.curriculum.metrics(self._batch_index))
    return out

  def get_state(self) -> dict[str, Any]:
    """The resumable state (JSON-serialisable; see the module docstring)."""
    curriculum = self.curriculum.get_state() if self.curriculum else {"level": 0, "level_recent": [], "levels": []}
    return {
        "version": STATE_VERSION,
        "strategy": self.config.strategy,
        "task": self.task.name,
        "seed": self.seed,
        "position": self._position,
        "batch_index": self._batch_index,
        "tracker": self.tracker.get_state(),
        "retired": sorted(self._retired),
        "pool": self.pool.get_state(),
        **curriculum,
        "outstanding": [list(p) for p in self._replay + self._outstanding],
        "stats": dict(self._stats, exhausted=self.pool.exhausted,
                      promotions=self.curriculum.promotions if self.curriculum else 0),
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
      self._position = check_int("state.position", int(state["position"]), 0)
      return
    if state["version"] != STATE_VERSION:
      raise ValueError(f"prompt-source state version {state['version']!r} is not {STATE_VERSION}")
    missing = [f for f in STATE_FIELDS if f not in state]
    if missing:
      raise ValueError(f"prompt-source state is missing field(s) {missing}")
    if state["strategy"] != self.config.strategy:
      raise ValueError(f"prompt-source state is for strategy {state['strategy']!r}, "
                       f"this source uses {self.config.strategy!r}")
    stats = state["stats"]
    if self.curriculum is not None:
      self.curriculum.set_state(state, int(stats.get("promotions", 0)))
    elif list(state["levels"]):
      raise ValueError(f"prompt-source state has curriculum levels {list(state['levels'])}, this source none")
    self._position = check_int("state.position", int(state["position"]), 0)
    self._batch_index = check_int("state.batch_index", int(state["batch_index"]), 0)
    self.tracker.set_state(state["tracker"])
    self._retired = set(state["retired"])
    self.pool.set_state(state["pool"], int(stats.get("exhausted", 0)))
    self._replay = [tuple(int(p) for p in positions) for positions in state["outstanding"]]
    self._outstanding = []
    self._stats = {k: int(stats.get(k, 0)) for k in self._stats}


__all__ = ["CuratedPromptSource", "KeyFn", "STATE_VERSION"]
