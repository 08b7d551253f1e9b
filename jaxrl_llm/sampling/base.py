"""The sampler interface shared by the built-in JAX sampler and the vLLM sampler.

A sampler turns token-id prompts into a ``Trajectory`` (plus text-friendly
lists) and accepts new weights in flight. Behaviour log-probabilities are those
of the distribution actually sampled from::

  mu(y | prefix) = softmax(z / tau)_y  renormalised over the kept set
                   (top-k: the k largest; top-p: the smallest prefix of the sorted
                   distribution with mass >= p; both applied after temperature)

With neither top-k nor top-p the kept set is the whole vocabulary, so mu is
the learner's ``softmax(logits / temperature)``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxrl_llm.types import Trajectory


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """How to sample.

  Attributes:
    max_new_tokens: response length limit N (the stop token counts).
    temperature: tau > 0; logits are divided by it before top-k / top-p.
    top_k: keep the k most likely tokens (0 = off). Ties at the k-th value are kept.
    top_p: nucleus mass in (0, 1] (1 = off).
    greedy: take the argmax instead of sampling; the recorded log-probability is
      then ``log softmax(z / tau)`` of the argmax, renormalised like above.
    stop_token_ids: tokens that end a response (included in it, with their
      log-probability). None means ``(model_config.eos_token_id,)``; ``()``
      disables stopping (every response has ``max_new_tokens`` tokens).
    num_samples: responses per prompt (contiguous rows sharing a group id).
    seed: base seed; call ``i`` of ``generate`` uses ``fold_in(PRNGKey(seed), i)``
      unless an explicit ``rng`` is passed.
    max_length: cap on prompt + response tokens; None means the model's
      ``max_position_embeddings``.
    truncate_prompts: drop the oldest prompt tokens of a prompt that would not
      fit (``len + max_new_tokens > max_length``) instead of raising ValueError.
    min_prompt_bucket: smallest padded prompt length (prompt lengths are rounded
      up to powers of two at least this big, so recompiles are rare).
    min_batch_bucket: smallest padded batch (rows are rounded up to powers of two).
  """

  max_new_tokens: int = 64
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  greedy: bool = False
  stop_token_ids: Optional[tuple[int, ...]] = None
  num_samples: int = 1
  seed: int = 0
  max_length: Optional[int] = None
  truncate_prompts: bool = False
  min_prompt_bucket: int = 16
  min_batch_bucket: int = 1

  def __post_init__(self):
    errors = []
    if int(self.max_new_tokens) < 1:
      errors.append(f"max_new_tokens={self.max_new_tokens!r}: expected >= 1")
    if not float(self.temperature) > 0:
      errors.append(f"temperature={self.temperature!r}: expected > 0 (use greedy=True for argmax)")
    if int(self.top_k) < 0:
      errors.append(f"top_k={self.top_k!r}: expected >= 0 (0 disables top-k)")
    if not 0 < float(self.top_p) <= 1:
      errors.append(f"top_p={self.top_p!r}: expected in (0, 1] (1 disables top-p)")
    if int(self.num_samples) < 1:
      errors.append(f"num_samples={self.num_samples!r}: expected >= 1")
    if self.max_length is not None and int(self.max_length) < 2:
      errors.append(f"max_length={self.max_length!r}: expected >= 2 or None")
    if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, tuple):
      errors.append(f"stop_token_ids={self.stop_token_ids!r}: expected a tuple of ints or None")
    for name in ("min_prompt_bucket", "min_batch_bucket"):
      if int(getattr(self, name)) < 1:
        errors.append(f"{name}={getattr(self, name)!r}: expected >= 1")
    if errors:
      raise ValueError("Invalid SamplerConfig: " + "; ".join(errors))

  def replace(self, **changes: Any) -> "SamplerConfig":
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass
class SampleResult:
  """Output of ``Sampler.generate``.

  Attributes:
    trajectory: the ``Trajectory`` (numpy arrays): tokens_bt = prompt (from
      index 0), then response, then pad; masks, behaviour log-probabilities
      aligned like ``sequence_logprobs``; rewards zeros.
    prompt_tokens: per row, the prompt actually used (after truncation).
    response_tokens: per row, the sampled tokens including the stop token.
    prompt_truncated_b: bool [B] the prompt lost its oldest tokens.
    policy_version: weights version that produced every token.
  """

  trajectory: Trajectory
  prompt_tokens: list[list[int]]
  response_tokens: list[list[int]]
  prompt_truncated_b: np.ndarray
  policy_version: int

  @property
  def response_logprobs(self) -> list[np.ndarray]:
    """Per row, the behaviour log-probabilities of ``response_tokens``."""
    traj = self.trajectory
    return [np.asarray(traj.behaviour_logp_bt[b])[np.asarray(traj.response_mask_bt[b])]
            for b in range(traj.batch_size)]


class Sampler(abc.ABC):
  """Generates trajectories from prompts with the current policy weights."""

  @abc.abstractmethod
  def generate(self, prompts: Sequence[Sequence[int]], *, rng: Any = None, **overrides: Any) -> SampleResult:
    """Samples ``num_samples`` responses for each prompt.

    Args:
      prompts: G token-id sequences (no padding).
      rng: optional ``jax.random`` key; default derives one from seed and call count.
      **overrides: per-call ``SamplerConfig`` field overrides.

    Returns:
      A ``SampleResult`` with B = G * num_samples rows, prompt ``g``'s samples
      in rows ``g * num_samples ... (g + 1) * num_samples - 1``.
    """

  @abc.abstractmethod
  def update_weights(self, params: Any, version: int) -> None:
    """Replaces the policy weights (same structure/shapes/dtypes) and their version."""

  @property
  @abc.abstractmethod
  def policy_version(self) -> int:
    """Version of the weights currently used."""
