"""The KV block allocator: reference counts and prefix caching.

Blocks hold `block_size` tokens. A sequence's block table lists its blocks in order; a block is
shared by every sequence whose table holds it, and returns to the free queue when its reference
count drops to 0.

Prefix caching: once a block is full (all its tokens scheduled), it is registered under a hash
chained over the full blocks before it: hash(parent's hash, this block's ids). A new sequence
walks its own chain and takes every registered block that matches, and computes only the rest.
A hit is confirmed, not trusted: the block's stored ids must equal the sequence's, and its stored
parent must be the block matched one level up (identified by (block id, tenancy), where a
block's tenancy changes every time it is handed out again). By induction a hit therefore holds
exactly the sequence's prefix, whatever the hash function does; the hash only finds candidates.

A freed block that is registered stays registered, reusable by a later hit, until the allocator
needs it for new data: the free queue hands out unregistered blocks first, then registered ones
least recently freed first (LRU eviction). A sequence frees its blocks last-to-first, so that a
prefix's root outlives its tail. The last, partial block of a sequence is never registered, so
never shared; and a sequence never takes a hit covering its last token (that token must be
computed to produce logits), so an entirely cached prompt still computes one block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Iterable

from .sequence import Sequence


def chain_hash(parent: int | None, ids: tuple[int, ...]) -> int:
    """The default block hash: Python's (deterministic) hash of the parent hash and the ids."""
    return hash((parent, ids))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Block:
    __slots__ = ("ref", "hash", "ids", "parent", "tenancy")

    def __init__(self):
        self.ref = 0
        self.hash: int | None = None  # registered under this hash (prefix cache), or None
        self.ids: tuple[int, ...] | None = None  # the ids it was registered with
        self.parent: tuple[int, int] | None = None  # (block id, tenancy) one level up
        self.tenancy = 0  # bumped each time the block is handed out for new data


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int | None, tuple[int, ...]], int] = chain_hash):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [_Block() for _ in range(num_blocks)]
        # Blocks with ref 0, in the order they are handed out (first = next).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.registry: dict[int, int] = {}  # hash -> block id
        # Blocks registered since the last commit(): their K/V is written only once the step
        # that schedules them runs, so a step that never runs must take them back (rollback).
        self.uncommitted: list[tuple[Sequence, int, int]] = []  # (seq, table index, block id)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """The chain hash of seq's i-th full block (memoised on the sequence: ids never change)."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else None
            seq.block_hashes.append(self.hash_fn(parent, tuple(seq.token_ids[j * bs:(j + 1) * bs])))
        return seq.block_hashes[i]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The registered blocks holding seq's leading full blocks (confirmed, see module doc),
        never covering its last token. Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent = None
        for i in range((seq.num_tokens - 1) // bs):
            b = self.registry.get(self._block_hash(seq, i))
            if b is None:
                break
            block = self.blocks[b]
            if block.ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]) or block.parent != parent:
                break
            hits.append(b)
            parent = (b, block.tenancy)
        return hits

    def can_allocate(self, seq: Sequence, num_tokens: int, hits: Iterable[int] = ()) -> bool:
        """Whether seq's table can grow to hold `num_tokens` tokens (taking `hits` first)."""
        if len(seq.block_table) * self.block_size >= num_tokens:
            return True  # it holds them already: most decode steps
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if not hits:  # a running sequence growing (every step, for each): nothing to count
            return need <= len(self.free)
        hits = list(hits)
        need -= len(hits)
        # A hit on a free block takes it out of the free queue too.
        available = self.num_free - sum(1 for b in hits if self.blocks[b].ref == 0)
        return need <= available

    # -- changes ---------------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int, hits: Iterable[int] = ()) -> None:
        """Grow seq's table to hold `num_tokens` tokens: first the prefix-cache `hits` (only for
        an empty table), then fresh blocks. Call can_allocate first."""
        if not hits and len(seq.block_table) * self.block_size >= num_tokens:
            return  # the table holds them already: most decode steps
        hits = list(hits)
        if hits:
            if seq.block_table:
                raise RuntimeError("prefix-cache hits go to a sequence with no blocks")
            for b in hits:
                self._take(b)
            seq.block_table.extend(hits)
            seq.num_registered_blocks = len(hits)
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            raise RuntimeError(f"out of KV blocks: need {need}, {self.num_free} free")
        for _ in range(need):
            b = next(iter(self.free))
            self._evict(b)
            self._take(b)
            self.blocks[b].tenancy += 1
            seq.block_table.append(b)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks of seq that the first `num_tokens` tokens fill (called when those
        tokens are scheduled: a sequence admitted later in the same step can share them, since a
        forward step writes every token's K/V before any attention reads the cache)."""
        bs = self.block_size
        # Most steps fill no new block (a decode fills one every block_size steps).
        if not self.enable_prefix_caching or num_tokens // bs <= seq.num_registered_blocks:
            return
        full = min(num_tokens // bs, len(seq.block_table))
        for i in range(seq.num_registered_blocks, full):
            b = seq.block_table[i]
            block = self.blocks[b]
            h = self._block_hash(seq, i)
            # A hit is registered already; an identical block computed twice keeps the first.
            if block.hash is None and h not in self.registry:
                block.hash = h
                block.ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
                prev = seq.block_table[i - 1] if i else None
                block.parent = None if prev is None else (prev, self.blocks[prev].tenancy)
                self.registry[h] = b
                if (i + 1) * bs > seq.num_computed:  # its K/V comes with the step being scheduled
                    self.uncommitted.append((seq, i, b))
        seq.num_registered_blocks = max(seq.num_registered_blocks, full)

    def commit(self) -> None:
        """The step that registered the uncommitted blocks is launched: their K/V will be in the
        cache before any later step reads it (one stream, in order)."""
        self.uncommitted.clear()

    def rollback(self) -> set[int]:
        """The step that registered the uncommitted blocks will never run: unregister them
        (their K/V was never written) and let their sequences register them again once
        computed. Returns their block ids."""
        taken = set()
        for seq, i, b in reversed(self.uncommitted):
            self._evict(b)
            if seq.block_table[i:i + 1] == [b]:
                seq.num_registered_blocks = min(seq.num_registered_blocks, i)
            taken.add(b)
        self.uncommitted.clear()
        return taken

    def free_blocks(self, seq: Sequence) -> None:
        """Drop seq's references, last block first. Registered blocks stay reusable, queued
        behind unregistered ones and in the order they were freed (LRU)."""
        for b in reversed(seq.block_table):
            block = self.blocks[b]
            if block.ref <= 0:
                raise RuntimeError(f"block {b} freed twice")
            block.ref -= 1
            if block.ref == 0:
                self.free[b] = None
                if block.hash is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table = []
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every registered block that no sequence holds."""
        for b in list(self.free):
            self._evict(b)

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref == 0:
            del self.free[b]
        block.ref += 1

    def _evict(self, b: int) -> None:
        block = self.blocks[b]
        if block.hash is not None:
            if self.registry.get(block.hash) == b:
                del self.registry[block.hash]
            block.hash = block.ids = block.parent = None

    # -- for tests -------------------------------------------------------------------------------

    def check(self, seqs: Iterable[Sequence]) -> None:
        """AssertionError unless the reference counts equal the tables' holdings, the free queue
        holds exactly the unreferenced blocks, and the registry and the blocks agree."""
        holders = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
            for b in seq.block_table:
                holders[b] += 1
        for b, block in enumerate(self.blocks):
            assert block.ref == holders[b], f"block {b}: ref {block.ref}, held {holders[b]} times"
            assert (block.ref == 0) == (b in self.free), f"block {b}: ref {block.ref}, free {b in self.free}"
        for h, b in self.registry.items():
            assert self.blocks[b].hash == h, f"registry says block {b} has hash {h}"
