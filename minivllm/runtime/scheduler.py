"""The scheduler: which tokens of which sequences the next forward step computes.

Continuous batching under two budgets, `max_num_batched_tokens` per step and `max_num_seqs`
running sequences. Each step:
  1. running sequences, decodes first, then unfinished prefills (chunked), oldest first within
     each (decodes longest context first under `longest_decodes_first`): a sequence gets
     min(its uncomputed tokens, the budget left), so a long prompt is prefilled over several
     steps, in the same steps as other sequences' decodes;
  2. if nothing was preempted, waiting sequences are admitted oldest first while the budgets and
     the free blocks allow, taking what the prefix cache holds for them and scheduling the rest
     (or a first chunk of it).
When a sequence's table cannot grow, the newest running sequence not yet scheduled this step is
preempted by recompute: its blocks are freed and it waits again at the front of the queue, with
its generated tokens kept, to be prefilled again (through the prefix cache when its blocks
survive). The scheduler needs no tensors: a mock model can drive it.

Under the "priority" policy (vLLM's) each sequence has a priority, lower first: "oldest first"
above reads "by (priority, arrival)", so running sequences take the budget (vLLM's in the order
they were admitted), and waiting ones are admitted, in that order; the one preempted is the
lowest priority's latest of all running, as vLLM's, even one the step has scheduled already:
its chunk comes back out of the step, its tokens back into the budget, so that no sequence is
preempted while a lower priority's runs. A waiting sequence preempts no running one to be
admitted (as vLLM's). Under "fcfs", a synchronous step with no prefix-cache hits, LoRA limit
or longest_decodes_first is the one vLLM's scheduler makes (tests/test_audit_s78_scheduler.py
steps the two side by side): a sequence part-way through its prefill is always the newest
running one, so vLLM's running list is in this order too, and its last running request the
newest.

With a speculator (n-gram speculative decoding, runtime/spec_decode.py), a decoding sequence may
also compute draft tokens after its one token: they count in the step's budget and its table is
grown for them (only where no preemption is needed), they stay out of its token_ids
(SchedulerOutput.drafts), and those the step accepts are appended one at a time (accept()).
(A draft model's speculator gives placeholders: the draft drafts once this step's tables hold
their slots, on the device, and the engine puts its tokens in their place when the step's result
brings them back: LLMEngine._draft_tokens, _take_drafts.)

A step is recorded either at once (`update(out, tokens)`), or in two halves for asynchronous
scheduling: `advance(out)` right after the step is launched, which marks its tokens computed and
appends a PENDING token to each sampled sequence, so that the next step can be scheduled while
this one runs; then `resolve(out, tokens)` once its tokens are known. The next step feeds a
pending token to the model from the device; the host never needs it to schedule. A sequence
whose pending token is certain to end it (max_tokens, max_model_len) is not scheduled again; one
that an EOS or stop token ends may run one step too many, whose token is dropped. Blocks are
offered to the prefix cache only once every token in them is known.

schedule() is all or nothing: one that raises part-way (an error, or Ctrl-C after it admitted,
grew or preempted some sequences) puts the queues, the sequences and the block manager back as
they were (runtime/schedule_undo.py), so that the engine can schedule again, or abort requests,
as if it had not run. Its records cost a few percent of a 256-sequence decode step's
schedule() on the host (measured on the CPU in session 77).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from .block_manager import BlockManager
from .sequence import PENDING, Sequence, Status
from .schedule_undo import ScheduleUndo


class ScheduledChunk(NamedTuple):
    """seq computes token_ids[start : start + num_tokens] this step; `want_logits` when that
    reaches its last token (then the step samples its next one), fixed when scheduled. An
    embedding's sequence (seq.pooling) wants no logits: its chunk that reaches its last token is
    pooled instead (SchedulerOutput.pooled).
    (A NamedTuple: one is built per running sequence per step, at half a frozen dataclass's cost.)"""

    seq: Sequence
    start: int
    num_tokens: int
    want_logits: bool

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start:self.start + self.num_tokens]


@dataclass
class SchedulerOutput:
    """chunks: the step's chunks in batch order; sampled: those that get a sampled token (want
    logits), in the order of the step's logits rows; pooled: those that end an embedding's prompt
    (the step returns their last token's hidden state), in batch order; prefills: those that
    compute prompt tokens or more than one token (a decode computes one generated token: the
    statistics that count prompt and recomputed tokens skip it); num_tokens: the chunks' tokens.
    All kept as chunks are added (Scheduler._schedule), since the engine reads them every step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    sampled: list[ScheduledChunk] = field(default_factory=list)
    pooled: list[ScheduledChunk] = field(default_factory=list)
    prefills: list[ScheduledChunk] = field(default_factory=list)
    num_tokens: int = 0
    # (sequence, prompt position) pairs whose prompt_logprobs the step computes, in the order of
    # its PromptScores: set by the engine (LLMEngine.step_input), which asks for them.
    scored: list[tuple[Sequence, int]] = field(default_factory=list)
    # Speculative decoding (runtime/spec_decode.py): a decoding sequence's draft tokens, computed
    # after its chunk's one token (counted in num_tokens, never in its token_ids until accepted).
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.chunks


def stop_by_token(seq: Sequence, max_model_len: int, at: int | None = None
                  ) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) when seq's token at index `at` (default its last) ends it,
    else None: EOS (unless ignore_eos) or a stop id, once min_tokens are out; max_tokens;
    max_model_len."""
    at = seq.num_tokens - 1 if at is None else at
    p, tok, n = seq.params, seq.token_ids[at], at + 1 - seq.prompt_len
    if n >= p.min_tokens:
        if not p.ignore_eos and tok in seq.eos_ids:  # the first is EOS proper (read_eos_ids)
            return "stop", None if tok == seq.eos_ids[0] else tok
        if tok in p.stop_ids:
            return "stop", tok
    return stop_by_count(seq, max_model_len, at + 1)


def length_limit(seq: Sequence, max_model_len: int) -> int:
    """The tokens (prompt included) at which seq ends by length: max_tokens or max_model_len."""
    p = seq.params
    if p.max_tokens is None:
        return max_model_len
    return min(seq.prompt_len + p.max_tokens, max_model_len)


def stop_by_count(seq: Sequence, max_model_len: int, num_tokens: int | None = None
                  ) -> tuple[str, None] | None:
    """("length", None) when a sequence of `num_tokens` tokens (default all it has, pending
    included) has reached max_tokens or max_model_len: known without the tokens' values."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    return ("length", None) if num_tokens >= length_limit(seq, max_model_len) else None


POLICIES = ("fcfs", "priority")


def _arrival(seq: Sequence) -> int:
    return seq.seq_id


def _priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.seq_id


def _decodes_first(seq: Sequence) -> tuple[bool, int]:
    """Sort key of the running sequences: decodes, then prefills, oldest first within each.
    (Attributes read directly: it runs for each sequence, each step.)"""
    return len(seq.token_ids) - seq.num_computed > 1, seq.seq_id


def _longest_decodes_first(seq: Sequence) -> tuple[bool, int, int]:
    """Sort key of the running sequences: decodes, longest context first, then prefills, oldest
    first (ties oldest first)."""
    n = len(seq.token_ids)
    if n - seq.num_computed > 1:
        return True, 0, seq.seq_id
    return False, -n, seq.seq_id


def _by_priority(key):
    """A running sort key with the priority first within decodes and within prefills."""
    def with_priority(seq: Sequence) -> tuple:
        k = key(seq)
        return (k[0], seq.priority, *k[1:])
    return with_priority


class Scheduler:
    """longest_decodes_first: a step's decodes in order of context length, longest first. A
    decode attention kernel that starts its programs in batch order then runs the longest first
    and fills its launch's tail with the short ones: the engine asks for it where that measured
    faster (an fp8 cache, BENCHMARKS.md session 14)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, longest_decodes_first: bool = False, policy: str = "fcfs",
                 speculator=None, max_loras: int | None = None):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.bm = block_manager
        # speculator(seq, most) -> up to `most` draft tokens for a decoding sequence (none for
        # one that may not speculate): runtime/spec_decode.py. None: no speculation.
        self.speculator = speculator
        self.longest_decodes_first = longest_decodes_first
        self.policy = policy
        self._sort_key = _longest_decodes_first if longest_decodes_first else _decodes_first
        # The order of the waiting queue and of preemption (the last is preempted first).
        self._order = _arrival
        if policy == "priority":
            self._sort_key, self._order = _by_priority(self._sort_key), _priority
        self.max_num_seqs = max_num_seqs
        # LoRA: the most adapters the running sequences may use at once (the runner's slots),
        # or None (no LoRA).
        self.max_loras = max_loras
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # by _order (arrival, or priority then arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_cached = 0  # prompt tokens taken from the prefix cache at first admission
        # vLLM's prefix_cache_queries / _hits: the tokens of each prefix-cache lookup of a sequence
        # never preempted (every admission attempt, as vLLM's get_computed_blocks), and the tokens
        # it found.
        self.num_prefix_cache_queries = 0
        self.num_prefix_cache_hits = 0
        # Called with each sequence that finish() ends (the engine's metrics), or None.
        self.on_finish = None

    # -- queues ----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        seq.max_num_tokens = length_limit(seq, self.max_model_len)
        bisect.insort(self.waiting, seq, key=self._order)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def sequences(self) -> list[Sequence]:
        return self.running + self.waiting

    def finish(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        """End seq (a stop string, an abort, or a stop token) and free its blocks."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.bm.free_blocks(seq)
        if seq.num_pending:  # tokens a running step samples for a sequence that has ended
            del seq.token_ids[-seq.num_pending:]
            seq.num_pending = 0
        seq.status = Status.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if self.on_finish is not None:
            self.on_finish(seq)

    def preempt(self, seq: Sequence) -> None:
        """Preempt running seq by recompute: free its blocks and queue it again, at its place by
        _order (ahead of newer requests), keeping its tokens; it is prefilled again (through the
        prefix cache where its blocks survive) when it comes back."""
        self.running.remove(seq)
        self.bm.free_blocks(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # -- one step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step. All or nothing: if it raises part-way (an error, or Ctrl-C), the
        scheduler, its block manager and its sequences are put back as they were before the call
        (ScheduleUndo), so that the engine can schedule again, or abort, as if it never ran."""
        undo = ScheduleUndo(self)
        try:
            return self._schedule_step(undo)
        except BaseException:
            undo.restore()
            raise

    def _schedule_step(self, undo: ScheduleUndo) -> SchedulerOutput:
        """schedule()'s work; each change to the queues, a sequence or the block manager is
        recorded in `undo` before it is made."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        # 1. Running sequences: decodes first, then chunks of unfinished prefills. (This loop runs
        # for each sequence each step: what it reads is looked up once, and a decode whose table
        # holds its token already, most of them, calls nothing to allocate.)
        running, block_size, speculator = Status.RUNNING, self.bm.block_size, self.speculator
        for seq in sorted(self.running, key=self._sort_key):
            if budget == 0:
                break
            if seq.status is not running:  # preempted earlier in this loop
                continue
            num_tokens = len(seq.token_ids)
            if seq.num_pending and num_tokens >= seq.max_num_tokens:
                continue  # its pending token is its last
            start = seq.num_computed
            n = min(num_tokens - start, budget)
            end, drafts = start + n, None  # end: the tokens its table must hold
            if speculator is not None:
                drafts = self._drafts(seq, start, n, budget)
                if drafts:
                    end += len(drafts)
            if len(seq.block_table) * block_size < end:
                grown = self._grow(out, seq, end, undo)
                # (A chunk that _grow took back out of the step gave its tokens back.)
                budget = self.max_num_batched_tokens - out.num_tokens
                if not grown:
                    continue  # preempted to make room for itself
            self._schedule(out, seq, start, n, undo)
            if drafts:
                out.drafts[seq] = drafts
                out.num_tokens += len(drafts)
            budget -= end - start

        # 2. Waiting sequences, oldest first; none while memory is short (something was preempted).
        # With LoRA (max_loras set), a sequence whose adapter would make the running sequences
        # use more than max_loras adapters waits, and the ones behind it may go first (vLLM's).
        at, loras = 0, None
        if self.max_loras is not None:
            loras = {s.lora_id for s in self.running if s.lora_id}
        while (not out.preempted and at < len(self.waiting) and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[at]
            if loras is not None and seq.lora_id and seq.lora_id not in loras and \
                    len(loras) >= self.max_loras:
                at += 1
                continue
            hits = self.bm.match_prefix(seq) if seq.prompt_logprobs is None else []
            cached = len(hits) * self.bm.block_size
            if not seq.num_preemptions and seq.prompt_logprobs is None and \
                    seq.prompt_embeds is None and self.bm.enable_prefix_caching:
                self.num_prefix_cache_queries += seq.num_tokens
                self.num_prefix_cache_hits += cached
            n = min(seq.num_tokens - cached, budget)
            if not self.bm.can_allocate(seq, cached + n, hits):
                break
            undo.queues()
            undo.seq(seq)
            undo.allocate(seq, cached + n, hits)
            self.waiting.pop(at)
            if loras is not None and seq.lora_id:
                loras.add(seq.lora_id)
            self.bm.allocate(seq, cached + n, hits)
            seq.num_computed = cached
            if seq.num_cached_prompt < 0:
                seq.num_cached_prompt = min(cached, seq.prompt_len)
                self.num_prompt_tokens_cached += seq.num_cached_prompt
                seq.scheduled_time = time.monotonic()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, cached, n, undo)
            budget -= n
        return out

    def _drafts(self, seq: Sequence, start: int, n: int, budget: int) -> list[int] | None:
        """A decode's draft tokens (speculative decoding): within the step's budget and the
        sequence's length limit (the step samples one token more than it has drafts), and only
        where its table can hold them without preempting anything."""
        num_tokens = len(seq.token_ids)
        if not n == num_tokens - start == 1 or seq.num_pending:
            return None
        most = min(budget - 1, seq.max_num_tokens - num_tokens - 1)
        drafts = self.speculator(seq, most) if most > 0 else None
        if drafts and not self.bm.can_allocate(seq, start + 1 + len(drafts)):
            return None
        return drafts

    def _grow(self, out: SchedulerOutput, seq: Sequence, num_tokens: int,
              undo: ScheduleUndo) -> bool:
        """Grow running seq's table to `num_tokens` tokens, preempting while blocks are short:
        under "fcfs" the newest sequence not scheduled this step; under "priority" the lowest
        priority's latest of all running, as vLLM's, even one this step has scheduled already
        (its chunk is taken back out of the step, its tokens back into the budget): otherwise
        a decode scheduled before seq could keep running at a lower priority than seq, which
        preempted itself. False when seq itself was preempted (the loop goes on with the
        others: in this order they include sequences vLLM's would have scheduled before it)."""
        while not self.bm.can_allocate(seq, num_tokens):
            if self.policy == "priority":
                victim = max(self.running, key=_priority)
            else:
                scheduled = {c.seq.seq_id for c in out.chunks}
                victim = max((s for s in self.running if s.seq_id not in scheduled),
                             key=_arrival)
            undo.preempt(victim)
            if self.policy == "priority":
                self._unschedule(out, victim, undo)
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        undo.allocate(seq, num_tokens)
        self.bm.allocate(seq, num_tokens)
        return True

    def _unschedule(self, out: SchedulerOutput, seq: Sequence, undo: ScheduleUndo) -> None:
        """Take seq's chunk and drafts, if the step has them, back out of it (seq is about to
        be preempted), and unregister the blocks the chunk registered: their K/V it will never
        write (BlockManager.uncommitted past this call's start lists them)."""
        chunks = out.chunks
        for i, chunk in enumerate(chunks):
            if chunk.seq is seq:
                break
        else:
            return
        del chunks[i]
        for kept in (out.sampled, out.pooled, out.prefills):
            for j, c in enumerate(kept):
                if c is chunk:
                    del kept[j]
                    break
        out.num_tokens -= chunk.num_tokens + len(out.drafts.pop(seq, ()))
        # (undo.register logged those blocks, and ScheduleUndo.restore mends their nodes.)
        self.bm.forget_uncommitted(seq, since=undo.num_uncommitted)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, start: int, n: int,
                  undo: ScheduleUndo) -> None:
        """Schedule seq's tokens start ... start + n - 1, its table holding them already."""
        end, num_tokens = start + n, len(seq.token_ids)
        # A block is registered under its ids: one holding a pending token waits for a later
        # step. Most steps fill no block (a decode fills one every block_size steps).
        known = min(end, num_tokens - seq.num_pending)
        if known // self.bm.block_size > seq.num_registered_blocks:
            undo.register(seq, known)
            self.bm.register_full_blocks(seq, known)
        last = end == num_tokens
        chunk = ScheduledChunk(seq, start, n, last and not seq.pooling)
        out.chunks.append(chunk)
        out.num_tokens += n
        if last:
            (out.pooled if seq.pooling else out.sampled).append(chunk)
        if n > 1 or start < seq.prompt_len:
            out.prefills.append(chunk)

    def abandon(self, out: SchedulerOutput) -> None:
        """`out` will never run (its launch raised): unregister the blocks it registered, whose
        K/V was never written, and recompute any sequence that took one of them as a prefix-cache
        hit. The others need nothing: a step's progress is recorded only once it is launched."""
        unwritten = self.bm.rollback()
        bs = self.bm.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            if seq.status is Status.RUNNING and any(
                    b in unwritten for b in seq.block_table[:seq.num_computed // bs]):
                self.preempt(seq)

    def advance(self, out: SchedulerOutput) -> None:
        """The first half of recording a launched step: its tokens are computed, each sampled
        sequence holds a PENDING token until resolve(), and each pooled one is finished (its
        blocks go back, stream-ordered after the step that writes them; the engine records its
        embedding when the step is read)."""
        for chunk in out.chunks:
            chunk.seq.num_computed = chunk.start + chunk.num_tokens
        for chunk in out.sampled:
            chunk.seq.token_ids.append(PENDING)
            chunk.seq.num_pending += 1
        for chunk in out.pooled:
            self.finish(chunk.seq, "pooled")

    def resolve(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """The second half: each sampled sequence's oldest pending token becomes `sampled`'s (in
        the order of out.sampled), and sequences it ends are finished. Sequences that ended
        meanwhile (a stop string, an abort) are skipped. Returns the sequences that got a token."""
        chunks = out.sampled
        if len(sampled) != len(chunks):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(chunks)} sampled sequences")
        got, finished = [], Status.FINISHED
        for chunk, tok in zip(chunks, sampled):
            seq = chunk.seq
            if seq.status is finished:
                continue
            at = len(seq.token_ids) - seq.num_pending
            seq.token_ids[at] = tok = int(tok)
            seq.num_pending -= 1
            got.append(seq)
            # Most tokens end nothing: stop_by_token only for an ending id or the last token.
            if tok in seq.ending_ids or at + 1 >= seq.max_num_tokens:
                stop = stop_by_token(seq, self.max_model_len, at)
                if stop is not None:
                    self.finish(seq, *stop)
        return got

    def accept(self, seq: Sequence, tok: int) -> None:
        """Append one more token that a speculative step sampled for seq (after its first, which
        resolve() recorded): the token before it was a draft that the step computed and that
        matched, so its K/V is in the cache. Finishes seq when the token ends it."""
        seq.num_computed = len(seq.token_ids)
        seq.token_ids.append(tok)
        at = len(seq.token_ids) - 1
        if tok in seq.ending_ids or at + 1 >= seq.max_num_tokens:
            stop = stop_by_token(seq, self.max_model_len, at)
            if stop is not None:
                self.finish(seq, *stop)

    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[Sequence]:
        """Record a finished step at once: advance() then resolve(). Returns the sequences that
        got a token."""
        if len(sampled) != len(out.sampled):
            raise ValueError(f"{len(sampled)} sampled tokens for {len(out.sampled)} sampled sequences")
        self.advance(out)
        return self.resolve(out, sampled)
