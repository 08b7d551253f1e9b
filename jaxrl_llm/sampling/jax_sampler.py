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
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_llm import models, ops
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig
from jaxrl_llm.sampling.processing import select_tokens
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.layout import next_power_of_two



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

  def generate(self, prompts: Sequence[Sequence[int]], *, rng: Any = None, row_ids: Optional[Sequence[int]] = None,
               **overrides: Any) -> SampleResult:
    """See ``Sampler.generate``; ``overrides`` are ``SamplerConfig`` fields for this call.

    ``row_ids`` (one int per output row, default ``0..B-1``) name the rows in the
    per-row sampling keys ``fold_in(rng, row_id)``: a sampler pool that splits
    one step's prompts over several calls passes each slice's global row ids and
    samples what one call over the whole step would (bit for bit in
    batch-invariant mode).
    """
    config = self.config.replace(**overrides) if overrides else self.config
    call = next(self._calls)
    if rng is None:
      rng = jax.random.fold_in(jax.random.PRNGKey(config.seed), call)
    prompts, truncated = layout.prepare_prompts(prompts, config, self.model_config)
    n = config.num_samples
    rows = [p for p in prompts for _ in range(n)]
    num_rows = len(rows)
    batch = next_power_of_two(num_rows, config.min_batch_bucket)
    lengths = np.array([len(p) for p in rows] + [1] * (batch - num_rows), np.int32)
    prompt_len = layout.prompt_bucket(lengths, config)
    pad_id = self.model_config.pad_token_id
    tokens = np.full((batch, prompt_len), pad_id, np.int32)
    for r, p in enumerate(rows):
      tokens[r, :len(p)] = p
    active = np.arange(batch) < num_rows
    cache_length = -(-(prompt_len + config.max_new_tokens) // ops.KEY_BLOCK) * ops.KEY_BLOCK
    stops = layout.stop_token_ids(config, self.model_config)
    spec = _Spec(max_new_tokens=int(config.max_new_tokens), temperature=float(config.temperature),
                 top_k=int(config.top_k), top_p=float(config.top_p), greedy=bool(config.greedy),
                 stop_token_ids=tuple(int(s) for s in stops), cache_length=int(cache_length))
    if row_ids is None:
      row_ids = np.arange(num_rows)
    row_ids = np.asarray(row_ids, np.int64)
    if row_ids.shape != (num_rows,):
      raise ValueError(f"generate: row_ids has shape {row_ids.shape}, expected ({num_rows},) (one id per row)")
    row_ids = jnp.asarray(np.concatenate([row_ids, np.arange(batch - num_rows) + row_ids.max() + 1]), jnp.int32)
    out = _generate_program(self._params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(active),
                            rng, row_ids, model_config=self.model_config, spec=spec)
    tokens_bt, logp_bt, resp_len, finished = (np.asarray(a)[:num_rows] for a in jax.device_get(out))
    return layout.build_sample_result(tokens_bt, logp_bt, lengths[:num_rows], resp_len, finished,
                                      truncated_g=truncated, num_samples=n, version=self._version)


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

