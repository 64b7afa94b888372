"""Hypothesis state machine for the scheduler, driven by a mock model that needs no tensors.

The mock model's next token is a hash of the whole sequence so far, and its "KV cache" records,
per slot, the prefix whose K/V the slot holds. Each step it first writes every scheduled token's
slot, then checks that every chunk's context (the positions before it) reads back the right
prefix, as a real forward step does. So preemption, chunking, prefix sharing (within a step too)
and block reuse must all keep each sequence's context intact, and each finished sequence's
tokens must equal the same mock model run on that prompt alone.

In asynchronous mode the machine drives the scheduler as the engine does with asynchronous
scheduling: each step is scheduled and advanced before the previous step's tokens are resolved,
and the mock forward reads a pending token's value from the previous step (as the device does)."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.sampling_params import SamplingParams
from minivllm.runtime.scheduler import Scheduler, stop_by_token
from minivllm.runtime.sequence import PENDING, Sequence, Status

BS = 4
VOCAB = 5
EOS = 4


def mock_next_token(tokens) -> int:
    return zlib.crc32(bytes(tokens)) % VOCAB


def reference(prompt, params: SamplingParams, max_model_len: int, eos: tuple) -> list[int]:
    """The sequence run alone, one token at a time, with the same stop rules."""
    seq = Sequence(0, "ref", 0, prompt, params, 0, eos_ids=eos)
    while True:
        seq.token_ids.append(mock_next_token(seq.token_ids))
        if stop_by_token(seq, max_model_len) is not None:
            return seq.output_ids


class MockModelSteps:
    """A machine's mock forward of scheduled steps (self.sched, self.bm, self.slots,
    self.asynchronous and self.in_flight: the SchedulerOutput and sampled tokens launched and
    not yet resolved)."""

    def _ids(self, seq) -> list[int]:
        """seq's token ids with a pending one replaced by its value in the launched step."""
        ids = list(seq.token_ids)
        if seq.num_pending:
            assert seq.num_pending == 1 and ids[-1] == PENDING
            out, sampled = self.in_flight
            ids[-1] = dict(zip((c.seq.seq_id for c in out.sampled), sampled))[seq.seq_id]
        return ids

    def _forward(self, out, commit: bool = False) -> None:
        """Write every new token's slot, then check that every chunk's context reads back its
        own prefix; then record the step (commit: the block manager's registrations too, as
        the engine commits them once a step is launched)."""
        ids = {c.seq.seq_id: self._ids(c.seq) for c in out.chunks}
        for c in out.chunks:
            for pos in range(c.start, c.start + c.num_tokens):
                self.slots[(c.seq.block_table[pos // BS], pos % BS)] = \
                    tuple(ids[c.seq.seq_id][:pos + 1])
        for c in out.chunks:
            for pos in range(c.start):
                got = self.slots.get((c.seq.block_table[pos // BS], pos % BS))
                assert got == tuple(ids[c.seq.seq_id][:pos + 1]), \
                    f"{c.seq} reads a wrong prefix at {pos}"
        sampled = [mock_next_token(ids[c.seq.seq_id]) for c in out.sampled]
        if commit:
            self.bm.commit()
        if not self.asynchronous:
            self.sched.update(out, sampled)
            return
        self.sched.advance(out)
        if self.in_flight is not None:
            self.sched.resolve(*self.in_flight)
        self.in_flight = (out, sampled) if out.chunks else None


class SchedulerMachine(MockModelSteps, RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), max_num_seqs=st.integers(1, 4),
                max_tokens_per_step=st.integers(1, 12), caching=st.booleans(),
                asynchronous=st.booleans(), longest_first=st.booleans(),
                policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, num_blocks, max_num_seqs, max_tokens_per_step, caching, asynchronous,
              longest_first, policy):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
        self.max_model_len = 24
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_tokens_per_step,
                               max_model_len=self.max_model_len, longest_decodes_first=longest_first,
                               policy=policy)
        self.policy = policy
        self.longest_first = longest_first
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.all: list[Sequence] = []
        self.steps = 0
        self.asynchronous = asynchronous
        self.in_flight = None  # (SchedulerOutput, sampled tokens) not yet resolved

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 10), stop_eos=st.booleans(), n=st.integers(1, 2),
          stop_ids=st.lists(st.integers(0, VOCAB - 1), max_size=2), min_tokens=st.integers(0, 3),
          priority=st.integers(-1, 2))
    def add_request(self, prompt, max_tokens, stop_eos, n, stop_ids, min_tokens, priority):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=not stop_eos, n=n,
                                stop_token_ids=stop_ids, min_tokens=min(min_tokens, max_tokens))
        # The engine refuses what can never fit; the scheduler may assume it.
        longest = min(len(prompt) + max_tokens, self.max_model_len) - 1
        if self.bm.blocks_for(longest) > self.bm.num_blocks:
            return
        for i in range(n):
            seq = Sequence(len(self.all), str(len(self.all)), i, prompt, params, 0,
                           eos_ids=(EOS,), priority=priority if self.policy == "priority" else 0)
            self.all.append(seq)
            self.sched.add(seq)

    @precondition(lambda self: self.sched.has_unfinished() or self.in_flight)
    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        seq = data.draw(st.sampled_from(self.sched.sequences))
        self.sched.finish(seq, "abort")

    def order(self, seq) -> tuple:
        """The policy's order: arrival, or priority then arrival (lower first)."""
        return (seq.priority, seq.seq_id) if self.policy == "priority" else (0, seq.seq_id)

    def _step(self):
        was_running = {s.seq_id for s in self.sched.running}
        out = self.sched.schedule()
        # Preemption takes the last in the policy's order among those the step did not
        # schedule; admission takes the waiting in that order, ahead of every one still waiting.
        scheduled = {c.seq.seq_id for c in out.chunks}
        for victim in out.preempted:
            assert all(self.order(s) < self.order(victim) for s in self.sched.running
                       if s.seq_id not in scheduled), "a later sequence should have gone first"
        admitted = [c.seq for c in out.chunks if c.seq.seq_id not in was_running]
        assert [self.order(s) for s in admitted] == sorted(self.order(s) for s in admitted)
        if admitted and self.sched.waiting:
            assert max(map(self.order, admitted)) < min(map(self.order, self.sched.waiting))
        self.steps += 1
        assert out.chunks or self.in_flight, "nothing scheduled while requests wait"
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        # What the engine's statistics read: every chunk with a prompt token or a recomputed one.
        assert out.prefills == [c for c in out.chunks if c.start < c.seq.prompt_len
                                or c.num_tokens > 1]
        assert len(out.chunks) <= self.sched.max_num_seqs
        assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks)
        for c in out.chunks:
            assert c.seq.status is Status.RUNNING
            assert len(c.seq.block_table) * BS >= c.start + c.num_tokens
        # The step opens with its decodes, oldest first or longest context first (ties: oldest).
        # A sequence admitted this step comes after them, even when the prefix cache leaves it one
        # token to compute.
        lead = []
        for c in out.chunks:
            if c.start != len(c.seq.token_ids) - 1 or c.seq.seq_id not in was_running:
                break
            lead.append((self.order(c.seq)[0], -len(c.seq.token_ids) if self.longest_first else 0,
                         c.seq.seq_id))
        assert lead == sorted(lead), lead
        self._forward(out)

    @invariant()
    def budgets_and_blocks(self):
        if not hasattr(self, "sched"):
            return
        assert len(self.sched.running) <= self.sched.max_num_seqs
        self.bm.check(self.sched.sequences)
        for seq in self.sched.waiting:
            assert seq.block_table == [] and seq.num_computed == 0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        limit = self.steps + 2000
        while self.sched.has_unfinished() or self.in_flight:
            assert self.steps < limit, "requests never finish"
            self._step()
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks
        for seq in self.all:
            assert seq.finished
            if seq.finish_reason != "abort":
                want = reference(seq.prompt_ids, seq.params, self.max_model_len, (EOS,))
                assert seq.output_ids == want, (seq, seq.output_ids, want)


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(TestScheduler.settings, max_examples=60, stateful_step_count=40)


def _seq(i, prompt, **kw):
    return Sequence(i, str(i), 0, prompt, SamplingParams(ignore_eos=True, **kw), 0)


def test_decodes_first_then_prefill_chunks_fill_the_budget():
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6, max_model_len=100)
    a, b = _seq(0, [1, 2, 3], max_tokens=5), _seq(1, list(range(20)), max_tokens=5)
    sched.add(a)
    out = sched.schedule()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 3)]
    sched.update(out, [0])
    sched.add(b)
    out = sched.schedule()
    # a decodes (1 token), b's prefill takes the 5 left.
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(a, 3, 1), (b, 0, 5)]
    assert [c.seq for c in out.sampled] == [a]
    sched.update(out, [0])
    out = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(a, 4, 1), (b, 5, 5)]


@pytest.mark.parametrize("longest_first", [False, True])
def test_decode_order(longest_first):
    """Decodes first, oldest first or (longest_decodes_first) longest context first with ties
    oldest first; prefill chunks follow, oldest first."""
    bm = BlockManager(64, BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=100,
                      longest_decodes_first=longest_first)
    seqs = [_seq(i, [i] * n, max_tokens=20) for i, n in enumerate((3, 9, 5, 9))]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == seqs  # admitted oldest first
    sched.update(out, [0] * 4)
    sched.add(_seq(4, [4] * 30, max_tokens=20))
    out = sched.schedule()
    decodes = [1, 3, 2, 0] if longest_first else [0, 1, 2, 3]
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(i, 1) for i in decodes] + [(4, 30)]
    sched.update(out, [0] * 5)
    out = sched.schedule()
    assert [c.seq.seq_id for c in out.chunks] == ([4] + decodes if longest_first else decodes + [4])


def test_preemption_takes_the_newest_and_it_comes_back_first():
    bm = BlockManager(4, BS)  # 16 slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    seqs = [_seq(i, [i] * 4, max_tokens=8) for i in range(4)]
    for s in seqs[:3]:
        sched.add(s)
    out = sched.schedule()  # the three prompts fill three blocks
    sched.update(out, [0, 0, 0])
    out = sched.schedule()  # each needs a second block and one is free: the newest must go
    assert out.preempted == [seqs[2]]
    assert [c.seq for c in out.chunks] == [seqs[0], seqs[1]]
    assert seqs[2].num_computed == 0 and seqs[2].block_table == [] and seqs[2].output_ids == [0]
    sched.update(out, [0, 0])
    sched.add(seqs[3])
    assert sched.waiting == [seqs[2], seqs[3]]
    sched.finish(seqs[0], "abort")  # frees two blocks: the preempted one comes back first
    out = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(seqs[1], 5, 1), (seqs[2], 0, 5)]


def test_same_step_admissions_share_the_prefix():
    bm = BlockManager(16, BS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    prompt = list(range(10))
    a, b = _seq(0, prompt, max_tokens=2), _seq(1, prompt + [7], max_tokens=2)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(0, 10), (8, 3)]
    assert a.block_table[:2] == b.block_table[:2]


# -- found by mutating the scheduler (the state machine's reference shares stop_by_token and
# length_limit with the code it checks, so these pin what it cannot) -----------------------------

def _running(sched, bm, seq, computed: int, held: int) -> None:
    """seq running with `computed` tokens computed and a table for `held` tokens."""
    seq.max_num_tokens = sched.max_model_len
    bm.allocate(seq, held)
    seq.num_computed = computed
    seq.status = Status.RUNNING
    sched.running.append(seq)


def test_eos_ends_once_the_output_holds_min_tokens_counting_itself():
    """vLLM: an EOS ends the output when len(output) >= min_tokens, the EOS included."""
    seq = Sequence(0, "0", 0, [1, 2], SamplingParams(min_tokens=2, max_tokens=10), 0,
                   eos_ids=(EOS, 8))
    seq.token_ids.append(EOS)
    assert stop_by_token(seq, 100) is None
    seq.token_ids[-1:] = [3, EOS]
    assert stop_by_token(seq, 100) == ("stop", None)  # the EOS proper: no stop reason
    seq.token_ids[-1] = 8
    assert stop_by_token(seq, 100) == ("stop", 8)  # another EOS id is the stop reason


def test_max_model_len_ends_a_sequence_before_its_max_tokens():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=8)
    seq = _seq(0, [1, 2, 3, 4, 5], max_tokens=100)
    sched.add(seq)
    while not (out := sched.schedule()).empty:
        sched.update(out, [1] * len(out.sampled))
    assert (seq.finish_reason, seq.num_tokens) == ("length", 8)


def test_a_younger_decode_goes_before_an_older_prefill_under_a_tight_budget():
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64)
    old, young = _seq(0, list(range(12)), max_tokens=5), _seq(1, [1, 2, 3], max_tokens=5)
    young.token_ids.append(5)  # a sampled token to compute
    _running(sched, bm, old, 4, 4)
    _running(sched, bm, young, 3, 3)
    out = sched.schedule()
    assert [(c.seq.seq_id, c.num_tokens) for c in out.chunks] == [(1, 1), (0, 3)]


def test_preemption_never_takes_a_sequence_already_scheduled_this_step():
    """The young decode is scheduled first; the old prefill's block must then come from the old
    one itself, not from the young one, whose chunk is already in the step."""
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    old, young = _seq(0, list(range(8)), max_tokens=5), _seq(1, [1, 2, 3, 4, 5], max_tokens=5)
    young.token_ids.append(7)
    _running(sched, bm, old, 4, 4)
    _running(sched, bm, young, 5, 6)
    assert bm.num_free == 0
    out = sched.schedule()
    assert out.preempted == [old] and [c.seq for c in out.chunks] == [young]
    assert young.status is Status.RUNNING


def test_a_step_that_preempts_admits_no_waiting_sequence():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, waiting, c = (_seq(0, list(range(8)) + [1], max_tokens=5), _seq(1, [1, 2], max_tokens=5),
                     _seq(2, list(range(7)) + [1], max_tokens=5))
    _running(sched, bm, a, 8, 8)  # needs a third block
    _running(sched, bm, c, 7, 8)
    sched.add(waiting)  # older than c, and would fit in the block c frees
    out = sched.schedule()
    assert out.preempted == [c] and [ch.seq for ch in out.chunks] == [a]
    assert sched.waiting == [waiting, c]


def test_a_preempted_sequence_waits_ahead_of_newer_requests():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b, c = (_seq(i, [1, 2, 3], max_tokens=10) for i in range(3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [0] * len(out.sampled))
    sched.add(c)
    sched.preempt(b)
    assert [s.seq_id for s in sched.waiting] == [1, 2]
