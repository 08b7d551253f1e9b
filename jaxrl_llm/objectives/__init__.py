"""Composable RL objectives for language models, in the shape of optax.

An objective is an :class:`ObjectiveTransform` ``(init, update)``; transforms
read and extend a per-token :class:`TokenRecord` and compose with
:func:`chain`; the last one, :func:`aggregate`, turns the per-token surrogate
into per-example loss partials. :func:`objective_loss` is the pure function the
learner differentiates. Named algorithms are chains in :mod:`.recipes`
(``recipes.grpo()``, ``recipes.dapo()``, ... or ``recipe("dapo")``).

Example::

  from jaxrl_llm import objectives as O
  objective = O.chain(O.truncated_is(cap=2.0), O.ppo_clip(eps_low=0.2, eps_high=0.28),
                      O.kl_loss(0.01), O.aggregate("token_mean"))
  state = objective.init(None)
  loss, (metrics, state) = O.objective_loss(
      objective, logp_bt, mask_bt=mask_bt, advantages_bt=adv_bt,
      behaviour_logp_bt=mu_bt, ref_logp_bt=ref_bt, state=state)

Every cross-example reduction goes through :mod:`jaxrl_llm.reduce`: loss and
metrics have the same bits for any micro-batching, padding or power-of-two
data-parallel layout. See docs/objectives.md.

Offline preference optimisation (DPO, IPO, SimPO) is in :mod:`.preference`: pure
losses of per-sequence log-probabilities (docs/preference_optimization.md).
"""

from jaxrl_llm.objectives import preference, recipes
from jaxrl_llm.objectives.aggregation import AGGREGATIONS, aggregate, aggregation_partials
from jaxrl_llm.objectives.base import (Controlled, ControlledState, CountState, EmptyState,
                                       ObjectiveTransform, chain, control_keys, get_control,
                                       scheduled, set_control, stateless)
from jaxrl_llm.objectives.importance import (CORRECTIONS, LEVELS, masked_is, segment_is, segment_sums,
                                             staleness_filter, truncated_is)
from jaxrl_llm.objectives.loss import (Partials, concat_partials, finalize,
                                       loss_normaliser, micro_batch_loss, objective_loss,
                                       per_example_partials)
from jaxrl_llm.objectives.policy import (cispo, clipped_objective, decoupled, dual_clip,
                                         geppo_adaptive, gspo, ppo_clip)
from jaxrl_llm.objectives.preference import (PREFERENCE_LOSSES, dpo_loss, ipo_loss, pair_losses,
                                             preference_metrics, simpo_loss)
from jaxrl_llm.objectives.recipes import RECIPES, recipe
from jaxrl_llm.objectives.record import TokenRecord, make_record
from jaxrl_llm.objectives.regularizers import (KL_ESTIMATORS, critic_warmup, entropy_bonus,
                                               kl_estimate, kl_loss, sft_loss, value_loss)
from jaxrl_llm.objectives.stats import DEFAULT_QUANTILES, masked_quantiles

__all__ = [
    "AGGREGATIONS", "CORRECTIONS", "Controlled", "ControlledState", "CountState", "control_keys", "get_control",
    "set_control", "DEFAULT_QUANTILES", "EmptyState", "KL_ESTIMATORS", "LEVELS",
    "ObjectiveTransform", "PREFERENCE_LOSSES", "Partials", "RECIPES", "TokenRecord", "aggregate",
    "aggregation_partials", "chain", "cispo", "clipped_objective",
    "concat_partials", "critic_warmup", "decoupled", "dpo_loss", "dual_clip", "entropy_bonus", "finalize",
    "geppo_adaptive", "gspo", "ipo_loss", "kl_estimate", "kl_loss", "loss_normaliser", "make_record",
    "masked_is", "masked_quantiles", "micro_batch_loss", "objective_loss",
    "pair_losses", "per_example_partials", "ppo_clip", "preference", "preference_metrics", "recipe", "recipes",
    "scheduled", "segment_is",
    "segment_sums", "sft_loss", "simpo_loss", "staleness_filter", "stateless", "truncated_is", "value_loss",
]
