"""The per-token record that objective transforms read and extend.

A :class:`TokenRecord` holds, for one batch of B sequences of T tokens, every
per-token input an objective may need plus the pieces being built:

* ``weights_bt`` multiplicative per-token weights (importance corrections);
  1 on the mask, 0 elsewhere at the start;
* ``surrogate_bt`` the per-token loss contribution, 0 at the start; terms are
  *added* to it (policy term, KL, entropy, SFT, value loss);
* ``mask_bt`` the tokens still in the loss; filters (masked IS, staleness)
  remove tokens from it, which also removes them from the normaliser;
* ``metrics`` per-example metric partials (:mod:`~jaxrl_llm.objectives.stats`);
* ``loss_num_b`` / ``loss_den_b`` the per-example loss partials written by
  :func:`~jaxrl_llm.objectives.aggregation.aggregate`.

Static configuration (not traced): ``group_size`` (N, contiguous samples per
prompt) and ``aggregation`` (set once the chain has aggregated).

Built by :func:`make_record`, which checks shapes and applies two rules at the
boundary: every input except ``logp_bt``, ``values_bt`` and ``entropy_bt``
goes through ``stop_gradient`` (behaviour, proximal and reference
log-probabilities, advantages and returns are data in every paper), and every
masked-out entry is replaced by an exact 0 with ``jnp.where``, so NaN or inf in
padding can reach neither the loss nor its gradient.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, ArrayLike, Bool, Float, Int


@struct.dataclass
class TokenRecord:
  """Per-token state threaded through an objective chain (all arrays [B, T]).

  Attributes:
    logp_bt: float32 log pi_theta(token) under the parameters being trained
      (differentiable).
    behaviour_logp_bt: float32 log mu(token), recorded by the sampler.
    prox_logp_bt: float32 log pi_k(token), the learner's weights before this
      update (proximal policy); equals ``behaviour_logp_bt`` when not given.
    advantages_bt: float32 per-token advantages.
    mask_bt: bool, tokens in the loss (shrinks when filters drop tokens).
    response_mask_bt: bool, the mask as given (never changed).
    weights_bt: float32 multiplicative per-token weights.
    surrogate_bt: float32 per-token loss being built.
    lag_bt: optional int32 policy-version lag (current version - sampling version).
    ref_logp_bt: optional float32 log pi_ref(token) for KL terms.
    entropy_bt: optional float32 per-token entropy of pi_theta (differentiable).
    values_bt: optional float32 critic predictions (differentiable).
    old_values_bt: optional float32 critic predictions at sampling time.
    returns_bt: optional float32 value targets.
    sft_mask_bt: optional bool, tokens that get the SFT loss (within mask_bt).
    metrics: dict name -> metric partial.
    loss_num_b, loss_den_b: per-example loss partials, None until aggregated.
    group_size: static N (samples per prompt, contiguous rows) or None.
    aggregation: static aggregation mode once aggregated, else None.
    prox_given: static; False when ``prox_logp_bt`` defaulted to the behaviour
      log-probabilities (then pi_k = mu by construction).
  """

  logp_bt: Array
  behaviour_logp_bt: Array
  prox_logp_bt: Array
  advantages_bt: Array
  mask_bt: Array
  response_mask_bt: Array
  weights_bt: Array
  surrogate_bt: Array
  lag_bt: Optional[Array] = None
  ref_logp_bt: Optional[Array] = None
  entropy_bt: Optional[Array] = None
  values_bt: Optional[Array] = None
  old_values_bt: Optional[Array] = None
  returns_bt: Optional[Array] = None
  sft_mask_bt: Optional[Array] = None
  metrics: dict = struct.field(default_factory=dict)
  loss_num_b: Optional[Array] = None
  loss_den_b: Optional[Array] = None
  group_size: Optional[int] = struct.field(pytree_node=False, default=None)
  aggregation: Optional[str] = struct.field(pytree_node=False, default=None)
  prox_given: bool = struct.field(pytree_node=False, default=False)

  @property
  def shape(self) -> tuple[int, int]:
    return tuple(self.logp_bt.shape)  # type: ignore[return-value]


def make_record(
    logp_bt: Float[ArrayLike, "B T"],
    *,
    mask_bt: Bool[ArrayLike, "B T"],
    advantages_bt: Float[ArrayLike, "B T"],
    behaviour_logp_bt: Float[ArrayLike, "B T"],
    prox_logp_bt: Optional[Float[ArrayLike, "B T"]] = None,
    ref_logp_bt: Optional[Float[ArrayLike, "B T"]] = None,
    lag_bt: Optional[Int[ArrayLike, "B T"]] = None,
    entropy_bt: Optional[Float[ArrayLike, "B T"]] = None,
    values_bt: Optional[Float[ArrayLike, "B T"]] = None,
    old_values_bt: Optional[Float[ArrayLike, "B T"]] = None,
    returns_bt: Optional[Float[ArrayLike, "B T"]] = None,
    sft_mask_bt: Optional[Bool[ArrayLike, "B T"]] = None,
    group_size: Optional[int] = None,
    who: str = "make_record",
) -> TokenRecord:
  """Checks shapes, sanitises masked entries and builds a fresh :class:`TokenRecord`.

  Args:
    logp_bt: float [B, T] log pi_theta of the sampled tokens (differentiable).
    mask_bt: bool [B, T] tokens that take part (response tokens incl. EOS).
    advantages_bt: float [B, T].
    behaviour_logp_bt: float [B, T] log mu.
    prox_logp_bt: optional float [B, T] log pi_k; defaults to ``behaviour_logp_bt``.
    ref_logp_bt, lag_bt, entropy_bt, values_bt, old_values_bt, returns_bt,
      sft_mask_bt: optional [B, T] arrays, see :class:`TokenRecord`.
    group_size: optional N; B must be a multiple of it.
    who: name used in error messages.

  Returns:
    A :class:`TokenRecord` with weights 1 on the mask and surrogate 0.

  Raises:
    ValueError: ``logp_bt`` is not rank 2, another array's shape differs from
      ``logp_bt``'s (the message names both arrays and shapes), or
      ``group_size`` does not divide B.
  """
  shape = tuple(np.shape(logp_bt))
  if len(shape) != 2:
    raise ValueError(f"{who}: logp_bt must be [B, T] (rank 2); got shape {shape}")
  named = dict(mask_bt=mask_bt, advantages_bt=advantages_bt,
               behaviour_logp_bt=behaviour_logp_bt, prox_logp_bt=prox_logp_bt,
               ref_logp_bt=ref_logp_bt, lag_bt=lag_bt, entropy_bt=entropy_bt,
               values_bt=values_bt, old_values_bt=old_values_bt, returns_bt=returns_bt,
               sft_mask_bt=sft_mask_bt)
  for name, a in named.items():
    if a is not None and tuple(np.shape(a)) != shape:
      raise ValueError(f"{who}: {name} has shape {tuple(np.shape(a))} but logp_bt has shape "
                       f"{shape}; every per-token array must be [B, T] like logp_bt")
  if group_size is not None:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
      raise TypeError(f"{who}: group_size must be a Python int; got {group_size!r}")
    if group_size <= 0 or shape[0] % group_size:
      raise ValueError(f"{who}: group_size={group_size} must be positive and divide the "
                       f"batch size B={shape[0]} (the samples of a prompt are contiguous rows)")
    group_size = int(group_size)

  mask = jnp.asarray(mask_bt).astype(bool)

  def live(a):  # differentiable inputs
    return None if a is None else jnp.where(mask, jnp.asarray(a, jnp.float32), 0.0)

  def data(a):  # constants in every objective
    return None if a is None else jax.lax.stop_gradient(live(a))

  behaviour = data(behaviour_logp_bt)
  return TokenRecord(
      logp_bt=live(logp_bt),
      behaviour_logp_bt=behaviour,
      prox_logp_bt=behaviour if prox_logp_bt is None else data(prox_logp_bt),
      advantages_bt=data(advantages_bt),
      mask_bt=mask,
      response_mask_bt=mask,
      weights_bt=mask.astype(jnp.float32),
      surrogate_bt=jnp.zeros(shape, jnp.float32),
      lag_bt=None if lag_bt is None else jnp.where(mask, jnp.asarray(lag_bt).astype(jnp.int32), 0),
      ref_logp_bt=data(ref_logp_bt),
      entropy_bt=live(entropy_bt),
      values_bt=live(values_bt),
      old_values_bt=data(old_values_bt),
      returns_bt=data(returns_bt),
      sft_mask_bt=None if sft_mask_bt is None else mask & jnp.asarray(sft_mask_bt).astype(bool),
      metrics={},
      group_size=group_size,
      prox_given=prox_logp_bt is not None,
  )


# ----------------------------------------------------------------------------- helpers


def require(record: TokenRecord, field: str, who: str) -> Array:
  """Returns ``record.<field>`` or raises ValueError saying which input to pass."""
  value = getattr(record, field)
  if value is None:
    raise ValueError(f"{who} needs {field}; pass {field}=... to objective_loss / "
                     "per_example_partials")
  return value


def check_open(record: TokenRecord, who: str) -> None:
  """Raises if the chain has already aggregated (``who`` comes after ``aggregate``)."""
  if record.aggregation is not None:
    raise ValueError(f"{who} comes after aggregate({record.aggregation!r}) in the chain; "
                     "put aggregate(...) last")


def add_surrogate(record: TokenRecord, term_bt: Array, who: str) -> TokenRecord:
  """Adds a per-token loss term to ``surrogate_bt``."""
  check_open(record, who)
  return record.replace(surrogate_bt=record.surrogate_bt + term_bt)


def scale_weights(record: TokenRecord, factor_bt: Array, who: str) -> TokenRecord:
  """Multiplies ``weights_bt`` by a (stop-gradient) per-token factor on the mask."""
  check_open(record, who)
  factor = jax.lax.stop_gradient(factor_bt)
  return record.replace(weights_bt=jnp.where(record.mask_bt, record.weights_bt * factor, 0.0))


def drop_tokens(record: TokenRecord, keep_bt: Array, who: str) -> TokenRecord:
  """Removes the tokens where ``keep_bt`` is False from the loss and the normaliser."""
  check_open(record, who)
  mask = record.mask_bt & keep_bt
  return record.replace(mask_bt=mask, weights_bt=jnp.where(mask, record.weights_bt, 0.0))


def add_metrics(record: TokenRecord, prefix: str, stats: dict[str, Any]) -> TokenRecord:
  """Adds partials named ``prefix/<name>``; a repeated prefix gets ``#2``, ``#3``..."""
  taken = {name.split("/", 1)[0] for name in record.metrics}
  unique, i = prefix, 1
  while unique in taken:
    i += 1
    unique = f"{prefix}#{i}"
  metrics = dict(record.metrics)
  for name, stat in stats.items():
    metrics[f"{unique}/{name}"] = stat
  return record.replace(metrics=metrics)
