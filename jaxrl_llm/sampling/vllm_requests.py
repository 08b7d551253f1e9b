"""vLLM requests and outputs: ``SamplerConfig`` -> ``SamplingParams``, ``RequestOutput`` -> ``SampleResult``.

Pure functions (no vLLM import), so every mapping is tested on a CPU with
stand-in outputs; :class:`jaxrl_llm.sampling.vllm_sampler.VllmSampler` only
sends what :func:`build_requests` builds and converts what comes back with
:func:`outputs_to_result`.

SamplerConfig -> vLLM (:func:`sampling_params_kwargs`)::

  temperature, top_p      same
  top_k                   0 (off) -> -1 (vLLM's "all tokens")
  max_new_tokens          max_tokens
  stop_token_ids          stop_token_ids = the resolved stop set (None -> (eos,),
                          () -> []), always with ignore_eos=True so vLLM adds no
                          stop ids of its own (tokenizer / generation_config EOS)
  num_samples             n (one request per prompt; vLLM gives child j the seed
                          ``seed + j``, so row r draws with seed ``base + r``;
                          explicit ``row_ids``: ``base + row_ids[r]``, one
                          n=1 request per row when a prompt's ids are not
                          consecutive)
  greedy                  temperature=0, one n=1 request per row
  seed                    ``base = blake2b(seed, call)`` or of the explicit rng key
  (always)                logprobs=0: only the sampled token's log-probability,
                          detokenize=False

Log-probabilities. The engine runs with ``logprobs_mode="processed_logprobs"``:
vLLM returns ``log_softmax`` of the logits after temperature, top-k and top-p,
i.e. ``log mu(y | prefix)`` of :mod:`jaxrl_llm.sampling.base`. Greedy requests
skip temperature and truncation in vLLM, so their log-probability is that of
``softmax(z)``: exact when temperature is 1 with neither top-k nor top-p,
otherwise recorded as NaN (greedy output is for evaluation; a NaN cannot be
trained on by mistake).

References:
  vLLM, https://github.com/vllm-project/vllm (``SamplingParams``,
  ``RequestOutput``, ``logprobs_mode``, v0.10 release notes).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, Optional, Sequence

import numpy as np

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SampleResult, SamplerConfig

VLLM_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature means greedy


def call_base_seed(seed: int, call: int, rng: Any = None) -> int:
  """The base seed of one ``generate`` call (row r samples with ``base + r``).

  Args:
    seed: ``SamplerConfig.seed``.
    call: index of the call on this sampler.
    rng: optional ``jax.random`` key (raw uint32 data or a typed key); when
      given it alone determines the seeds, as in the JAX sampler.

  Returns:
    An int in ``[0, 2**56)``.
  """
  if rng is None:
    material = f"jaxrl_llm.vllm_sampler:{int(seed)}:{int(call)}".encode()
  else:
    import jax  # pylint: disable=import-outside-toplevel
    dtype = getattr(rng, "dtype", None)
    typed = dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
    data = jax.random.key_data(rng) if typed else rng
    material = b"jaxrl_llm.vllm_sampler:rng:" + np.asarray(data).astype(np.uint32).tobytes()
  return int.from_bytes(hashlib.blake2b(material, digest_size=7).digest(), "little")


def sampling_params_kwargs(config: SamplerConfig, stops: Sequence[int], *, seed: Optional[int],
                           n: Optional[int] = None) -> dict[str, Any]:
  """Keyword arguments of ``vllm.SamplingParams`` for one request (see the module docstring).

  Args:
    config: the sampling settings.
    stops: the resolved stop set (:func:`layout.stop_token_ids`).
    seed: the request's seed (vLLM gives its j-th sample ``seed + j``); ignored when greedy.
    n: samples of this request (default ``config.num_samples``; greedy: 1).

  Returns:
    A dict for ``vllm.SamplingParams(**kwargs)``.

  Raises:
    ValueError: for a sampling temperature vLLM would treat as greedy (< 1e-5).
  """
  common = dict(max_tokens=int(config.max_new_tokens), min_tokens=0, stop_token_ids=[int(s) for s in stops],
                ignore_eos=True, logprobs=0, detokenize=False)
  if config.greedy:
    return dict(common, n=1, temperature=0.0, top_k=-1, top_p=1.0, seed=None)
  if float(config.temperature) < VLLM_GREEDY_BELOW:
    raise ValueError(f"temperature={config.temperature}: vLLM samples greedily below {VLLM_GREEDY_BELOW} (and then "
                     "records other log-probabilities); use greedy=True or a larger temperature")
  return dict(common, n=int(config.num_samples if n is None else n), temperature=float(config.temperature),
              top_k=int(config.top_k) if config.top_k > 0 else -1, top_p=float(config.top_p),
              seed=None if seed is None else int(seed))


def row_seeds(num_rows: int, base_seed: int, row_ids: Optional[Sequence[int]] = None) -> list[int]:
  """Seed of each output row: ``base + row_id`` (row ids default to ``0..B-1``).

  As in the JAX sampler, a pool that splits one step's prompts over several
  calls passes each slice's global row ids and gets the samples one call over
  the whole step would give.

  Raises:
    ValueError: when ``row_ids`` is not one non-negative int per row.
  """
  ids = np.arange(num_rows) if row_ids is None else np.asarray(row_ids, np.int64)
  if ids.shape != (num_rows,):
    raise ValueError(f"generate: row_ids has shape {ids.shape}, expected ({num_rows},) (one id per row)")
  if ids.size and ids.min() < 0:
    raise ValueError(f"generate: row_ids must be >= 0, got {int(ids.min())}")
  return [int(base_seed) + int(i) for i in ids]


def build_requests(prompts: Sequence[Sequence[int]], config: SamplerConfig, stops: Sequence[int],
                   base_seed: int, row_ids: Optional[Sequence[int]] = None
                   ) -> list[tuple[list[int], dict[str, Any]]]:
  """The ``(prompt_token_ids, SamplingParams kwargs)`` of one generate call.

  Row ``r = g * num_samples + j`` samples with seed ``base + row_ids[r]``
  (:func:`row_seeds`). When the seeds of a prompt's rows are consecutive (the
  default), the prompt is one request with ``n = num_samples`` and the first
  row's seed (vLLM gives its j-th sample ``seed + j``); otherwise, and when
  greedy, every row is its own n=1 request.
  """
  n = int(config.num_samples)
  seeds = row_seeds(len(prompts) * n, base_seed, row_ids)
  grouped = not config.greedy and all(seeds[g * n + j] == seeds[g * n] + j
                                      for g in range(len(prompts)) for j in range(n))
  if grouped:
    return [(list(p), sampling_params_kwargs(config, stops, seed=seeds[g * n])) for g, p in enumerate(prompts)]
  return [(list(p), sampling_params_kwargs(config, stops, seed=seeds[g * n + j], n=1))
          for g, p in enumerate(prompts) for j in range(n)]


def greedy_logprob_is_exact(config: SamplerConfig) -> bool:
  """vLLM's greedy log-probability (of softmax(z)) equals ours only at tau=1 without truncation."""
  return float(config.temperature) == 1.0 and int(config.top_k) == 0 and float(config.top_p) == 1.0


def _sampled_logprob(position: Any, token: int, where: str) -> float:
  if position is None:
    raise ValueError(f"{where}: vLLM returned no log-probabilities (SamplingParams.logprobs must be 0)")
  if token not in position:
    raise ValueError(f"{where}: the sampled token {token} has no log-probability in vLLM's output "
                     f"(got ids {sorted(position)[:5]})")
  value = position[token]
  return float(getattr(value, "logprob", value))


def outputs_to_result(request_outputs: Sequence[Any], prompts: Sequence[Sequence[int]],
                      truncated: Sequence[bool], config: SamplerConfig, model_config: ModelConfig,
                      version: int) -> SampleResult:
  """vLLM ``RequestOutput`` s -> the ``SampleResult`` the JAX sampler gives for the same tokens.

  Args:
    request_outputs: one per request of :func:`build_requests`, in order (one
      per prompt with n completions, or one per row with one); each
      has ``prompt_token_ids`` and ``outputs`` (``CompletionOutput`` s with
      ``index``, ``token_ids``, ``logprobs``: per position a mapping token id
      -> ``Logprob`` (``.logprob``) or float; a list or vLLM's FlatLogprobs).
    prompts: the G prepared prompts (:func:`layout.prepare_prompts`).
    truncated: their G truncation flags.
    config: the sampling settings of the call.
    model_config: gives pad / eos ids and the vocabulary size.
    version: policy version of the engine's weights.

  Returns:
    The SampleResult (B = G * num_samples rows, prompt g's samples contiguous).

  Raises:
    ValueError: when the outputs do not fit the requests (count, prompt,
      length, a stop token before the end, a missing or non-finite
      log-probability), naming the row.
  """
  n = int(config.num_samples)
  stops = layout.stop_token_ids(config, model_config)
  stop_set = set(stops)
  per_row = len(request_outputs) == len(prompts) * n
  if not per_row and (config.greedy or len(request_outputs) != len(prompts)):
    expected = f"{len(prompts) * n}" if config.greedy else f"{len(prompts)} (or {len(prompts) * n}, one per row)"
    raise ValueError(f"vLLM returned {len(request_outputs)} request outputs for {expected} requests")
  rows = [list(p) for p in prompts for _ in range(n)]
  completions = []
  for i, out in enumerate(request_outputs):
    sent = rows[i] if per_row else rows[i * n]
    got = getattr(out, "prompt_token_ids", None)
    if got is not None and [int(t) for t in got] != sent:
      raise ValueError(f"vLLM request output {i} is for prompt {list(got)[:8]}..., expected {sent[:8]}...")
    outs = sorted(out.outputs, key=lambda c: getattr(c, "index", 0))
    want = 1 if per_row else n
    if len(outs) != want:
      raise ValueError(f"vLLM request output {i} has {len(outs)} completions, expected {want}")
    completions.extend(outs)
  nan_logp = config.greedy and not greedy_logprob_is_exact(config)
  responses, logps, finished = [], [], []
  for r, completion in enumerate(completions):
    tokens = [int(t) for t in completion.token_ids]
    where = f"row {r} (prompt {r // n}, sample {r % n})"
    if not 1 <= len(tokens) <= config.max_new_tokens:
      raise ValueError(f"{where}: vLLM returned {len(tokens)} tokens, expected 1..{config.max_new_tokens}")
    bad = [t for t in tokens if not 0 <= t < model_config.vocab_size]
    if bad:
      raise ValueError(f"{where}: vLLM returned token ids outside [0, {model_config.vocab_size}): {bad[:5]}")
    early = [t for t in tokens[:-1] if t in stop_set]
    if early:
      raise ValueError(f"{where}: stop token {early[0]} occurs before the end of the response; the engine "
                       "did not stop where SamplerConfig.stop_token_ids says")
    if completion.logprobs is None or len(completion.logprobs) < len(tokens):
      have = None if completion.logprobs is None else len(completion.logprobs)
      raise ValueError(f"{where}: vLLM returned log-probabilities for {have} of {len(tokens)} tokens "
                       "(SamplingParams.logprobs must be 0)")
    if nan_logp:
      lp = [math.nan] * len(tokens)
    else:
      lp = [_sampled_logprob(completion.logprobs[t], tok, f"{where} token {t}") for t, tok in enumerate(tokens)]
      if not all(math.isfinite(v) for v in lp):
        raise ValueError(f"{where}: non-finite behaviour log-probability {lp}; the engine must run with "
                         "logprobs_mode='processed_logprobs'")
    responses.append(tokens)
    logps.append(lp)
    finished.append(tokens[-1] in stop_set)
  prompt_lengths = np.array([len(p) for p in rows], np.int64)
  width = layout.prompt_bucket(prompt_lengths, config) + int(config.max_new_tokens)
  tokens_bt, logp_bt = layout.fill_rows(rows, responses, logps, width, model_config.pad_token_id)
  return layout.build_sample_result(tokens_bt, logp_bt, prompt_lengths, np.array([len(x) for x in responses]),
                                    np.array(finished, bool), truncated_g=truncated, num_samples=n,
                                    version=version)


__all__ = ["VLLM_GREEDY_BELOW", "build_requests", "call_base_seed", "greedy_logprob_is_exact", "outputs_to_result",
           "row_seeds", "sampling_params_kwargs"]
