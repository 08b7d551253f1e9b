"""Advantage estimation and reward processing: pure, jit-able functions of arrays.

Shapes follow the package legend (B sequences, T tokens, G groups, N samples per
group). Every cross-example statistic goes through :mod:`jaxrl_llm.reduce`, so
results are bitwise invariant to padding, micro-batching and data-parallel
sharding of the batch axis. See docs/advantages.md for formulas, references and
which recipe uses what.

Modules:
  gae         GAE / Monte Carlo returns over variable-length responses.
  group       GRPO, Dr.GRPO, RLOO sequence advantages; zero-variance flags.
  normalize   advantage normalisation modes (none/batch/group/global), whitening.
  running     running reward z-score (Welford/Chan state).
  rewards     clipping, reference baseline, EOS placement, per-token KL shaping.
  kl_control  adaptive (Ziegler et al.) and fixed KL coefficient controllers.
  checks      argument checks (shapes, ranges, choices) with errors naming the
              argument; shared with the reward-model and diagnostics code.
"""

from jaxrl_llm.advantages.gae import gae
from jaxrl_llm.advantages.group import (
    GROUP_ESTIMATORS,
    GroupAdvantages,
    dr_grpo_advantages,
    group_advantages,
    group_zero_variance,
    grpo_advantages,
    rloo_advantages,
    sequence_to_tokens,
)
from jaxrl_llm.advantages.kl_control import (
    KLController,
    KLControllerState,
    adaptive_kl_controller,
    fixed_kl_controller,
)
from jaxrl_llm.advantages.normalize import (
    LEVELS,
    MODES,
    Moments,
    make_advantage_normalizer,
    masked_moments,
    normalize_advantages,
    whiten,
)
from jaxrl_llm.advantages.rewards import (
    clip_rewards,
    kl_penalized_rewards,
    last_token_mask,
    mean_sequence_kl,
    reference_baseline,
    reward_at_eos,
)
from jaxrl_llm.advantages.running import (
    RewardNormalizer,
    RunningMoments,
    running_moments_init,
    running_moments_update,
    running_reward_normalizer,
    running_variance,
    running_zscore,
)

# Every advantage estimator name (a run config's ``advantage.estimator``): the
# group-relative ones and "gae" (:func:`gae`, from a critic's value estimates).
ESTIMATORS = GROUP_ESTIMATORS + ("gae",)

__all__ = [
    "ESTIMATORS", "GROUP_ESTIMATORS", "GroupAdvantages", "KLController", "KLControllerState", "LEVELS", "MODES",
    "Moments", "RewardNormalizer", "RunningMoments", "adaptive_kl_controller", "clip_rewards",
    "dr_grpo_advantages", "fixed_kl_controller", "gae", "group_advantages",
    "group_zero_variance", "grpo_advantages", "kl_penalized_rewards", "last_token_mask",
    "make_advantage_normalizer", "masked_moments", "mean_sequence_kl", "normalize_advantages",
    "reference_baseline", "reward_at_eos", "rloo_advantages", "running_moments_init",
    "running_moments_update", "running_reward_normalizer", "running_variance",
    "running_zscore", "sequence_to_tokens", "whiten",
]
