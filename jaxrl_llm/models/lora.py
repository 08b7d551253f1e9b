"""LoRA adapters on the decoder's projections: which leaves train, merging, adding, folding.

LoRA (Hu et al. 2021, arXiv:2106.09685) freezes a projection's kernel W [in, out]
and learns a low-rank update of it::

  y = x W + b + s (x A) B,     A [in, r],  B [r, out],  s = lora_alpha / r

The adapters live in the parameter tree next to the kernel they adapt
(``layers_{i}/attn/q_proj/{kernel, lora_a, lora_b}``; declared by
:class:`jaxrl_llm.models.layers.Projected` when ``ModelConfig.lora_rank`` > 0 and
the projection is in ``lora_targets``), so every entry point (learner, sampler,
reference) runs the same unmerged forward and agrees bit for bit. What trains is
decided by :func:`trainable_mask`: the adapters and the scalar heads (a critic's
value head, a reward model's reward head), nothing else. :func:`merge` folds the
adapters into plain kernels (``W + s A B``) for Hugging Face export and vLLM;
:func:`add_adapters` gives a tree without adapters (an HF import, a full
fine-tune's checkpoint) its fresh ones.

PEFT's conventions (Mangrulkar et al., huggingface/peft) hold: ``s = alpha / r``
(no rsLoRA), A uniform(+-1/sqrt(in)), B zeros; ``lora_A.weight = A^T`` [r, in] and
``lora_B.weight = B^T`` [out, r] (jaxrl_llm.bridge.peft_export).
"""

from __future__ import annotations

from typing import Any, Iterator

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.layers import LORA_A_INIT

__all__ = ["ADAPTER_LEAVES", "HEADS", "add_adapters", "adapter_bytes", "adapter_paths", "adapters_only", "has_adapters",
           "merge", "merged_leaf", "trainable_mask", "with_adapters",
           "without_adapters"]

ADAPTER_LEAVES = ("lora_a", "lora_b")
HEADS = ("value_head", "reward_head")  # scalar heads train with the adapters (PPO critic, reward model)

Params = Any


def _projections(params: Params) -> Iterator[tuple[tuple[str, ...], dict]]:
  """``(path, holder)`` of every dict holding a ``kernel`` under ``layers_*`` (the adaptable projections)."""
  def walk(node, path):
    if isinstance(node, dict):
      if "kernel" in node and path and path[0].startswith("layers_"):
        yield path, node
      for key in sorted(node):
        yield from walk(node[key], path + (key,))
  yield from walk(params, ())


def has_adapters(params: Params) -> bool:
  """Whether any projection of ``params`` carries ``lora_a`` / ``lora_b``."""
  return any("lora_a" in holder for _, holder in _projections(params))


def adapter_paths(params: Params) -> list[tuple[str, ...]]:
  """Paths of the projections that carry adapters (``("layers_0", "attn", "q_proj")``, ...), sorted."""
  return [path for path, holder in _projections(params) if "lora_a" in holder]


def trainable_mask(params: Params) -> Any:
  """bool pytree like ``params``: True for adapter leaves and the scalar heads, False for the rest."""
  def mark(path, _):
    keys = [str(getattr(k, "key", k)) for k in path]
    return keys[-1] in ADAPTER_LEAVES or any(k in HEADS for k in keys)
  return jax.tree_util.tree_map_with_path(mark, params)


def adapters_only(params: Params) -> Params:
  """The adapter leaves of ``params`` as a tree of the same nesting (nothing else)."""
  return {"/".join(path): {k: params_at(params, path)[k] for k in ADAPTER_LEAVES} for path in adapter_paths(params)}


def params_at(params: Params, path: tuple[str, ...]) -> dict:
  node = params
  for key in path:
    node = node[key]
  return node


def with_adapters(base: Params, adapters: Params) -> Params:
  """``base`` (:func:`without_adapters`) with the leaves of ``adapters`` (:func:`adapters_only`) put back."""
  out = _copy_dicts(base)
  for joined, leaves in adapters.items():
    holder = params_at(out, tuple(joined.split("/")))
    holder.update(leaves)
  return out


def _copy_dicts(tree: Params) -> Params:
  return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def without_adapters(tree: Params) -> Params:
  """``tree`` less its adapter leaves (the same arrays; no copy)."""
  if not isinstance(tree, dict):
    return tree
  return {k: without_adapters(v) for k, v in tree.items() if k not in ADAPTER_LEAVES}


def _delta(holder: dict, scale: float) -> jax.Array:
  """``s A B`` [in, out] in float32."""
  return (holder["lora_a"].astype(jnp.float32) @ holder["lora_b"].astype(jnp.float32)) * scale


def merged_leaf(params: Params, path: tuple[str, ...], config: ModelConfig) -> jax.Array:
  """The leaf at ``path``; a kernel with adapters beside it comes merged: ``W + s A B`` in W's dtype.

  One tensor at a time, so an export or a weight update never holds a second copy of the model.
  """
  holder = params_at(params, tuple(path[:-1]))
  leaf = holder[path[-1]]
  if path[-1] != "kernel" or "lora_a" not in holder:
    return leaf
  return (leaf.astype(jnp.float32) + _delta(holder, config.lora_scale)).astype(leaf.dtype)


def merge(params: Params, config: ModelConfig) -> Params:
  """Plain parameters: every adapted kernel replaced by ``W + s A B`` (in W's dtype), adapters dropped.

  The tree a model *without* adapters reads (``config.replace(lora_rank=0)``):
  what Hugging Face export and vLLM receive. A tree without adapters is returned as is.
  """
  if not has_adapters(params):
    return params
  out = without_adapters(params)
  for path in adapter_paths(params):
    params_at(out, path)["kernel"] = merged_leaf(params, path + ("kernel",), config)
  return out


def add_adapters(params: Params, config: ModelConfig, rng: jax.Array) -> Params:
  """``params`` (without adapters) with fresh adapters on ``config.lora_targets``: A uniform, B zeros.

  Args:
    params: a tree without adapters (``init_params`` of the config without LoRA, an HF import).
    config: the model config with ``lora_rank`` > 0.
    rng: key for A (one independent draw per projection, by its path).

  Raises:
    ValueError: when ``params`` already has adapters, or no projection matches ``lora_targets``.
  """
  if has_adapters(params):
    raise ValueError("add_adapters: the parameters already carry LoRA adapters")
  out = _copy_dicts(params)
  added = 0
  for path, holder in _projections(out):
    name = path[-1].removesuffix("_proj")
    rank = config.lora_on(name)
    if not rank:
      continue
    kernel = holder["kernel"]
    key = jax.random.fold_in(rng, _path_seed(path))
    holder["lora_a"] = LORA_A_INIT(key, (kernel.shape[0], rank), jnp.float32)
    holder["lora_b"] = jnp.zeros((rank, kernel.shape[1]), jnp.float32)
    added += 1
  if config.lora_rank and not added:
    raise ValueError(f"lora_targets={tuple(config.lora_targets)}: no projection of the model matches")
  return out


def _path_seed(path: tuple[str, ...]) -> int:
  """A stable 31-bit integer of a parameter path (independent of Python's hash seed)."""
  value = 0
  for ch in "/".join(path):
    value = (value * 131 + ord(ch)) % (2**31 - 1)
  return value


def adapter_bytes(params: Params) -> int:
  """Bytes of the adapter leaves (what a sampler needs per update when only they change)."""
  return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(adapters_only(params)))

