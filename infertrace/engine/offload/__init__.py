"""CPU KV offload: a host tier of the prefix cache, and long contexts whose KV lives in host memory."""

from infertrace.engine.offload.chunked_attention import ChunkAttention, attend_chunk_reference, merge_partials
from infertrace.engine.offload.host_pool import HostKVPool, check_host_budget, host_available_bytes
from infertrace.engine.offload.kv_offload import COUNTER_NAMES, KVOffload
from infertrace.engine.offload.long_context import LongContext, ring_budget_tokens
from infertrace.engine.offload.prefix_tier import PrefixTier
from infertrace.engine.offload.transfers import Transfers

__all__ = [
    "COUNTER_NAMES",
    "ChunkAttention",
    "HostKVPool",
    "KVOffload",
    "LongContext",
    "PrefixTier",
    "Transfers",
    "attend_chunk_reference",
    "check_host_budget",
    "host_available_bytes",
    "merge_partials",
    "ring_budget_tokens",
]
