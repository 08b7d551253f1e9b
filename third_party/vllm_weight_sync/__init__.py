"""vLLM worker extension for in-flight weight updates from the jaxrl_llm learner.

Pass ``worker_extension_cls="third_party.vllm_weight_sync.WeightSyncExtension"``
to ``vllm.LLM``; its methods then run on every worker through
``LLM.collective_rpc(name, args=...)``. The wire format of tensors is in
:mod:`third_party.vllm_weight_sync.wire`.
"""

from third_party.vllm_weight_sync.extension import WeightSyncExtension
from third_party.vllm_weight_sync.wire import WIRE_DTYPES, check_entry, entries_nbytes, entry_to_torch

__all__ = ["WIRE_DTYPES", "WeightSyncExtension", "check_entry", "entries_nbytes", "entry_to_torch"]
