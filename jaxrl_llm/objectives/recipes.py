"""Named objectives as chains of transforms (the analogue of ``optax.adamw``).

Each recipe is a plain ``chain(...)`` ending in ``aggregate(...)``; reading its
body is reading the algorithm. Advantage estimation (GAE, group-relative,
Dr.GRPO's un-normalised advantages) and data filters (DAPO's dynamic sampling,
overlong shaping) live elsewhere (:mod:`jaxrl_llm.advantages`, the learner).

==================  =====================================================  ==========
recipe              chain                                                  arXiv
==================  =====================================================  ==========
``ppo``             ppo_clip(0.2) [+ entropy] + value_loss, token mean     1707.06347
``grpo``            ppo_clip(0.2) + kl_loss(0.04, k3), seq-mean-token-mean 2402.03300
``dr_grpo``         ppo_clip(0.2), seq_sum_norm(C)                         2503.20783
``dapo``            ppo_clip(0.2 / 0.28), token mean                       2503.14476
``cispo``           cispo(eps_high), token mean                            2506.13585
``gspo``            gspo(3e-4 / 4e-4), seq-mean-token-mean                 2507.18071
``decoupled_ppo``   decoupled(0.2), token mean                             2110.00641
``geppo``           geppo_adaptive(0.2), token mean                        2111.00072
==================  =====================================================  ==========

The PPO-clip recipes (ppo, grpo, dapo, decoupled_ppo) take ``dual_c``: the dual
clip of Ye et al. (arXiv:1912.09729) bounds the loss of tokens with A < 0 by
``-c * A`` (``objective.kwargs.dual_c`` in a run config).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxrl_llm.objectives.aggregation import aggregate
from jaxrl_llm.objectives.base import Hyper, ObjectiveTransform, chain, check_choice
from jaxrl_llm.objectives import policy
from jaxrl_llm.objectives.regularizers import KL_ESTIMATORS, entropy_bonus, kl_loss, value_loss


def ppo(eps: Hyper = 0.2, *, value_coef: Optional[Hyper] = 0.5,
        value_clip: Optional[float] = 0.2, entropy_coef: Hyper = 0.0,
        aggregation: str = "token_mean", dual_c: Optional[float] = None) -> ObjectiveTransform:
  """PPO with a critic: clipped surrogate, optional entropy bonus, clipped value loss.

  ``chain(ppo_clip(eps), [entropy_bonus(entropy_coef)], [value_loss(value_coef,
  value_clip)], aggregate(aggregation))``; needs values_bt / old_values_bt /
  returns_bt unless ``value_coef`` is None, and entropy_bt when
  ``entropy_coef`` > 0.

  References:
    Schulman et al., arXiv:1707.06347; Ouyang et al., arXiv:2203.02155.
  """
  parts = [policy.ppo_clip(eps, dual_c=dual_c)]
  if callable(entropy_coef) or entropy_coef:
    parts.append(entropy_bonus(entropy_coef))
  if value_coef is not None:
    parts.append(value_loss(value_coef, value_clip))
  return chain(*parts, aggregate(aggregation))


def grpo(eps: Hyper = 0.2, *, kl_coef: Hyper = 0.04, kl_estimator: str = "k3",
         aggregation: str = "seq_mean_token_mean", dual_c: Optional[float] = None) -> ObjectiveTransform:
  """GRPO: PPO clip on group-relative advantages, k3 KL loss, sequence-mean of token means.

  ``-(1/G) sum_i (1/|o_i|) sum_t [min(r A, clip(r) A) - beta * k3]``; needs
  ref_logp_bt when ``kl_coef`` > 0 (``kl_coef=0`` drops the KL term).

  References:
    Shao et al., DeepSeekMath, arXiv:2402.03300.
  """
  check_choice("grpo", "kl_estimator", kl_estimator, KL_ESTIMATORS)  # also when kl_coef=0 drops the term
  parts = [policy.ppo_clip(eps, dual_c=dual_c)]
  if callable(kl_coef) or kl_coef:
    parts.append(kl_loss(kl_coef, kl_estimator))
  return chain(*parts, aggregate(aggregation))


def dr_grpo(max_response_len: float, *, eps: Hyper = 0.2) -> ObjectiveTransform:
  """Dr.GRPO: PPO clip, no KL, per-sequence token sums divided by the maximum response length.

  ``-(1/B) sum_i (1/C) sum_t min(r A, clip(r) A)`` with C = ``max_response_len``
  fixed (a run fills in its ``rl.max_new_tokens``), removing GRPO's length bias;
  pair it with :func:`jaxrl_llm.advantages.dr_grpo_advantages` (no std
  normalisation).

  References:
    Liu et al., Understanding R1-Zero-Like Training: A Critical Perspective,
    arXiv:2503.20783.
  """
  return chain(policy.ppo_clip(eps), aggregate("seq_sum_norm", constant=max_response_len))


def dapo(eps_low: Hyper = 0.2, eps_high: Hyper = 0.28, *, dual_c: Optional[float] = None) -> ObjectiveTransform:
  """DAPO: clip-higher (0.2 / 0.28), no KL, token-level mean over the batch.

  References:
    Yu et al., DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale, arXiv:2503.14476.
  """
  return chain(policy.ppo_clip(eps_low=eps_low, eps_high=eps_high, eps=eps_low, dual_c=dual_c),
               aggregate("token_mean"))


def cispo(eps_high: Hyper = 2.0, *, eps_low: Optional[Hyper] = None,
          aggregation: str = "token_mean") -> ObjectiveTransform:
  """CISPO: clipped stop-gradient IS weight x A x log pi, token-level mean by default.

  ScaleRL (arXiv:2510.13786) pairs CISPO with ``aggregation="prompt_mean"``.

  References:
    MiniMax, MiniMax-M1, arXiv:2506.13585.
  """
  return chain(policy.cispo(eps_high, eps_low=eps_low), aggregate(aggregation))


def gspo(eps_low: Hyper = 3e-4, eps_high: Hyper = 4e-4) -> ObjectiveTransform:
  """GSPO: sequence-level geometric-mean ratio, sequence-mean aggregation, no KL.

  References:
    Zheng et al., Group Sequence Policy Optimization, arXiv:2507.18071.
  """
  return chain(policy.gspo(eps_low, eps_high), aggregate("seq_mean_token_mean"))


def decoupled_ppo(eps: Hyper = 0.2, *, aggregation: str = "token_mean",
                  dual_c: Optional[float] = None) -> ObjectiveTransform:
  """Decoupled PPO: trust region around pi_k, importance weight pi_k / mu.

  References:
    Hilton, Cobbe, Schulman, arXiv:2110.00641.
  """
  return chain(policy.decoupled(eps, dual_c=dual_c), aggregate(aggregation))


def geppo(eps: Hyper = 0.2, *, aggregation: str = "token_mean") -> ObjectiveTransform:
  """GePPO-style: clip window [rho_k - eps, rho_k + eps] around rho_k = pi_k / mu.

  References:
    Queeney, Paschalidis, Cassandras, arXiv:2111.00072.
  """
  return chain(policy.geppo_adaptive(eps), aggregate(aggregation))


RECIPES: dict[str, Callable[..., ObjectiveTransform]] = {
    "ppo": ppo, "grpo": grpo, "dr_grpo": dr_grpo, "dapo": dapo, "cispo": cispo,
    "gspo": gspo, "decoupled_ppo": decoupled_ppo, "geppo": geppo,
}


def recipe(name: str, **kwargs: Any) -> ObjectiveTransform:
  """Builds a named recipe, e.g. ``recipe("dapo", eps_high=0.3)`` (for configs)."""
  check_choice("recipe", "recipe name", name, tuple(RECIPES))
  return RECIPES[name](**kwargs)
