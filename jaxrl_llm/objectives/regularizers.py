"""Additive per-token terms: entropy bonus, KL to a reference, SFT, value loss.

These terms are *not* importance-weighted (``weights_bt`` is ignored): each is
added to ``surrogate_bt`` as is and shares the aggregation of the policy term.
Also :func:`critic_warmup`, which zeroes whatever policy loss precedes it for
the first steps so that only the critic learns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_llm.objectives import stats as S
from jaxrl_llm.objectives.base import (CountState, Hyper, ObjectiveTransform, check_choice,
                                       check_hyper, scheduled)
from jaxrl_llm.objectives.record import (TokenRecord, add_metrics, add_surrogate, check_open,
                                         require)

KL_ESTIMATORS = ("k1", "k2", "k3")


def entropy_bonus(coef: Hyper = 0.01) -> ObjectiveTransform:
  """Entropy bonus: ``loss_t = -coef * H_t``.

  ``H_t`` is ``entropy_bt``, the entropy of pi_theta's next-token distribution
  at position t, computed by the learner from the logits (differentiable).

  Args:
    coef: coefficient (>= 0) or a schedule.

  References:
    Mnih et al., Asynchronous Methods for Deep Reinforcement Learning (entropy
    regularisation), arXiv:1602.01783; PPO, arXiv:1707.06347 (eq. 9).
  """
  check_hyper("entropy_bonus", "coef", coef, ge=0.0)
  name = "entropy_bonus"

  def fn(record: TokenRecord, coef) -> TokenRecord:
    h = require(record, "entropy_bt", name)
    record = add_surrogate(record, -coef * h, name)
    return add_metrics(record, name, {"entropy_mean": S.token_mean(jax.lax.stop_gradient(h),
                                                                   record.mask_bt)})

  return scheduled(fn, coef=coef)


def kl_estimate(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str) -> jax.Array:
  """Schulman's per-sample estimators of KL(pi_theta || pi_ref) at tokens x ~ pi_theta.

  With ``d = log pi_ref(x) - log pi_theta(x)``::

    k1 = -d                 (unbiased, high variance, can be negative)
    k2 = d^2 / 2            (biased, low variance, >= 0)
    k3 = exp(d) - 1 - d     (unbiased, low variance, >= 0; GRPO's choice)

  Args:
    logp_bt: float [B, T] log pi_theta.
    ref_logp_bt: float [B, T] log pi_ref.
    estimator: "k1", "k2" or "k3".

  Returns:
    float [B, T] per-token estimates.
  """
  d = ref_logp_bt - logp_bt
  if estimator == "k1":
    return -d
  if estimator == "k2":
    return 0.5 * d * d
  return jnp.expm1(d) - d


def kl_loss(coef: Hyper = 0.04, estimator: str = "k3") -> ObjectiveTransform:
  """KL penalty to a reference policy as a loss: ``loss_t = coef * k(x_t, ref_t)``.

  ``k`` is one of Schulman's estimators (:func:`kl_estimate`), differentiated
  through ``logp_bt`` (the reference is a constant). GRPO uses k3 with coef
  0.04. Metrics: ``kl_mean`` (the chosen estimator) and ``k1_mean`` / ``k3_mean``
  for the other estimators among k1 and k3.

  Args:
    coef: coefficient beta (>= 0) or a schedule.
    estimator: "k1", "k2" or "k3".

  References:
    Schulman, Approximating KL Divergence (2020 note, joschu.net);
    Shao et al., DeepSeekMath (GRPO's k3 KL loss), arXiv:2402.03300.
  """
  check_hyper("kl_loss", "coef", coef, ge=0.0)
  check_choice("kl_loss", "estimator", estimator, KL_ESTIMATORS)
  name = "kl_loss"

  def fn(record: TokenRecord, coef) -> TokenRecord:
    ref = require(record, "ref_logp_bt", name)
    k = kl_estimate(record.logp_bt, ref, estimator)
    record = add_surrogate(record, coef * k, name)
    x = jax.lax.stop_gradient(record.logp_bt)
    stats = {"kl_mean": S.token_mean(jax.lax.stop_gradient(k), record.mask_bt)}
    for other in ("k1", "k3"):
      if other != estimator:
        stats[f"{other}_mean"] = S.token_mean(kl_estimate(x, ref, other), record.mask_bt)
    return add_metrics(record, name, stats)

  return scheduled(fn, coef=coef)


def sft_loss(coef: Hyper = 0.1) -> ObjectiveTransform:
  """Supervised (negative log-likelihood) loss on marked tokens: ``loss_t = -coef * x_t``.

  Applied where ``sft_mask_bt`` is True (restricted to ``mask_bt``, so the
  tokens are counted by the aggregation like any other; demonstration rows go
  into the batch with their tokens in ``mask_bt`` and zero advantage).
  Metrics: ``nll_mean`` over the marked tokens, ``token_share``.

  Args:
    coef: coefficient (>= 0) or a schedule.

  References:
    Ouyang et al., Training language models to follow instructions with human
    feedback (PPO-ptx: pretraining-loss mixing), arXiv:2203.02155.
  """
  check_hyper("sft_loss", "coef", coef, ge=0.0)
  name = "sft_loss"

  def fn(record: TokenRecord, coef) -> TokenRecord:
    marked = require(record, "sft_mask_bt", name) & record.mask_bt
    record = add_surrogate(record, jnp.where(marked, -coef * record.logp_bt, 0.0), name)
    nll = -jax.lax.stop_gradient(record.logp_bt)
    return add_metrics(record, name, {"nll_mean": S.token_mean(nll, marked),
                                      "token_share": S.token_fraction(marked, record.mask_bt)})

  return scheduled(fn, coef=coef)


def value_loss(coef: Hyper = 0.5, clip_eps: float | None = 0.2) -> ObjectiveTransform:
  """PPO's clipped value loss.

  Per token, with V = ``values_bt`` (differentiable), V_old = ``old_values_bt``
  and R = ``returns_bt``::

    V_clip = V_old + clip(V - V_old, -eps, eps)
    loss_t = coef * 0.5 * max((V - R)^2, (V_clip - R)^2)

  (``clip_eps=None``: ``coef * 0.5 * (V - R)^2``.) The max makes the loss
  pessimistic: where the clipped error is larger, the gradient is zero.
  Metrics: ``loss_mean`` (per token, before coef), ``clip_frac``: the share of
  tokens that are clipped, i.e. ``|V - V_old| > eps`` and the clipped error is
  the larger. Inside the window ``V_clip`` equals V in exact arithmetic but
  ``V_old + (V - V_old)`` can round 1 ulp away from V in float32, making the
  clipped error larger by rounding alone (e.g. V = 0.028817441,
  V_old = 0.20676579, R = -0.77121145, eps = 0.2); such a token is not clipped.

  Args:
    coef: coefficient (>= 0) or a schedule.
    clip_eps: value clip range (> 0) or None.

  References:
    PPO reference implementation (baselines ppo2), arXiv:1707.06347;
    Engstrom et al., Implementation Matters in Deep Policy Gradients,
    arXiv:2005.12729 (value clipping).
  """
  check_hyper("value_loss", "coef", coef, ge=0.0)
  check_hyper("value_loss", "clip_eps", clip_eps, gt=0.0, allow_none=True)
  name = "value_loss"

  def fn(record: TokenRecord, coef) -> TokenRecord:
    v = require(record, "values_bt", name)
    ret = require(record, "returns_bt", name)
    err = (v - ret) ** 2
    if clip_eps is None:
      per_token, clipped = err, jnp.zeros_like(record.mask_bt)
    else:
      v_old = require(record, "old_values_bt", name)
      delta = v - v_old
      v_clip = v_old + jnp.clip(delta, -clip_eps, clip_eps)
      err_clip = (v_clip - ret) ** 2
      per_token = jnp.maximum(err, err_clip)
      # Outside the window only: inside it err_clip > err can be rounding (docstring).
      clipped = (jnp.abs(delta) > clip_eps) & (err_clip > err)
    per_token = 0.5 * per_token
    record = add_surrogate(record, coef * per_token, name)
    return add_metrics(record, name, {
        "loss_mean": S.token_mean(jax.lax.stop_gradient(per_token), record.mask_bt),
        "clip_frac": S.token_fraction(clipped, record.mask_bt)})

  return scheduled(fn, coef=coef)


def critic_warmup(steps: int) -> ObjectiveTransform:
  """Freezes the actor for the first ``steps`` updates (critic warm-up).

  While ``count < steps`` the surrogate built so far is replaced by exact
  zeros (``jnp.where``, so its gradient is exactly 0); terms added later in
  the chain are untouched. Put it after the policy terms and before
  :func:`value_loss`::

    chain(ppo_clip(), critic_warmup(50), value_loss(), aggregate("token_mean"))

  State: :class:`~jaxrl_llm.objectives.base.CountState`, incremented per update.
  Metric: ``frozen`` (1 while frozen).

  Args:
    steps: number of initial updates with the actor frozen (int >= 0).

  References:
    Zheng et al., Secrets of RLHF in Large Language Models Part I: PPO,
    arXiv:2307.04964 (critic pre-training: the actor waits until the critic
    gives accurate advantages).
  """
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(f"critic_warmup: steps must be an int >= 0; got {steps!r}")
  name = "critic_warmup"

  def init(params):
    del params
    return CountState(jnp.zeros([], jnp.int32))

  def update(record: TokenRecord, state: CountState):
    frozen = state.count < steps
    check_open(record, name)
    record = record.replace(surrogate_bt=jnp.where(frozen, 0.0, record.surrogate_bt))
    valid = jnp.any(record.mask_bt, axis=1)
    record = add_metrics(record, name, {"frozen": S.seq_mean(
        jnp.broadcast_to(frozen, valid.shape).astype(jnp.float32), valid)})
    return record, CountState(state.count + 1)

  return ObjectiveTransform(init, update)
