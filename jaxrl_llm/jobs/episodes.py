"""The RL job's multi-turn parts (``config.env``): the episode runner, its source of samples, its evaluator.

With ``env.name`` set, the synchronous source plays one episode per row
(:class:`EpisodeSource`) instead of one ``generate`` call, and the rows carry
the episodes' rewards, so the reward stage is skipped; held-out evaluation
plays greedy and sampled episodes the same way (:class:`EpisodeEvaluator`): an
episode is correct when its reward is >= 1.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxrl_llm.envs import base as env_base
from jaxrl_llm.envs.episodes import EpisodeRunner, reward_figures
from jaxrl_llm.envs.observation import ObservationFormat
from jaxrl_llm.tasks.tool_calls import TOOL_CALL_CLOSE
from jaxrl_llm.envs.tools import make_registry
from jaxrl_llm.jobs.evaluation import PolicyEvaluator, Scores, sampling_key as eval_key
from jaxrl_llm.reward_model.encoding import encode_prompt
from jaxrl_llm.rollout.sources import Rollout, SyncSource, sampling_key

__all__ = ["EpisodeEvaluator", "EpisodeSource", "build_episode_runner", "episode_runner_builder", "turn_stops"]


def turn_stops(tokenizer: Any, stop_at_tool_call: bool) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
  """``(stop ids, stop sequences)`` of a model turn: EOS, and with ``stop_at_tool_call`` the tool-call end
  tag, as one id when the tokenizer has it as one token, else as the sequence it encodes to (none when
  the tokenizer cannot write it)."""
  stops, sequences = [tokenizer.eos_id], []
  if stop_at_tool_call:
    close = tokenizer.token_to_id(TOOL_CALL_CLOSE)
    if close is None:
      try:
        sequences.append(tuple(tokenizer.encode(TOOL_CALL_CLOSE, add_special_tokens=False)))
      except ValueError:  # a character tokenizer without these characters: the model cannot write the tag
        pass
    elif close not in stops:
      stops.append(close)
  return tuple(stops), tuple(sequences)


def build_episode_runner(settings: Any, task: Any, tokenizer: Any, encode_prompt: Callable[[Any], list[int]],
                         tools: Optional[Any] = None) -> EpisodeRunner:
  """The runner of ``config.env`` (an :class:`~jaxrl_llm.configuration.environment.EnvSettings`).

  Args:
    settings: the run's ``env`` settings.
    task: the run's task (the environment scores answers with it).
    tokenizer: the policy's tokenizer.
    encode_prompt: the first observation's text -> prompt ids.
    tools: a ready :class:`~jaxrl_llm.envs.tools.ToolRegistry` (default: ``env.tools`` with ``env.tool_aliases``).
  """
  factory = env_base.load_environment_factory(settings.name)
  sandbox = None
  if tools is None:
    sandbox = _sandbox_runner(settings) if "python" in settings.tools else None
    tools = make_registry(list(settings.tools), aliases=dict(settings.tool_aliases), python_runner=sandbox)
  kwargs = dict(settings.kwargs)
  stops, sequences = turn_stops(tokenizer, settings.stop_at_tool_call)
  limits = env_base.EpisodeLimits(max_turns=settings.max_turns, max_tokens=settings.max_tokens,
                                  max_turn_tokens=settings.max_turn_tokens)
  return EpisodeRunner(
      env_factory=lambda example: factory(task=task, tools=tools, **kwargs), limits=limits,
      encode_prompt=encode_prompt, encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False),
      decode=lambda ids: tokenizer.decode([i for i in ids if 0 <= int(i) < tokenizer.vocab_size]),
      observation_format=ObservationFormat.build(settings.observation_format, tokenizer),
      stop_token_ids=stops, stop_sequences=sequences, pad_id=tokenizer.pad_id,
      resource_metrics=sandbox.metrics if sandbox is not None else dict)


def episode_runner_builder(settings: Any, task: Any, tokenizer: Any, use_chat_template: bool) -> Callable[[], Any]:
  """A picklable ``() -> EpisodeRunner`` for sampler actors (``SamplerSpec.episodes``): each actor
  builds its own runner, tools and sandboxes in its own process."""
  encode = functools.partial(encode_prompt, tokenizer, use_chat_template=use_chat_template)
  return functools.partial(build_episode_runner, settings, task, tokenizer, encode)


def _sandbox_runner(settings: Any) -> Any:
  from jaxrl_llm.tasks.sandbox import Sandbox  # pylint: disable=import-outside-toplevel
  return Sandbox(workers=settings.sandbox_workers)


class EpisodeSource(SyncSource):
  """The synchronous source of multi-turn rows: step ``t`` plays the step's G x n episodes with
  ``sampling_key(seed, t)``; the rows come scored (``Rollout.rewards``)."""

  def __init__(self, sampler: Any, prompts: Any, runner: EpisodeRunner, seed: int, group_size: int,
               prepare: Callable[[Any], Any] = lambda params: params):
    super().__init__(sampler, prompts, encode=None, seed=seed, prepare=prepare)
    self.runner, self.group_size = runner, group_size

  def collect(self, step: int) -> Rollout:
    pb = self.prompts.next_batch()
    examples = list(pb.examples)
    t0 = time.perf_counter()
    out = self.runner.run(self.sampler, examples, self.group_size, sampling_key(self.seed, step))
    seconds = time.perf_counter() - t0
    rewards = out.rewards.astype(np.float32)
    return Rollout(examples, out.trajectory, out.response_tokens, seconds, rewards=rewards,
                   reward_metrics=reward_figures(rewards),
                   metrics={"time/wait_s": seconds, **out.metrics, **self.runner.resource_metrics()})


class EpisodeEvaluator(PolicyEvaluator):
  """Held-out evaluation by episodes: greedy and ``n`` sampled episodes per example, correct when the
  episode's reward is >= 1; keys and row ids as in :class:`~jaxrl_llm.jobs.evaluation.PolicyEvaluator`."""

  def __init__(self, sampler: Any, runner: EpisodeRunner, rewards: Any, *, seed: int, pass_k: int):
    super().__init__(sampler, rewards, encode=None, decode=None, seed=seed, pass_k=pass_k)
    self.runner = runner
    self.last_metrics: dict[str, float] = {}

  def _episodes(self, examples: Sequence[Any], n: int, rng: Any, first: int, **overrides: Any
                ) -> tuple[list[str], np.ndarray]:
    out = self.runner.run(self.sampler, list(examples), n, rng,
                          row_ids=np.arange(first * n, (first + len(examples)) * n), **overrides)
    if overrides.get("greedy"):
      self.last_metrics = out.metrics  # the greedy episodes' turns, tool calls and end reasons
    return out.transcripts, np.asarray(out.rewards) >= 1.0

  def score(self, examples: Sequence[Any], step: int, num_samples: int, batch_size: Optional[int] = None,
            on_batch: Optional[Callable[[int, Scores], None]] = None) -> Scores:
    import jax  # pylint: disable=import-outside-toplevel
    examples = list(examples)
    rng = eval_key(self.seed, step)
    size = batch_size or max(len(examples), 1)
    parts = []
    for first in range(0, len(examples), size):
      batch = examples[first:first + size]
      greedy, greedy_ok = self._episodes(batch, 1, jax.random.PRNGKey(0), first, greedy=True)
      if num_samples:
        texts, hits = self._episodes(batch, num_samples, rng, first)
        samples = [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(batch))]
        hits = hits.reshape(len(batch), num_samples)
      else:
        samples, hits = [[] for _ in batch], np.zeros((len(batch), 0), bool)
      parts.append(Scores(greedy, greedy_ok, samples, hits))
      if on_batch is not None:
        on_batch(first + len(batch), parts[-1])
    return Scores.concat(parts, num_samples)

  def __call__(self, examples: Sequence[Any], step: int) -> dict[str, float]:
    metrics = super().__call__(examples, step)
    metrics.update({f"eval/greedy_{k.split('/', 1)[1]}": v for k, v in self.last_metrics.items()
                    if k.startswith("env/")})
    return metrics
