"""Held-out evaluation of a policy: greedy accuracy and pass@k with the in-process sampler.

A response is correct when the task's reward of it is >= 1 (exact answers:
partial-credit training rewards do not count). Rewards are scored by a guarded
:class:`~jaxrl_llm.tasks.RewardRunner`, the same code path as training (the RL
job's evaluation runner shares the training runner's worker processes): a call that
raises, hangs, crashes or runs out of memory is a wrong answer, counted under
``reward/eval/*``, and never stops the run. Greedy decoding uses a fixed
key; pass@k samples ``k`` responses per prompt with a key that depends on the
run's seed and the step, so an evaluation repeats exactly in a resumed run.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrl_llm.types import Trajectory

__all__ = ["PolicyEvaluator"]


class PolicyEvaluator:
  """Evaluates the policy held by ``sampler`` on task examples.

  Args:
    sampler: the in-process sampler (the job keeps it at the current weights).
    rewards: the guarded reward runner of the task's reward (``rewards.score(pairs) -> float32 [B]``).
    encode: prompt -> ids; decode: ids -> text.
    seed: the run's seed (pass@k keys).
    pass_k: samples per prompt of pass@k.
  """

  def __init__(self, sampler: Any, rewards: Any, encode: Callable, decode: Callable, *, seed: int, pass_k: int):
    if not callable(getattr(rewards, "score", None)):
      raise TypeError(f"PolicyEvaluator: rewards must be a RewardRunner (with .score(pairs)), got {rewards!r}")
    self.sampler = sampler
    self.rewards = rewards
    self.encode = encode
    self.decode = decode
    self.seed = seed
    self.pass_k = pass_k

  def greedy(self, examples: Sequence[Any]) -> tuple[Trajectory, list[str]]:
    """The policy's greedy answer to each example: ``(Trajectory, response texts)``."""
    out = self.sampler.generate([self.encode(e.prompt) for e in examples], greedy=True, num_samples=1,
                                rng=jax.random.PRNGKey(0))
    return out.trajectory, [self.decode(r) for r in out.response_tokens]

  def correct(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
    """bool [len(pairs)]: whether each ``(example, response)`` scores >= 1 (a failed call: False)."""
    return np.asarray(self.rewards.score(list(pairs))) >= 1.0

  def greedy_correct(self, examples: Sequence[Any]) -> np.ndarray:
    """bool [len(examples)]: whether the greedy answer is exactly right."""
    _, texts = self.greedy(examples)
    return self.correct(list(zip(examples, texts)))

  def __call__(self, examples: Sequence[Any], step: int) -> dict[str, float]:
    """``eval/accuracy`` (greedy), ``eval/pass@k`` and ``eval/sample_accuracy`` on ``examples``."""
    examples = list(examples)
    correct = self.greedy_correct(examples)
    k = self.pass_k
    rng = jax.random.fold_in(jax.random.PRNGKey(self.seed + 1), step)
    sampled = self.sampler.generate([self.encode(e.prompt) for e in examples], num_samples=k,
                                    rng=jax.random.fold_in(rng, 1))
    hits = self.correct([(examples[i // k], self.decode(r))
                         for i, r in enumerate(sampled.response_tokens)]).reshape(len(examples), k)
    return {"eval/accuracy": float(correct.mean()), f"eval/pass@{k}": float(hits.any(1).mean()),
            "eval/sample_accuracy": float(hits.mean())}
