"""The host KV pool: pinned host memory cut into blocks of the device pool's block size.

Each block is one contiguous run of memory holding K and V of every layer, [2, layers, block_size, kv_heads,
head_dim], so that moving a block is one copy: a strided host copy runs at a small fraction of the bus's bandwidth.
Blocks carry reference counts (a block is pinned while a copy reads or writes it), and full blocks of the prefix
cache stay findable by chained hash until the least recently used unreferenced one is taken for new content. A
long sequence takes a run of consecutive blocks and lays its KV out layer-major inside it (see `region`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable

import torch

from infertrace.engine.block_manager import Block


def host_available_bytes() -> int | None:
    """Memory the host can still hand out (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_budget(host_gb: float, block_bytes: int) -> int:
    """Blocks a host pool of `host_gb` GiB holds; one clear error when the host cannot give that memory."""
    want = int(host_gb * 1024**3)
    available = host_available_bytes()
    if available is not None and want > available:
        raise ValueError(
            f"offload_host_gb={host_gb:g} asks for {want / 1024**3:.2f} GiB of host memory but only "
            f"{available / 1024**3:.2f} GiB is available; lower offload_host_gb"
        )
    blocks = want // block_bytes
    if blocks < 1:
        raise ValueError(
            f"offload_host_gb={host_gb:g} is smaller than one KV block ({block_bytes} bytes); raise offload_host_gb"
        )
    return blocks


class HostKVPool:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        pin_memory: bool,
    ):
        assert num_blocks >= 1
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.row_shape = (num_kv_heads, head_dim)
        self.block_numel = 2 * num_layers * block_size * num_kv_heads * head_dim
        # untouched until written: no block is read before a copy has filled it
        self.tensor = torch.empty((num_blocks, self.block_numel), dtype=dtype, pin_memory=pin_memory)
        self.block_nbytes = self.block_numel * self.tensor.element_size()
        self.blocks = [Block(i) for i in range(num_blocks)]  # same bookkeeping as a device block
        self.hash_to_block: dict[int, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # hold nothing reusable
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced, findable by hash; LRU first
        self.on_evict: Callable[[int], None] | None = None  # called with the hash of an evicted block
        self.num_evictions = 0

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_nbytes

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take (free or unreferenced cached)."""
        return len(self._free) + len(self._cached)

    # ----- prefix-cache blocks -----
    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The block holding these tokens under this chained hash (a hash alone is never trusted)."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def touch(self, block_id: int) -> None:
        """Mark a cached block as recently used."""
        if block_id in self._cached:
            self._cached.move_to_end(block_id)

    def allocate(self) -> int | None:
        """A block for new content, pinned once; None when every block is pinned."""
        if self._free:
            block_id, _ = self._free.popitem(last=False)
        elif self._cached:
            block_id, _ = self._cached.popitem(last=False)
            self._forget(block_id)
        else:
            return None
        self.blocks[block_id].ref_count = 1
        return block_id

    def publish(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Make a block (allocated for it) findable under `block_hash`."""
        block = self.blocks[block_id]
        assert block.hash is None and block_hash not in self.hash_to_block
        block.hash, block.token_ids = block_hash, token_ids
        self.hash_to_block[block_hash] = block_id

    def reset_prefix_cache(self) -> int:
        """Forget every unpinned cached block (they become free); returns how many. Not counted as evictions."""
        for block_id in self._cached:
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
            self._free[block_id] = None
        forgotten = len(self._cached)
        self._cached.clear()
        return forgotten

    def pin(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self._cached.pop(block_id, None)
            self._free.pop(block_id, None)
        block.ref_count += 1

    def unpin(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"host block {block_id} unpinned twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._cached[block_id] = None  # most recently used end
            else:
                self._free[block_id] = None

    # ----- runs for long sequences -----
    def find_run(self, length: int) -> int | None:
        """First block of `length` consecutive unreferenced blocks, the window evicting fewest cached ones."""
        if length > self.num_blocks:
            return None
        best, best_cost = None, None
        ok = cost = 0  # unreferenced blocks ending here / cached blocks in the current window
        for i, block in enumerate(self.blocks):
            ok = ok + 1 if block.ref_count == 0 else 0
            cost += block.hash is not None and block.ref_count == 0
            if i >= length:
                prev = self.blocks[i - length]
                cost -= prev.hash is not None and prev.ref_count == 0
            if ok >= length and (best_cost is None or cost < best_cost):
                best, best_cost = i - length + 1, cost
                if cost == 0:
                    break
        return best

    def allocate_run(self, length: int) -> int | None:
        first = self.find_run(length)
        if first is None:
            return None
        for block_id in range(first, first + length):
            self._free.pop(block_id, None)
            self._cached.pop(block_id, None)
            self._forget(block_id)
            self.blocks[block_id].ref_count = 1
        return first

    def free_run(self, first: int, length: int) -> None:
        for block_id in range(first, first + length):
            self.unpin(block_id)

    def region(self, first: int, length: int) -> torch.Tensor:
        """Blocks [first, first+length) as one [layers, 2, tokens, kv_heads, head_dim] layer-major region.

        Layer-major inside the run makes the (layer, token range) a long sequence streams one contiguous copy.
        """
        flat = self.tensor[first : first + length].view(-1)
        return flat.view(self.num_layers, 2, length * self.block_size, *self.row_shape)

    def _forget(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.hash_to_block[block.hash]
            evicted = block.hash
            block.hash = block.token_ids = None
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(evicted)

    def check_consistency(self) -> None:
        """Assert the pool's invariants (for tests)."""
        for block in self.blocks:
            # an unreferenced block is on exactly one of the two lists, a referenced one on none
            listed = (block.block_id in self._free) + (block.block_id in self._cached)
            assert listed == (block.ref_count == 0), (block.block_id, block.ref_count, listed)
            assert not (block.block_id in self._free and block.hash is not None)
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
