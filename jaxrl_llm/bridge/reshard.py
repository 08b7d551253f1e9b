"""Learner params -> vLLM tensor-parallel layout (names, fusions, slices), and back.

For tensor-parallel size P, every rank of a vLLM engine holds, per layer, the
fused and sliced tensors below (torch layout ``[out, in]``). The table is the
same for the three families; only the optional rows differ (bias: Qwen2 and
Llama with ``attention_bias``; q/k norm: Qwen3).

  vLLM name (per rank)                          built from HF tensors                split
  model.embed_tokens.weight [Vp/P, D]           model.embed_tokens.weight            vocab-parallel rows
  model.layers.{i}.input_layernorm.weight       same name                            replicated
  model.layers.{i}.self_attn.qkv_proj.weight    q_proj, k_proj, v_proj .weight       q, k, v each by heads,
     [(H/P + 2*Kr)*hd, D]                                                             then concat (dim 0)
  model.layers.{i}.self_attn.qkv_proj.bias      q_proj, k_proj, v_proj .bias         as the weight
  model.layers.{i}.self_attn.q_norm.weight      same name (Qwen3)                    replicated
  model.layers.{i}.self_attn.k_norm.weight      same name (Qwen3)                    replicated
  model.layers.{i}.self_attn.o_proj.weight      same name [D, H*hd]                  row-parallel (dim 1)
  model.layers.{i}.post_attention_layernorm...  same name                            replicated
  model.layers.{i}.mlp.gate_up_proj.weight      gate_proj, up_proj .weight           each dim 0 by F/P,
     [2*F/P, D]                                                                       then concat
  model.layers.{i}.mlp.down_proj.weight         same name [D, F]                     row-parallel (dim 1)
  model.norm.weight                             same name                            replicated
  lm_head.weight [Vp/P, D]                      lm_head.weight (absent when tied:    vocab-parallel rows
                                                vLLM ties it to embed_tokens)

Key/value heads (vLLM ``QKVParallelLinear``): when K >= P each rank holds
Kr = K/P consecutive KV heads; when K < P (P must then be a multiple of K) each
rank holds Kr = 1 head, head ``rank // (P/K)``, i.e. every KV head is
replicated on P/K consecutive ranks. H and F must be divisible by P.

Vocabulary (vLLM ``VocabParallelEmbedding`` / ``ParallelLMHead``, no LoRA):
the vocabulary is padded to ``Vp = ceil(V / 64) * 64`` (``DEFAULT_VOCAB_PADDING_SIZE``
= 64, independent of P); each rank holds rows ``[r*Vp/P, (r+1)*Vp/P)`` of the
padded matrix, and rows at or past V are zeros (vLLM's weight loader fills
them with 0). Vp must be divisible by P (vLLM asserts the same), which holds
for any power-of-two P <= 64.

At P = 1 vLLM's ``load_weights`` wants the unfused HF-named stream and does its
own fusion: :func:`iter_hf_tensors` yields exactly that, one full tensor at a
time. :func:`reassemble` inverts a per-rank layout back to the HF tensors, bit
for bit (replicated copies are checked to be identical).

Host memory: :func:`iter_vllm_shards` gathers one fused tensor at a time (its
HF parts, then the P slices), so a publisher that sends each tensor before
asking for the next holds about two tensors; :func:`shard_for_vllm` collects
everything (the whole model once) and is meant for tests and small models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Optional, Sequence

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.bridge.host import to_host
from jaxrl_llm.bridge.layout import TensorSpec, backbone_specs, get_path
from jaxrl_llm.models import lora
from jaxrl_llm.models.config import ModelConfig

DEFAULT_VOCAB_PADDING_SIZE = 64
KINDS = ("replicated", "row", "vocab", "qkv", "gate_up")


@dataclasses.dataclass(frozen=True)
class PlanEntry:
  """One vLLM parameter and the HF tensors it is built from.

  Attributes:
    vllm_name: the parameter name in vLLM's model.
    kind: 'replicated', 'row' (split dim 1), 'vocab' (padded rows, split dim
      0), 'qkv' (q/k/v split by heads along dim 0, concatenated) or 'gate_up'
      (gate/up split along dim 0, concatenated).
    parts: the HF tensors, in fusion order.
  """

  vllm_name: str
  kind: str
  parts: tuple[TensorSpec, ...]


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
  """How one ModelConfig is laid out over P vLLM tensor-parallel ranks.

  Attributes:
    config: the model configuration.
    tp_size: P.
    vocab_padding_size: vLLM's vocabulary padding (64 unless LoRA changes it).
    entries: one PlanEntry per vLLM parameter, in vLLM module order.
  """

  config: ModelConfig
  tp_size: int
  vocab_padding_size: int
  entries: tuple[PlanEntry, ...]

  @property
  def padded_vocab_size(self) -> int:
    """Vp = ceil(V / padding) * padding."""
    pad = self.vocab_padding_size
    return -(-self.config.vocab_size // pad) * pad

  @property
  def kv_heads_per_rank(self) -> int:
    """Kr: KV heads held by each rank (1 when KV heads are replicated)."""
    return max(self.config.num_kv_heads // self.tp_size, 1)

  @property
  def kv_replicas(self) -> int:
    """How many consecutive ranks hold the same KV head (1 when partitioned)."""
    return max(self.tp_size // self.config.num_kv_heads, 1)

  def kv_head_range(self, rank: int) -> tuple[int, int]:
    """[first, last) KV heads of ``rank``."""
    if self.config.num_kv_heads >= self.tp_size:
      return rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank
    head = rank // self.kv_replicas
    return head, head + 1

  def rank_shape(self, entry: PlanEntry) -> tuple[int, ...]:
    """Shape of ``entry`` on one rank (torch layout)."""
    p, hd = self.tp_size, self.config.resolved_head_dim
    first = entry.parts[0].hf_shape
    if entry.kind == "replicated":
      return first
    if entry.kind == "row":
      return (first[0], first[1] // p)
    if entry.kind == "vocab":
      return (self.padded_vocab_size // p,) + first[1:]
    if entry.kind == "gate_up":
      return (2 * first[0] // p,) + first[1:]
    q_rows = self.config.num_heads // p * hd
    return (q_rows + 2 * self.kv_heads_per_rank * hd,) + first[1:]

  def entry(self, vllm_name: str) -> PlanEntry:
    for e in self.entries:
      if e.vllm_name == vllm_name:
        return e
    raise KeyError(f"{vllm_name!r} is not a parameter of this plan")


def make_reshard_plan(config: ModelConfig, tp_size: int,
                      vocab_padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> ReshardPlan:
  """Builds the vLLM layout of ``config`` for tensor-parallel size ``tp_size``.

  Args:
    config: the model configuration.
    tp_size: P >= 1.
    vocab_padding_size: vocabulary padding (vLLM's DEFAULT_VOCAB_PADDING_SIZE).

  Returns:
    The ReshardPlan.
  """
  p = int(tp_size)
  errors = []
  if p < 1:
    errors.append(f"tp_size={tp_size}: expected >= 1")
  else:
    h, k, f = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % p:
      errors.append(f"num_heads={h} is not divisible by tp_size={p}")
    if k >= p and k % p:
      errors.append(f"num_kv_heads={k} is not divisible by tp_size={p}")
    if k < p and p % k:
      errors.append(f"tp_size={p} is not a multiple of num_kv_heads={k} (vLLM replicates KV heads "
                    "only by an integer factor)")
    if f % p:
      errors.append(f"intermediate_size={f} is not divisible by tp_size={p}")
    padded = -(-config.vocab_size // vocab_padding_size) * vocab_padding_size
    if padded % p:
      errors.append(f"padded vocabulary {padded} (vocab_size={config.vocab_size} rounded up to "
                    f"{vocab_padding_size}) is not divisible by tp_size={p}")
  if errors:
    raise ValueError("cannot shard for vLLM: " + "; ".join(errors))

  spec = {s.hf_name: s for s in backbone_specs(config)}
  entries = [PlanEntry("model.embed_tokens.weight", "vocab", (spec["model.embed_tokens.weight"],))]
  for i in range(config.num_layers):
    pre = f"model.layers.{i}"
    attn = f"{pre}.self_attn"
    entries.append(PlanEntry(f"{attn}.qkv_proj.weight", "qkv",
                             tuple(spec[f"{attn}.{x}_proj.weight"] for x in "qkv")))
    if config.attention_bias:
      entries.append(PlanEntry(f"{attn}.qkv_proj.bias", "qkv",
                               tuple(spec[f"{attn}.{x}_proj.bias"] for x in "qkv")))
    entries.append(PlanEntry(f"{attn}.o_proj.weight", "row", (spec[f"{attn}.o_proj.weight"],)))
    if config.qk_norm:
      for norm in ("q_norm", "k_norm"):
        entries.append(PlanEntry(f"{attn}.{norm}.weight", "replicated", (spec[f"{attn}.{norm}.weight"],)))
    entries.append(PlanEntry(f"{pre}.mlp.gate_up_proj.weight", "gate_up",
                             (spec[f"{pre}.mlp.gate_proj.weight"], spec[f"{pre}.mlp.up_proj.weight"])))
    entries.append(PlanEntry(f"{pre}.mlp.down_proj.weight", "row", (spec[f"{pre}.mlp.down_proj.weight"],)))
    for norm in ("input_layernorm", "post_attention_layernorm"):
      entries.append(PlanEntry(f"{pre}.{norm}.weight", "replicated", (spec[f"{pre}.{norm}.weight"],)))
  entries.append(PlanEntry("model.norm.weight", "replicated", (spec["model.norm.weight"],)))
  if not config.tie_word_embeddings:
    entries.append(PlanEntry("lm_head.weight", "vocab", (spec["lm_head.weight"],)))
  return ReshardPlan(config, p, vocab_padding_size, tuple(entries))


def _hf_tensor(params: Mapping[str, Any], spec: TensorSpec, dtype: Optional[np.dtype],
               config: ModelConfig) -> np.ndarray:
  get_path(params, spec.path)  # a missing tensor: the error names it
  array = to_host(lora.merged_leaf(params, spec.path, config))  # LoRA adapters merged, one kernel at a time
  if spec.transpose:
    array = array.T
  return array.astype(dtype, copy=False) if dtype is not None else array


def iter_hf_tensors(params: Mapping[str, Any], config: ModelConfig,
                    dtype: Optional[str] = None) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF name, full tensor in torch layout), one tensor at a time.

  This is the stream vLLM's ``model.load_weights`` consumes (vLLM fuses and
  slices it itself; tied models have no ``lm_head.weight``).

  Args:
    params: Flax params (any sharding; gathered per tensor).
    config: the model configuration.
    dtype: optional dtype to cast to (e.g. "bfloat16" for a bf16 engine).
  """
  np_dtype = np.dtype(jnp.dtype(dtype)) if dtype else None
  for spec in backbone_specs(config):
    yield spec.hf_name, _hf_tensor(params, spec, np_dtype, config)


def split_entry(plan: ReshardPlan, entry: PlanEntry, parts: Sequence[np.ndarray]) -> list[np.ndarray]:
  """Slices the full HF tensors of one entry into its P per-rank tensors.

  Args:
    plan: the plan.
    entry: one of ``plan.entries``.
    parts: the full HF tensors of ``entry.parts`` (torch layout), same order.

  Returns:
    P arrays (replicated entries return the same read-only array P times).
  """
  p, cfg = plan.tp_size, plan.config
  for spec, part in zip(entry.parts, parts):
    if tuple(part.shape) != spec.hf_shape:
      raise ValueError(f"{spec.hf_name}: expected shape {spec.hf_shape}, got {tuple(part.shape)}")
  if entry.kind == "replicated":
    return [parts[0]] * p
  if entry.kind == "row":
    return list(np.split(parts[0], p, axis=1))
  if entry.kind == "vocab":
    full = parts[0]
    padded = np.zeros((plan.padded_vocab_size,) + full.shape[1:], full.dtype)
    padded[:full.shape[0]] = full
    return list(np.split(padded, p, axis=0))
  if entry.kind == "gate_up":
    gates, ups = np.split(parts[0], p, axis=0), np.split(parts[1], p, axis=0)
    return [np.concatenate([g, u], axis=0) for g, u in zip(gates, ups)]
  hd = cfg.resolved_head_dim
  q, k, v = parts
  q_rows = cfg.num_heads // p * hd
  out = []
  for rank in range(p):
    first, last = plan.kv_head_range(rank)
    out.append(np.concatenate([q[rank * q_rows:(rank + 1) * q_rows],
                               k[first * hd:last * hd], v[first * hd:last * hd]], axis=0))
  return out


def iter_vllm_shards(params: Mapping[str, Any], plan: ReshardPlan,
                     dtype: Optional[str] = None) -> Iterator[tuple[str, list[np.ndarray]]]:
  """Yields (vLLM name, [tensor of rank 0, ..., rank P-1]) one parameter at a time.

  Args:
    params: Flax params (any sharding; gathered per tensor).
    plan: from :func:`make_reshard_plan`.
    dtype: optional dtype to cast to.
  """
  np_dtype = np.dtype(jnp.dtype(dtype)) if dtype else None
  for entry in plan.entries:
    parts = [_hf_tensor(params, spec, np_dtype, plan.config) for spec in entry.parts]
    yield entry.vllm_name, split_entry(plan, entry, parts)


def shard_for_vllm(params: Mapping[str, Any], config: ModelConfig, tp_size: int, *,
                   dtype: Optional[str] = None,
                   vocab_padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> list[dict[str, np.ndarray]]:
  """Per-rank ordered dicts ``vLLM name -> np.ndarray`` (torch layout).

  Args:
    params: Flax params.
    config: the model configuration.
    tp_size: P.
    dtype: optional dtype to cast to.
    vocab_padding_size: vLLM's vocabulary padding.

  Returns:
    A list of P dicts, in ``plan.entries`` order.
  """
  plan = make_reshard_plan(config, tp_size, vocab_padding_size)
  ranks: list[dict[str, np.ndarray]] = [{} for _ in range(plan.tp_size)]
  for name, shards in iter_vllm_shards(params, plan, dtype):
    for rank, shard in enumerate(shards):
      ranks[rank][name] = shard
  return ranks


def _same_replicas(name: str, arrays: Sequence[np.ndarray], ranks: Sequence[int]) -> np.ndarray:
  for rank, array in zip(ranks[1:], arrays[1:]):
    if not np.array_equal(arrays[0], array):
      raise ValueError(f"{name}: replicated copy on rank {rank} differs from rank {ranks[0]}")
  return arrays[0]


def reassemble(per_rank: Sequence[Mapping[str, np.ndarray]], plan: ReshardPlan) -> dict[str, np.ndarray]:
  """Inverts the plan: per-rank vLLM tensors -> full HF-named tensors (torch layout).

  Args:
    per_rank: P mappings vLLM name -> array, as from :func:`shard_for_vllm`.
    plan: the plan they were made with.

  Returns:
    dict HF name -> full tensor, bit-identical to the tensors that were split.

  Raises:
    ValueError: on a missing name, a wrong per-rank shape, or replicated
      copies (norms, replicated KV heads) that differ between ranks.
  """
  p, cfg = plan.tp_size, plan.config
  if len(per_rank) != p:
    raise ValueError(f"expected {p} ranks, got {len(per_rank)}")
  out: dict[str, np.ndarray] = {}
  for entry in plan.entries:
    shards = []
    for rank, tensors in enumerate(per_rank):
      if entry.vllm_name not in tensors:
        raise ValueError(f"rank {rank} has no {entry.vllm_name!r}")
      shard = np.asarray(tensors[entry.vllm_name])
      if tuple(shard.shape) != plan.rank_shape(entry):
        raise ValueError(f"rank {rank} {entry.vllm_name}: expected shape {plan.rank_shape(entry)}, "
                         f"got {tuple(shard.shape)}")
      shards.append(shard)
    names = [s.hf_name for s in entry.parts]
    if entry.kind == "replicated":
      out[names[0]] = _same_replicas(entry.vllm_name, shards, range(p))
    elif entry.kind == "row":
      out[names[0]] = np.concatenate(shards, axis=1)
    elif entry.kind == "vocab":
      out[names[0]] = np.concatenate(shards, axis=0)[:cfg.vocab_size]
    elif entry.kind == "gate_up":
      half = shards[0].shape[0] // 2
      out[names[0]] = np.concatenate([s[:half] for s in shards], axis=0)
      out[names[1]] = np.concatenate([s[half:] for s in shards], axis=0)
    else:
      hd = cfg.resolved_head_dim
      q_rows, kv_rows = cfg.num_heads // p * hd, plan.kv_heads_per_rank * hd
      out[names[0]] = np.concatenate([s[:q_rows] for s in shards], axis=0)
      for offset, name in ((q_rows, names[1]), (q_rows + kv_rows, names[2])):
        pieces = []
        for first_rank in range(0, p, plan.kv_replicas):
          group = range(first_rank, first_rank + plan.kv_replicas)
          pieces.append(_same_replicas(f"{entry.vllm_name} ({name})",
                                       [shards[r][offset:offset + kv_rows] for r in group], group))
        out[name] = np.concatenate(pieces, axis=0)
  return out
