"""The one table that maps Hugging Face tensor names to the Flax parameter pytree.

Every other bridge module (import, export, vLLM resharding) walks this table, so
the correspondence between the two layouts is written down exactly once.

  HF name (torch layout [out, in])               Flax path (kernel layout [in, out])   transpose
  model.embed_tokens.weight [V, D]               embed/embedding [V, D]                no
  model.layers.{i}.input_layernorm.weight [D]    layers_{i}/attn_norm/scale            no
  model.layers.{i}.self_attn.q_proj.weight       layers_{i}/attn/q_proj/kernel         yes
  model.layers.{i}.self_attn.{q,k,v}_proj.bias   layers_{i}/attn/{q,k,v}_proj/bias     no (attention_bias)
  model.layers.{i}.self_attn.k_proj.weight       layers_{i}/attn/k_proj/kernel         yes
  model.layers.{i}.self_attn.v_proj.weight       layers_{i}/attn/v_proj/kernel         yes
  model.layers.{i}.self_attn.q_norm.weight [hd]  layers_{i}/attn/q_norm/scale          no (qk_norm)
  model.layers.{i}.self_attn.k_norm.weight [hd]  layers_{i}/attn/k_norm/scale          no (qk_norm)
  model.layers.{i}.self_attn.o_proj.weight       layers_{i}/attn/o_proj/kernel         yes
  model.layers.{i}.post_attention_layernorm...   layers_{i}/mlp_norm/scale             no
  model.layers.{i}.mlp.{gate,up,down}_proj.weight layers_{i}/mlp/{gate,up,down}_proj/kernel yes
  model.norm.weight [D]                          final_norm/scale                      no
  lm_head.weight [V, D]                          lm_head/kernel [D, V]                 yes (absent when tied)

Value and reward heads are not part of HF checkpoints; they travel in a side
file (see :mod:`jaxrl_llm.bridge.hf_export`) under their Flax path joined by
``/`` (e.g. ``value_head/kernel``), in Flax layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

from jaxrl_llm.models.config import ModelConfig

Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """One parameter tensor and where it lives in both layouts.

  Attributes:
    hf_name: Hugging Face state-dict name (or the side-file name for heads).
    path: key path into the Flax params pytree.
    shape: shape in the Flax pytree.
    transpose: the HF tensor is the transpose of the Flax one (Linear weights).
  """

  hf_name: str
  path: tuple[str, ...]
  shape: tuple[int, ...]
  transpose: bool

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """Shape of the tensor in HF/torch layout."""
    return tuple(reversed(self.shape)) if self.transpose else self.shape

  @property
  def flax_name(self) -> str:
    """The Flax path joined by ``/`` (used in messages and side files)."""
    return "/".join(self.path)


def backbone_specs(config: ModelConfig) -> list[TensorSpec]:
  """Specs of every tensor a HF checkpoint of ``config`` holds, in HF's order.

  Args:
    config: the model configuration.

  Returns:
    A list of :class:`TensorSpec`; ``lm_head.weight`` is absent when
    ``config.tie_word_embeddings``.
  """
  d, v, f = config.hidden_size, config.vocab_size, config.intermediate_size
  hd = config.resolved_head_dim
  q_out, kv_out = config.num_heads * hd, config.num_kv_heads * hd
  specs = [TensorSpec("model.embed_tokens.weight", ("embed", "embedding"), (v, d), False)]
  for i in range(config.num_layers):
    hf, fx = f"model.layers.{i}", f"layers_{i}"
    specs.append(TensorSpec(f"{hf}.input_layernorm.weight", (fx, "attn_norm", "scale"), (d,), False))
    for proj, out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
      specs.append(TensorSpec(f"{hf}.self_attn.{proj}.weight", (fx, "attn", proj, "kernel"), (d, out), True))
      if config.attention_bias:
        specs.append(TensorSpec(f"{hf}.self_attn.{proj}.bias", (fx, "attn", proj, "bias"), (out,), False))
    if config.qk_norm:
      specs.append(TensorSpec(f"{hf}.self_attn.q_norm.weight", (fx, "attn", "q_norm", "scale"), (hd,), False))
      specs.append(TensorSpec(f"{hf}.self_attn.k_norm.weight", (fx, "attn", "k_norm", "scale"), (hd,), False))
    specs.append(TensorSpec(f"{hf}.self_attn.o_proj.weight", (fx, "attn", "o_proj", "kernel"), (q_out, d), True))
    specs.append(TensorSpec(f"{hf}.post_attention_layernorm.weight", (fx, "mlp_norm", "scale"), (d,), False))
    specs.append(TensorSpec(f"{hf}.mlp.gate_proj.weight", (fx, "mlp", "gate_proj", "kernel"), (d, f), True))
    specs.append(TensorSpec(f"{hf}.mlp.up_proj.weight", (fx, "mlp", "up_proj", "kernel"), (d, f), True))
    specs.append(TensorSpec(f"{hf}.mlp.down_proj.weight", (fx, "mlp", "down_proj", "kernel"), (f, d), True))
  specs.append(TensorSpec("model.norm.weight", ("final_norm", "scale"), (d,), False))
  if not config.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head", "kernel"), (d, v), True))
  return specs


def head_specs(config: ModelConfig) -> list[TensorSpec]:
  """Specs of the value / reward heads (side file only; Flax layout, no transpose)."""
  specs = []
  for head, enabled in (("value_head", config.value_head), ("reward_head", config.reward_head)):
    if enabled:
      specs.append(TensorSpec(f"{head}/kernel", (head, "kernel"), (config.hidden_size, 1), False))
      specs.append(TensorSpec(f"{head}/bias", (head, "bias"), (1,), False))
  return specs


def get_path(tree: Params, path: Sequence[str], what: str = "params") -> Any:
  """Reads ``tree[path[0]][path[1]]...`` with an error naming the missing key."""
  node = tree
  for depth, key in enumerate(path):
    if not isinstance(node, Mapping) or key not in node:
      raise KeyError(f"{what} has no entry {'/'.join(path)!r} (missing {key!r} at "
                     f"{'/'.join(path[:depth]) or 'the top level'})")
    node = node[key]
  return node


def set_path(tree: dict, path: Sequence[str], value: Any) -> None:
  """Sets ``tree[path[0]]...[path[-1]] = value``, creating nested dicts."""
  node = tree
  for key in path[:-1]:
    node = node.setdefault(key, {})
  node[path[-1]] = value


def flatten_paths(tree: Params, prefix: tuple[str, ...] = ()) -> Iterable[tuple[str, ...]]:
  """Yields the key path of every leaf of a nested-dict pytree."""
  for key, value in tree.items():
    if isinstance(value, Mapping):
      yield from flatten_paths(value, prefix + (key,))
    else:
      yield prefix + (key,)


def check_params_match(params: Params, specs: Sequence[TensorSpec], what: str = "params") -> None:
  """Raises one ValueError listing every missing, unexpected or mis-shaped leaf.

  Args:
    params: nested-dict pytree of arrays (anything with ``.shape``).
    specs: the tensors ``params`` must hold, exactly.
    what: name of the tree for the message.
  """
  expected = {s.path: s for s in specs}
  problems = []
  present = set(flatten_paths(params))
  for path, spec in expected.items():
    if path not in present:
      problems.append(f"missing {spec.flax_name} (expected shape {spec.shape})")
    else:
      shape = tuple(get_path(params, path, what).shape)
      if shape != spec.shape:
        problems.append(f"mis-shaped {spec.flax_name}: expected {spec.shape}, got {shape}")
  for path in sorted(present - set(expected)):
    problems.append(f"unexpected {'/'.join(path)} (shape {tuple(get_path(params, path, what).shape)})")
  if problems:
    raise ValueError(f"{what} do not match the ModelConfig ({len(problems)} problem(s)):\n  "
                     + "\n  ".join(problems))
