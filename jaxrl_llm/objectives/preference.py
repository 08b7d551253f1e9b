"""Offline preference optimisation: DPO, IPO and SimPO losses, and the pairwise metrics they share.

Pure functions of per-sequence log-probabilities (the learner computes them:
the sum of the response tokens' ``log pi``), jit-able and shardable over pairs.
Here ``B`` counts *pairs*: ``policy_chosen_b[i]`` and ``policy_rejected_b[i]``
are the policy's log-probabilities of the two responses of pair ``i``, and
``ref_*`` those of the frozen reference policy. Cross-pair reductions go through
:mod:`jaxrl_llm.reduce`, so a loss or metric has the same bits for any
micro-batching or padding of the pair axis.

With the log-ratio margin ``h = (pi_c - ref_c) - (pi_r - ref_r)``, per pair::

  DPO    -log sigma(beta h)                                 (Rafailov et al. 2023, arXiv:2305.18290)
  cDPO   -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)   (label smoothing eps; conservative DPO)
  IPO    (h - 1 / (2 tau))^2,  tau = beta                   (Azar et al. 2023, arXiv:2310.12036)
  SimPO  -log sigma(beta (pi_c / |y_c| - pi_r / |y_r|) - gamma)  (Meng et al. 2024, arXiv:2405.14734)

SimPO is reference-free: its log-probabilities are divided by the response
lengths ``|y|`` (tokens). The implicit rewards reported are ``beta (pi - ref)``
(DPO, IPO) and ``beta pi / |y|`` (SimPO); a pair is ranked right when the chosen
response's implicit reward is higher.

The pairwise metrics (:func:`pairwise_accuracy`, :func:`mean_margin`,
:func:`preference_metrics`) are those of a reward model's scores too:
:mod:`jaxrl_llm.reward_model.loss` uses them on its scores.

Example::

  >>> import jax.numpy as jnp
  >>> from jaxrl_llm.objectives import preference
  >>> loss, m = preference.dpo_loss(jnp.array([-1.0]), jnp.array([-3.0]), jnp.array([-2.0]), jnp.array([-2.0]),
  ...                               beta=0.5)
  >>> round(float(loss), 4), float(m["accuracy"])   # softplus(-0.5 * 2)
  (0.3133, 1.0)
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Bool, Float

from jaxrl_llm import reduce
from jaxrl_llm.advantages import checks

__all__ = ["PREFERENCE_LOSSES", "check_pairs", "dpo_loss", "dpo_losses", "ipo_loss", "ipo_losses", "log_ratio_margin",
           "mean_margin", "pair_losses", "pair_mask", "pairwise_accuracy", "preference_metrics", "simpo_loss",
           "simpo_losses"]

PREFERENCE_LOSSES = ("dpo", "ipo", "simpo")  # dpo.loss: the losses of :func:`pair_losses`


def check_pairs(who: str, **arrays: Any) -> int:
  """Checks that every (non-None) array is [B], with the B of the first one; returns B.

  Example: ``check_pairs("dpo_loss", policy_chosen_b=pc, policy_rejected_b=pr, valid_b=None)``.

  Raises:
    ValueError: naming ``who``, the array and the expected shape.
  """
  items = [(name, x) for name, x in arrays.items() if x is not None]
  first, x0 = items[0]
  checks.check_rank(who, first, x0, 1, "[B]")
  batch = checks.shape_of(x0)[0]
  for name, x in items[1:]:
    checks.check_b(who, name, x, batch, first)
  return batch


def pair_mask(chosen_b: Any, valid_b: Optional[Any]) -> Array:
  """``valid_b`` as bool [B], or all True when None."""
  if valid_b is None:
    return jnp.ones(checks.shape_of(chosen_b), bool)
  return jnp.asarray(valid_b).astype(bool)


# --------------------------------------------------------------------------- pairwise metrics


def pairwise_accuracy(chosen_b: Float[ArrayLike, "B"], rejected_b: Float[ArrayLike, "B"],
                      valid_b: Optional[Bool[ArrayLike, "B"]] = None) -> Float[Array, ""]:
  """Share of valid pairs ranked right: ``mean(1[r_c > r_r] + 0.5 * 1[r_c == r_r])``.

  A tie counts one half, so a constant score is exactly 0.5 (chance); so is a
  policy equal to its reference under DPO (every implicit reward is 0).

  Args:
    chosen_b: float [B] scores (or implicit rewards) of the preferred responses.
    rejected_b: float [B] those of the other responses.
    valid_b: optional bool [B].

  Returns:
    float32 scalar in [0, 1] (0 with no valid pair).
  """
  check_pairs("pairwise_accuracy", chosen_b=chosen_b, rejected_b=rejected_b, valid_b=valid_b)
  c = jnp.asarray(chosen_b, jnp.float32)
  r = jnp.asarray(rejected_b, jnp.float32)
  hit = jnp.where(c > r, 1.0, jnp.where(c == r, 0.5, 0.0))
  return reduce.batch_mean(hit, pair_mask(chosen_b, valid_b))


def mean_margin(chosen_b: Float[ArrayLike, "B"], rejected_b: Float[ArrayLike, "B"],
                valid_b: Optional[Bool[ArrayLike, "B"]] = None) -> Float[Array, ""]:
  """Mean gap ``mean(r_c - r_r)`` over valid pairs (0 with none).

  Args:
    chosen_b: float [B].
    rejected_b: float [B].
    valid_b: optional bool [B].

  Returns:
    float32 scalar.
  """
  check_pairs("mean_margin", chosen_b=chosen_b, rejected_b=rejected_b, valid_b=valid_b)
  gap = jnp.asarray(chosen_b, jnp.float32) - jnp.asarray(rejected_b, jnp.float32)
  return reduce.batch_mean(gap, pair_mask(chosen_b, valid_b))


def preference_metrics(chosen_b: Float[ArrayLike, "B"], rejected_b: Float[ArrayLike, "B"],
                       valid_b: Optional[Bool[ArrayLike, "B"]] = None) -> dict[str, Array]:
  """Pairwise accuracy, mean margin and mean chosen / rejected scores over valid pairs.

  Args:
    chosen_b: float [B].
    rejected_b: float [B].
    valid_b: optional bool [B].

  Returns:
    dict of float32 scalars: ``accuracy``, ``margin``, ``chosen``, ``rejected``, ``pairs``.
  """
  valid = pair_mask(chosen_b, valid_b)
  return {
      "accuracy": pairwise_accuracy(chosen_b, rejected_b, valid),
      "margin": mean_margin(chosen_b, rejected_b, valid),
      "chosen": reduce.batch_mean(jnp.asarray(chosen_b, jnp.float32), valid),
      "rejected": reduce.batch_mean(jnp.asarray(rejected_b, jnp.float32), valid),
      "pairs": reduce.batch_count(valid),
  }


# --------------------------------------------------------------------------- per-pair losses


def _f32(x: Any) -> Array:
  return jnp.asarray(x, jnp.float32)


def log_ratio_margin(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
                     ref_chosen_b: Float[ArrayLike, "B"], ref_rejected_b: Float[ArrayLike, "B"]
                     ) -> Float[Array, "B"]:
  """``h = (pi_c - ref_c) - (pi_r - ref_r)``, float32 [B]; the reference terms carry no gradient."""
  check_pairs("log_ratio_margin", policy_chosen_b=policy_chosen_b, policy_rejected_b=policy_rejected_b,
              ref_chosen_b=ref_chosen_b, ref_rejected_b=ref_rejected_b)
  ref_c, ref_r = jax.lax.stop_gradient(_f32(ref_chosen_b)), jax.lax.stop_gradient(_f32(ref_rejected_b))
  return (_f32(policy_chosen_b) - ref_c) - (_f32(policy_rejected_b) - ref_r)


def dpo_losses(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
               ref_chosen_b: Float[ArrayLike, "B"], ref_rejected_b: Float[ArrayLike, "B"], *, beta: float = 0.1,
               label_smoothing: float = 0.0) -> Float[Array, "B"]:
  """Per-pair DPO loss ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)`` (arXiv:2305.18290).

  ``eps = label_smoothing`` > 0 is conservative DPO (cDPO: each label is flipped
  with probability eps). ``-log sigma(z) = softplus(-z)``: no overflow for large
  margins.

  Args:
    policy_chosen_b / policy_rejected_b: float [B] summed response log-probabilities under the policy.
    ref_chosen_b / ref_rejected_b: float [B] the same under the frozen reference.
    beta: strength of the implicit KL constraint (> 0).
    label_smoothing: eps in [0, 0.5).

  Returns:
    float32 [B] losses.
  """
  z = beta * log_ratio_margin(policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b)
  losses = jax.nn.softplus(-z)
  if label_smoothing:
    losses = (1.0 - label_smoothing) * losses + label_smoothing * jax.nn.softplus(z)
  return losses


def ipo_losses(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
               ref_chosen_b: Float[ArrayLike, "B"], ref_rejected_b: Float[ArrayLike, "B"], *, beta: float = 0.1
               ) -> Float[Array, "B"]:
  """Per-pair IPO loss ``(h - 1 / (2 tau))^2`` with ``tau = beta`` (arXiv:2310.12036, eq. 17).

  The squared loss regresses the log-ratio margin onto ``1 / (2 tau)`` instead of
  pushing it to infinity, so it does not overfit deterministic preferences.

  Args:
    policy_chosen_b / policy_rejected_b: float [B] summed response log-probabilities under the policy.
    ref_chosen_b / ref_rejected_b: float [B] the same under the frozen reference.
    beta: tau (> 0); the target margin is ``1 / (2 beta)`` nats.

  Returns:
    float32 [B] losses.
  """
  h = log_ratio_margin(policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b)
  return jnp.square(h - 1.0 / (2.0 * beta))


def _per_token(logp_b: Any, length_b: Any) -> Array:
  return _f32(logp_b) / jnp.maximum(jax.lax.stop_gradient(_f32(length_b)), 1.0)


def simpo_losses(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
                 chosen_length_b: Float[ArrayLike, "B"], rejected_length_b: Float[ArrayLike, "B"], *,
                 beta: float = 2.0, gamma: float = 0.5) -> Float[Array, "B"]:
  """Per-pair SimPO loss ``-log sigma(beta (pi_c / |y_c| - pi_r / |y_r|) - gamma)`` (arXiv:2405.14734).

  Reference-free: the length-normalised log-probability is the implicit reward,
  and ``gamma`` is the target reward margin.

  Args:
    policy_chosen_b / policy_rejected_b: float [B] summed response log-probabilities under the policy.
    chosen_length_b / rejected_length_b: float or int [B] response lengths in tokens (a length below
      1, e.g. on a padding pair, counts as 1).
    beta: reward scale (> 0; the paper uses 2 to 10).
    gamma: target margin (>= 0).

  Returns:
    float32 [B] losses.
  """
  check_pairs("simpo_losses", policy_chosen_b=policy_chosen_b, policy_rejected_b=policy_rejected_b,
              chosen_length_b=chosen_length_b, rejected_length_b=rejected_length_b)
  z = beta * (_per_token(policy_chosen_b, chosen_length_b) - _per_token(policy_rejected_b, rejected_length_b))
  return jax.nn.softplus(-(z - gamma))


def pair_losses(loss: str, policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
                ref_chosen_b: Optional[Float[ArrayLike, "B"]] = None,
                ref_rejected_b: Optional[Float[ArrayLike, "B"]] = None,
                chosen_length_b: Optional[Float[ArrayLike, "B"]] = None,
                rejected_length_b: Optional[Float[ArrayLike, "B"]] = None, *, beta: float = 0.1,
                label_smoothing: float = 0.0, gamma: float = 0.5
                ) -> tuple[Float[Array, "B"], Float[Array, "B"], Float[Array, "B"]]:
  """The per-pair losses of ``loss`` (one of :data:`PREFERENCE_LOSSES`) and both implicit rewards.

  DPO and IPO need the reference log-probabilities; SimPO needs the lengths.

  Returns:
    ``(losses_b, chosen_reward_b, rejected_reward_b)``, float32 [B] each: the implicit rewards
    are ``beta (pi - ref)`` (DPO, IPO) or ``beta pi / |y|`` (SimPO), without gradient.

  Raises:
    ValueError: an unknown ``loss`` or a missing input, naming it.
  """
  if loss not in PREFERENCE_LOSSES:
    raise ValueError(f"pair_losses: loss={loss!r}: expected one of {PREFERENCE_LOSSES}")
  if loss == "simpo":
    if chosen_length_b is None or rejected_length_b is None:
      raise ValueError("pair_losses: loss='simpo' needs chosen_length_b and rejected_length_b")
    losses = simpo_losses(policy_chosen_b, policy_rejected_b, chosen_length_b, rejected_length_b, beta=beta,
                          gamma=gamma)
    chosen = beta * _per_token(policy_chosen_b, chosen_length_b)
    rejected = beta * _per_token(policy_rejected_b, rejected_length_b)
  else:
    if ref_chosen_b is None or ref_rejected_b is None:
      raise ValueError(f"pair_losses: loss={loss!r} needs ref_chosen_b and ref_rejected_b (the reference policy)")
    if loss == "dpo":
      losses = dpo_losses(policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b, beta=beta,
                          label_smoothing=label_smoothing)
    else:
      losses = ipo_losses(policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b, beta=beta)
    chosen = beta * (_f32(policy_chosen_b) - _f32(ref_chosen_b))
    rejected = beta * (_f32(policy_rejected_b) - _f32(ref_rejected_b))
  return losses, jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)


# --------------------------------------------------------------------------- batch losses


def _mean_loss(losses_b: Array, chosen_b: Array, rejected_b: Array, valid_b: Any,
               normaliser: Any) -> tuple[Array, dict[str, Array]]:
  valid = pair_mask(losses_b, valid_b)
  den = reduce.batch_count(valid) if normaliser is None else _f32(normaliser)
  return reduce.safe_div(reduce.batch_sum(losses_b, valid), den), preference_metrics(chosen_b, rejected_b, valid)


def dpo_loss(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
             ref_chosen_b: Float[ArrayLike, "B"], ref_rejected_b: Float[ArrayLike, "B"],
             valid_b: Optional[Bool[ArrayLike, "B"]] = None, *, beta: float = 0.1, label_smoothing: float = 0.0,
             normaliser: Optional[Float[ArrayLike, ""]] = None) -> tuple[Float[Array, ""], dict[str, Array]]:
  """Mean DPO (cDPO with ``label_smoothing``) loss over valid pairs, with the implicit-reward metrics.

  ``loss = sum_{i valid} l_i / n``, ``n`` the number of valid pairs or ``normaliser`` (the whole
  batch's count, so micro-batch losses add up to the full-batch loss). See :func:`dpo_losses`.

  Args:
    policy_chosen_b / policy_rejected_b / ref_chosen_b / ref_rejected_b: float [B].
    valid_b: optional bool [B]; False rows (padding pairs) contribute nothing.
    beta, label_smoothing: see :func:`dpo_losses`.
    normaliser: optional float scalar denominator.

  Returns:
    ``(loss, metrics)``: float32 scalar and :func:`preference_metrics` of the implicit rewards
    ``beta (pi - ref)`` (``accuracy``: reward accuracy; ``margin``: mean reward margin).
  """
  check_pairs("dpo_loss", policy_chosen_b=policy_chosen_b, policy_rejected_b=policy_rejected_b,
              ref_chosen_b=ref_chosen_b, ref_rejected_b=ref_rejected_b, valid_b=valid_b)
  out = pair_losses("dpo", policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b, beta=beta,
                    label_smoothing=label_smoothing)
  return _mean_loss(*out, valid_b, normaliser)


def ipo_loss(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
             ref_chosen_b: Float[ArrayLike, "B"], ref_rejected_b: Float[ArrayLike, "B"],
             valid_b: Optional[Bool[ArrayLike, "B"]] = None, *, beta: float = 0.1,
             normaliser: Optional[Float[ArrayLike, ""]] = None) -> tuple[Float[Array, ""], dict[str, Array]]:
  """Mean IPO loss over valid pairs (:func:`ipo_losses`), with the implicit-reward metrics.

  Args:
    policy_chosen_b / policy_rejected_b / ref_chosen_b / ref_rejected_b: float [B].
    valid_b: optional bool [B].
    beta: tau.
    normaliser: optional float scalar denominator.

  Returns:
    ``(loss, metrics)`` as :func:`dpo_loss`.
  """
  check_pairs("ipo_loss", policy_chosen_b=policy_chosen_b, policy_rejected_b=policy_rejected_b,
              ref_chosen_b=ref_chosen_b, ref_rejected_b=ref_rejected_b, valid_b=valid_b)
  out = pair_losses("ipo", policy_chosen_b, policy_rejected_b, ref_chosen_b, ref_rejected_b, beta=beta)
  return _mean_loss(*out, valid_b, normaliser)


def simpo_loss(policy_chosen_b: Float[ArrayLike, "B"], policy_rejected_b: Float[ArrayLike, "B"],
               chosen_length_b: Float[ArrayLike, "B"], rejected_length_b: Float[ArrayLike, "B"],
               valid_b: Optional[Bool[ArrayLike, "B"]] = None, *, beta: float = 2.0, gamma: float = 0.5,
               normaliser: Optional[Float[ArrayLike, ""]] = None) -> tuple[Float[Array, ""], dict[str, Array]]:
  """Mean SimPO loss over valid pairs (:func:`simpo_losses`), with the implicit-reward metrics.

  Args:
    policy_chosen_b / policy_rejected_b: float [B] summed response log-probabilities.
    chosen_length_b / rejected_length_b: [B] response lengths in tokens.
    valid_b: optional bool [B].
    beta, gamma: see :func:`simpo_losses`.
    normaliser: optional float scalar denominator.

  Returns:
    ``(loss, metrics)``: the metrics of the implicit rewards ``beta pi / |y|``.
  """
  check_pairs("simpo_loss", policy_chosen_b=policy_chosen_b, policy_rejected_b=policy_rejected_b,
              chosen_length_b=chosen_length_b, rejected_length_b=rejected_length_b, valid_b=valid_b)
  out = pair_losses("simpo", policy_chosen_b, policy_rejected_b, chosen_length_b=chosen_length_b,
                    rejected_length_b=rejected_length_b, beta=beta, gamma=gamma)
  return _mean_loss(*out, valid_b, normaliser)
