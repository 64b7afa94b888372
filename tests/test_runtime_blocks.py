"""Hypothesis state machine for the block allocator: random sequences that share prefixes grow,
free and come back. A mock "KV cache" records, for every slot written, the whole token prefix
whose K/V it would hold; a sequence must always read its own prefix back through its block
table, so a wrong prefix-cache hit, an overwritten shared block or a leaked block all fail; and
every prefix a live sequence registered must be found again in full, whoever computed its
blocks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant, precondition,
                                 rule)

from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.sampling_params import SamplingParams
from minivllm.runtime.sequence import Sequence

BS = 2
TOKENS = st.lists(st.integers(0, 1), min_size=1, max_size=12)  # a tiny alphabet: prefixes repeat


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(10, BS)
        self.live: list[Sequence] = []
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix held
        self.next_id = 0
        self.hits = 0

    seqs = Bundle("seqs")

    def _compute(self, seq: Sequence, end: int) -> None:
        """Write K/V for positions num_computed..end-1 (what a forward step does)."""
        for pos in range(seq.num_computed, end):
            slot = (seq.block_table[pos // BS], pos % BS)
            assert self.bm.blocks[slot[0]].ref == 1, "a sequence writes into a shared block"
            self.slots[slot] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed = end
        self.bm.register_full_blocks(seq, end)

    @rule(target=seqs, tokens=TOKENS, chunk=st.integers(1, 14))
    def admit(self, tokens, chunk):
        seq = Sequence(self.next_id, str(self.next_id), 0, tokens, SamplingParams(), 0)
        self.next_id += 1
        hits = self.bm.match_prefix(seq)
        cached = len(hits) * BS
        assert cached < seq.num_tokens, "a hit covered the last token"
        end = min(seq.num_tokens, cached + chunk)
        if not self.bm.can_allocate(seq, end, hits):
            return seq  # stays unadmitted (no blocks): a later rule may free some
        free_before = self.bm.num_free
        self.bm.allocate(seq, end, hits)
        fresh = self.bm.blocks_for(end) - len(hits)
        taken_from_free = sum(1 for b in hits if self.bm.blocks[b].ref == 1)
        assert self.bm.num_free == free_before - fresh - taken_from_free
        self.hits += len(hits)
        seq.num_computed = cached
        self._compute(seq, end)
        self.live.append(seq)
        return seq

    @rule(seq=seqs, new=st.lists(st.integers(0, 1), max_size=6), chunk=st.integers(1, 8))
    def grow(self, seq, new, chunk):
        """Finish (part of) the prefill, or append decoded tokens and compute them."""
        if seq not in self.live:
            return
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.extend(new)
        end = min(seq.num_tokens, seq.num_computed + chunk)
        if end == seq.num_computed or not self.bm.can_allocate(seq, end):
            return
        self.bm.allocate(seq, end)
        self._compute(seq, end)

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.live:
            self.bm.free_blocks(seq)
            self.live.remove(seq)
        assert seq.block_table == []

    def _unshared(self):
        return [s for s in self.live if all(self.bm.blocks[b].ref == 1 for b in s.block_table)]

    @precondition(lambda self: self._unshared())
    @rule(data=st.data())
    def double_free_is_caught(self, data):
        seq = data.draw(st.sampled_from(self._unshared()))
        ghost = Sequence(-1, "ghost", 0, [0], SamplingParams(), 0)
        ghost.block_table = list(seq.block_table)
        self.bm.free_blocks(seq)
        self.live.remove(seq)
        if ghost.block_table:
            with pytest.raises(RuntimeError, match="freed twice"):
                self.bm.free_blocks(ghost)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()

    @invariant()
    def refcounts_consistent(self):
        self.bm.check(self.live)
        assert self.bm.num_free + len({b for s in self.live for b in s.block_table}) == self.bm.num_blocks

    @invariant()
    def every_sequence_reads_its_own_prefix(self):
        for seq in self.live:
            for pos in range(seq.num_computed):
                held = self.slots.get((seq.block_table[pos // BS], pos % BS))
                assert held == tuple(seq.token_ids[:pos + 1]), f"{seq} reads a wrong prefix at {pos}"

    @invariant()
    def registered_blocks_hold_their_ids(self):
        for b, ids in self.bm.registered_blocks().items():
            for off, t in enumerate(ids):
                assert self.slots[(b, off)][-1] == t

    @invariant()
    def every_registered_prefix_is_found_again(self):
        """A new sequence whose prompt starts with a live sequence's registered blocks (and one
        more token, which must be computed) hits all of them: identical blocks computed by two
        sequences in different chunks do not cut the chain."""
        for seq in self.live:
            n = seq.num_registered_blocks
            probe = Sequence(-2, "probe", 0, seq.token_ids[:n * BS] + [0], SamplingParams(), 0)
            hits = self.bm.match_prefix(probe)
            assert len(hits) == n, f"{seq}: {n} blocks registered, {len(hits)} found"

    def teardown(self):
        for seq in self.live:
            self.bm.free_blocks(seq)
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks


TestAllocator = AllocatorMachine.TestCase
# Few blocks and a tiny alphabet make sharing, duplicates and eviction frequent; more examples
# than the profile's default, because these run in milliseconds.
TestAllocator.settings = settings(TestAllocator.settings, max_examples=200)


def _seq(i, tokens):
    return Sequence(i, str(i), 0, tokens, SamplingParams(), 0)


def test_prefix_hits_share_blocks_and_never_cover_the_last_token():
    bm = BlockManager(10, 4)
    a = _seq(0, list(range(10)))
    bm.allocate(a, 10)
    bm.register_full_blocks(a, 10)
    b = _seq(1, list(range(9)) + [99])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]  # two full blocks; the partial third is never shared
    c = _seq(2, list(range(8)))  # exactly two full blocks: the last token must be computed
    assert bm.match_prefix(c) == a.block_table[:1]
    bm.allocate(b, 10, hits)
    assert [bm.blocks[x].ref for x in hits] == [2, 2]
    bm.check([a, b])


def test_freed_registered_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(4, 2)
    a = _seq(0, [1, 2, 3, 4, 5])
    bm.allocate(a, 5)
    bm.register_full_blocks(a, 5)
    blocks = list(a.block_table)
    bm.free_blocks(a)
    # The unregistered partial block goes first; the registered ones last-freed-last.
    assert list(bm.free)[:2] == [blocks[2], 3]
    again = _seq(1, [1, 2, 3, 4, 9])
    assert bm.match_prefix(again) == blocks[:2]
    # Allocating everything evicts: the tail block of a's prefix goes before its root.
    hog = _seq(2, [7] * 6)
    bm.allocate(hog, 6)
    assert blocks[0] not in hog.block_table and blocks[1] in hog.block_table
    assert bm.match_prefix(again) == blocks[:1]


def test_blocks_computed_twice_are_all_found():
    """Two sequences of one prompt prefill it in different chunks, so each computes some of its
    blocks itself: a third finds the whole prompt, block by block from either of them, and still
    does after either one's copies are gone."""
    bm = BlockManager(16, 2)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    a = _seq(0, prompt)
    bm.allocate(a, 4)
    bm.register_full_blocks(a, 4)  # a's first chunk: blocks 0-1
    b = _seq(1, prompt)
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.allocate(b, 6, hits)
    bm.register_full_blocks(b, 6)  # b computes block 2 itself
    bm.allocate(a, 9)
    bm.register_full_blocks(a, 9)  # a computes blocks 2-3: block 2 is b's twin
    bm.check([a, b])
    c = _seq(2, prompt)
    found = bm.match_prefix(c)
    assert len(found) == 4
    assert found[:2] == a.block_table[:2] and found[2] in (a.block_table[2], b.block_table[2])
    assert found[3] == a.block_table[3]
    bm.free_blocks(b)
    bm.reset_prefix_cache()  # b's own block 2 is evicted; a's twin still holds that prefix
    assert bm.match_prefix(c) == a.block_table[:4]
    bm.check([a])


def test_equal_ids_after_another_prefix_are_another_node():
    """A block's ids alone never make a hit: [0, 0] after [1, 1] is not [0, 0] at the start."""
    bm = BlockManager(10, 2)
    c = _seq(0, [1, 1, 0, 0, 1])
    bm.allocate(c, 5)
    bm.register_full_blocks(c, 5)
    assert bm.match_prefix(_seq(1, [0, 0, 0])) == []
    assert bm.match_prefix(_seq(2, [1, 1, 0, 0, 0])) == c.block_table[:2]
    # Once the blocks are handed out for new data, nothing matches any more, and the trie is empty.
    bm.free_blocks(c)
    hog = _seq(3, [1] * 20)
    bm.allocate(hog, 20)
    assert bm.match_prefix(_seq(4, [1, 1, 0, 0, 0])) == [] and not bm.trie
    bm.check([hog])


def test_rollback_unregisters_only_the_blocks_the_abandoned_step_would_write():
    """A step that never runs takes back the blocks it registered whose K/V it was to compute;
    a block computed by an earlier step (registered late: its last token was pending then) stays,
    and the sequence registers the rest again once they are computed."""
    bm = BlockManager(8, 4)
    seq = _seq(0, list(range(12)))
    bm.allocate(seq, 12)
    seq.num_computed = 4  # block 0 was computed by an earlier step, blocks 1-2 by this one
    bm.register_full_blocks(seq, 12)
    assert len(bm.registered_blocks()) == 3
    assert bm.rollback() == set(seq.block_table[1:3])
    assert list(bm.registered_blocks()) == [seq.block_table[0]]
    assert seq.num_registered_blocks == 1
    bm.check([seq])
    seq.num_computed = 12  # the step runs again, and this time it is launched
    bm.register_full_blocks(seq, 12)
    bm.commit()
    assert sorted(bm.registered_blocks()) == sorted(seq.block_table) and not bm.rollback()


def _prompt_seq(i, ids):
    return Sequence(i, str(i), 0, list(ids), SamplingParams(), 0)


def test_a_hit_takes_the_copy_a_sequence_still_holds():
    """Two sequences computed the same block, and one freed its copy: a third prompt with that
    prefix shares the copy still held, so that it costs no free block (the freed copy may be
    evicted later; taking it would use one more block, admitting requests later)."""
    bm = BlockManager(8, 2)
    a, b = _prompt_seq(0, [5, 6, 7]), _prompt_seq(1, [5, 6, 7])
    for s in (a, b):
        bm.allocate(s, 3)
        bm.register_full_blocks(s, 3)
        s.num_computed = 3
    bm.commit()
    bm.free_blocks(a)
    c = _prompt_seq(2, [5, 6, 7])
    hits = bm.match_prefix(c)
    assert hits == [b.block_table[0]]
    free = bm.num_free
    bm.allocate(c, 3, hits)
    assert bm.num_free == free - 1  # the last, partial block only
    bm.check([b, c])


def test_reset_prefix_cache_forgets_every_block_no_sequence_holds():
    bm = BlockManager(4, 2)
    a = _prompt_seq(0, range(1, 9))  # fills every block: all four registered
    bm.allocate(a, 8)
    bm.register_full_blocks(a, 8)
    a.num_computed = 8
    bm.commit()
    bm.free_blocks(a)
    assert len(bm.registered_blocks()) == 4
    bm.reset_prefix_cache()
    assert bm.registered_blocks() == {} and bm.match_prefix(_prompt_seq(1, range(1, 10))) == []
