"""Multi-turn episodes: the policy writes, the environment answers, until the episode is done.

:class:`EpisodeRunner` plays one batch of episodes (G examples x n samples,
one :class:`~jaxrl_llm.envs.base.Environment` per row) with a sampler session
(:mod:`jaxrl_llm.sampling.session`)::

  prompt_r  = encode(env_r.reset(example))
  repeat up to limits.max_turns:
    turn  = session.generate(rows still playing)        stop: EOS or a tool-call end token
    step  = env_r.step(decode(turn))                     (observation, reward, done, info)
    done  -> the episode ends with its reward
    else  -> session.append(encode(format.wrap(observation, turn)))

and lays the result out as one :class:`~jaxrl_llm.types.Trajectory` row per
episode: prompt, model turn, observation, model turn, ..., pad. Model tokens
are ``response_mask_bt`` (the loss mask) with their behaviour
log-probabilities and the policy version that sampled them; observation
tokens are ``observation_mask_bt``: attended to, never trained on, with no
log-probability and no version. The learner computes log pi over the whole
row, so the log-probabilities of model tokens after an observation are those
the sampler recorded (bit for bit in batch-invariant mode, tested).

What can go wrong ends the episode with a named reason (counted in
``env/ended_<reason>``), never the run:

  done               the environment set ``done`` (the normal end)
  env_error          ``reset`` or ``step`` raised (reward 0)
  bad_observation    ``step`` returned something that is not a StepResult with a
                     str observation (reward 0)
  bad_reward         a reward that is not a finite number (reward 0)
  turn_limit         ``limits.max_turns`` turns without ``done`` (the rewards so far)
  token_limit        the model used the episode's token budget (``limits.max_tokens``)
                     before the environment was done (the rewards so far)
  context_exhausted  the next observation does not fit in what is left of the
                     budget (the rewards so far)

References: the agent loops of verl and Tunix, ReAct (Yao et al., arXiv:2210.03629).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np

from jaxrl_llm.envs.base import EpisodeLimits, StepResult
from jaxrl_llm.sampling import session as session_lib
from jaxrl_llm.types import Trajectory

__all__ = ["END_REASONS", "STAT_FIELDS", "EpisodeBatch", "EpisodeRunner", "episode_metrics", "reward_figures",
           "turn_spans"]

END_REASONS = ("done", "env_error", "bad_observation", "bad_reward", "turn_limit", "token_limit",
               "context_exhausted")
_ZERO_REWARD = ("env_error", "bad_observation", "bad_reward")
STAT_FIELDS = ("turns", "tool_calls", "tool_errors", "tool_seconds", "env_seconds", "end_reason")
"""Per-row episode statistics (``EpisodeBatch.stats``; ``end_reason`` indexes ``END_REASONS``)."""


@dataclasses.dataclass
class EpisodeBatch:
  """A batch of finished episodes.

  Attributes:
    trajectory: B rows laid out as in the module docstring; ``finished_b`` is
      True where the environment ended the episode (reason ``done``).
    response_tokens: per row, the model's tokens of every turn, concatenated.
    rewards: float32 [B], the sum of each episode's step rewards (0 for the reasons in ``_ZERO_REWARD``).
    stats: ``{name: [B] array}`` for each of ``STAT_FIELDS``: the rows' turns, tool calls and
      errors, seconds in tools and in the environment, end reason (an index of ``END_REASONS``).
    transcripts: per row, the decoded text after the prompt (turns and observations).
  """

  trajectory: Trajectory
  response_tokens: list[list[int]]
  rewards: np.ndarray
  stats: dict[str, np.ndarray]
  transcripts: list[str]

  @property
  def end_reasons(self) -> list[str]:
    return [END_REASONS[int(i)] for i in self.stats["end_reason"]]

  @property
  def metrics(self) -> dict[str, float]:
    """``env/*`` figures of the batch (:func:`episode_metrics`)."""
    return episode_metrics(self.stats, self.trajectory)


@dataclasses.dataclass
class _Episode:
  """One row's episode while it is played."""

  env: Any
  prompt: list[int] = dataclasses.field(default_factory=list)
  tokens: list[int] = dataclasses.field(default_factory=list)  # after the prompt
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)  # -1 on observation tokens
  model: list[bool] = dataclasses.field(default_factory=list)
  text: list[str] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turns: int = 0
  tool_calls: int = 0
  tool_errors: int = 0
  tool_seconds: float = 0.0
  env_seconds: float = 0.0
  reason: str = ""

  def add(self, tokens: Sequence[int], logprobs: Sequence[float], version: int, model: bool) -> None:
    self.tokens += tokens
    self.logprobs += logprobs if model else [0.0] * len(tokens)
    self.versions += [version if model else -1] * len(tokens)
    self.model += [model] * len(tokens)


class EpisodeRunner:
  """Plays batches of episodes with a sampler (see the module docstring).

  Args:
    env_factory: ``example -> Environment`` (one fresh environment per row).
    limits: turns and token budgets of an episode.
    encode_prompt: the first observation's text -> prompt ids (chat template applied when configured).
    encode_text: observation text -> ids (no special tokens added).
    decode: ids -> text with special tokens kept (the environment parses tags).
    observation_format: ``wrap(observation, turn_text) -> text`` appended after a turn
      (:class:`~jaxrl_llm.envs.observation.ObservationFormat`).
    stop_sequences: token sequences that end a model turn (a tool-call end tag the tokenizer
      splits into several tokens).
    stop_token_ids: ids that end a model turn (EOS and, where the tokenizer has one, the
      tool-call end token).
    pad_id: the padding id.
    open_session: ``(sampler, prompts, rng=, row_ids=, capacity=, max_turn_tokens=, **overrides) -> TurnSession``
      (default :func:`jaxrl_llm.sampling.session.open_session`: the KV-cache session of the built-in
      sampler, the replaying one of any other).
    resource_metrics: ``() -> dict`` of the tools' own counters since the last call (the python
      tool's ``Sandbox.metrics``: calls, seconds, kills by cause), added to each step's metrics.
  """

  def __init__(self, *, env_factory: Callable[[Any], Any], limits: EpisodeLimits,
               encode_prompt: Callable[[str], list[int]], encode_text: Callable[[str], list[int]],
               decode: Callable[[Sequence[int]], str], observation_format: Any, stop_token_ids: Sequence[int],
               pad_id: int, stop_sequences: Sequence[Sequence[int]] = (),
               open_session: Callable[..., Any] = session_lib.open_session,
               resource_metrics: Callable[[], Mapping[str, float]] = dict):
    self.env_factory, self.limits = env_factory, limits
    self.encode_prompt, self.encode_text, self.decode = encode_prompt, encode_text, decode
    self.observation_format = observation_format
    self.stop_token_ids = tuple(int(s) for s in stop_token_ids)
    self.stop_sequences = tuple(tuple(int(t) for t in seq) for seq in stop_sequences)
    self.open_session, self.pad_id = open_session, pad_id
    self.resource_metrics = resource_metrics

  def run(self, sampler: Any, examples: Sequence[Any], num_samples: int, rng: Any,
          row_ids: Sequence[int] | None = None, guard: Callable[[], ContextManager] = contextlib.nullcontext,
          **overrides: Any) -> EpisodeBatch:
    """Plays ``num_samples`` episodes of each example (rows ``g*n .. g*n+n-1``).

    Args:
      sampler: the policy's sampler (its weights at each turn sample that turn).
      examples: G task examples.
      num_samples: n episodes per example.
      rng: the batch's key; row ``r`` samples with ``row_ids[r]`` (default ``0..B-1``).
      guard: held around every use of the sampler's weights (opening the session, each turn, each
        append): a sampler actor applies weights received in flight on entering it, so new weights
        land between turns, never inside one.
      **overrides: ``SamplerConfig`` fields for these episodes (``greedy=True`` for evaluation).
    """
    episodes, prompts = [], []
    for example in examples:
      for _ in range(num_samples):
        ep = _Episode(env=None)
        t0 = time.perf_counter()
        try:
          ep.env = self.env_factory(example)
          prompt_text = ep.env.reset(example)
          if not isinstance(prompt_text, str):
            raise TypeError(f"reset returned {type(prompt_text).__name__}, expected str")
        except Exception as e:  # a broken environment ends its own episode only
          ep.reason, prompt_text = "env_error", example.prompt
          ep.text.append(f"[env_error: {type(e).__name__}: {e}]")
        ep.env_seconds += time.perf_counter() - t0
        episodes.append(ep)
        prompts.append(self.encode_prompt(prompt_text))
    rows = len(episodes)
    row_ids = np.arange(rows) if row_ids is None else np.asarray(row_ids, np.int64)
    limits = self.limits
    with guard():
      session = self.open_session(sampler, prompts, rng=rng, row_ids=row_ids, capacity=limits.max_tokens,
                                  max_turn_tokens=limits.max_turn_tokens, **overrides)
    for r, ep in enumerate(episodes):
      ep.prompt = list(session.prompts[r])
    playing = [r for r, ep in enumerate(episodes) if not ep.reason]
    for turn in range(limits.max_turns):
      if not playing:
        break
      budgets = [min(limits.max_turn_tokens, session.remaining(r)) for r in playing]
      with guard():
        outputs = session.generate(playing, budgets, self.stop_token_ids, self.stop_sequences)
      next_rows, observed = [], []
      for r, out in zip(playing, outputs):
        ep = episodes[r]
        ep.turns += 1
        ep.add(out.tokens, out.logprobs, out.version, model=True)
        text = self.decode(out.tokens)
        ep.text.append(text)
        if not out.stopped and session.remaining(r) == 0:
          ep.reason = "token_limit"
          continue
        t0 = time.perf_counter()
        step, reason = _checked_step(ep.env, text)
        ep.env_seconds += time.perf_counter() - t0
        if reason:
          ep.reason = reason
          continue
        ep.reward += float(step.reward)
        info = step.info or {}
        ep.tool_calls += int(info.get("tool_calls", 0))
        ep.tool_errors += int(info.get("tool_errors", 0))
        ep.tool_seconds += float(info.get("tool_seconds", 0.0))
        if step.done:
          ep.reason = "done"
          continue
        if turn + 1 == limits.max_turns:
          ep.reason = "turn_limit"
          continue
        obs_text = self.observation_format.wrap(step.observation, text)
        ids = self.encode_text(obs_text)
        if len(ids) >= session.remaining(r):  # the observation and at least one model token must fit
          ep.reason = "context_exhausted"
          ep.text.append(f"[observation of {len(ids)} tokens; {session.remaining(r)} left]")
          continue
        ep.add(ids, [], -1, model=False)
        ep.text.append(obs_text)
        next_rows.append(r)
        observed.append(ids)
      if next_rows:
        with guard():
          session.append(next_rows, observed)
      playing = next_rows
    for ep in episodes:
      if ep.reason in _ZERO_REWARD:
        ep.reward = 0.0
    return self._batch(episodes, num_samples)

  def _batch(self, episodes: list[_Episode], num_samples: int) -> EpisodeBatch:
    rows = len(episodes)
    width = max(len(ep.prompt) + len(ep.tokens) for ep in episodes)
    tokens = np.full((rows, width), self.pad_id, np.int32)
    prompt_mask = np.zeros((rows, width), bool)
    response_mask = np.zeros((rows, width), bool)
    observation_mask = np.zeros((rows, width), bool)
    logp = np.zeros((rows, width), np.float32)
    versions = np.full((rows, width), -1, np.int32)
    for r, ep in enumerate(episodes):
      p, n = len(ep.prompt), len(ep.tokens)
      tokens[r, :p], tokens[r, p:p + n] = ep.prompt, ep.tokens
      prompt_mask[r, :p] = True
      model = np.asarray(ep.model, bool)
      response_mask[r, p:p + n], observation_mask[r, p:p + n] = model, ~model
      logp[r, p:p + n] = ep.logprobs
      versions[r, p:p + n] = ep.versions
    trajectory = Trajectory(
        tokens_bt=tokens, prompt_mask_bt=prompt_mask, response_mask_bt=response_mask,
        observation_mask_bt=observation_mask, behaviour_logp_bt=logp, policy_version_bt=versions,
        group_id_b=np.repeat(np.arange(rows // num_samples, dtype=np.int32), num_samples),
        rewards_b=np.array([ep.reward for ep in episodes], np.float32),
        finished_b=np.array([ep.reason == "done" for ep in episodes], bool))
    stats = {
        "turns": np.array([ep.turns for ep in episodes], np.int32),
        "tool_calls": np.array([ep.tool_calls for ep in episodes], np.int32),
        "tool_errors": np.array([ep.tool_errors for ep in episodes], np.int32),
        "tool_seconds": np.array([ep.tool_seconds for ep in episodes], np.float32),
        "env_seconds": np.array([ep.env_seconds for ep in episodes], np.float32),
        "end_reason": np.array([END_REASONS.index(ep.reason) for ep in episodes], np.int32),
    }
    return EpisodeBatch(
        trajectory=trajectory,
        response_tokens=[[t for t, m in zip(ep.tokens, ep.model) if m] for ep in episodes],
        rewards=trajectory.rewards_b.copy(), stats=stats, transcripts=["".join(ep.text) for ep in episodes])


def reward_figures(rewards: np.ndarray) -> dict[str, float]:
  """``reward/mean`` and ``reward/correct_rate`` (share of rewards >= 1) of a batch of episodes."""
  rewards = np.asarray(rewards, np.float32)
  return {"reward/mean": float(rewards.mean()), "reward/correct_rate": float((rewards >= 1).mean())}


def episode_metrics(stats: Mapping[str, np.ndarray], trajectory: Trajectory) -> dict[str, float]:
  """``env/*`` figures of a batch of episodes: turns, tool calls and errors, token shares, end reasons, time.

  Args:
    stats: the rows' ``STAT_FIELDS`` (``EpisodeBatch.stats``, or several batches' concatenated).
    trajectory: the same rows (model and observation token counts).
  """
  n = max(len(stats["turns"]), 1)
  calls = float(np.sum(stats["tool_calls"]))
  errors = float(np.sum(stats["tool_errors"]))
  model_tokens = float(np.asarray(trajectory.response_mask_bt).sum())
  obs_tokens = float(np.asarray(trajectory.observation_mask_bt).sum())
  out = {
      "env/turns_mean": float(np.sum(stats["turns"])) / n,
      "env/tool_calls_per_episode": calls / n,
      "env/tool_call_rate": float(np.sum(np.asarray(stats["tool_calls"]) > 0)) / n,
      "env/tool_errors": errors,
      "env/tool_error_rate": errors / max(calls, 1.0),
      "env/model_tokens": model_tokens,
      "env/observation_tokens": obs_tokens,
      "env/observation_share": obs_tokens / max(model_tokens + obs_tokens, 1.0),
      "time/env_s": float(np.sum(stats["env_seconds"])),
      "time/tool_s": float(np.sum(stats["tool_seconds"])),
  }
  reasons = np.asarray(stats["end_reason"])
  for i, reason in enumerate(END_REASONS):
    out[f"env/ended_{reason}"] = float(np.sum(reasons == i))
  return out


def _checked_step(env: Any, text: str) -> tuple[StepResult | None, str]:
  """``env.step(text)`` and the reason it cannot be used ("" when it can)."""
  try:
    step = env.step(text)
  except Exception:  # the environment's bug ends this episode, not the run
    return None, "env_error"
  if not isinstance(step, StepResult) or not isinstance(step.observation, str):
    return None, "bad_observation"
  try:
    reward = float(step.reward)
  except (TypeError, ValueError):
    return None, "bad_reward"
  if not math.isfinite(reward):
    return None, "bad_reward"
  return step, ""


def turn_spans(trajectory: Trajectory, row: int) -> list[tuple[str, int, int]]:
  """The turn boundaries of ``row``: ``[(kind, start, stop)]`` with kind "prompt", "model" or "observation"."""
  kinds = np.where(np.asarray(trajectory.prompt_mask_bt[row]), 1, 0)
  kinds = np.where(np.asarray(trajectory.response_mask_bt[row]), 2, kinds)
  kinds = np.where(np.asarray(trajectory.observation_mask_bt[row]), 3, kinds)
  names = {1: "prompt", 2: "model", 3: "observation"}
  spans, start = [], 0
  for t in range(1, len(kinds) + 1):
    if t == len(kinds) or kinds[t] != kinds[start]:
      if kinds[start]:
        spans.append((names[int(kinds[start])], start, t))
      start = t
  return spans
