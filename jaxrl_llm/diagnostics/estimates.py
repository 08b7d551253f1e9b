"""Estimators of evaluation figures: unbiased pass@k and 95 % confidence intervals (pure NumPy, float64).

Used by the training loop's held-out evaluation and by ``jaxrl-eval`` alike
(:mod:`jaxrl_llm.jobs.evaluation`), so both report the same numbers for the same
samples. It lives in ``diagnostics`` (layer 2, next to the other measures of a
run) because it is pure arithmetic on counts, with no dependency on models,
samplers or jobs, and a lower layer would be one of arrays and kernels.

**pass@k** (Chen et al. 2021, "Evaluating Large Language Models Trained on
Code", arXiv:2107.03374, section 2.1): with ``n >= k`` samples of a problem of
which ``c`` are correct, the probability that at least one of ``k`` samples
drawn without replacement from them is correct,

  pass@k = 1 - C(n - c, k) / C(n, k) = 1 - prod_{i = n - c + 1}^{n} (1 - k / i),

is an unbiased estimate of the problem's pass@k. The product form (the paper's
numerically stable numpy code) never forms the binomial coefficients, which
overflow float64 for n in the hundreds; it is 1 exactly when ``n - c < k``
(every k-subset holds a correct sample) and 0 exactly when ``c = 0``. With
``n = k`` it is "any of the k samples is correct", the figure the training loop
has always reported. The benchmark figure is the mean over problems.

**Intervals** (95 %, two-sided, z = 1.959964):

* a proportion of independent successes (the greedy accuracy: one deterministic
  answer per problem, correct or not): the Wilson score interval (Wilson 1927;
  Brown, Cai & DasGupta 2001 recommend it over the Wald interval, which collapses
  to a point at 0 or 1 and under-covers for small n);
* a mean of per-problem figures in [0, 1] (pass@k, sample accuracy): the normal
  approximation over problems, mean +- z * s / sqrt(N) with s the sample
  standard deviation (ddof=1) of the per-problem estimates, clipped to [0, 1]
  (the central-limit interval over questions of Miller 2024, "Adding Error Bars
  to Evals", arXiv:2411.00640; the variance of the per-problem estimates includes
  the sampling noise of each problem's n samples). Deterministic, no resampling.
  When every problem has the same estimate (all solved, none solved) s = 0 and
  the interval is that point: read the greedy accuracy's Wilson interval then.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

__all__ = ["Z95", "mean_interval", "pass_at_k", "pass_at_k_per_problem", "wilson_interval"]

Z95 = 1.959963984540054  # the 0.975 quantile of the standard normal


def pass_at_k(n: int, c: int, k: int) -> float:
  """The unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (float64).

  Raises:
    ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
  """
  n, c, k = int(n), int(c), int(k)
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k: c={c} correct of n={n} samples: expected 0 <= c <= n")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k: k={k} with n={n} samples: expected 1 <= k <= n (n samples per problem >= k)")
  if n - c < k:
    return 1.0
  # 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_per_problem(hits_gn: np.ndarray, k: int) -> np.ndarray:
  """float64 [G]: the unbiased pass@k of each problem from its samples' correctness ``hits_gn`` (bool [G, n])."""
  hits = np.asarray(hits_gn, bool)
  if hits.ndim != 2:
    raise ValueError(f"pass_at_k_per_problem: hits has shape {hits.shape}, expected [problems, samples]")
  n = hits.shape[1]
  return np.array([pass_at_k(n, c, k) for c in hits.sum(1)], np.float64)


def wilson_interval(successes: int, total: int, z: float = Z95) -> tuple[float, float]:
  """The Wilson score interval of a proportion ``successes / total`` (``(0, 1)`` when ``total`` is 0)."""
  if total <= 0:
    return 0.0, 1.0
  if not 0 <= successes <= total:
    raise ValueError(f"wilson_interval: {successes} successes of {total}: expected 0 <= successes <= total")
  p = successes / total
  z2 = z * z
  centre = (p + z2 / (2 * total)) / (1 + z2 / total)
  half = z * math.sqrt(p * (1 - p) / total + z2 / (4 * total * total)) / (1 + z2 / total)
  return max(0.0, centre - half), min(1.0, centre + half)


def mean_interval(values: Sequence[float], z: float = Z95) -> tuple[float, float]:
  """The normal-approximation interval of the mean of per-problem figures in [0, 1] (clipped to [0, 1]).

  ``(0, 1)`` for no values; the mean itself for one value or equal values (no spread to measure).
  """
  x = np.asarray(values, np.float64).reshape(-1)
  if x.size == 0:
    return 0.0, 1.0
  mean = float(x.mean())
  if x.size == 1:
    return mean, mean
  half = z * float(x.std(ddof=1)) / math.sqrt(x.size)
  return max(0.0, mean - half), min(1.0, mean + half)
