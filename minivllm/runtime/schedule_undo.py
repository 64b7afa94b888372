"""A schedule() call's undo log: the values each of its changes to the scheduler's queues, its
sequences and its block manager overwrites, recorded before the change, so that a call that
raises part-way (an error, or Ctrl-C) can be put back (Scheduler.schedule)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler
    from .sequence import Sequence


# The kinds of ScheduleUndo's records: (kind, ...what the change overwrites).
_SEQ, _TABLE, _REGISTERED, _BLOCK, _TAKEN, _NODE = range(6)


class ScheduleUndo:
    """What one schedule() call has changed: a log of the values each change overwrites,
    recorded before the change (write-ahead). restore() puts them back, last first, whatever part
    of a change was made, so that a schedule() that raises part-way (an error, or Ctrl-C) leaves
    the scheduler, its block manager and its sequences as they were. Records are taken only
    where the call changes something: a steady decode step grows a few tables and fills a few
    blocks, a tuple or two each; restore() passes over the free queue and the trie, which only a
    failure pays.

    The block manager's structures are read and written directly (block_manager.py): a block's
    reference count and node, the free queue, the trie and its nodes' keys and blocks."""

    __slots__ = ("sched", "log", "lists", "next_node", "num_uncommitted", "counters")

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.log: list[tuple] = []
        self.lists = None  # copies of running and waiting, taken before either changes
        self.next_node = sched.bm.next_node  # nodes from here on are the call's
        self.num_uncommitted = len(sched.bm.uncommitted)
        self.counters = (sched.num_preemptions, sched.num_prompt_tokens_cached,
                         sched.num_prefix_cache_queries, sched.num_prefix_cache_hits)

    # -- records, each before its change ---------------------------------------------------------

    def queues(self) -> None:
        if self.lists is None:
            self.lists = (self.sched.running[:], self.sched.waiting[:])

    def seq(self, seq: Sequence) -> None:
        """Before a change to seq's state (its preemption or admission)."""
        self.log.append((_SEQ, seq, seq.block_table, len(seq.block_table), seq.num_computed,
                         seq.num_registered_blocks, seq.num_preemptions, seq.status,
                         seq.max_num_tokens, seq.num_cached_prompt, seq.scheduled_time))

    def block(self, b: int) -> None:
        """Before a change to block b's reference count or node."""
        block = self.sched.bm.blocks[b]
        self.log.append((_BLOCK, b, block.ref, block.node))

    def preempt(self, seq: Sequence) -> None:
        """Before Scheduler.preempt(seq)."""
        self.queues()
        self.seq(seq)
        for b in seq.block_table:
            self.block(b)

    def allocate(self, seq: Sequence, num_tokens: int, hits=()) -> None:
        """Before BlockManager.allocate(seq, num_tokens, hits): seq's table, the hits, and the
        blocks it will take from the free queue's front, whose nodes it evicts."""
        bm, log = self.sched.bm, self.log
        log.append((_TABLE, seq, seq.block_table, len(seq.block_table),
                    seq.num_registered_blocks))
        if hits:
            for b in hits:
                self.block(b)
            hits = set(hits)
        need = -(-num_tokens // bm.block_size) - len(seq.block_table) - len(hits)
        if need <= 0:
            return
        blocks = bm.blocks
        for b in bm.free:  # the front: what allocate takes, the hits aside
            if not hits or b not in hits:
                node = blocks[b].node  # its reference count is 0: it is free
                log.append((_TAKEN, b, node))
                if node is not None:
                    log.append((_NODE, node, bm.node_key[node], bm.node_blocks[node]))
                need -= 1
                if not need:
                    return

    def register(self, seq: Sequence, num_tokens: int) -> None:
        """Before BlockManager.register_full_blocks(seq, num_tokens): seq's count of registered
        blocks and the blocks it may register (their nodes; the nodes they join are mended in
        restore())."""
        bm, log = self.sched.bm, self.log
        first = seq.num_registered_blocks
        log.append((_REGISTERED, seq, first))
        blocks = bm.blocks
        for b in seq.block_table[first:num_tokens // bm.block_size]:
            block = blocks[b]
            if block.node is None:  # (a hit is left as it is)
                log.append((_BLOCK, b, block.ref, None))

    # -- putting back ----------------------------------------------------------------------------

    def restore(self) -> None:
        sched = self.sched
        bm, blocks = sched.bm, sched.bm.blocks
        # The trie: the call's nodes go first (every key it inserted follows, in the dict's
        # order, those that were there, and names one of its nodes; node_key and node_blocks
        # follow), so that an evicted node can take its key back.
        made = []
        for key, node in reversed(bm.trie.items()):
            if node < self.next_node:
                break
            made.append(key)
        for key in made:
            del bm.trie[key]
        for node in range(self.next_node, bm.next_node + 1):
            bm.node_key.pop(node, None)
            bm.node_blocks.pop(node, None)
        bm.next_node = self.next_node
        del bm.uncommitted[self.num_uncommitted:]
        front, touched = [], []  # blocks taken from the free queue's front, in order; all blocks
        for record in reversed(self.log):
            kind = record[0]
            if kind == _TAKEN:
                _, b, node = record
                front.append(b)
                touched.append(b)
                blocks[b].ref, blocks[b].node = 0, node
            elif kind == _BLOCK:
                _, b, ref, node = record
                touched.append(b)
                blocks[b].ref, blocks[b].node = ref, node
            elif kind == _NODE:
                _, node, key, members = record
                bm.trie[key], bm.node_key[node], bm.node_blocks[node] = node, key, members
            elif kind == _TABLE or kind == _SEQ:
                seq, table, n = record[1:4]
                # A table grown in place is copied, not cut back: a table only grows in place
                # (the decode graphs' staging knows a table by its identity and length).
                seq.block_table = table if len(table) == n else table[:n]
                if kind == _TABLE:
                    seq.num_registered_blocks = record[4]
                else:
                    (seq.num_computed, seq.num_registered_blocks, seq.num_preemptions, seq.status,
                     seq.max_num_tokens, seq.num_cached_prompt, seq.scheduled_time) = record[4:]
            else:  # _REGISTERED
                _, seq, n = record
                seq.num_registered_blocks = n
        # A node the call added a block to (its blocks are those whose node it is).
        for node, members in bm.node_blocks.items():
            if any(blocks[b].node != node for b in members):
                bm.node_blocks[node] = tuple(b for b in members if blocks[b].node == node)
        # The free queue: the blocks taken from its front back there, in order, those the call
        # freed out, the others in their order. A prefix-cache hit taken from it goes back to its
        # end: finding its place again would cost each admission that takes one a search of the
        # queue, and schedule() run again takes it again.
        if touched:
            front.reverse()
            free = dict.fromkeys(b for b in front if blocks[b].ref == 0)
            free.update((b, None) for b in bm.free if blocks[b].ref == 0)
            free.update((b, None) for b in touched if blocks[b].ref == 0)
            bm.free.clear()
            bm.free.update(free)
        if self.lists is not None:
            sched.running[:], sched.waiting[:] = self.lists
        (sched.num_preemptions, sched.num_prompt_tokens_cached,
         sched.num_prefix_cache_queries, sched.num_prefix_cache_hits) = self.counters
