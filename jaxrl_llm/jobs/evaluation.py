"""Held-out evaluation of a policy: greedy accuracy and pass@k with the in-process sampler.

One implementation serves the training loop's periodic evaluation
(``RLJob.evaluate``, run by the ``EvaluationHook``) and the ``jaxrl-eval`` command
(:mod:`jaxrl_llm.jobs.eval_command`): :meth:`PolicyEvaluator.score` answers each
example greedily and with ``n`` samples and scores every answer, and
:func:`eval_metrics` turns the scores into figures with the shared estimators of
:mod:`jaxrl_llm.diagnostics.estimates` (unbiased pass@k, Chen et al. 2021,
arXiv:2107.03374; with ``n = k`` it is "any of the k samples is correct").

A response is correct when the task's reward of it is >= 1 (exact answers:
partial-credit training rewards do not count). Rewards are scored by a guarded
:class:`~jaxrl_llm.tasks.RewardRunner`, the same code path as training (the RL
job's evaluation runner shares the training runner's worker processes): a call that
raises, hangs, crashes or runs out of memory is a wrong answer, counted under
``reward/eval/*``, and never stops the run. Greedy decoding uses a fixed
key; the samples use a key that depends on the run's seed and the step, and row
``i * n + j`` (example ``i``, sample ``j``) samples with ``fold_in(key, i * n + j)``
whatever the batch it is in, so an evaluation repeats exactly in a resumed run and
in ``jaxrl-eval`` (bit for bit in batch-invariant mode; otherwise with the
training loop's one batch, the command's default).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jaxrl_llm.diagnostics import estimates
from jaxrl_llm.types import Trajectory

__all__ = ["PolicyEvaluator", "Scores", "eval_metrics", "sampling_key"]


def sampling_key(seed: int, step: int) -> jax.Array:
  """The key of the evaluation's samples at global step ``step`` of a run with ``seed``."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed + 1), step), 1)


@dataclasses.dataclass
class Scores:
  """Every answer of an evaluation and whether it is correct (N examples, n samples each).

  Attributes:
    greedy: N greedy responses (text).
    greedy_correct: bool [N].
    samples: N lists of n sampled responses (text).
    hits: bool [N, n]: whether each sample is correct.
  """

  greedy: list[str]
  greedy_correct: np.ndarray
  samples: list[list[str]]
  hits: np.ndarray

  @classmethod
  def concat(cls, parts: Sequence["Scores"], n: int) -> "Scores":
    greedy_ok = np.concatenate([p.greedy_correct for p in parts] or [np.zeros((0,), bool)]).astype(bool)
    hits = np.concatenate([p.hits for p in parts] or [np.zeros((0, n), bool)]).astype(bool)
    return cls([t for p in parts for t in p.greedy], greedy_ok, [s for p in parts for s in p.samples], hits)


def eval_metrics(scores: Scores, ks: Sequence[int], prefix: str = "eval/") -> dict[str, float]:
  """``{prefix}accuracy`` (greedy), ``{prefix}pass@{k}`` (unbiased, mean over examples) for each k and
  ``{prefix}sample_accuracy`` (share of correct samples); the training loop's metric names with "eval/"."""
  out = {f"{prefix}accuracy": float(np.asarray(scores.greedy_correct).mean())}
  hits = np.asarray(scores.hits, bool)
  if hits.size:
    for k in ks:
      out[f"{prefix}pass@{k}"] = float(estimates.pass_at_k_per_problem(hits, k).mean())
    out[f"{prefix}sample_accuracy"] = float(hits.mean())
  return out


class PolicyEvaluator:
  """Evaluates the policy held by ``sampler`` on task examples.

  Args:
    sampler: the in-process sampler (the job keeps it at the current weights).
    rewards: the guarded reward runner of the task's reward (``rewards.score(pairs) -> float32 [B]``).
    encode: prompt -> ids; decode: ids -> text.
    seed: the run's seed (the samples' keys).
    pass_k: samples per prompt of the training loop's pass@k (``n = k``).
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

  def sample(self, examples: Sequence[Any], n: int, rng: jax.Array, first: int = 0) -> list[list[str]]:
    """``n`` sampled responses to each example; example ``i`` of the list is example ``first + i`` of the
    whole evaluation (its rows are ``(first + i) * n + j``, whatever the batch)."""
    rows = {"row_ids": np.arange(first * n, (first + len(examples)) * n)} if first else {}  # else the default ids
    out = self.sampler.generate([self.encode(e.prompt) for e in examples], num_samples=n, rng=rng, **rows)
    texts = [self.decode(r) for r in out.response_tokens]
    return [texts[i * n:(i + 1) * n] for i in range(len(examples))]

  def score(self, examples: Sequence[Any], step: int, num_samples: int, batch_size: Optional[int] = None,
            on_batch: Optional[Callable[[int, "Scores"], None]] = None) -> Scores:
    """Greedy and ``num_samples`` sampled answers to every example, scored, in batches of ``batch_size``
    examples (None: one batch, as the training loop evaluates); ``on_batch(examples done, batch scores)``
    after each batch (a progress bar)."""
    examples = list(examples)
    rng = sampling_key(self.seed, step)
    size = batch_size or max(len(examples), 1)
    parts = []
    for first in range(0, len(examples), size):
      batch = examples[first:first + size]
      _, greedy = self.greedy(batch)
      greedy_ok = self.correct(list(zip(batch, greedy)))
      samples = self.sample(batch, num_samples, rng, first) if num_samples else [[] for _ in batch]
      hits = (self.correct([(e, t) for e, ts in zip(batch, samples) for t in ts]) if num_samples
              else np.zeros((0,), bool)).reshape(len(batch), num_samples)
      parts.append(Scores(greedy, greedy_ok, samples, hits))
      if on_batch is not None:
        on_batch(first + len(batch), parts[-1])
    return Scores.concat(parts, num_samples)

  def __call__(self, examples: Sequence[Any], step: int) -> dict[str, float]:
    """``eval/accuracy`` (greedy), ``eval/pass@k`` and ``eval/sample_accuracy`` on ``examples``."""
    return eval_metrics(self.score(examples, step, self.pass_k), (self.pass_k,))
