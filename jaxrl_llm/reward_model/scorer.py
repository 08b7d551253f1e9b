"""A trained reward model as the RL reward: batched scoring on the learner mesh, then processing.

:class:`RewardModelScorer` loads a reward model's Hugging Face export (trunk +
reward head from the heads side file) into the learner mesh's sharding and
scores finished trajectories in fixed-size chunks of rows (a few compiled
shapes). When the reward model's tokenizer is the policy's (same fingerprint:
vocabulary, chat template, special ids) the sampled token rows are scored as
they are; otherwise each row is re-encoded from its prompt and response text
with the reward model's tokenizer (:mod:`.encoding`, the layout it was trained
on). Rows longer than the reward model's context keep their last tokens (the
score position).

:class:`SequenceRewards` turns the scores into the sequence rewards of a batch
of B = G x N samples, in this order::

  s_i = RM(x_i, y_i)                                  read at the EOS (eos.py)
  s_i = s_i - no_eos_penalty * 1[y_i has no EOS]      (truncated responses)
  s_i = s_i - RM(x_i, y_ref(x_i))                     baseline: "greedy" | "answer"
  s_i = running z-score of s_i                        normalize: "running"
  s_i = clip(s_i, -clip, clip)                        clip > 0
  r_i = rm_weight * s_i + rule_weight * rule(x_i, y_i)

The reference response ``y_ref`` is the current policy's greedy answer
(``baseline="greedy"``, the baseline of ReMax, arXiv:2310.10505) or the
task's gold response (``"answer"``). The running
z-score merges each batch into Welford/Chan moments first
(:func:`jaxrl_llm.advantages.running_reward_normalizer`); its state is a small
JSON dict the run checkpoints with its progress, so a resumed run normalises
as the uninterrupted one would.

References:
  Ouyang et al., InstructGPT, arXiv:2203.02155; Li et al., ReMax, arXiv:2310.10505.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxrl_llm import advantages as A, bridge, models
from jaxrl_llm.bridge.hf_import import HEADS_FILE
from jaxrl_llm.learner import builders, mesh as mesh_lib
from jaxrl_llm.reward_model import eos
from jaxrl_llm.reward_model.encoding import PairEncoder, bucket_width, pad_rows
from jaxrl_llm.tasks import Example, Task
from jaxrl_llm.types import Trajectory


class RewardModelScorer:
  """A reward model on the learner mesh that scores token rows.

  Args:
    folder: the reward model's HF export (``hf_export/`` of a reward-model run).
    mesh: the learner mesh (parameters are placed in its sharding).
    use_chat_template: encode prompts with the chat template (``task.use_chat_template``).
    policy_tokenizer: the policy's tokenizer; when its fingerprint equals the
      reward model's, sampled rows are scored without re-encoding.
    chunk_rows: rows per scoring call (a multiple of the mesh's batch shards).

  Raises:
    FileNotFoundError / ValueError: naming ``reward_model.path`` when the folder
      is missing or holds no reward head.
  """

  def __init__(self, folder: str, mesh: jax.sharding.Mesh, *, use_chat_template: bool = False,
               policy_tokenizer: Optional[bridge.Tokenizer] = None, chunk_rows: int = 256):
    if not os.path.isdir(folder):
      raise FileNotFoundError(f"reward_model.path={folder!r}: no such folder (train a reward model with "
                              "`jaxrl-train --config=configs/rm_addition.py` and point to its hf_export/)")
    if "reward_head" not in builders.stored_heads(folder):
      raise ValueError(f"reward_model.path={folder!r}: no reward head in {HEADS_FILE}; expected the hf_export/ "
                       "of a reward-model run (job='reward_model')")
    self.folder = folder
    self.mesh = mesh
    self.tokenizer = bridge.Tokenizer.from_folder(folder)
    self.config = bridge.config_from_hf(folder, reward_head=True, pad_token_id=self.tokenizer.pad_id)
    self.params = bridge.load_hf_params(folder, self.config, shardings=models.param_shardings(self.config, mesh),
                                        require_heads=True)
    self.encoder = PairEncoder(self.tokenizer, use_chat_template, self.config.max_position_embeddings)
    self.same_tokenizer = (policy_tokenizer is not None
                           and policy_tokenizer.fingerprint() == self.tokenizer.fingerprint())
    shards = mesh_lib.batch_divisor(mesh)
    self.chunk_rows = max(shards, -(-int(chunk_rows) // shards) * shards)
    self._sharding = mesh_lib.batch_sharding(mesh, 2)
    self._score = jax.jit(lambda p, t, m: models.reward_scores(p, self.config, t, m))

  def score_tokens(self, tokens_bt: np.ndarray, mask_bt: np.ndarray) -> np.ndarray:
    """Scores rows (right- or left-padded) at their last real token.

    Args:
      tokens_bt: int [B, T] token ids of the reward model's vocabulary.
      mask_bt: bool [B, T] real tokens; T <= the reward model's context.

    Returns:
      float32 [B] scores (numpy).
    """
    tokens = np.asarray(tokens_bt, np.int32)
    mask = np.asarray(mask_bt, bool)
    if tokens.shape != mask.shape or tokens.ndim != 2:
      raise ValueError(f"score_tokens: tokens_bt {tokens.shape} and mask_bt {mask.shape} must be one [B, T] shape")
    if tokens.shape[1] > self.config.max_position_embeddings:
      raise ValueError(f"score_tokens: rows of {tokens.shape[1]} tokens exceed the reward model's context "
                       f"({self.config.max_position_embeddings})")
    out = []
    for start in range(0, tokens.shape[0], self.chunk_rows):
      t, m = tokens[start:start + self.chunk_rows], mask[start:start + self.chunk_rows]
      n = t.shape[0]
      if n < self.chunk_rows:  # padding rows: one pad token each, dropped below
        t = np.concatenate([t, np.full((self.chunk_rows - n, t.shape[1]), self.config.pad_token_id, np.int32)])
        m = np.concatenate([m, np.zeros((self.chunk_rows - n, m.shape[1]), bool)])
        m[n:, 0] = True
      scores = self._score(self.params, jax.device_put(t, self._sharding), jax.device_put(m, self._sharding))
      out.append(np.asarray(scores, np.float32)[:n])
    return np.concatenate(out) if out else np.zeros((0,), np.float32)

  def encode_rows(self, prompts: Sequence[Any], responses: Sequence[str], finished_b: Sequence[bool]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``prompt | response | EOS (finished rows only)`` in the reward model's tokens, right-padded.

    A row longer than the reward model's context keeps its last tokens.

    Returns:
      ``(tokens_bt int32, mask_bt bool)``.
    """
    limit = self.encoder.max_length
    rows = [self.encoder.sequence(p, r, eos=bool(f))[-limit:] for p, r, f in zip(prompts, responses, finished_b)]
    width = bucket_width(max(len(r) for r in rows), 16, limit)
    return pad_rows(rows, self.tokenizer.pad_id, len(rows), width)

  def score_texts(self, prompts: Sequence[Any], responses: Sequence[str], finished_b: Sequence[bool]
                  ) -> np.ndarray:
    """Scores of prompt / response texts (EOS appended where ``finished_b``); float32 [B]."""
    return self.score_tokens(*self.encode_rows(prompts, responses, finished_b))

  def score_trajectory(self, trajectory: Trajectory, prompts: Sequence[Any], responses: Sequence[str]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """Scores sampled rows: the tokens as they are (same tokenizer, rows that fit) or re-encoded texts.

    Args:
      trajectory: the B sampled rows (prompt | response | pad).
      prompts: per row, the prompt (text) it answers.
      responses: per row, the decoded response text (without the stop token).

    Returns:
      ``(scores_b float32, has_eos_b bool)``: ``has_eos_b`` is the sampler's
      ``finished_b`` (False: cut at the length limit, scored at its last token).
    """
    finished = np.asarray(trajectory.finished_b, bool)
    tokens = np.asarray(trajectory.tokens_bt)
    if self.same_tokenizer and tokens.shape[1] <= self.config.max_position_embeddings:
      mask = np.asarray(trajectory.sequence_mask_bt, bool)
      return self.score_tokens(tokens, mask), finished
    return self.score_texts(prompts, responses, finished), finished


def group_pair_agreement(scores_b: np.ndarray, rule_b: np.ndarray, group_size: int) -> Optional[float]:
  """Share of same-prompt sample pairs with different rule rewards that the scores order the same way.

  The reward model's pairwise accuracy on the policy's own samples, judged by the
  task's verifier (ties in score count 1/2). None when no pair differs in rule reward.

  Args:
    scores_b: float [B] reward-model scores, groups of ``group_size`` contiguous rows.
    rule_b: float [B] rule rewards.
    group_size: N samples per prompt.
  """
  s = np.asarray(scores_b, np.float64).reshape(-1, group_size)
  r = np.asarray(rule_b, np.float64).reshape(-1, group_size)
  ds = s[:, :, None] - s[:, None, :]
  dr = r[:, :, None] - r[:, None, :]
  judged = dr > 0
  if not judged.any():
    return None
  return float(np.where(ds > 0, 1.0, np.where(ds == 0, 0.5, 0.0))[judged].mean())


class SequenceRewards:
  """Sequence rewards from a reward model (and the task's rule reward); see the module docstring.

  Args:
    rm_config: the ``reward_model`` ConfigDict (weights, normalize, clip,
      baseline, no_eos_penalty).
    scorer: the :class:`RewardModelScorer`.
    task: the run's task (gold responses for ``baseline="answer"``).
    greedy_responses: for ``baseline="greedy"``: ``examples -> (Trajectory,
      response texts)`` of the current policy's greedy answers, one per example.
  """

  def __init__(self, rm_config: ml_collections.ConfigDict, scorer: RewardModelScorer, task: Task,
               greedy_responses: Optional[Callable[[Sequence[Example]], tuple[Trajectory, list[str]]]] = None):
    self.rm_weight = float(rm_config.rm_weight)
    self.rule_weight = float(rm_config.rule_weight)
    self.normalize = rm_config.normalize
    self.clip = float(rm_config.clip)
    self.baseline = rm_config.baseline
    self.no_eos_penalty = float(rm_config.no_eos_penalty)
    if self.baseline == "greedy" and greedy_responses is None:
      raise ValueError("reward_model.baseline='greedy' needs the policy's greedy responses (greedy_responses)")
    self.scorer = scorer
    self.task = task
    self.greedy_responses = greedy_responses
    self.normalizer = A.running_reward_normalizer()
    self.moments = self.normalizer.init()
    self._normalize = jax.jit(self.normalizer.update)

  # ---------------------------------------------------------------- state

  def get_state(self) -> dict:
    """The running moments as JSON-safe numbers (exact float32 round trip)."""
    m = self.moments
    return {"count": int(m.count), "mean": float(m.mean), "m2": float(m.m2)}

  def set_state(self, state: Optional[dict]) -> None:
    if state:
      self.moments = A.RunningMoments(jnp.asarray(state["count"], jnp.int32), jnp.asarray(state["mean"], jnp.float32),
                                      jnp.asarray(state["m2"], jnp.float32))

  # ---------------------------------------------------------------- scoring

  def reference_scores(self, examples: Sequence[Example]) -> np.ndarray:
    """float32 [G]: the reward model's score of each prompt's reference response."""
    if self.baseline == "answer":
      return self.scorer.score_texts([e.prompt for e in examples], [self.task.sft_target(e) for e in examples],
                                     [True] * len(examples))
    trajectory, texts = self.greedy_responses(examples)
    scores, has_eos = self.scorer.score_trajectory(trajectory, [e.prompt for e in examples], texts)
    return np.asarray(eos.apply_no_eos_penalty(scores, has_eos, self.no_eos_penalty))

  def __call__(self, examples: Sequence[Example], pairs: Sequence[tuple[Example, str]], trajectory: Trajectory,
               rule_b: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Rewards of the B = G x N sampled rows.

    Args:
      examples: the G prompts' examples.
      pairs: per row, ``(example, response text)`` (rows of a prompt contiguous).
      trajectory: the B sampled rows.
      rule_b: float [B] the task's rule reward of each row.

    Returns:
      ``(rewards_b float32, metrics)``.
    """
    rule = np.asarray(rule_b, np.float32)
    raw, has_eos = self.scorer.score_trajectory(trajectory, [e.prompt for e, _ in pairs], [r for _, r in pairs])
    scores = eos.apply_no_eos_penalty(raw, has_eos, self.no_eos_penalty)
    metrics = {"reward/rm_raw_mean": float(raw.mean()), "reward/rm_raw_std": float(raw.std()),
               "reward/rule_mean": float(rule.mean()), "reward/no_eos_share": float(1.0 - has_eos.mean())}
    if raw.std() > 0 and rule.std() > 0:
      metrics["reward/rm_rule_corr"] = float(np.corrcoef(raw, rule)[0, 1])
    agreement = group_pair_agreement(raw, rule, len(pairs) // max(1, len(examples)))
    if agreement is not None:
      metrics["reward/rm_rule_pair_agreement"] = agreement
    if self.baseline != "none":
      ref = self.reference_scores(examples)
      metrics["reward/rm_baseline_mean"] = float(ref.mean())
      scores = A.reference_baseline(scores, ref)
    if self.normalize == "running":
      scores, self.moments = self._normalize(self.moments, scores)
      metrics["reward/rm_running_mean"] = float(self.moments.mean)
      metrics["reward/rm_running_std"] = float(np.sqrt(A.running_variance(self.moments)))
    if self.clip:
      scores = A.clip_rewards(scores, self.clip)
    scores = np.asarray(scores, np.float32)
    metrics["reward/rm_mean"] = float(scores.mean())
    rewards = (self.rm_weight * scores + self.rule_weight * rule).astype(np.float32)
    return rewards, metrics


def build_sequence_rewards(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
                           policy_tokenizer: bridge.Tokenizer, task: Task,
                           greedy_responses: Optional[Callable[[Sequence[Example]], tuple[Trajectory, list[str]]]]
                           = None) -> Optional[SequenceRewards]:
  """The RL run's reward-model rewards from ``config.reward_model``; None when ``path`` is empty."""
  rc = config.reward_model
  if not rc.path:
    return None
  scorer = RewardModelScorer(rc.path, mesh, use_chat_template=config.task.use_chat_template,
                             policy_tokenizer=policy_tokenizer)
  return SequenceRewards(rc, scorer, task, greedy_responses)
