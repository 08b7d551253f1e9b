"""Multi-turn sampling sessions: generate a turn, append an observation, generate the next turn.

A multi-turn episode (:mod:`jaxrl_llm.envs`) alternates model turns and
environment observations in one growing token sequence per row. A
:class:`TurnSession` holds those sequences for a batch of rows between turns:

  generate(rows, budgets, stop_ids)   each listed row samples until a stop token
                                      or its budget; returns a TurnOutput per row
  append(rows, tokens)                each listed row's context grows by these
                                      (observation) tokens; nothing is sampled

Two implementations share the contract:

* :class:`JaxSession` (the built-in sampler) keeps the KV cache on the device
  between turns. After a turn, a row's last sampled token is *pending* (not
  yet in the cache); ``append`` writes the pending token and the observation
  in one chunked prefill at the row's own offset (``models.extend``), so the
  history is never re-read. When the sampler's weights change between turns
  (in-flight updates), the session re-reads every row's history once with the
  new weights before sampling again, so each token's behaviour
  log-probability is exactly that of the version it records (the same choice
  as :mod:`jaxrl_llm.rollout.segments`).
* :class:`ReplaySession` works over any :class:`~jaxrl_llm.sampling.Sampler`
  (vLLM in particular): every turn is one ``generate`` call on the rows' whole
  histories. vLLM's automatic prefix caching (``sampler.vllm.enable_prefix_caching``)
  finds the history's KV blocks again, so only the new tokens are prefilled.

Randomness: row ``r`` (global row id) draws the uniform of its k-th sampled
token of the episode from ``fold_in(fold_in(rng, r), k)`` in the JAX session,
so the tokens do not depend on which other rows share a turn. The replay
session passes ``fold_in(rng, turn)`` and the row ids to ``generate``.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm import models, ops
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SamplerConfig
from jaxrl_llm.sampling.layout import next_power_of_two
from jaxrl_llm.sampling.processing import select_tokens

__all__ = ["JaxSession", "ReplaySession", "TurnOutput", "TurnSession", "open_session"]

MIN_CHUNK_BUCKET = 8  # observation chunks are padded to powers of two of at least this many tokens


@dataclasses.dataclass
class TurnOutput:
  """One row's model turn.

  Attributes:
    tokens: the sampled ids (the stop token included when one was sampled).
    logprobs: behaviour log-probability of each token (``SamplerConfig`` processing).
    stopped: the turn ended with a stop token (False: it ran out of budget).
    version: the policy version that sampled every token of the turn.
  """

  tokens: list[int]
  logprobs: list[float]
  stopped: bool
  version: int


class TurnSession(abc.ABC):
  """Token histories of a batch of rows, grown turn by turn (see the module docstring).

  Attributes:
    prompts: per row, the prompt actually used (after any truncation).
    prompt_truncated: per row, the prompt lost its oldest tokens.
    capacity: tokens each row may add after its prompt (model and observation tokens).
  """

  prompts: list[list[int]]
  prompt_truncated: list[bool]
  capacity: int

  def __init__(self):
    self.added = [0] * len(self.prompts)

  @property
  def num_rows(self) -> int:
    return len(self.prompts)

  def remaining(self, row: int) -> int:
    """Tokens row ``row`` may still add (model or observation)."""
    return self.capacity - self.added[row]

  def generate(self, rows: Sequence[int], budgets: Sequence[int], stop_token_ids: Sequence[int],
               stop_sequences: Sequence[Sequence[int]] = ()) -> list[TurnOutput]:
    """Samples one turn for each of ``rows``.

    Args:
      rows: distinct row indices.
      budgets: per row, the most tokens of this turn (>= 1, <= ``remaining``).
      stop_token_ids: ids that end a turn (kept in it).
      stop_sequences: token sequences that end a turn when the turn's tokens end with one (kept
        in it): a tool-call end tag that the tokenizer splits into several tokens.

    Returns:
      One TurnOutput per row, in order.
    """
    rows, budgets = [int(r) for r in rows], [int(b) for b in budgets]
    for r, b in zip(rows, budgets):
      if not 1 <= b <= self.remaining(r):
        raise ValueError(f"generate: row {r} asks for {b} tokens with {self.remaining(r)} left of its capacity "
                         f"{self.capacity} (expected 1 <= budget <= remaining)")
    if not rows:
      return []
    sequences = tuple(tuple(int(t) for t in seq) for seq in stop_sequences if len(seq))
    outputs = self._generate(rows, budgets, tuple(int(s) for s in stop_token_ids), sequences)
    for r, out in zip(rows, outputs):
      self.added[r] += len(out.tokens)
    return outputs

  def append(self, rows: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
    """Adds ``tokens[i]`` (observation ids, may be empty) to the context of ``rows[i]``."""
    rows, tokens = [int(r) for r in rows], [[int(t) for t in ids] for ids in tokens]
    for r, ids in zip(rows, tokens):
      if len(ids) > self.remaining(r):
        raise ValueError(f"append: row {r} gets {len(ids)} tokens with {self.remaining(r)} left of its capacity "
                         f"{self.capacity}")
    if rows:
      self._append(rows, tokens)
    for r, ids in zip(rows, tokens):
      self.added[r] += len(ids)

  @abc.abstractmethod
  def _generate(self, rows: list[int], budgets: list[int], stops: tuple[int, ...],
                sequences: tuple[tuple[int, ...], ...]) -> list[TurnOutput]:
    """``generate`` after validation."""

  @abc.abstractmethod
  def _append(self, rows: list[int], tokens: list[list[int]]) -> None:
    """``append`` after validation."""


class ReplaySession(TurnSession):
  """A session over any sampler's ``generate``: each turn re-submits the rows' whole histories.

  Args:
    sampler: a :class:`~jaxrl_llm.sampling.Sampler` (``generate(prompts, rng=, row_ids=, **overrides)``).
    prompts: one token-id prompt per row.
    rng: the episode batch's key.
    row_ids: global row ids (per-row sampling keys).
    capacity: tokens each row may add after its prompt.
    config: the sampler's settings (prompt length checks).
    model_config: the policy's decoder config.
    **overrides: ``SamplerConfig`` fields for every turn (``greedy=True``).
  """

  def __init__(self, sampler: Any, prompts: Sequence[Sequence[int]], *, rng: Any, row_ids: Sequence[int],
               capacity: int, config: SamplerConfig, model_config: ModelConfig, **overrides: Any):
    self.sampler = sampler
    self.overrides = overrides
    self.prompts, self.prompt_truncated = layout.prepare_prompts(
        prompts, config.replace(max_new_tokens=int(capacity)), model_config)
    self.capacity = int(capacity)
    self.rng, self.row_ids = rng, np.asarray(row_ids, np.int64)
    self.histories = [list(p) for p in self.prompts]
    self.turns = 0
    super().__init__()

  def _generate(self, rows, budgets, stops, sequences):
    key = jax.random.fold_in(self.rng, self.turns)
    self.turns += 1
    outputs: dict[int, TurnOutput] = {}
    for budget in sorted(set(budgets)):  # one call per budget: a row near its capacity asks for fewer tokens
      group = [r for r, b in zip(rows, budgets) if b == budget]
      result = self.sampler.generate([self.histories[r] for r in group], rng=key, row_ids=self.row_ids[group],
                                     **{**self.overrides, "num_samples": 1, "max_new_tokens": budget,
                                        "stop_token_ids": stops, "truncate_prompts": False})
      for i, r in enumerate(group):
        tokens = [int(t) for t in result.response_tokens[i]]
        logps = [float(x) for x in result.response_logprobs[i]]
        cut = _first_sequence_end(tokens, sequences)  # the sampler knows stop ids only: cut after a sequence
        tokens, logps = tokens[:cut], logps[:cut]
        self.histories[r] += tokens
        in_sequence = any(len(tokens) >= len(q) and tuple(tokens[-len(q):]) == q for q in sequences)
        stopped = bool(tokens) and (tokens[-1] in stops or in_sequence)
        outputs[r] = TurnOutput(tokens, logps, stopped, int(result.policy_version))
    return [outputs[r] for r in rows]

  def _append(self, rows, tokens):
    for r, ids in zip(rows, tokens):
      self.histories[r] += ids


@dataclasses.dataclass(frozen=True)
class _TurnSpec:
  """Everything static about one compiled turn program."""

  max_steps: int
  temperature: float
  top_k: int
  top_p: float
  greedy: bool
  stop_token_ids: tuple[int, ...]
  stop_sequences: tuple[tuple[int, ...], ...] = ()


class JaxSession(TurnSession):
  """The built-in sampler's session: the KV cache stays on the device between turns.

  Args:
    sampler: a :class:`~jaxrl_llm.sampling.JaxSampler` (its current weights and version are read at
      every turn).
    prompts: one token-id prompt per row.
    rng: the episode batch's key.
    row_ids: global row ids (per-row sampling keys).
    capacity: tokens each row may add after its prompt.
    max_turn_tokens: the most tokens of one turn (static: one compiled turn program serves every turn).
    **overrides: ``SamplerConfig`` fields for every turn (``greedy=True``).
  """

  def __init__(self, sampler: Any, prompts: Sequence[Sequence[int]], *, rng: Any, row_ids: Sequence[int],
               capacity: int, max_turn_tokens: int, **overrides: Any):
    self.sampler = sampler
    mc, config = sampler.model_config, sampler.config.replace(**overrides)
    self.config = config
    self.model_config = mc
    self.prompts, self.prompt_truncated = layout.prepare_prompts(
        prompts, config.replace(max_new_tokens=int(capacity)), mc)
    self.capacity, self.max_turn_tokens = int(capacity), int(max_turn_tokens)
    num_rows = len(self.prompts)
    self.batch = next_power_of_two(num_rows, config.min_batch_bucket)
    row_ids = np.asarray(row_ids, np.int64)
    if row_ids.shape != (num_rows,):
      raise ValueError(f"JaxSession: row_ids has shape {row_ids.shape}, expected ({num_rows},)")
    row_ids = np.concatenate([row_ids, np.arange(self.batch - num_rows) + row_ids.max() + 1])
    self.row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(jnp.asarray(row_ids, jnp.int32))
    longest = max(len(p) for p in self.prompts) + self.capacity
    self.cache_length = -(-(longest + 1) // ops.KEY_BLOCK) * ops.KEY_BLOCK
    self.histories = [list(p) for p in self.prompts] + [[self.model_config.pad_token_id]] * (self.batch - num_rows)
    self.pending: list[int | None] = [None] * self.batch  # last sampled token, not yet in the cache
    self.sampled = jnp.zeros((self.batch,), jnp.int32)  # tokens sampled per row so far (the key counter)
    super().__init__()
    self._read_histories()

  def _read_histories(self) -> None:
    """(Re)builds the cache from every row's history with the sampler's current weights."""
    rows = [h + ([self.pending[r]] if self.pending[r] is not None else []) for r, h in enumerate(self.histories)]
    lengths = np.array([len(h) for h in rows], np.int32)
    width = min(next_power_of_two(int(lengths.max()), self.config.min_prompt_bucket), self.cache_length)
    tokens = np.full((self.batch, width), self.model_config.pad_token_id, np.int32)
    for r, h in enumerate(rows):
      tokens[r, :len(h)] = h
    self.logits, self.cache = models.prefill(self.sampler.params, self.model_config, jnp.asarray(tokens),
                                             jnp.asarray(lengths), self.cache_length)
    self.histories = rows
    self.pending = [None] * self.batch
    self.written = jnp.asarray(lengths)
    self.version = self.sampler.policy_version

  def _generate(self, rows, budgets, stops, sequences):
    if self.sampler.policy_version != self.version:  # new weights since the cache was written
      self._read_histories()
    for r in rows:
      if self.pending[r] is not None:
        raise ValueError(f"generate: row {r} has not been given its observation since its last turn "
                         "(call append, with no tokens if there is no observation)")
    c = self.config
    spec = _TurnSpec(max_steps=self.max_turn_tokens, temperature=float(c.temperature), top_k=int(c.top_k),
                     top_p=float(c.top_p), greedy=bool(c.greedy), stop_token_ids=stops,
                     stop_sequences=tuple(q for q in sequences if len(q) <= self.max_turn_tokens))
    budget = np.zeros((self.batch,), np.int32)
    budget[rows] = np.minimum(budgets, self.max_turn_tokens)
    out = _turn_program(self.sampler.params, self.logits, self.cache, self.written, self.sampled,
                        jnp.asarray(budget), self.row_keys, model_config=self.model_config, spec=spec)
    tokens, logps, counts, stopped, self.logits, self.cache, self.written, self.sampled = out
    tokens, logps, counts, stopped = jax.device_get((tokens, logps, counts, stopped))
    outputs = []
    for r in rows:
      n = int(counts[r])
      ids = [int(t) for t in tokens[r, :n]]
      self.histories[r] += ids[:-1]
      self.pending[r] = ids[-1]
      outputs.append(TurnOutput(ids, [float(x) for x in logps[r, :n]], bool(stopped[r]), int(self.version)))
    return outputs

  def _append(self, rows, tokens):
    chunks = {r: ([self.pending[r]] if self.pending[r] is not None else []) + ids for r, ids in zip(rows, tokens)}
    width = next_power_of_two(max(len(c) for c in chunks.values()), MIN_CHUNK_BUCKET)
    buffer = np.full((self.batch, width), self.model_config.pad_token_id, np.int32)
    counts = np.zeros((self.batch,), np.int32)
    for r, chunk in chunks.items():
      buffer[r, :len(chunk)] = chunk
      counts[r] = len(chunk)
      self.histories[r] += chunk
      self.pending[r] = None
    if not counts.any():
      return
    logits, self.cache = models.extend(self.sampler.params, self.model_config, self.cache, jnp.asarray(buffer),
                                       self.written, jnp.asarray(counts))
    fed = jnp.asarray(counts > 0)
    self.logits = jnp.where(fed[:, None], logits, self.logits)
    self.written = self.written + jnp.asarray(counts)


@functools.partial(jax.jit, static_argnames=("model_config", "spec"))
def _turn_program(params, logits, cache, written_b, sampled_b, budget_b, row_keys, *, model_config: ModelConfig,
                  spec: _TurnSpec):
  """One turn of every row with ``budget_b > 0`` as one program.

  Returns ``(tokens [B, M], logp [B, M], count_b, stopped_b, logits, cache, written_b, sampled_b)``.
  A row's tokens are fed to the cache as long as it goes on sampling; its last
  token is left out (the caller keeps it pending), and ``logits`` keep the
  value they had for rows that did not sample.
  """
  mc = model_config
  batch = logits.shape[0]
  stop_ids = jnp.asarray(spec.stop_token_ids, jnp.int32)
  tokens = jnp.full((batch, spec.max_steps), mc.pad_token_id, jnp.int32)
  logps = jnp.zeros((batch, spec.max_steps), jnp.float32)
  count = jnp.zeros((batch,), jnp.int32)
  stopped = jnp.zeros((batch,), bool)

  def going(count, stopped):
    return (count < budget_b) & ~stopped

  def cond(state):
    step, _, _, _, _, count, stopped, _, _ = state
    return (step < spec.max_steps) & jnp.any(going(count, stopped))

  def body(state):
    step, logits, cache, tokens, logps, count, stopped, written, sampled = state
    alive = going(count, stopped)
    uniform = jax.vmap(lambda k, n: jax.random.uniform(jax.random.fold_in(k, n)))(row_keys, sampled)
    token, logp = select_tokens(logits, uniform, temperature=spec.temperature, top_k=spec.top_k,
                                top_p=spec.top_p, greedy=spec.greedy, invariant=mc.batch_invariant)
    token = jnp.where(alive, token, mc.pad_token_id)
    tokens = tokens.at[:, step].set(token)
    logps = logps.at[:, step].set(jnp.where(alive, logp, 0.0))
    count, sampled = count + alive, sampled + alive
    ended = jnp.isin(token, stop_ids)
    for seq in spec.stop_sequences:  # the turn's tokens (columns 0..step) end with seq
      window = lax.dynamic_slice_in_dim(tokens, jnp.maximum(step - len(seq) + 1, 0), len(seq), axis=1)
      ended = ended | ((step + 1 >= len(seq)) & jnp.all(window == jnp.asarray(seq, jnp.int32)[None], axis=1))
    stopped = stopped | (alive & ended)
    feed = going(count, stopped)  # rows that need the next logits
    new_logits, cache = lax.cond(jnp.any(feed),
                                 lambda: models.decode_step(params, mc, cache, token, written),
                                 lambda: (logits, cache))
    logits = jnp.where(feed[:, None], new_logits, logits)
    return step + 1, logits, cache, tokens, logps, count, stopped, written + feed, sampled

  state = (jnp.int32(0), logits, cache, tokens, logps, count, stopped, written_b, sampled_b)
  _, logits, cache, tokens, logps, count, stopped, written, sampled = lax.while_loop(cond, body, state)
  return tokens, logps, count, stopped, logits, cache, written, sampled


def open_session(sampler: Any, prompts: Sequence[Sequence[int]], *, rng: Any, row_ids: Sequence[int],
                 capacity: int, max_turn_tokens: int, **overrides: Any) -> TurnSession:
  """The sampler's session: :class:`JaxSession` for the built-in sampler, :class:`ReplaySession` otherwise.

  Args:
    sampler: a sampler (``JaxSampler``, ``VllmSampler`` or any ``Sampler``).
    prompts: one token-id prompt per row (rows, not groups: repeat a prompt for its samples).
    rng: the episode batch's key.
    row_ids: global row ids.
    capacity: tokens each row may add after its prompt.
    max_turn_tokens: the most tokens of one model turn.
    **overrides: ``SamplerConfig`` fields for every turn (``greedy=True`` for evaluation).
  """
  from jaxrl_llm.sampling.jax_sampler import JaxSampler  # the module imports this one's dependencies only
  if isinstance(sampler, JaxSampler):
    return JaxSession(sampler, prompts, rng=rng, row_ids=row_ids, capacity=capacity,
                      max_turn_tokens=max_turn_tokens, **overrides)
  return ReplaySession(sampler, prompts, rng=rng, row_ids=row_ids, capacity=capacity,
                       config=sampler.config.replace(**overrides), model_config=sampler.model_config, **overrides)


def _first_sequence_end(tokens: Sequence[int], sequences: tuple[tuple[int, ...], ...]) -> int:
  """Length of the shortest prefix of ``tokens`` that ends with one of ``sequences`` (``len(tokens)``: none)."""
  for end in range(1, len(tokens) + 1):
    if any(end >= len(q) and tuple(tokens[end - len(q):end]) == q for q in sequences):
      return end
  return len(tokens)
