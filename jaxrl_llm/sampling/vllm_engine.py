"""The vLLM engine's set-up: import, worker extension, fingerprint checks and ``vllm.LLM`` arguments.

What :class:`jaxrl_llm.sampling.vllm_sampler.VllmSampler` checks and builds
before it samples, as functions that run without a GPU:

* :func:`import_vllm` and :func:`ensure_worker_extension_importable`: vLLM
  and the worker extension ``third_party.vllm_weight_sync.WeightSyncExtension``
  (which receives published weights without a restart), with errors that say
  how to install them;
* :func:`sampler_fingerprint` / :func:`check_sampler_fingerprint`: the
  tokenizer and model config the engine will load must be the learner's;
* :func:`check_engine_layout`: the engine's per-rank parameter shapes against
  the reshard plan of tensor-parallel publishing;
* :class:`VllmEngineConfig`: the ``vllm.LLM`` keyword arguments and the
  weight transport (:mod:`jaxrl_llm.bridge.weight_transport`).

vllm and torch are imported inside functions only: importing this module
never imports them.

References:
  vLLM, https://github.com/vllm-project/vllm (``LLM``, ``collective_rpc``,
  ``worker_extension_cls``, ``logprobs_mode``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any, Mapping, Optional, Sequence

from jaxrl_llm.bridge import fingerprint as fp_lib
from jaxrl_llm.bridge import hf_config
from jaxrl_llm.bridge.reshard import ReshardPlan
from jaxrl_llm.bridge.tokenizer import Tokenizer
from jaxrl_llm.bridge.weight_transport import DEFAULT_BUCKET_BYTES, TRANSPORTS, WeightTransport, make_transport
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.sampling import layout
from jaxrl_llm.sampling.base import SamplerConfig

VLLM_HINT = ("install the [vllm] extra on a CUDA machine: pip install 'jaxrl_llm[vllm]' "
             "(vLLM >= 0.10.2, which has logprobs_mode='processed_logprobs')")
WORKER_EXTENSION = "third_party.vllm_weight_sync.WeightSyncExtension"
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
    ipc_device / nccl_device: the sender's CUDA device of those transports.
    ipc_devices: the CUDA devices of every engine worker (one per rank) when the
      sender sees them all (a sampler actor); empty: ``(ipc_device,)``.
    nccl_host / nccl_port: rendezvous of the NCCL group.
    executor_backend: vLLM's ``distributed_executor_backend`` at P > 1 ("mp":
      worker processes that inherit the GPUs Ray gave the actor; "ray" would
      ask Ray for GPUs again).
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
  ipc_devices: tuple[str, ...] = ()
  nccl_device: str = "cuda:0"
  nccl_host: str = "127.0.0.1"
  nccl_port: int = 29517
  executor_backend: str = "mp"
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
    if self.executor_backend not in ("mp", "ray"):
      errors.append(f"executor_backend={self.executor_backend!r}: expected 'mp' or 'ray'")
    reserved = sorted(set(self.extra_engine_args) & set(_RESERVED_ENGINE_ARGS))
    if reserved:
      errors.append(f"extra_engine_args sets {reserved}, which VllmSampler sets itself")
    if errors:
      raise ValueError("Invalid VllmEngineConfig: " + "; ".join(errors))

  def engine_dtype(self, model_config: ModelConfig) -> str:
    return self.dtype or model_config.param_dtype

  def in_actor(self, nccl_port: int) -> "VllmEngineConfig":
    """This config for a process that holds exactly the engine's GPUs, plus the NCCL sender's (a
    sampler actor; :func:`jaxrl_llm.rollout.placement.gpus_per_actor`).

    The engine's workers take ``cuda:0 .. cuda:P-1`` of the actor's visible GPUs; the IPC
    sender shares buffers on each of them; the NCCL sender broadcasts from the extra
    ``cuda:P`` over loopback on ``nccl_port`` (one group per actor).
    """
    p = int(self.tensor_parallel_size)
    return dataclasses.replace(self, ipc_devices=tuple(f"cuda:{i}" for i in range(p)), nccl_device=f"cuda:{p}",
                               nccl_host="127.0.0.1", nccl_port=int(nccl_port))

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
        **({"distributed_executor_backend": self.executor_backend} if self.tensor_parallel_size > 1 else {}),
        **dict(self.extra_engine_args))

  def make_transport(self, model_config: ModelConfig) -> WeightTransport:
    """The weight transport this config names, casting to the engine dtype."""
    dtype = self.engine_dtype(model_config)
    if self.transport == "object_store":
      return make_transport("object_store", tp_size=self.tensor_parallel_size, dtype=dtype,
                            bucket_bytes=self.bucket_bytes)
    if self.transport == "ipc":
      return make_transport("ipc", device=self.ipc_device, devices=self.ipc_devices, dtype=dtype,
                            bucket_bytes=self.bucket_bytes)
    return make_transport("nccl", host=self.nccl_host, port=self.nccl_port, device=self.nccl_device, dtype=dtype,
                          bucket_bytes=self.bucket_bytes)


__all__ = ["VLLM_HINT", "VllmEngineConfig", "WORKER_EXTENSION", "check_engine_layout", "check_sampler_fingerprint",
           "ensure_worker_extension_importable", "import_vllm", "sampler_fingerprint"]
