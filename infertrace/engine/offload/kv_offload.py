"""The engine's host tiers of KV: one host pool shared by the prefix-cache tier and long-context requests."""

from __future__ import annotations

from typing import Any

from infertrace.engine.block_manager import BlockManager
from infertrace.engine.config import EngineConfig
from infertrace.engine.offload.host_pool import HostKVPool
from infertrace.engine.offload.long_context import LongContext
from infertrace.engine.offload.prefix_tier import PrefixTier
from infertrace.engine.offload.transfers import Transfers

# engine counters this module keeps up to date (cumulative)
COUNTER_NAMES = (
    "offload_blocks_stored",
    "offload_blocks_loaded",
    "offload_host_evictions",
    "offload_bytes_h2d",
    "offload_bytes_d2h",
    "offload_transfer_seconds",  # copy time on the copy streams (wall time of the copies on a CPU device)
    "long_context_requests",
    "long_context_steps",
)


class KVOffload:
    def __init__(self, config: EngineConfig, runner, block_manager: BlockManager, host_blocks: int, max_model_len: int):
        spec = runner.spec
        pin = runner.device.type == "cuda"
        try:
            self.pool = HostKVPool(
                host_blocks,
                spec.num_hidden_layers,
                config.block_size,
                spec.num_key_value_heads,
                spec.head_dim,
                runner.dtype,
                pin_memory=pin,
            )
        except RuntimeError as exc:  # the host refused the (pinned) allocation
            kind = "pinned host memory" if pin else "host memory"
            raise ValueError(
                f"could not allocate {kind} for offload_host_gb={config.offload_host_gb:g}: "
                f"{str(exc).splitlines()[0]}; lower offload_host_gb"
            ) from None
        self.transfers = Transfers(runner.device)
        self.prefix: PrefixTier | None = None
        self.long: LongContext | None = None
        if config.offload_prefix:
            self.prefix = PrefixTier(self.pool, self.transfers, runner.kv_cache, config.block_size)
            block_manager.kept_elsewhere = self.prefix.contains
            self.pool.on_evict = block_manager.note_dropped
        if config.offload_long:
            device_tokens = block_manager.num_blocks * config.block_size
            self.long = LongContext(config, runner, self.pool, self.transfers, device_tokens, max_model_len)

    def poll(self) -> None:
        """Account finished copies and release the host blocks they pinned."""
        self.transfers.poll()

    def load(self, loads: list[tuple[list[int], list[int]]]) -> None:
        """Queue the host-tier hits' copies into their device blocks before the step's forward."""
        if loads:
            self.prefix.load([h for hs, _ in loads for h in hs], [d for _, ds in loads for d in ds])

    def store(self, published: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Queue copies of newly full device blocks to the host tier."""
        if published and self.prefix is not None:
            self.prefix.store(published)

    def counters(self) -> dict[str, float]:
        t = self.transfers
        return {
            "offload_blocks_stored": self.prefix.blocks_stored if self.prefix else 0,
            "offload_blocks_loaded": self.prefix.blocks_loaded if self.prefix else 0,
            "offload_host_evictions": self.pool.num_evictions,
            "offload_bytes_h2d": t.bytes_h2d,
            "offload_bytes_d2h": t.bytes_d2h,
            "offload_transfer_seconds": t.seconds,
            "long_context_requests": self.long.num_sequences if self.long else 0,
            "long_context_steps": self.long.num_steps if self.long else 0,
        }

    def describe(self) -> dict[str, Any]:
        """Sizes and choices, for server info and benchmark provenance."""
        info: dict[str, Any] = {
            "host_blocks": self.pool.num_blocks,
            "host_bytes": self.pool.nbytes,
            "host_pinned": self.pool.tensor.is_pinned(),
        }
        if self.long is not None:
            info |= {
                "ring_slots": self.long.num_slots,
                "chunk_tokens": self.long.chunk_tokens,
                "ring_bytes": self.long.ring_nbytes,
                "chunk_attention": self.long.attention.name,
                "device_tokens": self.long.device_tokens,
            }
        return info
