"""The vLLM sampler: a ``vllm.LLM`` engine behind the ``Sampler`` interface (extra ``[vllm]``).

Same contract as :class:`~jaxrl_llm.sampling.jax_sampler.JaxSampler`: token-id
prompts in, a ``SampleResult`` out whose ``Trajectory`` has the layout of
:mod:`jaxrl_llm.sampling.layout` (prompt from index 0, response, pad; width =
prompt bucket + ``max_new_tokens``), behaviour log-probabilities of the
distribution actually sampled, and the policy version of every token.

The sampler is the stateful shell around two pure modules:
:mod:`jaxrl_llm.sampling.vllm_requests` (``SamplerConfig`` -> requests, seeds,
and vLLM outputs -> ``SampleResult``; the mapping table and the log-probability
convention are there) and :mod:`jaxrl_llm.sampling.vllm_engine` (vLLM import,
worker extension, fingerprint and layout checks, ``VllmEngineConfig``). Their
public names are re-exported here.

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

import itertools
import os
from typing import Any, Optional, Sequence

from jaxrl_llm.bridge import fingerprint as fp_lib
from jaxrl_llm.bridge.reshard import make_reshard_plan
from jaxrl_llm.bridge.weight_transport import PublishStats, WeightTransport, next_version
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig
from jaxrl_llm.sampling.vllm_engine import (VLLM_HINT, WORKER_EXTENSION, VllmEngineConfig, check_engine_layout,
                                            check_sampler_fingerprint, ensure_worker_extension_importable,
                                            import_vllm, sampler_fingerprint)
from jaxrl_llm.sampling.vllm_requests import (build_requests, call_base_seed, greedy_logprob_is_exact,
                                              outputs_to_result, row_seeds, sampling_params_kwargs)


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
    self.llm_kwargs = engine.llm_kwargs(self.model_path, model_config, config, tokenizer_path=tokenizer_path)
    self._llm = vllm.LLM(**self.llm_kwargs)
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


__all__ = ["VLLM_HINT", "WORKER_EXTENSION", "VllmEngineConfig", "VllmSampler", "build_requests", "call_base_seed",
           "check_engine_layout", "check_sampler_fingerprint", "ensure_worker_extension_importable",
           "greedy_logprob_is_exact", "import_vllm", "outputs_to_result", "row_seeds", "sampler_fingerprint",
           "sampling_params_kwargs"]
