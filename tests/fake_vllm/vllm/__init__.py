"""A stand-in for the ``vllm`` package at the engine boundary, for CPU tests of sampler placement.

``tests/test_placement.py`` puts this folder on the ``PYTHONPATH`` of its Ray cluster's actors,
so that a ``sampler.kind='vllm'`` actor runs the real ``VllmSampler`` construction (fingerprint
checks, engine arguments, weight transport) up to ``vllm.LLM(**kwargs)``, which only records its
arguments here. Nothing in it samples: ``generate`` raises.
"""

__version__ = "0.0+placement-test"


class SamplingParams:
  def __init__(self, **kwargs):
    self.kwargs = kwargs


class LLM:
  """Records the engine arguments it was built with."""

  def __init__(self, **kwargs):
    self.kwargs = dict(kwargs)

  def generate(self, *args, **kwargs):
    raise RuntimeError("the placement tests' stand-in vllm package has no engine")

  def collective_rpc(self, method, args=()):
    raise RuntimeError(f"the placement tests' stand-in vllm package has no workers ({method})")

  def reset_prefix_cache(self):
    return True
