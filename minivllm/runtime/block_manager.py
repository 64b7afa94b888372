"""The KV block allocator: reference counts and prefix caching.

Blocks hold `block_size` tokens. A sequence's block table lists its blocks in order; a block is
shared by every sequence whose table holds it, and returns to the free queue when its reference
count drops to 0.

Prefix caching: once a block is full (all its tokens scheduled), it is registered under the
exact token prefix it ends: a node of a trie whose key is (the node of the prefix one block
shorter, this block's ids). Keys compare by content, so a hit can only be a block that holds
exactly the sequence's prefix: no hash is trusted. A node keeps every block registered under it,
so identical blocks computed separately (two sequences prefilling one prompt in different chunks,
or generating the same tokens) are all found: a new sequence walks the trie a block at a time and
takes one block of each node on its path, whichever sequence computed it.

A freed block that is registered stays registered, reusable by a later hit, until the allocator
needs it for new data: the free queue hands out unregistered blocks first, then registered ones
least recently freed first (LRU eviction). A sequence frees its blocks last-to-first, so that a
prefix's root outlives its tail. A node goes with its last block; its children, if any, are then
unreachable (node ids are never reused) and go with their own blocks. The last, partial block of
a sequence is never registered, so never shared; and a sequence never takes a hit covering its
last token (that token must be computed to produce logits), so an entirely cached prompt still
computes one block.

Sequences of a LoRA adapter compute other K/V from the same tokens: their trie hangs from a root
of its own, -lora_int_id (node ids are positive, the base model's root 0), so that a prefix is
shared only between sequences of one adapter (vLLM keys its prefix cache by the LoRA id too).
A sequence with a cache_salt hangs its trie from (that root, the salt), as vLLM folds the salt
into its first block's hash: its blocks are shared only with sequences of the same salt and
adapter, never with unsalted ones. A salt costs no table of its own: it lives in its first
blocks' keys, and goes with them.

The trie is dicts of ints and tuples of ints (and salts' strings), no object a node: the
garbage collector stops tracking those, so tens of thousands of cached blocks cost its passes
nothing (a first form with an object a node made benchmarks/prefix_cache_host.py's decode phase
20-35% dearer, most of it in collections).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

from .sequence import Sequence


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


ROOT = 0  # the empty prefix: the parent of every first block's node


def root_of(seq: Sequence) -> int | tuple[int, str]:
    """The trie root of seq's prefixes: ROOT for the base model, -lora_int_id for an adapter's;
    for a salted sequence, (that root, its cache_salt)."""
    root = -seq.lora_id
    return root if seq.cache_salt is None else (root, seq.cache_salt)


class _Block:
    __slots__ = ("ref", "node")

    def __init__(self):
        self.ref = 0
        self.node: int | None = None  # registered under this prefix (prefix cache), or None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [_Block() for _ in range(num_blocks)]
        # Blocks with ref 0, in the order they are handed out (first = next).
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # node -> the registered blocks holding its prefix's last block (one, unless computed twice)
        self.node_blocks: dict[int, tuple[int, ...]] = {}
        self.node_key: dict[int, tuple[int, tuple[int, ...]]] = {}  # node -> its key in the trie
        self.trie: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent node, block ids) -> node
        self.next_node = ROOT + 1
        # Blocks registered since the last commit(): their K/V is written only once the step
        # that schedules them runs, so a step that never runs must take them back (rollback).
        self.uncommitted: list[tuple[Sequence, int, int]] = []  # (seq, table index, block id)

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def registered_blocks(self) -> dict[int, tuple[int, ...]]:
        """Every registered block and the ids it holds."""
        return {b: self.node_key[node][1] for node, members in self.node_blocks.items()
                for b in members}

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks holding seq's leading full blocks, one a block, never covering its
        last token. Changes nothing."""
        # A prompt of embeddings has placeholder ids: blocks keyed by them would match any other
        # such prompt of the same length. Its blocks are never shared (nor registered, below).
        if not self.enable_prefix_caching or seq.prompt_embeds is not None:
            return []
        bs, ids, blocks, trie = self.block_size, seq.token_ids, self.blocks, self.trie
        hits: list[int] = []
        salt = seq.cache_salt  # root_of(seq), inline
        node = -seq.lora_id if salt is None else (-seq.lora_id, salt)
        for i in range((seq.num_tokens - 1) // bs):
            node = trie.get((node, tuple(ids[i * bs:(i + 1) * bs])))
            if node is None:
                break
            members = self.node_blocks[node]
            # A block some sequence holds already, if any: it costs no free block.
            hits.append(next((b for b in members if blocks[b].ref), members[0]))
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
            seq.block_table.append(b)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks of seq that the first `num_tokens` tokens fill (called when those
        tokens are scheduled: a sequence admitted later in the same step can share them, since a
        forward step writes every token's K/V before any attention reads the cache)."""
        bs = self.block_size
        # Most steps fill no new block (a decode fills one every block_size steps).
        if not self.enable_prefix_caching or num_tokens // bs <= seq.num_registered_blocks or \
                seq.prompt_embeds is not None:  # placeholder ids: see match_prefix
            return
        full = min(num_tokens // bs, len(seq.block_table))
        table, ids = seq.block_table, seq.token_ids
        for i in range(seq.num_registered_blocks, full):
            block = self.blocks[table[i]]
            if block.node is not None:  # a hit
                continue
            # The leading blocks are registered (they come first); their node is this one's
            # parent. None past the root only for a hit a rollback took back: the sequence is
            # preempted then, and registers nothing below it.
            parent = self.blocks[table[i - 1]].node if i else root_of(seq)
            if parent is None:
                full = i
                break
            key = (parent, tuple(ids[i * bs:(i + 1) * bs]))
            node = self.trie.get(key)
            if node is None:
                node = self.trie[key] = self.next_node
                self.next_node += 1
                self.node_key[node] = key
                self.node_blocks[node] = (table[i],)
            else:
                self.node_blocks[node] += (table[i],)
            block.node = node
            if (i + 1) * bs > seq.num_computed:  # its K/V comes with the step being scheduled
                self.uncommitted.append((seq, i, table[i]))
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

    def forget_uncommitted(self, seq: Sequence, since: int = 0) -> None:
        """rollback's for seq alone, of the blocks it registered past uncommitted[since:]: its
        chunk taken back out of the step being scheduled (Scheduler._unschedule; seq is then
        preempted), their K/V never written."""
        ours = self.uncommitted[since:]
        if any(s is seq for s, _, _ in ours):
            for s, _, b in reversed(ours):
                if s is seq:
                    self._evict(b)
            self.uncommitted[since:] = [e for e in ours if e[0] is not seq]

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
                if block.node is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table = []  # a new list: a table only ever grows in place (runner.StepInput)
        seq.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        """Forget every registered block that no sequence holds."""
        for b in list(self.free):
            self._evict(b)

    def forget_root(self, root: int) -> None:
        """Forget the registered blocks no sequence holds whose prefixes hang from trie root
        `root` (a LoRA id's, -lora_int_id, before the id names another adapter), salted or
        not."""
        top: dict[int, int | None] = {}  # node -> its root (None: unreachable, a parent gone)

        def root_of_node(node: int) -> int | None:
            path = []
            while node is not None and type(node) is not tuple and node > ROOT and \
                    node not in top:
                path.append(node)
                key = self.node_key.get(node)
                node = key[0] if key is not None else None
            if type(node) is tuple:  # a salted root: (the adapter's root, the salt)
                node = node[0]
            found = None if node is None else top.get(node, node)
            for n in path:
                top[n] = found
            return found

        doomed = [b for b in self.free
                  if self.blocks[b].node is not None and root_of_node(self.blocks[b].node) == root]
        for b in doomed:
            self._evict(b)

    def _take(self, b: int) -> None:
        block = self.blocks[b]
        if block.ref == 0:
            del self.free[b]
        block.ref += 1

    def _evict(self, b: int) -> None:
        """Unregister block b; its node goes with its last block."""
        block = self.blocks[b]
        node, block.node = block.node, None
        if node is None:
            return
        rest = tuple(x for x in self.node_blocks[node] if x != b)
        if rest:
            self.node_blocks[node] = rest
        else:
            del self.node_blocks[node]
            del self.trie[self.node_key.pop(node)]

    # -- for tests -------------------------------------------------------------------------------

    def check(self, seqs: Iterable[Sequence]) -> None:
        """AssertionError unless the reference counts equal the tables' holdings, the free queue
        holds exactly the unreferenced blocks, the trie and the blocks agree, and every
        sequence's registered blocks are registered along its own prefix."""
        holders = [0] * self.num_blocks
        for seq in seqs:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq} holds a block twice"
            for b in seq.block_table:
                holders[b] += 1
            parent = root_of(seq)
            for i, b in enumerate(seq.block_table[:seq.num_registered_blocks]):
                node = self.blocks[b].node
                if node is None:  # taken back by a rollback, and the sequence with it
                    break
                assert self.node_key[node] == (parent, tuple(seq.token_ids[i * self.block_size:
                                                                          (i + 1) * self.block_size])), \
                    f"{seq}'s block {i} is registered under another prefix"
                parent = node
        for b, block in enumerate(self.blocks):
            assert block.ref == holders[b], f"block {b}: ref {block.ref}, held {holders[b]} times"
            assert (block.ref == 0) == (b in self.free), f"block {b}: ref {block.ref}, free {b in self.free}"
            if block.node is not None:
                assert b in self.node_blocks.get(block.node, ()), f"block {b}'s node does not list it"
        assert len(self.trie) == len(self.node_key) == len(self.node_blocks)
        for node, members in self.node_blocks.items():
            assert members and len(set(members)) == len(members), f"node {node}: blocks {members}"
            assert all(self.blocks[b].node == node for b in members)
            assert self.trie[self.node_key[node]] == node
