"""Reward models: train an EOS-head reward model on preference pairs, use it as the RL reward.

Modules:
  loss         Bradley-Terry pairwise loss (optional margin), pairwise accuracy, mean margin.
  eos          where the reward head is read (last real token) for right/left padding and
               truncated responses; the no-EOS penalty.
  preferences  preference pairs: JSONL loader (file:line errors, identical pairs skipped),
               held-out split, built-in pairs of any task (``Task.preference_pairs``).
  encoding     prompt | response | EOS token rows (chat template), right-padded pair batches, the
               checkpointed stream of training pair batches (shared with the DPO job).
  step         the Bradley-Terry training step (the job is ``jaxrl_llm.jobs.RewardModelJob``).
  scorer       batched scoring of trajectories on the learner mesh; rule + RM combination,
               running z-score, clipping, reference-response baseline.
  shaping      token-level KL penalty in the reward (GAE path), fixed or adaptive beta.

See docs/reward_models.md.
"""

from jaxrl_llm.reward_model.encoding import (PairEncoder, PairStream, PreferenceBatch, collate_pairs, encode_prompt,
                                             held_out_batches)
from jaxrl_llm.reward_model.eos import apply_no_eos_penalty, ends_with_eos, score_index
from jaxrl_llm.reward_model.loss import (bradley_terry_loss, mean_margin, pairwise_accuracy, pairwise_losses,
                                         preference_metrics)
from jaxrl_llm.reward_model.preferences import (ListPreferences, PreferenceData, PreferencePair, TaskPreferences,
                                                build_preference_data, jsonl_preferences, load_preference_jsonl,
                                                split_pairs)
from jaxrl_llm.reward_model.scorer import RewardModelScorer, SequenceRewards, build_sequence_rewards
from jaxrl_llm.reward_model.shaping import KLRewardShaper, build_kl_shaper

__all__ = [
    "KLRewardShaper", "ListPreferences", "PairEncoder", "PairStream", "PreferenceBatch", "PreferenceData",
    "PreferencePair", "RewardModelScorer", "SequenceRewards", "TaskPreferences",
    "apply_no_eos_penalty", "bradley_terry_loss", "build_kl_shaper", "build_preference_data",
    "build_sequence_rewards", "collate_pairs", "encode_prompt", "ends_with_eos", "held_out_batches",
    "jsonl_preferences", "load_preference_jsonl", "mean_margin", "pairwise_accuracy", "pairwise_losses",
    "preference_metrics",
    "score_index", "split_pairs",
]
