"""Samplers: the ``Sampler`` interface, the built-in JAX sampler (KV cache, jitted loop) and the
vLLM sampler (GPU; ``vllm`` is imported only when a VllmSampler is built)."""

from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig
from jaxrl_llm.sampling.jax_sampler import JaxSampler, generate_trace_count, next_power_of_two
from jaxrl_llm.sampling.processing import inverse_cdf_sample, kept_set, select_tokens
from jaxrl_llm.sampling.vllm_sampler import VllmEngineConfig, VllmSampler

__all__ = [
    "JaxSampler",
    "SampleResult",
    "Sampler",
    "SamplerConfig",
    "VllmEngineConfig",
    "VllmSampler",
    "generate_trace_count",
    "inverse_cdf_sample",
    "kept_set",
    "next_power_of_two",
    "select_tokens",
]
