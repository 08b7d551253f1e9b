"""Loss aggregation: per-token surrogate -> per-example partials -> scalar.

Every mode is written as ``loss = sum_b num_b / sum_b den_b`` with per-example
partials (both sums by :func:`jaxrl_llm.reduce.batch_sum`, ``safe_div`` so an
empty batch gives exactly 0). With ``S_b = sum_t mask * surrogate`` (a pairwise
tree, :func:`jaxrl_llm.reduce.masked_row_sum`), ``n_b`` the row's token count
and ``v_b = n_b > 0``:

==========================  ==========================  ====================
mode                        num_b                       den_b
==========================  ==========================  ====================
``token_mean``              S_b                         n_b
``seq_mean_token_mean``     S_b / n_b                   v_b
``seq_mean_token_sum``      S_b                         v_b
``seq_sum_norm`` (C)        S_b / C                     v_b
``prompt_mean`` (N)         S_b / n_g(b)                1 on the first row of
                                                        each group with n_g > 0
==========================  ==========================  ====================

``n_g`` is the number of tokens of all samples of row b's prompt (contiguous
groups of ``group_size`` rows): ``n_g = sum_{b' in g} n_b'``. So ``token_mean``
is the mean over all tokens (DAPO), ``seq_mean_token_mean`` the mean over
sequences of each sequence's token mean (GRPO), ``seq_sum_norm`` the sum over a
sequence's tokens divided by a constant C (e.g. the maximum response length)
averaged over sequences (Dr.GRPO), and ``prompt_mean`` the mean over prompts of
the mean over all tokens of that prompt's samples (pooled, as ScaleRL's
prompt-level aggregation and CISPO's ``1 / sum_i |o_i|``):
``loss = mean_{g: n_g > 0} (sum_{b in g} S_b) / n_g``. A prompt with samples of 1
and 3 tokens and per-token losses -1 and +1, +1, +1 has loss (-1 + 3) / 4 = 0.5,
not the mean of the samples' means (0).

``den_b`` never depends on ``logp_bt`` (the mask is changed only by filters
that look at data), so the normaliser ``sum_b den_b`` of a whole batch is known
before any gradient: with gradient accumulation each micro-batch contributes
``sum_{b in mb} num_b / normaliser`` and the sum over micro-batches is the
whole-batch loss. For ``prompt_mean`` a micro-batch must hold whole groups.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from jaxrl_llm import reduce
from jaxrl_llm.objectives import differentiable
from jaxrl_llm.objectives.base import ObjectiveTransform, check_choice, check_hyper, stateless
from jaxrl_llm.objectives.record import TokenRecord

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_sum_norm",
                "prompt_mean")


def aggregation_partials(surrogate_bt, mask_bt, mode: str, *, constant: Optional[float] = None,
                         group_size: Optional[int] = None):
  """Per-example ``(num_b, den_b)`` for ``mode``; see the module docstring.

  Args:
    surrogate_bt: float [B, T] per-token loss.
    mask_bt: bool [B, T].
    mode: one of :data:`AGGREGATIONS`.
    constant: C for ``seq_sum_norm``.
    group_size: N for ``prompt_mean``.

  Returns:
    (num_b, den_b), float32 [B] each.
  """
  s_b = differentiable.row_sum(surrogate_bt, jnp.asarray(mask_bt).astype(bool))
  n_b = reduce.row_count(mask_bt)
  valid_b = (n_b > 0).astype(jnp.float32)
  if mode == "token_mean":
    return s_b, n_b
  if mode == "seq_mean_token_mean":
    return reduce.safe_div(s_b, n_b), valid_b
  if mode == "seq_mean_token_sum":
    return s_b, valid_b
  if mode == "seq_sum_norm":
    return s_b / jnp.float32(constant), valid_b
  if mode == "prompt_mean":
    if group_size is None:
      raise ValueError("aggregate('prompt_mean') needs group_size; pass group_size=N to "
                       "objective_loss / per_example_partials")
    # Tokens of the whole prompt (exact: a sum of integer counts), from the mask only,
    # so the partials of a row depend on its group's mask and its own surrogate.
    n_gb = jnp.repeat(reduce.group_sum(n_b, group_size), group_size)
    num_b = reduce.safe_div(s_b, n_gb)
    first = (jnp.arange(s_b.shape[0]) % group_size) == 0
    return num_b, (first & (n_gb > 0)).astype(jnp.float32)
  check_choice("aggregation_partials", "mode", mode, AGGREGATIONS)
  raise AssertionError(mode)


def aggregate(mode: str = "token_mean", *, constant: Optional[float] = None) -> ObjectiveTransform:
  """Ends a chain: turns ``surrogate_bt`` into per-example loss partials.

  Writes ``loss_num_b`` / ``loss_den_b`` into the record and marks it
  aggregated; a transform placed after it raises. The scalar loss is
  ``safe_div(batch_sum(num_b), batch_sum(den_b))`` (see the module docstring
  for each mode's partials).

  Args:
    mode: one of ``"token_mean"``, ``"seq_mean_token_mean"``,
      ``"seq_mean_token_sum"``, ``"seq_sum_norm"``, ``"prompt_mean"``.
    constant: C > 0, required by (and only by) ``"seq_sum_norm"``.

  Raises:
    ValueError: unknown mode (the message lists the valid ones), or a missing /
      non-positive / unexpected ``constant``.

  References:
    Token mean: Yu et al., DAPO, arXiv:2503.14476. Sequence mean of token
    means: Shao et al., DeepSeekMath (GRPO), arXiv:2402.03300. Constant
    normaliser: Liu et al., Understanding R1-Zero-Like Training (Dr.GRPO),
    arXiv:2503.20783. Prompt-level mean over the pooled tokens of a prompt's
    samples: Khatri et al., The Art of Scaling Reinforcement Learning Compute
    for LLMs (ScaleRL, §3.2 loss aggregation), arXiv:2510.13786; CISPO's
    ``1 / sum_i |o_i|`` normaliser, MiniMax-M1, arXiv:2506.13585.
  """
  check_choice("aggregate", "aggregation mode", mode, AGGREGATIONS)
  if mode == "seq_sum_norm":
    check_hyper("aggregate", "constant", constant, gt=0.0)
    if callable(constant):
      raise TypeError("aggregate: constant must be a number, not a schedule")
  elif constant is not None:
    raise ValueError(f"aggregate: constant is only used by 'seq_sum_norm', not {mode!r}")

  def fn(record: TokenRecord) -> TokenRecord:
    if record.aggregation is not None:
      raise ValueError(f"aggregate({mode!r}): the chain already aggregated with "
                       f"{record.aggregation!r}; use one aggregate(...) at the end")
    num_b, den_b = aggregation_partials(record.surrogate_bt, record.mask_bt, mode,
                                        constant=constant, group_size=record.group_size)
    return record.replace(loss_num_b=num_b, loss_den_b=den_b, aggregation=mode)

  return stateless(fn)
