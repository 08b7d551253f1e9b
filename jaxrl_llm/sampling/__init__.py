"""Samplers: the ``Sampler`` interface and the built-in JAX sampler (KV cache, jitted loop)."""

from jaxrl_llm.sampling.base import SampleResult, Sampler, SamplerConfig
from jaxrl_llm.sampling.jax_sampler import JaxSampler, generate_trace_count, next_power_of_two
from jaxrl_llm.sampling.processing import inverse_cdf_sample, kept_set, select_tokens

__all__ = [
    "JaxSampler",
    "SampleResult",
    "Sampler",
    "SamplerConfig",
    "generate_trace_count",
    "inverse_cdf_sample",
    "kept_set",
    "next_power_of_two",
    "select_tokens",
]
