"""Held-out evaluation of a policy: greedy accuracy and pass@k with the in-process sampler.

A response is correct when the task's reward of it is >= 1 (exact answers:
partial-credit training rewards do not count). Greedy decoding uses a fixed
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
    task: the run's task (its ``reward`` decides correctness).
    encode: prompt -> ids; decode: ids -> text.
    seed: the run's seed (pass@k keys).
    pass_k: samples per prompt of pass@k.
  """

  def __init__(self, sampler: Any, task: Any, encode: Callable, decode: Callable, *, seed: int, pass_k: int):
    self.sampler = sampler
    self.task = task
    self.encode = encode
    self.decode = decode
    self.seed = seed
    self.pass_k = pass_k

  def greedy(self, examples: Sequence[Any]) -> tuple[Trajectory, list[str]]:
    """The policy's greedy answer to each example: ``(Trajectory, response texts)``."""
    out = self.sampler.generate([self.encode(e.prompt) for e in examples], greedy=True, num_samples=1,
                                rng=jax.random.PRNGKey(0))
    return out.trajectory, [self.decode(r) for r in out.response_tokens]

  def greedy_correct(self, examples: Sequence[Any]) -> np.ndarray:
    """bool [len(examples)]: whether the greedy answer is exactly right."""
    _, texts = self.greedy(examples)
    return np.array([self.task.reward(e, t) >= 1.0 for e, t in zip(examples, texts)])

  def __call__(self, examples: Sequence[Any], step: int) -> dict[str, float]:
    """``eval/accuracy`` (greedy), ``eval/pass@k`` and ``eval/sample_accuracy`` on ``examples``."""
    examples = list(examples)
    correct = self.greedy_correct(examples)
    k = self.pass_k
    rng = jax.random.fold_in(jax.random.PRNGKey(self.seed + 1), step)
    sampled = self.sampler.generate([self.encode(e.prompt) for e in examples], num_samples=k,
                                    rng=jax.random.fold_in(rng, 1))
    hits = np.array([self.task.reward(examples[i // k], self.decode(r)) >= 1.0
                     for i, r in enumerate(sampled.response_tokens)]).reshape(len(examples), k)
    return {"eval/accuracy": float(correct.mean()), f"eval/pass@{k}": float(hits.any(1).mean()),
            "eval/sample_accuracy": float(hits.mean())}
