"""jaxrl_llm: reinforcement learning of language models in JAX.

Dimension legend used in names and docstrings across the package:

  B  batch (sequences)             T  tokens per sequence (padded)
  G  groups (prompts)              N  samples per group (B = G * N)
  V  vocabulary                    D  model width
  H  attention heads               K  key/value heads
  S  cache / key length            P  tensor-parallel size

Suffixes such as ``_bt`` or ``_b`` on array names state their shape.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
