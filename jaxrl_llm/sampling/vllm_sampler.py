"""The vLLM sampler: a ``vllm.LLM`` engine behind the ``Sampler`` interface (extra ``[vllm]``).

Same contract as :class:`~jaxrl_llm.sampling.jax_sampler.JaxSampler`: token-id
prompts in, a ``SampleResult`` out whose ``Trajectory`` has the layout of
:mod:`jaxrl_llm.sampling.layout` (prompt from index 0, response, pad; width =
prompt bucket + ``max_new_tokens``), behaviour log-probabilities of the
distribution actually sampled, and the policy version of every token.

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

Weights. ``update_weights(params, version)`` publishes through a
:mod:`jaxrl_llm.bridge.weight_transport` transport into the worker extension
``third_party.vllm_weight_sync.WeightSyncExtension`` (no restart), then resets
vLLM's prefix cache so no cached KV from the old weights is reused. Versions
must increase strictly. At construction the tokenizer and model config the
engine will load are fingerprinted and checked against the learner's.

vllm and torch are imported inside functions only: importing this module (or
``jaxrl_llm.sampling``) never imports them.

References:
  vLLM, https://github.com/vllm-project/vllm (``LLM``, ``SamplingParams``,
  ``collective_rpc``, ``logprobs_mode``, v0.10 release notes);
  Piche et al., PipelineRL, arXiv:2509.19128 (in-flight weight updates).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import itertools
import math
import os
import sys
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from jaxrl_llm.bridge import fingerprint as fp_lib
from jaxrl_llm.bridge import hf_config
from jaxrl_llm.bridge.reshard import ReshardPlan, make_reshard_plan
from jaxrl_llm.bridge.tokenizer import Tokenizer
from jaxrl_llm.bridge.weight_transport import (DEFAULT_BUCKET_BYTES, TRANSPORTS, PublishStats, WeightTransport,
                                               make_transport, next_version)
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig

VLLM_HINT = ("install the [vllm] extra on a CUDA machine: pip install 'jaxrl_llm[vllm]' "
             "(vLLM >= 0.10.2, which has logprobs_mode='processed_logprobs')")
WORKER_EXTENSION = "third_party.vllm_weight_sync.WeightSyncExtension"
_VLLM_GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a smaller temperature means greedy
_RESERVED_ENGINE_ARGS = ("model", "tokenizer", "logprobs_mode", "worker_extension_cls")


def import_vllm():
  """Returns the ``vllm`` module, or raises ImportError saying how to install it."""
  try:
    return importlib.import_module("vllm")
  except ImportError as e:
    if e.name not in (None, "vllm"):  # vllm is there but one of its own imports failed
      raise ImportError(f"vLLM is installed but does not import ({e}); reinstall the [vllm] extra: "
                        f"{VLLM_HINT}") from e
    raise ImportError(f"the vLLM sampler needs vLLM, which is not installed here: {VLLM_HINT}") from e


def ensure_worker_extension_importable() -> str:
  """Makes ``third_party.vllm_weight_sync`` importable here and in vLLM's worker processes.

  Returns:
    The folder holding ``third_party/`` (put first on ``sys.path`` when needed,
    and on ``PYTHONPATH`` so spawned / Ray worker processes find it too).

  Raises:
    ImportError: when the extension is neither importable nor next to the package.
  """
  try:
    module = importlib.import_module("third_party.vllm_weight_sync")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(module.__file__))))
  except ImportError:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(os.path.join(root, "third_party", "vllm_weight_sync", "__init__.py")):
      raise ImportError(f"cannot find the vLLM worker extension third_party/vllm_weight_sync (looked in {root}); "
                        "run from a checkout of jaxrl_llm") from None
    sys.path.insert(0, root)
    importlib.import_module("third_party.vllm_weight_sync")
  paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  if root not in paths:
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + paths)
  return root


# ----------------------------------------------------------------- pure parts
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
  if float(config.temperature) < _VLLM_GREEDY_BELOW:
    raise ValueError(f"temperature={config.temperature}: vLLM samples greedily below {_VLLM_GREEDY_BELOW} (and then "
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


def sampler_fingerprint(model_path: str, model_config: ModelConfig, *, tokenizer_path: Optional[str] = None,
                        revision: Optional[str] = None) -> fp_lib.Fingerprint:
  """Fingerprint of what the engine will load: the tokenizer folder and the HF config.

  The pad id follows the tokenizer (as the learner's builders do), so a
  learner built from the same folder gets the same fingerprint.
  """
  tokenizer = Tokenizer.from_folder(tokenizer_path or model_path)
  folder_config = hf_config.config_from_hf(model_path, pad_token_id=tokenizer.pad_id,
                                           param_dtype=model_config.param_dtype)
  return fp_lib.make_fingerprint(tokenizer, folder_config, revision)


def check_sampler_fingerprint(learner: fp_lib.Fingerprint, sampler: fp_lib.Fingerprint, model_config: ModelConfig,
                              *, model_path: str, revision: Optional[str] = None) -> None:
  """Raises FingerprintMismatchError naming both fingerprints when sampler and learner differ.

  Also checks that ``model_config`` (used to lay out published weights) is the
  learner's: its model digest must be the learner's.
  """
  try:
    fp_lib.check_fingerprints(learner, sampler, expected_name="learner", actual_name="vLLM sampler")
  except fp_lib.FingerprintMismatchError as e:
    raise fp_lib.FingerprintMismatchError(
        f"VllmSampler({model_path}): the engine would not run what the learner trains (learner fingerprint "
        f"{learner.digest()}, vLLM sampler fingerprint {sampler.digest()}): {e}", e.parts) from None
  own = fp_lib.model_fingerprint(model_config, revision)
  if own != learner.model:
    raise fp_lib.FingerprintMismatchError(
        f"VllmSampler({model_path}): model_config has model fingerprint {own[:12]} but the learner's is "
        f"{learner.model[:12]}; pass the learner's ModelConfig (and the same revision)", ["model"])


def check_engine_layout(reports: Sequence[Mapping[str, Any]], plan: ReshardPlan) -> None:
  """Checks the engine's per-rank parameter shapes against the reshard plan.

  Args:
    reports: ``WeightSyncExtension.report_parameter_shapes()`` of every worker
      (``{"rank": r, "shapes": {name: shape}}``).
    plan: :func:`make_reshard_plan` of the learner's config at the engine's TP size.

  Raises:
    ValueError: listing every missing or mis-shaped parameter, per rank.
  """
  ranks = sorted(int(r["rank"]) for r in reports)
  if ranks != list(range(plan.tp_size)):
    raise ValueError(f"the engine reports tensor-parallel ranks {ranks}, the plan has {plan.tp_size}")
  problems = []
  for report in reports:
    shapes = {k: tuple(v) for k, v in report["shapes"].items()}
    for entry in plan.entries:
      want = plan.rank_shape(entry)
      got = shapes.get(entry.vllm_name)
      if got is None:
        problems.append(f"rank {report['rank']}: no parameter {entry.vllm_name}")
      elif got != want:
        problems.append(f"rank {report['rank']}: {entry.vllm_name} has shape {got}, the plan expects {want}")
  if problems:
    raise ValueError("the vLLM engine's parameters do not match the reshard plan (" + str(len(problems))
                     + " problem(s)):\n  " + "\n  ".join(problems))


@dataclasses.dataclass(frozen=True)
class VllmEngineConfig:
  """How to build the ``vllm.LLM`` engine and publish weights to it.

  Attributes:
    tensor_parallel_size: P GPUs per engine.
    dtype: engine dtype ("bfloat16", "float16", "float32"); None means the
      ModelConfig's ``param_dtype``. Published weights are cast to it.
    gpu_memory_utilization: share of GPU memory vLLM may take.
    enforce_eager: no CUDA graphs (faster start, slower decode).
    enable_prefix_caching: reuse KV of shared prefixes (the n samples of a
      prompt); the cache is reset after every weight update.
    max_model_len: None means ``layout.max_length`` of the ModelConfig and
      the SamplerConfig.
    skip_tokenizer_init: prompts are token ids and nothing is detokenised, so
      vLLM can skip loading the tokenizer.
    seed: engine seed (per-request seeds are set anyway).
    transport: "object_store" (default), "nccl" or "ipc" (see weight_transport).
    bucket_bytes: about this many bytes per weight RPC.
    ipc_device / nccl_device: the learner-side CUDA device of those transports.
    nccl_host / nccl_port: rendezvous of the NCCL group.
    extra_engine_args: any other ``vllm.LLM`` keyword (not the reserved ones).
  """

  tensor_parallel_size: int = 1
  dtype: Optional[str] = None
  gpu_memory_utilization: float = 0.5
  enforce_eager: bool = False
  enable_prefix_caching: bool = True
  max_model_len: Optional[int] = None
  skip_tokenizer_init: bool = False
  seed: int = 0
  transport: str = "object_store"
  bucket_bytes: int = DEFAULT_BUCKET_BYTES
  ipc_device: str = "cuda:0"
  nccl_device: str = "cuda:0"
  nccl_host: str = "127.0.0.1"
  nccl_port: int = 29517
  extra_engine_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    errors = []
    if int(self.tensor_parallel_size) < 1:
      errors.append(f"tensor_parallel_size={self.tensor_parallel_size!r}: expected >= 1")
    if self.dtype not in (None, "bfloat16", "float16", "float32"):
      errors.append(f"dtype={self.dtype!r}: expected None, bfloat16, float16 or float32")
    if not 0 < float(self.gpu_memory_utilization) <= 1:
      errors.append(f"gpu_memory_utilization={self.gpu_memory_utilization!r}: expected in (0, 1]")
    if self.transport not in TRANSPORTS:
      errors.append(f"transport={self.transport!r}: expected one of {TRANSPORTS}")
    reserved = sorted(set(self.extra_engine_args) & set(_RESERVED_ENGINE_ARGS))
    if reserved:
      errors.append(f"extra_engine_args sets {reserved}, which VllmSampler sets itself")
    if errors:
      raise ValueError("Invalid VllmEngineConfig: " + "; ".join(errors))

  def engine_dtype(self, model_config: ModelConfig) -> str:
    return self.dtype or model_config.param_dtype

  def llm_kwargs(self, model_path: str, model_config: ModelConfig, sampler_config: SamplerConfig, *,
                 tokenizer_path: Optional[str] = None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (pure; the engine is built from exactly these)."""
    return dict(
        model=model_path, tokenizer=tokenizer_path or model_path, dtype=self.engine_dtype(model_config),
        seed=int(self.seed), tensor_parallel_size=int(self.tensor_parallel_size),
        gpu_memory_utilization=float(self.gpu_memory_utilization), enforce_eager=bool(self.enforce_eager),
        enable_prefix_caching=bool(self.enable_prefix_caching),
        max_model_len=int(self.max_model_len or layout.max_length(model_config, sampler_config)),
        skip_tokenizer_init=bool(self.skip_tokenizer_init), generation_config="vllm",
        logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
        **dict(self.extra_engine_args))

  def make_transport(self, model_config: ModelConfig) -> WeightTransport:
    """The weight transport this config names, casting to the engine dtype."""
    dtype = self.engine_dtype(model_config)
    if self.transport == "object_store":
      return make_transport("object_store", tp_size=self.tensor_parallel_size, dtype=dtype,
                            bucket_bytes=self.bucket_bytes)
    if self.transport == "ipc":
      return make_transport("ipc", device=self.ipc_device, dtype=dtype, bucket_bytes=self.bucket_bytes)
    return make_transport("nccl", host=self.nccl_host, port=self.nccl_port, device=self.nccl_device, dtype=dtype,
                          bucket_bytes=self.bucket_bytes)


class VllmSampler(Sampler):
  """Samples with a vLLM engine; weights come from the learner in flight.

  Example (on a CUDA machine with the [vllm] extra)::

    fingerprint = bridge.make_fingerprint(tokenizer, model_config)       # the learner's
    sampler = VllmSampler(model_config, "/ckpt/qwen2.5-0.5b", fingerprint,
                          SamplerConfig(max_new_tokens=256, temperature=1.0, num_samples=8))
    result = sampler.generate(prompt_ids)
    sampler.update_weights(new_params, version=1)   # no restart; prefix cache reset
  """

  def __init__(self, model_config: ModelConfig, model_path: str, learner_fingerprint: fp_lib.Fingerprint,
               config: SamplerConfig = SamplerConfig(), *, version: int = 0, revision: Optional[str] = None,
               tokenizer_path: Optional[str] = None, engine: VllmEngineConfig = VllmEngineConfig(),
               transport: Optional[WeightTransport] = None):
    """Checks fingerprints, then builds the engine.

    Args:
      model_config: the learner's ModelConfig (lays out published weights).
      model_path: HF folder the engine loads (config, tokenizer, initial weights).
      learner_fingerprint: ``bridge.make_fingerprint`` of the learner's tokenizer and config.
      config: sampling settings.
      version: policy version of the weights in ``model_path``.
      revision: revision string both fingerprints were made with.
      tokenizer_path: tokenizer folder when not ``model_path``.
      engine: engine and transport settings.
      transport: a ready transport (overrides ``engine.transport``).

    Raises:
      FingerprintMismatchError: naming both fingerprints and the differing parts.
      ImportError: when vLLM is not installed (says to install the [vllm] extra).
    """
    self.model_config = model_config
    self.config = config
    self.model_path = os.fspath(model_path)
    self.engine_config = engine
    self.fingerprint = sampler_fingerprint(self.model_path, model_config, tokenizer_path=tokenizer_path,
                                           revision=revision)
    check_sampler_fingerprint(learner_fingerprint, self.fingerprint, model_config, model_path=self.model_path,
                              revision=revision)
    vllm = import_vllm()
    ensure_worker_extension_importable()
    self._version = int(version)
    self._calls = itertools.count()
    self.last_publish: Optional[PublishStats] = None
    self._llm = vllm.LLM(**engine.llm_kwargs(self.model_path, model_config, config, tokenizer_path=tokenizer_path))
    self._transport = transport or engine.make_transport(model_config)
    if engine.tensor_parallel_size > 1 and self._transport.name == "object_store":
      check_engine_layout(self.collective_rpc("report_parameter_shapes"),
                          make_reshard_plan(model_config, engine.tensor_parallel_size))
    if self._transport.name == "nccl":
      self._transport.connect(self.collective_rpc, engine.tensor_parallel_size)

  @property
  def policy_version(self) -> int:
    return self._version

  @property
  def llm(self) -> Any:
    """The ``vllm.LLM`` engine."""
    return self._llm

  def collective_rpc(self, method: str, args: tuple = ()) -> list:
    """Runs a ``WeightSyncExtension`` method on every worker; returns their results."""
    return self._llm.collective_rpc(method, args=tuple(args))

  def generate(self, prompts: Sequence[Sequence[int]], *, rng: Any = None, row_ids: Optional[Sequence[int]] = None,
               **overrides: Any) -> SampleResult:
    """See ``Sampler.generate``; ``overrides`` are ``SamplerConfig`` fields for this call.

    ``row_ids`` (one int per output row, default ``0..B-1``): row r samples with
    seed ``base + row_ids[r]``, so a pool splitting one step's prompts over
    several calls (same ``rng``, global row ids) samples what one call would.
    """
    config = self.config.replace(**overrides) if overrides else self.config
    call = next(self._calls)
    prompts, truncated = layout.prepare_prompts(prompts, config, self.model_config)
    stops = layout.stop_token_ids(config, self.model_config)
    requests = build_requests(prompts, config, stops, call_base_seed(config.seed, call, rng), row_ids)
    vllm = import_vllm()
    outputs = self._llm.generate([{"prompt_token_ids": ids} for ids, _ in requests],
                                 [vllm.SamplingParams(**kwargs) for _, kwargs in requests], use_tqdm=False)
    return outputs_to_result(outputs, prompts, truncated, config, self.model_config, self._version)

  def update_weights(self, params: Any, version: int) -> None:
    """Publishes ``params`` to the engine through the transport; ``version`` must be newer.

    Raises:
      ValueError: when ``version`` is not newer than ``policy_version`` (nothing is sent).
    """
    new = next_version(self._version, version)
    self.last_publish = self._transport.publish(params, self.model_config, self.collective_rpc)
    self._llm.reset_prefix_cache()
    self._version = new

  def commit_weights(self, version: int) -> None:
    """Marks weights pushed by an external sender (the learner's own transport) as ``version``."""
    new = next_version(self._version, version)
    self._llm.reset_prefix_cache()
    self._version = new

  def close(self) -> None:
    """Releases the transport and the engine."""
    self._transport.close()
    self._llm = None


__all__ = ["VllmEngineConfig", "VllmSampler", "build_requests", "call_base_seed", "check_engine_layout", "row_seeds",
           "check_sampler_fingerprint", "greedy_logprob_is_exact", "import_vllm", "outputs_to_result",
           "sampler_fingerprint", "sampling_params_kwargs"]
