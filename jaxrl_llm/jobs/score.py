"""The score stage of an RL step: sequence rewards of the sampled responses.

``rewards = clip(rule_weight * task reward + rm_weight * processed RM score)``
where the task's rule reward (or the weighted components of ``reward.functions``:
:func:`training_rewards`) runs in a guarded runner (:func:`reward_runner`: a
pool of worker processes; timeouts, exceptions, crashes and memory errors score 0
and are counted, and a reward that fails on most calls for ``reward.failure_steps``
steps stops the run: :meth:`RewardStage.end_step`), the reward
model's score is processed as configured (:class:`jaxrl_llm.reward_model.SequenceRewards`:
no-EOS penalty, reference baseline, running z-score, clip), and without a
reward model the rule reward is the reward. ``advantage.reward_clip`` clips the
result. A curated prompt stream is told each prompt's rewards (its pass rates).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxrl_llm.tasks import RewardRunner, remote_reward, reward_plugins, reward_runner as reward_runner_lib
from jaxrl_llm.types import Trajectory

__all__ = ["RewardStage", "RUNNER_COUNTERS", "reward_runner", "training_rewards"]

# RewardRunner counters saved with the run's progress (cumulative over the whole run).
RUNNER_COUNTERS = reward_runner_lib.COUNTERS


def reward_runner(fn: Callable[[Any, str], float], settings: Any, name: str = "task") -> RewardRunner:
  """The guarded runner of ``fn`` configured by ``config.reward`` (a ``RewardSettings``)."""
  return RewardRunner(fn, name=name, mode=settings.mode, timeout_s=settings.timeout_s, workers=settings.workers,
                      memory_mb=settings.memory_mb, cpu_seconds=settings.cpu_seconds,
                      max_failure_share=settings.max_failure_share, failure_steps=settings.failure_steps)


def training_rewards(task: Any, settings: Any, task_runner: RewardRunner) -> Any:
  """The runner the RL reward comes from: ``task_runner``, or the weighted components of
  ``reward.functions`` (:mod:`jaxrl_llm.tasks.reward_plugins`), each in a guarded runner of its
  own (the ``"task"`` component reuses ``task_runner``)."""
  components = reward_plugins.parse_components(settings.functions)
  if not components:
    return task_runner
  runners = []
  for c in components:
    if c.name == reward_plugins.TASK:
      runner = task_runner
    elif remote_reward.is_url(c.name):
      client = remote_reward.RemoteReward(c.name, timeout_s=settings.timeout_s, retries=settings.remote_retries)
      runner = remote_reward.RemoteRewardRunner(client, name=c.label, max_failure_share=settings.max_failure_share,
                                                failure_steps=settings.failure_steps)
    else:
      runner = reward_runner(reward_plugins.resolve(c.name, task), settings, name=c.label)
    runners.append((c, runner))
  return reward_plugins.WeightedRewards(runners)


class RewardStage:
  """Scores B = G x n sampled rows.

  Args:
    runner: the task's guarded :class:`~jaxrl_llm.tasks.RewardRunner`.
    decode: response ids -> text.
    group_size: n rows per prompt (rows of a prompt are contiguous).
    sequence_rewards: the reward-model rewards, or None (rule reward only).
    reward_clip: clip the rewards to [-c, c]; 0: no clipping.
    record: ``record(examples, rewards)`` of a curated prompt stream, or None.
  """

  def __init__(self, runner: Any, decode: Callable[[Sequence[int]], str], group_size: int, *,
               sequence_rewards: Any = None, reward_clip: float = 0.0,
               record: Optional[Callable[[list, np.ndarray], None]] = None):
    self.runner = runner
    self.decode = decode
    self.group_size = group_size
    self.sequence_rewards = sequence_rewards
    self.reward_clip = float(reward_clip)
    self.record = record

  def __call__(self, examples: Sequence[Any], trajectory: Trajectory,
               response_tokens: Sequence[Sequence[int]]) -> tuple[np.ndarray, dict]:
    """``(rewards float32 [B], metrics)`` of one batch (``trajectory`` trimmed, numpy)."""
    n = self.group_size
    pairs = [(examples[i // n], self.decode(r)) for i, r in enumerate(response_tokens)]
    rewards = np.asarray(self.runner.score(pairs), np.float32)
    metrics: dict[str, Any] = dict(self.runner.step_metrics())
    if self.sequence_rewards is not None:
      rewards, rm_metrics = self.sequence_rewards(examples, pairs, trajectory, rewards)
      metrics.update(rm_metrics)
    if self.reward_clip:
      rewards = np.clip(rewards, -self.reward_clip, self.reward_clip)
    if self.record is not None:
      self.record(list(examples), rewards)
    return rewards, metrics

  def runner_metrics(self) -> dict:
    """The rule-reward runner's cumulative counters (``reward/task/*``)."""
    return self.runner.metrics

  def end_step(self) -> None:
    """Ends one RL step's window of reward calls (raises ``RewardFailureError`` after too many failing steps)."""
    self.runner.end_step()

  def get_state(self) -> dict:
    state = {"runner": self.runner.get_state()}
    if self.sequence_rewards is not None:
      state["reward_model"] = self.sequence_rewards.get_state()
    return state

  def set_state(self, state: dict) -> None:
    # a resumed run logs the counts an uninterrupted one would (counters an older checkpoint lacks stay 0)
    self.runner.set_state(state.get("runner", {}))
    if self.sequence_rewards is not None:
      self.sequence_rewards.set_state(state.get("reward_model"))
