"""Paged KV blocks: allocation, reference counts and the prefix cache.

A full block whose KV is computed is published under the chained hash of its tokens. A request whose leading
blocks hash the same (and hold the same tokens: a hash alone is never trusted) shares those blocks instead of
recomputing them. A block nobody references keeps its content and stays findable until it is needed for new
tokens; the least recently freed is taken first.

Hashes of full blocks whose KV was dropped from every tier are remembered (a bounded log), so that computing the
same tokens again can be counted as recomputation.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

from infertrace.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, cached={self.hash is not None})"


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self._free: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # unreferenced, still in the prefix cache; LRU first
        # hashes whose KV no tier holds any more, most recent last; bounded
        self.dropped: OrderedDict[int, None] = OrderedDict()
        self.dropped_capacity = max(4096, 4 * num_blocks)
        self.kept_elsewhere: Callable[[int], bool] | None = None  # another tier (the host) still holds this hash

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, seq: Sequence, num_new_tokens: int, num_table_blocks: int | None = None) -> int:
        """Blocks to add to `seq`'s table so that its next `num_new_tokens` tokens have slots."""
        table = len(seq.block_table) if num_table_blocks is None else num_table_blocks
        computed = seq.num_computed_tokens if num_table_blocks is None else num_table_blocks * self.block_size
        return max(0, self.blocks_needed(computed + num_new_tokens) - table)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding `seq`'s leading full blocks (changes nothing).

        The last token is never served from the cache: its logits are needed to sample the next one.
        """
        if not self.prefix_caching:
            return []
        hits = []
        for i in range((len(seq) - 1) // self.block_size):
            block_id = self.hash_to_block.get(seq.block_hash(i, self.block_size))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(seq.block_tokens(i, self.block_size)):
                break  # a hash collision: different tokens
            hits.append(block_id)
        return hits

    def is_referenced(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count > 0

    def claim(self, seq: Sequence, hits: list[int]) -> None:
        """Give a sequence with no blocks the cached blocks `hits` (from match_prefix) as its leading blocks."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._cached_free[block_id]
            block.ref_count += 1
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extend `seq`'s block table to cover its next `num_new_tokens` tokens; the caller checked there is room."""
        need = self.num_new_blocks(seq, num_new_tokens)
        assert need <= self.num_free_blocks, f"allocating {need} blocks with {self.num_free_blocks} free"
        for _ in range(need):
            seq.block_table.append(self._take_free_block())

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks first, so that they are also the first to be evicted."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks that hold `seq`'s first `num_tokens` slots: those past them (slots written for draft
        tokens the verify step rejected) go back to the pool."""
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self._cached_free[block_id] = None
            else:
                self._free.append(block_id)

    def register_full_blocks(self, seq: Sequence) -> list[tuple[int, int, tuple[int, ...]]]:
        """Publish `seq`'s full, computed blocks to the prefix cache; returns the newly published ones as
        (block id, hash, tokens)."""
        if not self.prefix_caching:
            return []
        published = []
        num_full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        for i in range(seq.num_registered_blocks, num_full):
            block = self.blocks[seq.block_table[i]]
            h = seq.block_hash(i, self.block_size)
            if block.hash is None and h not in self.hash_to_block:
                block.hash = h
                block.token_ids = tuple(seq.block_tokens(i, self.block_size))
                self.hash_to_block[h] = block.block_id
                self.dropped.pop(h, None)
                published.append((block.block_id, h, block.token_ids))
            # else: the same content is already cached in another block; this copy stays private
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)
        return published

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block (they become plain free blocks); returns how many."""
        for block_id in self._cached_free:
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash = block.token_ids = None
            self._free.append(block_id)
        forgotten = len(self._cached_free)
        self._cached_free.clear()
        return forgotten

    def note_dropped(self, block_hash: int) -> None:
        """Remember that no tier holds the KV of `block_hash` any more (unless this cache still does)."""
        if block_hash in self.hash_to_block:
            return
        self.dropped[block_hash] = None
        self.dropped.move_to_end(block_hash)
        while len(self.dropped) > self.dropped_capacity:
            self.dropped.popitem(last=False)

    def num_dropped_blocks(self, seq: Sequence, first_block: int) -> int:
        """Leading full blocks of `seq` from `first_block` on whose KV was computed once and dropped since."""
        if not self.prefix_caching or not self.dropped:
            return 0
        n = 0
        for i in range(first_block, (len(seq) - 1) // self.block_size):
            if seq.block_hash(i, self.block_size) not in self.dropped:
                break
            n += 1
        return n

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._cached_free.popitem(last=False)
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            if self.kept_elsewhere is None or not self.kept_elsewhere(block.hash):
                self.note_dropped(block.hash)
            block.hash = None
            block.token_ids = None
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"block {block_id} allocated twice"
        block.ref_count = 1
        return block_id

    def check_consistency(self, live: list[Sequence]) -> None:
        """Assert the invariants against the sequences that hold blocks (for tests and debugging)."""
        refs = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"{block} but {refs[block.block_id]} tables hold it"
        free = list(self._free) + list(self._cached_free)
        assert len(free) == len(set(free)), "a block is free twice"
        assert all(self.blocks[b].ref_count == 0 for b in free), "a referenced block is on a free list"
        assert all(self.blocks[b].hash is None for b in self._free)
        assert self.num_free_blocks + sum(1 for b in self.blocks if b.ref_count > 0) == self.num_blocks
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h
