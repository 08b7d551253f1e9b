"""Host-side numpy helpers shared by the consistency and off-policy diagnostics.

Argument checks come from :mod:`jaxrl_llm.advantages.checks` (``check_bt``,
``shape_of``) and quantile names and levels from
:mod:`jaxrl_llm.objectives.stats` (``quantile_name``, ``check_quantiles``), so
the diagnostics and the objectives' metrics spell errors and quantiles alike.

Conventions of every diagnostic built on these helpers:

* **Inputs** are [B, T] arrays (numpy, or JAX arrays gathered to the host once
  per step). Masks are ``bool``; log-probabilities are float32 (any float is
  accepted and widened). Entries outside the mask are replaced by exact zeros
  first, so padding may hold anything (NaN, inf) without effect or warning.
  Entries inside the mask must be finite: a non-finite log-probability,
  advantage or return there is a bug upstream and raises ``ValueError``.
* **Arithmetic** is float64 on the float32 inputs. The difference of two
  float32 log-probabilities is exact in float64, so identical inputs give a
  ratio of exactly 1 and a TV of exactly 0.
* **Sums over tokens** are taken per row with numpy's ``sum(axis=1)`` (the same
  pairwise summation for every row, whatever its position or the batch size)
  and the B row sums are added with ``math.fsum`` (correctly rounded, hence
  independent of their order). The bits of every metric are therefore a
  function of the inputs only and do not change when rows are permuted. They
  are not bitwise invariant to the padded width T (extra padding columns change
  numpy's pairwise split; the difference is in the last float64 bits).
* **Empty selections** (no token in the mask, or none with a given property)
  give ``NaN`` for every mean, share, quantile and extremum, computed without a
  numpy warning; the accompanying ``.../tokens`` count is 0. NaN means
  "undefined this step": metric writers log it and alerts ignore it.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm.advantages.checks import check_bt, shape_of
from jaxrl_llm.objectives.stats import check_quantiles, quantile_name

NAN = float("nan")


def as_mask(who: str, name: str, mask: Any) -> np.ndarray:
  """Returns ``mask`` as a numpy bool array; raises unless its dtype is bool."""
  m = np.asarray(mask)
  if m.dtype != np.bool_:
    raise ValueError(f"{who}: {name} must be a bool mask; got dtype {m.dtype}")
  return m


def masked_f64(who: str, name: str, x: Any, mask: np.ndarray) -> np.ndarray:
  """``x`` as float64 with exact zeros outside ``mask``; raises on non-finite masked entries."""
  a = np.asarray(x)
  if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
    raise ValueError(f"{who}: {name} must be a float array; got dtype {a.dtype}")
  out = np.where(mask, a, 0).astype(np.float64)
  bad = ~np.isfinite(out)
  if bad.any():
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"{who}: {name} has {int(bad.sum())} non-finite value(s) inside the mask "
                     f"(first at [b, t] = {list(first)}: {a[first].item()!r}); masked entries must be finite")
  return out


def count(mask: np.ndarray) -> int:
  """Number of True entries (an exact integer)."""
  return int(np.count_nonzero(mask))


def total(values_bt: np.ndarray, mask_bt: np.ndarray) -> float:
  """Order-independent sum of the masked entries: per-row sums, then ``math.fsum``."""
  return math.fsum(np.where(mask_bt, values_bt, 0.0).sum(axis=1).tolist())


def mean(values_bt: np.ndarray, mask_bt: np.ndarray, n: int) -> float:
  """Mean of the ``n`` masked entries (``n = count(mask_bt)``); NaN when n is 0."""
  return total(values_bt, mask_bt) / n if n else NAN


def share(cond_bt: np.ndarray, mask_bt: np.ndarray, n: int) -> float:
  """Share of the ``n`` masked entries where ``cond_bt`` holds (exact counts); NaN when n is 0."""
  return count(cond_bt & mask_bt) / n if n else NAN


def safe_ratio(num: float, den: float) -> float:
  """``num / den``; NaN when ``den`` is 0 or either is NaN."""
  if math.isnan(num) or math.isnan(den) or den == 0.0:
    return NAN
  return num / den


def extremum(values_bt: np.ndarray, mask_bt: np.ndarray, fn) -> float:
  """``fn`` (np.min / np.max) of the masked entries (exact); NaN when none."""
  v = values_bt[mask_bt]
  return float(fn(v)) if v.size else NAN


def quantiles(values_bt: np.ndarray, mask_bt: np.ndarray, qs: Sequence[float]) -> list[float]:
  """Order-statistic quantiles of the masked entries (no interpolation).

  Hyndman & Fan type 1 (numpy's ``method="inverted_cdf"``), the definition of
  :func:`jaxrl_llm.objectives.stats.masked_quantiles`: with the k masked values
  sorted ascending, x_(0) <= ... <= x_(k-1), the q-quantile is x_(r) with
  ``r = clip(ceil(q k) - 1, 0, k - 1)`` (q k in float64 here). The result is an
  element of the data, so it does not depend on the order of the rows.

  Returns:
    one float per level; NaN for all when no entry is masked in.
  """
  v = np.sort(values_bt[mask_bt])
  k = v.size
  if not k:
    return [NAN for _ in qs]
  return [float(v[min(max(math.ceil(q * k) - 1, 0), k - 1)]) for q in qs]


def check_limit(who: str, name: str, value: Any, lo: float = 0.0, hi: float = math.inf,
                allow_none: bool = True) -> None:
  """Raises ValueError unless ``value`` is a number in [lo, hi] (or None when allowed)."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    raise ValueError(f"{who}: {name} must be a number; got {value!r}")
  if math.isnan(float(value)) or not lo <= float(value) <= hi:
    raise ValueError(f"{who}: {name} must lie in [{lo}, {hi}]; got {value!r}")


def settings_checker(section: str, settings: Any) -> Callable[[bool, str, str], None]:
  """``need(ok, field, expected)`` raising ValueError("<section>.<field>=<value>: expected ...")
  for a settings dataclass whose fields mirror the ``config.<section>`` fields."""

  def need(ok: bool, field: str, expected: str) -> None:
    if not ok:
      raise ValueError(f"{section}.{field}={getattr(settings, field)!r}: expected {expected}")

  return need


__all__ = ["NAN", "as_mask", "check_bt", "check_limit", "check_quantiles", "count", "extremum", "masked_f64", "mean",
           "quantile_name", "quantiles", "safe_ratio", "settings_checker", "shape_of", "share", "total"]
