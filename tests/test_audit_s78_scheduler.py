"""The scheduler's policies against vLLM v1's (session 78 audit).

Compared with vllm/v1/core/sched/scheduler.py (Scheduler.schedule, _preempt_request) and
vllm/v1/core/sched/request_queue.py (FCFSRequestQueue, PriorityRequestQueue) of vLLM's main
(commits 00024d314514900f361ad072af6931e403b7f589 and 0097c7ed191ad98928976a47ae63ab625a5d112f
respectively). `VLLMModel` below is a brute-force, step-by-step
model of those rules for the subset minivllm implements (synchronous steps, no prefix cache,
no LoRA, no speculation): a token budget and max_num_seqs per step; running requests first,
each min(its uncomputed tokens, the budget left), so a prompt longer than the budget is
prefilled over several steps; a request that cannot grow its blocks preempts (fcfs: the newest
running one; priority: the largest (priority, arrival) of ALL running, one already scheduled
this step included, its tokens given back to the budget) until it fits or preempts itself;
preempted requests wait again (fcfs: at the front; priority: by (priority, arrival)) with their
tokens kept; waiting requests are admitted in queue order only in a step that preempted none,
while the budget, max_num_seqs and the free blocks allow, the first that does not fit stopping
admission (no skipping ahead; a waiting request never preempts a running one).
long_prefill_token_threshold is 0 by default in vLLM (no cap) and max_num_partial_prefills is
not read by the v1 scheduler: minivllm has neither, and the model leaves them out.

minivllm's documented deviations, which the model follows in its default mode (scheduler.py's
module docstring): running sequences take the budget decodes first, then unfinished prefills,
oldest first within each, by (priority, arrival) under "priority" (vLLM's: the running list's
order, which is admission order); under "fcfs" the victim is the newest running sequence not
yet scheduled this step; a sequence that preempted itself leaves the rest of the loop to run
(vLLM breaks out of it; a pull request to continue instead, vllm-project/vllm#26765, was not
merged), since in minivllm's order the sequences after it include ones vLLM would have
scheduled before it. Under "fcfs" the model's other mode, vLLM's own loop, schedules the same
steps. Found and fixed: under "priority" minivllm chose its victim among the sequences not yet
scheduled in the step, so a decode scheduled first kept running while a higher priority's
prefill preempted itself (tests below).
"""

from __future__ import annotations

import copy
import heapq
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.sampling_params import SamplingParams
from minivllm.runtime.scheduler import Scheduler
from minivllm.runtime.sequence import Sequence, Status

# The scheduler's mock model and mock forward (tests/test_runtime_scheduler.py), and the
# interrupted-scheduler audit's record of everything schedule() may change.
from test_audit_s77_runtime import Interrupt, state
from test_runtime_scheduler import BS as MOCK_BS, EOS, MockModelSteps, reference


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Req:
    __slots__ = ("rid", "prompt_len", "max_tokens", "priority", "num_tokens", "computed",
                 "blocks")

    def __init__(self, rid, prompt_len, max_tokens, priority):
        self.rid, self.prompt_len, self.max_tokens = rid, prompt_len, max_tokens
        self.priority = priority
        self.num_tokens, self.computed, self.blocks = prompt_len, 0, 0

    def key(self):  # vLLM's Request.__lt__: (priority, arrival_time); arrival = id here
        return (self.priority, self.rid)


class VLLMModel:
    """vLLM v1's queues and step, brute force (see the module docstring)."""

    def __init__(self, policy, num_blocks, block_size, budget, max_num_seqs, max_model_len, *,
                 vllm_order: bool):
        # vllm_order: vLLM's own running loop (admission order, the fcfs victim its last, a
        # request that preempted itself ends the loop); else minivllm's documented one.
        self.vllm_order = vllm_order
        self.policy, self.bs, self.budget = policy, block_size, budget
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.free = num_blocks
        self.running: list[Req] = []  # admission order, as vLLM's
        self.waiting = deque() if policy == "fcfs" else []  # FCFS deque / priority heap

    def add(self, req: Req) -> None:
        if self.policy == "fcfs":
            self.waiting.append(req)
        else:
            heapq.heappush(self.waiting, (req.key(), req))

    def _prepend(self, req: Req) -> None:  # _preempt_request: waiting.prepend_request
        if self.policy == "fcfs":
            self.waiting.appendleft(req)
        else:
            heapq.heappush(self.waiting, (req.key(), req))

    def _peek(self) -> Req:
        return self.waiting[0] if self.policy == "fcfs" else self.waiting[0][1]

    def _pop(self) -> Req:
        return self.waiting.popleft() if self.policy == "fcfs" else heapq.heappop(self.waiting)[1]

    def waiting_order(self) -> list[int]:
        if self.policy == "fcfs":
            return [r.rid for r in self.waiting]
        return [r.rid for _, r in sorted(self.waiting)]

    def _preempt(self, victim: Req, scheduled: dict, preempted: list) -> int:
        """_preempt_request: blocks freed, tokens kept, back to the waiting queue. Returns the
        tokens a victim already scheduled this step gives back to the budget."""
        self.running.remove(victim)
        self.free += victim.blocks
        victim.blocks = victim.computed = 0
        self._prepend(victim)
        preempted.append(victim.rid)
        return scheduled.pop(victim.rid)[1] if victim.rid in scheduled else 0

    def _victim(self, scheduled: dict) -> Req:
        if self.policy == "priority":  # max(self.running, key=(priority, arrival_time))
            return max(self.running, key=Req.key)
        if self.vllm_order:  # self.running.pop(): the last admitted
            return self.running[-1]
        # minivllm: the newest not yet scheduled this step
        return max((r for r in self.running if r.rid not in scheduled), key=lambda r: r.rid)

    def _loop_order(self) -> list[Req]:
        """minivllm's documented running order: decodes, then prefills; by (priority,) arrival."""
        def key(r):
            prio = (r.priority,) if self.policy == "priority" else ()
            return (r.num_tokens - r.computed > 1, *prio, r.rid)
        return sorted(self.running, key=key)

    def step(self):
        """One step: ([(id, start, num_tokens)] in batch order, [preempted ids])."""
        budget, scheduled, preempted = self.budget, {}, []
        # vLLM walks self.running by index as preemptions change it; minivllm walks its order.
        order = None if self.vllm_order else self._loop_order()
        i = 0
        while i < (len(self.running) if order is None else len(order)) and budget > 0:
            req = self.running[i] if order is None else order[i]
            i += 1
            if req not in self.running:  # preempted earlier this step (minivllm's order)
                continue
            n = min(req.num_tokens - req.computed, budget)
            need = ceil_div(req.computed + n, self.bs) - req.blocks
            while need > self.free:
                victim = self._victim(scheduled)
                if order is None and self.running.index(victim) < i - 1:
                    i -= 1  # vLLM's req_index -= 1: one before it left the list
                budget += self._preempt(victim, scheduled, preempted)
                if victim is req:
                    break
            if req not in self.running:
                if order is None:
                    break  # vLLM: "Cannot schedule this request." break
                continue  # minivllm: the rest of its order still runs
            req.blocks += need
            self.free -= need
            scheduled[req.rid] = (req.computed, n)
            budget -= n
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self._peek()
                n = min(req.num_tokens, budget)
                need = ceil_div(n, self.bs)
                if need > self.free:
                    break
                self._pop()
                self.running.append(req)
                req.blocks = need
                self.free -= need
                scheduled[req.rid] = (0, n)
                budget -= n
        return [(rid, s, n) for rid, (s, n) in scheduled.items()], preempted

    def record(self, chunks) -> None:
        """The step ran: tokens computed, a token sampled where a chunk reached the end, and
        requests that reached max_tokens or max_model_len finished (vLLM's check_stop)."""
        by_id = {r.rid: r for r in self.running}
        for rid, start, n in chunks:
            req = by_id[rid]
            req.computed = start + n
            if req.computed == req.num_tokens:
                req.num_tokens += 1
                if req.num_tokens - req.prompt_len >= req.max_tokens or \
                        req.num_tokens >= self.max_model_len:
                    self.running.remove(req)
                    self.free += req.blocks


def minivllm_scheduler(policy, num_blocks, block_size, budget, max_num_seqs, max_model_len):
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, policy=policy)


def seq_of(rid, prompt_len, max_tokens, priority) -> Sequence:
    return Sequence(rid, str(rid), 0, [1] * prompt_len,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0, priority=priority)


BS = 4
MAX_MODEL_LEN = 32

workloads = st.fixed_dictionaries(dict(
    policy=st.sampled_from(["fcfs", "priority"]),
    num_blocks=st.integers(2, 12),
    budget=st.integers(1, 16),
    max_num_seqs=st.integers(1, 5),
    # (steps after the one before, prompt length, max_tokens, priority)
    requests=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 20), st.integers(1, 10),
                                st.integers(0, 3)), min_size=1, max_size=8),
))


def run_both(w, vllm_order: bool):
    """Step minivllm's scheduler and the model side by side; every step's chunks (in batch
    order), preemptions and waiting order must agree."""
    policy, nb = w["policy"], w["num_blocks"]
    args = (policy, nb, BS, w["budget"], w["max_num_seqs"], MAX_MODEL_LEN)
    model, sched = VLLMModel(*args, vllm_order=vllm_order), minivllm_scheduler(*args)
    arrivals, at = deque(), 0
    for rid, (gap, plen, mt, prio) in enumerate(w["requests"]):
        at += gap  # requests arrive in id order, `gap` steps after the one before
        if ceil_div(min(plen + mt, MAX_MODEL_LEN) - 1, BS) > nb:
            continue  # the engine refuses a request that can never fit
        arrivals.append((at, rid, plen, mt, prio if policy == "priority" else 0))
    for step in range(600):
        while arrivals and arrivals[0][0] <= step:
            _, rid, plen, mt, prio = arrivals.popleft()
            model.add(Req(rid, plen, mt, prio))
            sched.add(seq_of(rid, plen, mt, prio))
        if not sched.has_unfinished():
            assert not model.running and not model.waiting
            if not arrivals:
                return
            continue
        want_chunks, want_preempted = model.step()
        out = sched.schedule()
        got = [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks]
        assert (got, [s.seq_id for s in out.preempted]) == (want_chunks, want_preempted), step
        assert [s.seq_id for s in sched.waiting] == model.waiting_order(), step
        model.record(want_chunks)
        sched.update(out, [1] * len(out.sampled))
        assert {s.seq_id for s in sched.running} == {r.rid for r in model.running}
    raise AssertionError("never finished")


@settings(max_examples=500, deadline=None)
@given(workloads)
def test_schedules_match_the_vllm_model(w):
    """Both policies against the model with minivllm's documented running order; under fcfs
    against vLLM's own loop too (admission order, the victim its last running request, a
    request that preempted itself ending the loop), which it matches: there a sequence part-way
    through its prefill is always the newest running one. Under priority this failed before
    the fix: a sequence preempted itself (or a better one) while a lower priority's decode,
    scheduled first, kept running."""
    run_both(w, vllm_order=False)
    if w["policy"] == "fcfs":
        run_both(w, vllm_order=True)


# -- the priority victim, one already scheduled this step --------------------------------------

def _running(sched, seq, computed: int, held: int) -> None:
    """seq running with `computed` tokens computed and a table for `held` tokens."""
    seq.max_num_tokens = sched.max_model_len
    sched.bm.allocate(seq, held)
    seq.num_computed = computed
    seq.status = Status.RUNNING
    sched.running.append(seq)


def _decode_and_prefill():
    """A low-priority decode whose token fills its first block (the step registers it), and a
    higher-priority prefill, admitted after it, that needs two blocks more with one free."""
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                      policy="priority")
    low = Sequence(0, "low", 0, [1, 2, 3], SamplingParams(ignore_eos=True, max_tokens=9), 0,
                   priority=1)
    low.token_ids.append(0)  # a sampled token: its K/V completes block 0
    high = Sequence(1, "high", 0, list(range(12)), SamplingParams(ignore_eos=True, max_tokens=2),
                    0, priority=0)
    _running(sched, low, 3, 4)
    _running(sched, high, 4, 4)
    return bm, sched, low, high


def test_the_lowest_priority_is_preempted_though_scheduled_first():
    """vLLM: max(self.running, key=(priority, arrival_time)), scheduled or not; its tokens go
    back to the budget. minivllm preempted `high` itself (the newest not yet scheduled), so the
    lower priority's decode ran and the higher priority's prefill waited."""
    bm, sched, low, high = _decode_and_prefill()
    out = sched.schedule()
    assert out.preempted == [low] and low.status is Status.WAITING
    # high's chunk was sized before low gave its token back: 7 of the 8 (as vLLM's).
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(high, 4, 7)]
    assert out.num_tokens == 7 and out.sampled == [] and out.prefills == out.chunks
    # The block low's chunk registered (its K/V never written) is no prefix-cache hit (here
    # high takes it anyway: the next test keeps it free).
    assert (1, 2, 3, 0) not in bm.registered_blocks().values()
    assert all(s is not low for s, _, _ in bm.uncommitted)
    bm.check(sched.sequences)
    # low comes back with its four tokens to compute, none of them from the cache.
    sched.update(out, [])
    sched.finish(high, "abort")
    out = sched.schedule()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(low, 0, 4)]


def test_a_chunk_taken_back_leaves_no_unwritten_block_in_the_prefix_cache():
    """low's decode completes its second block, which its chunk registers; low is then the
    victim (its chunk taken back) and high, still short, preempts itself, so nothing reuses the
    freed blocks: the second block, whose last slot the step never writes, must not be a hit
    for a later prompt that starts with low's eight tokens (it was, when taking the chunk back
    left the registration)."""
    bm = BlockManager(5, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                      policy="priority")
    params = SamplingParams(ignore_eos=True, max_tokens=2)
    mid = Sequence(0, "mid", 0, [9] * 5, params, 0, priority=0)
    mid.token_ids.append(9)
    low = Sequence(1, "low", 0, [1, 2, 3, 0, 1, 2, 3], params, 0, priority=1)
    low.token_ids.append(0)
    high = Sequence(2, "high", 0, list(range(20, 36)), params, 0, priority=0)
    _running(sched, mid, 5, 8)
    _running(sched, low, 7, 8)
    _running(sched, high, 4, 4)
    out = sched.schedule()
    assert out.preempted == [low, high]
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(mid, 5, 1)]
    later = Sequence(3, "later", 0, [1, 2, 3, 0, 1, 2, 3, 0, 5], params, 0)
    assert len(bm.match_prefix(later)) == 1  # low's first block: its K/V was computed
    bm.check(sched.sequences)


def test_a_failure_after_taking_a_chunk_back_is_undone():
    """schedule() raising while it unregisters the taken-back chunk's block (Ctrl-C there)
    leaves everything as it was, and the call made again schedules what an uninterrupted twin
    does."""
    bm, sched, low, high = _decode_and_prefill()
    twin = copy.deepcopy(sched)
    want = twin.schedule()
    before = state(sched)

    def interrupted(b):
        raise Interrupt
    bm._evict = interrupted
    with pytest.raises(Interrupt):
        sched.schedule()
    del bm._evict
    after = state(sched)
    assert {k: v for k, v in after.items() if k != "free"} == \
        {k: v for k, v in before.items() if k != "free"}
    assert set(after["free"]) == set(before["free"])
    bm.check(sched.sequences)
    out = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == \
        [(c.seq.seq_id, c.start, c.num_tokens) for c in want.chunks]
    assert [s.seq_id for s in out.preempted] == [s.seq_id for s in want.preempted]
    assert state(sched, with_times=False) == state(twin, with_times=False)


def by_priority(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.seq_id


class PrioritySteps(MockModelSteps):
    """Priority scheduling with the prefix cache on, synchronous or asynchronous, driven by the
    mock model, whose forward checks that every chunk reads its own prefix back. Each step,
    every preempted sequence must be the lowest priority's latest of those running when it was
    chosen (vLLM's rule): none left running or scheduled comes after it in (priority, arrival).
    At the end every sequence has the mock model's tokens for its prompt alone."""

    def __init__(self, num_blocks, max_num_seqs, budget, asynchronous):
        self.bm = BlockManager(num_blocks, MOCK_BS)
        self.max_model_len = 24
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget, max_model_len=self.max_model_len,
                               policy="priority")
        self.slots: dict = {}
        self.all: list[Sequence] = []
        self.asynchronous = asynchronous
        self.in_flight = None
        self.steps = 0

    def add_request(self, prompt, max_tokens, n, priority):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)
        if self.bm.blocks_for(min(len(prompt) + max_tokens, self.max_model_len) - 1) > \
                self.bm.num_blocks:
            return  # the engine refuses what can never fit
        for i in range(n):
            seq = Sequence(len(self.all), str(len(self.all)), i, prompt, params, 0,
                           eos_ids=(EOS,), priority=priority)
            self.all.append(seq)
            self.sched.add(seq)

    def step(self):
        out = self.sched.schedule()
        self.steps += 1
        kept = [c.seq for c in out.chunks] + self.sched.running
        for victim in out.preempted:
            assert victim.status is Status.WAITING
            assert all(by_priority(s) < by_priority(victim) for s in kept), (victim, kept)
        assert out.num_tokens == sum(c.num_tokens for c in out.chunks)
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert out.sampled == [c for c in out.chunks if c.want_logits]
        self._forward(out)

    def busy(self) -> bool:
        return self.sched.has_unfinished() or self.in_flight is not None

    def finish(self):
        limit = self.steps + 2000
        while self.busy():
            assert self.steps < limit, "requests never finish"
            self.step()
        self.bm.check([])
        for seq in self.all:
            want = reference(seq.prompt_ids, seq.params, self.max_model_len, (EOS,))
            assert seq.output_ids == want, (seq, seq.output_ids, want)


prompts = st.lists(st.integers(0, 3), min_size=1, max_size=14)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(4, 9), budget=st.integers(2, 9), asynchronous=st.booleans(),
       low=st.lists(st.tuples(prompts, st.integers(3, 10), st.integers(1, 2)), min_size=1,
                    max_size=3),
       warmup=st.integers(0, 6),
       high=st.lists(st.tuples(prompts, st.integers(1, 6), st.integers(0, 1)), min_size=1,
                     max_size=2))
def test_higher_priorities_arriving_while_lower_ones_decode(num_blocks, budget, asynchronous,
                                                            low, warmup, high):
    """Lower priorities decoding (n=2 twins among them, which share their blocks) when higher
    ones arrive and run short of blocks: the victim is then often a decode the step scheduled
    already. Before the fix a higher priority preempted itself there while the lower one's
    decode ran."""
    m = PrioritySteps(num_blocks, 4, budget, asynchronous)
    for prompt, max_tokens, n in low:
        m.add_request(prompt, max_tokens, n, priority=2)
    for _ in range(warmup):
        if m.busy():
            m.step()
    for prompt, max_tokens, priority in high:
        m.add_request(prompt, max_tokens, 1, priority)
    m.finish()
