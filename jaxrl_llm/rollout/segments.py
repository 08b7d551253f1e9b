"""Segmented generation: responses sampled in pieces, weights may change between pieces.

PipelineRL (Piché et al., arXiv:2509.19128) lets a sampler take new weights
while sequences are still being generated: tokens before the update come from
version v, tokens after it from v + 1. :func:`generate_in_segments` does this
on top of any sampler's ``generate``: it samples ``segment_tokens`` tokens for
every unfinished row, lets the caller swap weights (``segment_fn`` applies
staged weights before each call), and continues each unfinished row from its
prompt + partial response. Continuing re-reads the prefix with the current
weights, so the keys and values a new token attends to are those of the
weights that sample it (PipelineRL keeps the stale cache instead; recomputing
costs one prefill per segment and keeps each token's behaviour
log-probability exactly that of the version it records).

Per-row keys: segment ``s`` of row ``r`` uses ``fold_in(fold_in(rng, s), r)``
for ``s >= 1`` and the caller's row ids for ``s = 0``, so with
``segment_tokens = 0`` (one segment) the result is what one ``generate`` call
gives.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SampleResult


def generate_in_segments(segment_fn: Callable[..., SampleResult], prompts: Sequence[Sequence[int]], *,
                         num_samples: int, rng: Any, row_ids: np.ndarray, segment_tokens: int,
                         max_new_tokens: int, pad_id: int) -> SampleResult:
  """Samples ``num_samples`` responses per prompt, ``segment_tokens`` tokens at a time.

  Args:
    segment_fn: ``segment_fn(prompts, rng=, row_ids=, num_samples=, max_new_tokens=)``
      returning a SampleResult (a sampler's ``generate``, typically wrapped to
      apply staged weights first).
    prompts: G token-id prompts.
    num_samples: n responses per prompt (rows ``g*n .. g*n+n-1``).
    rng: the step's sampling key.
    row_ids: int [G*n] global row ids (per-row keys).
    segment_tokens: tokens per segment; 0 or >= max_new_tokens means one call.
    max_new_tokens: response length limit.
    pad_id: padding id of the trajectory.

  Returns:
    A SampleResult of G*n rows; ``policy_version_bt`` holds, per token, the
    version that sampled it, and ``policy_version`` the oldest of them.
  """
  row_ids = np.asarray(row_ids)
  if segment_tokens <= 0 or segment_tokens >= max_new_tokens:
    return segment_fn(prompts, rng=rng, row_ids=row_ids, num_samples=num_samples, max_new_tokens=max_new_tokens)
  import jax  # the callers (sampler actors) run JAX anyway

  rows = [list(p) for p in prompts for _ in range(num_samples)]
  num_rows = len(rows)
  responses: list[list[int]] = [[] for _ in rows]
  logps: list[list[float]] = [[] for _ in rows]
  versions: list[list[int]] = [[] for _ in rows]
  finished = np.zeros(num_rows, bool)
  truncated = np.zeros(num_rows, bool)
  produced, segment = 0, 0
  while produced < max_new_tokens and not finished.all():
    active = np.flatnonzero(~finished)
    budget = min(segment_tokens, max_new_tokens - produced)
    key = rng if segment == 0 else jax.random.fold_in(rng, segment)
    result = segment_fn([rows[r] + responses[r] for r in active], rng=key, row_ids=row_ids[active],
                        num_samples=1, max_new_tokens=budget)
    for i, r in enumerate(active):
      if segment == 0:
        rows[r] = list(result.prompt_tokens[i])  # after any truncation
        truncated[r] = bool(result.prompt_truncated_b[i])
      tokens = list(result.response_tokens[i])
      responses[r] += tokens
      logps[r] += [float(x) for x in result.response_logprobs[i]]
      versions[r] += [int(result.policy_version)] * len(tokens)
      finished[r] = bool(result.trajectory.finished_b[i])
    produced += budget
    segment += 1

  width = max(len(p) + len(r) for p, r in zip(rows, responses))
  tokens_bt, logp_bt = layout.fill_rows(rows, responses, logps, width, pad_id)
  _, version_bt = layout.fill_rows(rows, responses, versions, width, pad_id)  # versions exact in float32
  oldest = min((v[0] for v in versions if v), default=-1)
  out = layout.build_sample_result(tokens_bt, logp_bt, np.array([len(p) for p in rows]),
                                   np.array([len(r) for r in responses]), finished,
                                   truncated_g=list(truncated[::num_samples]), num_samples=num_samples,
                                   version=oldest)
  response_mask = np.asarray(out.trajectory.response_mask_bt)
  per_token = np.where(response_mask, np.rint(version_bt), -1).astype(np.int32)
  out.trajectory = out.trajectory.replace(policy_version_bt=per_token)
  return out
