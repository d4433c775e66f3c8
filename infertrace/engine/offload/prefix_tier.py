"""The host tier of the prefix cache: full blocks stored eagerly, found by chained hash on a device miss, loaded back.

A block's KV is copied to the host pool as soon as the block is full and computed, so that when the device evicts
it the copy is already there. A request whose leading blocks miss on the device but hit here gets fresh device
blocks, and the copies into them are queued before the step that reads them. Host blocks are pinned while a copy
reads or writes them, and otherwise evicted least recently used first.
"""

from __future__ import annotations

import torch

from infertrace.engine.offload.host_pool import HostKVPool
from infertrace.engine.offload.transfers import D2H, H2D, Transfer, Transfers
from infertrace.engine.sequence import Sequence


def device_block_view(kv_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """The device KV cache [2, layers, slots, kv_heads, head_dim] as [2, layers, blocks, one block's row]."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or not kv_cache.is_contiguous():
        raise ValueError(
            f"KV offload expects a contiguous [2, layers, slots, kv_heads, head_dim] cache, got {tuple(kv_cache.shape)}"
        )
    two, layers, slots, heads, dim = kv_cache.shape
    return kv_cache.view(two, layers, slots // block_size, block_size * heads * dim)


def runs(sorted_ids: list[int]) -> list[tuple[int, int, int]]:
    """(position, first id, length) of each run of consecutive ids, so that a run moves in one copy."""
    out: list[tuple[int, int, int]] = []
    for pos, block_id in enumerate(sorted_ids):
        if out and out[-1][1] + out[-1][2] == block_id:
            p, first, n = out[-1]
            out[-1] = (p, first, n + 1)
        else:
            out.append((pos, block_id, 1))
    return out


class PrefixTier:
    def __init__(self, pool: HostKVPool, transfers: Transfers, kv_cache: torch.Tensor, block_size: int):
        self.pool = pool
        self.transfers = transfers
        self.block_size = block_size
        self.kv_blocks = device_block_view(kv_cache, block_size)
        self._filling: dict[int, Transfer] = {}  # host block -> the store writing it, until that finished
        self.blocks_stored = 0
        self.blocks_loaded = 0
        self.stores_skipped = 0  # blocks not stored because every host block was pinned

    def contains(self, block_hash: int) -> bool:
        return block_hash in self.pool.hash_to_block

    def match(self, seq: Sequence, first_block: int) -> list[int]:
        """Host blocks holding `seq`'s full blocks from `first_block` on, up to the first miss (changes nothing).

        As on the device, the last token is never served from the cache: its logits are needed.
        """
        bs = self.block_size
        hits = []
        for i in range(first_block, (len(seq) - 1) // bs):
            block_id = self.pool.lookup(seq.block_hash(i, bs), tuple(seq.block_tokens(i, bs)))
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def pin(self, host_ids: list[int]) -> None:
        """Keep hit blocks from eviction until their load finished (`load` releases them)."""
        for block_id in host_ids:
            self.pool.pin(block_id)
            self.pool.touch(block_id)

    def store(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Copy newly full device blocks, given as (device block, hash, tokens), to the host.

        A hash the host already holds is only marked as recently used."""
        pairs: list[tuple[int, int]] = []
        for device_id, block_hash, token_ids in blocks:
            known = self.pool.hash_to_block.get(block_hash)
            if known is not None:
                self.pool.touch(known)
                continue
            host_id = self.pool.allocate()
            if host_id is None:
                self.stores_skipped += 1
                continue
            self.pool.publish(host_id, block_hash, token_ids)
            pairs.append((host_id, device_id))
        if not pairs:
            return
        pairs.sort()
        host_ids = [h for h, _ in pairs]
        index = torch.tensor([d for _, d in pairs], dtype=torch.long).to(self.kv_blocks.device, non_blocking=True)
        # gathered on the compute stream right after the forward that wrote them: the device blocks may be reused
        # from the next step on without waiting for the copy
        staging = self.kv_blocks.index_select(2, index).permute(2, 0, 1, 3).reshape(len(pairs), -1)
        copies = [(self.pool.tensor[first : first + n], staging[pos : pos + n]) for pos, first, n in runs(host_ids)]

        def done() -> None:
            # a host block is pinned until its store finished, so no later store can have taken its entry
            for block_id in host_ids:
                self._filling.pop(block_id, None)
                self.pool.unpin(block_id)

        transfer = self.transfers.copy(D2H, copies, keep_alive=[staging], on_done=done)
        if transfer.end is not None:
            self._filling.update(dict.fromkeys(host_ids, transfer))
        self.blocks_stored += len(pairs)

    def load(self, host_ids: list[int], device_ids: list[int]) -> None:
        """Copy pinned host blocks into device blocks before the compute stream's next work; unpins them when done."""
        if not host_ids:
            return
        order = sorted(range(len(host_ids)), key=host_ids.__getitem__)
        sorted_host = [host_ids[i] for i in order]
        two, layers, _, row = self.kv_blocks.shape
        device = self.kv_blocks.device
        staging = torch.empty((len(order), self.pool.block_numel), dtype=self.kv_blocks.dtype, device=device)
        copies = [(staging[pos : pos + n], self.pool.tensor[first : first + n]) for pos, first, n in runs(sorted_host)]
        filling = [self._filling.get(block_id) for block_id in sorted_host]

        def done() -> None:
            for block_id in sorted_host:
                self.pool.unpin(block_id)

        transfer = self.transfers.copy(H2D, copies, after=filling, keep_alive=[staging], on_done=done)
        self.transfers.wait(transfer)
        index = torch.tensor([device_ids[i] for i in order], dtype=torch.long).to(device, non_blocking=True)
        self.kv_blocks.index_copy_(2, index, staging.view(len(order), two, layers, row).permute(1, 2, 0, 3))
        self.blocks_loaded += len(order)
