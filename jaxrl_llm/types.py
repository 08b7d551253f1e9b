"""The trajectory container shared by samplers, rollout and the learner.

Shapes follow the legend in :mod:`jaxrl_llm` (B sequences, T tokens).
A ``Trajectory`` is what a sampler emits for one batch of prompts; the learner
turns it into its own batch (``jaxrl_llm.learner.rl_step.RLBatch``) by adding
advantages and, optionally, reference log-probabilities and critic targets. It
is a flax ``struct.dataclass`` pytree, so it passes through ``jit`` and can be
sharded over the data axis.
"""

from __future__ import annotations

import jax
import numpy as np
from flax import struct

Array = jax.Array | np.ndarray


@struct.dataclass
class Trajectory:
  """Sampled sequences with everything the learner needs to correct for off-policyness.

  Attributes:
    tokens_bt: int32 [B, T] prompt followed by response, right-padded with pad id.
    prompt_mask_bt: bool [B, T] True on prompt tokens.
    response_mask_bt: bool [B, T] True on sampled response tokens, including the
      stop (EOS) token when one was sampled. Padding is False. This is the loss
      mask: only these tokens are trained on.
    observation_mask_bt: bool [B, T] True on tokens an environment or tool wrote
      between the model's turns (multi-turn episodes, :mod:`jaxrl_llm.envs`).
      They are context (attended to, like the prompt) but carry no behaviour
      log-probability, no policy version and no loss. All False for
      single-turn rows. A multi-turn row reads: prompt, model turn,
      observation, model turn, ..., pad; response and observation tokens form
      one contiguous run right after the prompt.
    behaviour_logp_bt: float32 [B, T] log mu(token_t | prefix) of the sampled token
      under the sampler's processed distribution (temperature, top-k/top-p),
      recorded at sampling time; 0 outside the response.
    policy_version_bt: int32 [B, T] version of the weights that sampled each token
      (-1 outside the response). In-flight updates may change it mid-sequence.
    group_id_b: int32 [B] prompt index; the N samples of a prompt are contiguous.
    rewards_b: float32 [B] scalar reward of each sequence (verifier or reward model).
    finished_b: bool [B] True when the response ended with a stop token, False
      when it hit the length limit.
  """

  tokens_bt: Array
  prompt_mask_bt: Array
  response_mask_bt: Array
  observation_mask_bt: Array
  behaviour_logp_bt: Array
  policy_version_bt: Array
  group_id_b: Array
  rewards_b: Array
  finished_b: Array

  @property
  def batch_size(self) -> int:
    return int(self.tokens_bt.shape[0])

  @property
  def sequence_mask_bt(self) -> Array:
    """bool [B, T]: every real token (prompt, response, observation), i.e. what the model attends to."""
    xp = np if isinstance(self.prompt_mask_bt, np.ndarray) else jax.numpy
    return xp.asarray(self.prompt_mask_bt) | xp.asarray(self.response_mask_bt) | xp.asarray(self.observation_mask_bt)

  def trimmed(self, multiple: int = 8) -> "Trajectory":
    """Drops trailing columns that are padding in every row (host-side, numpy).

    Samplers lay rows out as ``[prompt bucket | max_new_tokens]``; when prompts
    are short or responses stop early most trailing columns hold no real token,
    and the learner would spend its forward and backward passes on them (the
    default addition job: 24 columns, at most 15 used). The width kept is the
    last used column rounded up by :func:`width_bucket` (to a multiple of
    ``multiple`` up to ``4 * multiple``, then to ``2^k`` or ``1.5 * 2^k``), so the
    learner compiles for a handful of widths only, about two per doubling of
    the length (multi-turn episodes spread over many widths). Causal attention
    makes the result the same maths for every real token.

    Args:
      multiple: the rounding of short widths (>= 1).

    Returns:
      A Trajectory whose [B, T] fields have ``T' <= T`` columns.
    """
    if multiple < 1:
      raise ValueError(f"Trajectory.trimmed: multiple={multiple!r}: expected >= 1")
    used = np.asarray(self.sequence_mask_bt)
    columns = np.flatnonzero(used.any(axis=0))
    last = int(columns[-1]) + 1 if columns.size else 1
    width = min(int(used.shape[1]), width_bucket(last, multiple))
    if width == used.shape[1]:
      return self
    cut = lambda a: np.asarray(a)[:, :width]
    return self.replace(tokens_bt=cut(self.tokens_bt), prompt_mask_bt=cut(self.prompt_mask_bt),
                        response_mask_bt=cut(self.response_mask_bt),
                        observation_mask_bt=cut(self.observation_mask_bt),
                        behaviour_logp_bt=cut(self.behaviour_logp_bt),
                        policy_version_bt=cut(self.policy_version_bt))


  def take(self, rows) -> "Trajectory":
    """The trajectory of the given rows (host-side, numpy), in that order."""
    rows = np.asarray(rows, np.int64)
    return jax.tree.map(lambda a: np.asarray(a)[rows], self)


def width_bucket(n: int, multiple: int = 8) -> int:
  """Smallest width >= ``n`` among ``multiple, 2 multiple, ..., 4 multiple`` and then ``2^k`` and
  ``1.5 * 2^k`` above it (for 8: 8, 16, 24, 32, 48, 64, 96, 128, 192, ...): at most a third of a
  long batch is padding, and the widths, one compilation each, grow geometrically."""
  n, multiple = max(int(n), 1), int(multiple)
  if n <= 4 * multiple:
    return -(-n // multiple) * multiple
  width = 4 * multiple
  while True:
    for candidate in (width, width * 3 // 2):
      if candidate >= n:
        return candidate
    width *= 2


_BT_FILL = {"tokens_bt": None, "prompt_mask_bt": False, "response_mask_bt": False, "observation_mask_bt": False,
            "behaviour_logp_bt": 0.0, "policy_version_bt": -1}


def concat_trajectories(trajectories, pad_id: int) -> Trajectory:
  """Stacks trajectories' rows (in the given order), right-padding T to the widest.

  Group ids are renumbered so that groups of different parts stay distinct
  and increase in row order.

  Args:
    trajectories: a non-empty sequence of (numpy) Trajectories.
    pad_id: token id of the padding columns.

  Returns:
    One Trajectory with B = the sum of the parts' rows and T = the widest part's T.
  """
  if not trajectories:
    raise ValueError("concat_trajectories: no trajectories")
  width = max(np.asarray(t.tokens_bt).shape[1] for t in trajectories)

  def stack(name):
    fill = pad_id if _BT_FILL[name] is None else _BT_FILL[name]
    parts = [np.asarray(getattr(t, name)) for t in trajectories]
    return np.concatenate([np.pad(a, [(0, 0), (0, width - a.shape[1])], constant_values=fill) for a in parts], 0)

  groups, offset = [], 0
  for t in trajectories:
    g = np.asarray(t.group_id_b)
    groups.append(g - g.min() + offset if g.size else g)
    offset = (groups[-1].max() + 1) if g.size else offset
  return Trajectory(
      tokens_bt=stack("tokens_bt").astype(np.int32), prompt_mask_bt=stack("prompt_mask_bt"),
      response_mask_bt=stack("response_mask_bt"), observation_mask_bt=stack("observation_mask_bt"),
      behaviour_logp_bt=stack("behaviour_logp_bt").astype(np.float32),
      policy_version_bt=stack("policy_version_bt").astype(np.int32),
      group_id_b=np.concatenate(groups).astype(np.int32),
      rewards_b=np.concatenate([np.asarray(t.rewards_b) for t in trajectories]).astype(np.float32),
      finished_b=np.concatenate([np.asarray(t.finished_b) for t in trajectories]).astype(bool))


__all__ = ["Array", "Trajectory", "concat_trajectories", "width_bucket"]
