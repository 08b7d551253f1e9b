"""The built-in JAX sampler: jitted prefill + KV-cache decode loop, no Python per token.

Layout. Prompts are right-padded into ``[B, Lp]`` (prompt token i at index i,
position i). The KV cache stores token t of row b at index t (the learner's
layout), so row b's response starts at index ``len_b`` and the trajectory is
simply the token buffer: prompt, response, pad. Decode step s feeds the token
at index ``len_b + s`` of every row at once (rows at different positions).

Static shapes. The batch is rounded up to a power of two (dummy rows are
marked finished from the start) and the prompt length to a power of two of at
least ``min_prompt_bucket``; the cache length is ``Lp + max_new_tokens``
rounded up to the attention key block. One compilation serves every call with
the same buckets and the same ``SamplerConfig`` sampling fields; parameters are
jit arguments, so ``update_weights`` never recompiles.

Loop. ``lax.while_loop`` over steps, exiting early when every row has
finished; each step selects tokens (``processing.select_tokens``), records
their behaviour log-probabilities, and runs one ``models.decode_step``.

Randomness. Row ``r`` (global sample index) at step ``s`` draws one uniform
from ``fold_in(fold_in(call_key, r), s)``, so a row's sample does not depend on
the batch bucket or on the other rows.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm import models, ops
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig
from jaxrl_llm.sampling.processing import select_tokens
from jaxrl_llm.types import Trajectory


def next_power_of_two(n: int, minimum: int = 1) -> int:
  """Smallest power of two >= max(n, minimum)."""
  n = max(int(n), int(minimum), 1)
  return 1 << (n - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class _Spec:
  """Everything static about one compiled generate program."""

  max_new_tokens: int
  temperature: float
  top_k: int
  top_p: float
  greedy: bool
  stop_token_ids: tuple[int, ...]
  cache_length: int


class JaxSampler(Sampler):
  """Samples with the built-in decoder (``jaxrl_llm.models``) and a KV cache.

  Example::

    sampler = JaxSampler(model_config, params, SamplerConfig(max_new_tokens=32, temperature=0.7))
    result = sampler.generate([[5, 6, 7], [8]], num_samples=4)
    result.trajectory.tokens_bt, result.response_tokens
    sampler.update_weights(new_params, version=1)   # no recompilation
  """

  def __init__(self, model_config: ModelConfig, params: Any, config: SamplerConfig = SamplerConfig(),
               version: int = 0):
    """Creates the sampler.

    Args:
      model_config: the decoder config (``batch_invariant`` selects the kernels).
      params: parameter pytree of ``models.init_params`` / the bridge.
      config: sampling settings.
      version: version of ``params``.
    """
    self.model_config = model_config
    self.config = config
    self._params = params
    self._version = int(version)
    self._calls = itertools.count()

  @property
  def policy_version(self) -> int:
    return self._version

  @property
  def params(self) -> Any:
    return self._params

  def update_weights(self, params: Any, version: int) -> None:
    """Swaps in new weights without recompiling.

    Args:
      params: pytree with the same structure, shapes and dtypes as the current one.
      version: their policy version (recorded in ``policy_version_bt``).

    Raises:
      ValueError: naming the first parameter whose structure, shape or dtype differs.
    """
    old_flat, old_tree = jax.tree_util.tree_flatten_with_path(self._params)
    new_flat, new_tree = jax.tree_util.tree_flatten_with_path(params)
    if old_tree != new_tree:
      raise ValueError(f"update_weights: parameter tree structure differs from the current one: "
                       f"{new_tree} vs {old_tree}")
    for (path, old), (_, new) in zip(old_flat, new_flat):
      if tuple(old.shape) != tuple(new.shape) or jnp.dtype(old.dtype) != jnp.dtype(new.dtype):
        raise ValueError(f"update_weights: params{jax.tree_util.keystr(path)} has shape {tuple(new.shape)} "
                         f"dtype {new.dtype}, expected {tuple(old.shape)} {old.dtype}")
    self._params = params
    self._version = int(version)

  # ----------------------------------------------------------------- host side

  def _max_length(self, config: SamplerConfig) -> int:
    limit = self.model_config.max_position_embeddings
    return limit if config.max_length is None else min(int(config.max_length), limit)

  def _prepare_prompts(self, prompts: Sequence[Sequence[int]], config: SamplerConfig
                       ) -> tuple[list[list[int]], list[bool]]:
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
      raise ValueError(f"generate: prompts must be a non-empty sequence of token-id sequences, got {type(prompts)}")
    vocab = self.model_config.vocab_size
    max_len = self._max_length(config)
    budget = max_len - config.max_new_tokens
    if budget < 1:
      raise ValueError(f"generate: max_new_tokens={config.max_new_tokens} leaves no room for a prompt within "
                       f"max length {max_len}")
    out, truncated = [], []
    for i, prompt in enumerate(prompts):
      ids = [int(t) for t in np.asarray(prompt, dtype=np.int64).reshape(-1)]
      if not ids:
        raise ValueError(f"generate: prompt {i} is empty (at least one token is needed)")
      bad = [t for t in ids if not 0 <= t < vocab]
      if bad:
        raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab}): {bad[:5]}")
      if len(ids) > budget:
        if not config.truncate_prompts:
          raise ValueError(
              f"generate: prompt {i} has {len(ids)} tokens; with max_new_tokens={config.max_new_tokens} it needs "
              f"{len(ids) + config.max_new_tokens} > max length {max_len} (max_position_embeddings="
              f"{self.model_config.max_position_embeddings}, max_length={config.max_length}). Shorten it or set "
              f"truncate_prompts=True to keep its last {budget} tokens.")
        ids = ids[len(ids) - budget:]
        truncated.append(True)
      else:
        truncated.append(False)
      out.append(ids)
    return out, truncated

  def generate(self, prompts: Sequence[Sequence[int]], *, rng: Any = None, **overrides: Any) -> SampleResult:
    """See ``Sampler.generate``; ``overrides`` are ``SamplerConfig`` fields for this call."""
    config = self.config.replace(**overrides) if overrides else self.config
    call = next(self._calls)
    if rng is None:
      rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), call)
    prompts, truncated = self._prepare_prompts(prompts, config)
    n = config.num_samples
    rows = [p for p in prompts for _ in range(n)]
    num_rows = len(rows)
    batch = next_power_of_two(num_rows, config.min_batch_bucket)
    lengths = np.array([len(p) for p in rows] + [1] * (batch - num_rows), np.int32)
    prompt_len = next_power_of_two(int(lengths.max()), config.min_prompt_bucket)
    pad_id = self.model_config.pad_token_id
    tokens = np.full((batch, prompt_len), pad_id, np.int32)
    for r, p in enumerate(rows):
      tokens[r, :len(p)] = p
    active = np.arange(batch) < num_rows
    cache_length = -(-(prompt_len + config.max_new_tokens) // ops.KEY_BLOCK) * ops.KEY_BLOCK
    stops = config.stop_token_ids
    if stops is None:
      stops = (self.model_config.eos_token_id,)
    if pad_id in stops:
      raise ValueError(f"generate: stop_token_ids {stops} contain the pad id {pad_id}; pad and stop must differ")
    spec = _Spec(max_new_tokens=int(config.max_new_tokens), temperature=float(config.temperature),
                 top_k=int(config.top_k), top_p=float(config.top_p), greedy=bool(config.greedy),
                 stop_token_ids=tuple(int(s) for s in stops), cache_length=int(cache_length))
    row_ids = jnp.arange(batch, dtype=jnp.int32)
    out = _generate_program(self._params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(active),
                            rng, row_ids, model_config=self.model_config, spec=spec)
    tokens_bt, logp_bt, resp_len, finished = (np.asarray(a)[:num_rows] for a in jax.device_get(out))
    lengths = lengths[:num_rows]
    index = np.arange(tokens_bt.shape[1])[None]
    prompt_mask = index < lengths[:, None]
    response_mask = (index >= lengths[:, None]) & (index < (lengths + resp_len)[:, None])
    version = self._version
    trajectory = Trajectory(
        tokens_bt=tokens_bt.astype(np.int32),
        prompt_mask_bt=prompt_mask,
        response_mask_bt=response_mask,
        behaviour_logp_bt=np.where(response_mask, logp_bt, 0.0).astype(np.float32),
        policy_version_bt=np.where(response_mask, version, -1).astype(np.int32),
        group_id_b=np.repeat(np.arange(len(prompts), dtype=np.int32), n),
        rewards_b=np.zeros((num_rows,), np.float32),
        finished_b=finished.astype(bool),
    )
    response_tokens = [tokens_bt[r, lengths[r]:lengths[r] + resp_len[r]].tolist() for r in range(num_rows)]
    return SampleResult(trajectory=trajectory, prompt_tokens=[list(p) for p in rows],
                        response_tokens=response_tokens,
                        prompt_truncated_b=np.repeat(np.asarray(truncated, bool), n), policy_version=version)


_TRACES = collections.Counter()


def generate_trace_count() -> int:
  """How many times the generate program has been traced (= compiled) in this process."""
  return sum(_TRACES.values())


@functools.partial(jax.jit, static_argnames=("model_config", "spec"))
def _generate_program(params, prompt_bl, lengths_b, active_b, rng, row_ids_b, *, model_config: ModelConfig,
                      spec: _Spec):
  """The whole generation as one program; returns (tokens_bt, logp_bt, response_len_b, finished_b).

  Parameters are arguments (not constants), so new weights of the same shapes
  reuse the compiled program.
  """
  _TRACES[(model_config, spec, prompt_bl.shape)] += 1
  mc = model_config
  batch, prompt_len = prompt_bl.shape
  steps = spec.max_new_tokens
  rows = jnp.arange(batch)
  row_keys = jax.vmap(lambda r: jax.random.fold_in(rng, r))(row_ids_b)
  stop_ids = jnp.asarray(spec.stop_token_ids, jnp.int32)

  logits, cache = models.prefill(params, mc, prompt_bl, lengths_b, spec.cache_length)
  tokens_bt = jnp.full((batch, prompt_len + steps), mc.pad_token_id, jnp.int32).at[:, :prompt_len].set(prompt_bl)
  logp_bt = jnp.zeros((batch, prompt_len + steps), jnp.float32)
  finished = ~active_b
  resp_len = jnp.zeros((batch,), jnp.int32)

  def cond(state):
    step, _, _, _, _, finished, _ = state
    return (step < steps) & ~jnp.all(finished)

  def body(state):
    step, logits, cache, tokens_bt, logp_bt, finished, resp_len = state
    uniform = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step)))(row_keys)
    token, logp = select_tokens(logits, uniform, temperature=spec.temperature, top_k=spec.top_k,
                                top_p=spec.top_p, greedy=spec.greedy, invariant=mc.batch_invariant)
    alive = ~finished
    token = jnp.where(alive, token, mc.pad_token_id)
    index = lengths_b + step
    tokens_bt = tokens_bt.at[rows, index].set(token)
    logp_bt = logp_bt.at[rows, index].set(jnp.where(alive, logp, 0.0))
    resp_len = resp_len + alive.astype(jnp.int32)
    finished = finished | (alive & jnp.isin(token, stop_ids))
    more = (step + 1 < steps) & ~jnp.all(finished)
    logits, cache = lax.cond(more, lambda: models.decode_step(params, mc, cache, token, index),
                             lambda: (logits, cache))
    return step + 1, logits, cache, tokens_bt, logp_bt, finished, resp_len

  state = (jnp.int32(0), logits, cache, tokens_bt, logp_bt, finished, resp_len)
  _, _, _, tokens_bt, logp_bt, finished, resp_len = lax.while_loop(cond, body, state)
  return tokens_bt, logp_bt, resp_len, finished & active_b


__all__ = ["JaxSampler", "generate_trace_count", "next_power_of_two"]

