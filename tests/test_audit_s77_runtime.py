"""Runtime robustness (session 77): a sleep that fails part-way, a schedule() that raises
part-way, and the scheduler's public preemption.

The oracles: transformers' greedy tokens of the same checkpoint (fp32 on the CPU, exact); the
engine's own uninterrupted run; for the scheduler alone, a mock model whose next token hashes
the whole sequence and whose "KV cache" records, per slot, the prefix the slot's K/V holds, so
that every chunk's context is checked to read back right (tests/test_runtime_scheduler.py's), and
an uninterrupted twin of the scheduler (a deep copy) run on the same step."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from safetensors.torch import load_file
from torch.utils._pytree import tree_leaves

from minivllm import LLM, SamplingParams
from minivllm.runtime import runner as runner_mod
from minivllm.runtime.block_manager import BlockManager
from minivllm.runtime.scheduler import Scheduler
from minivllm.runtime.sequence import Sequence, Status
from minivllm.runtime.sleep import storages

import engine_helpers
from hf_tiny import hf_greedy, make_hf_model, save_checkpoint
# The scheduler's mock model and its mock forward (tests/test_runtime_scheduler.py).
from test_runtime_scheduler import BS, EOS, MockModelSteps, reference as mock_reference


class Boom(Exception):
    pass


class Interrupt(BaseException):
    """Stands for KeyboardInterrupt (a BaseException, not an Exception) where a real one would
    stop the test run if it escaped."""


# -- sleep that fails part-way -------------------------------------------------------------------

SLEEPY = dict(num_kv_blocks=64, attention_backend="reference", device="cpu", block_size=4,
              max_num_batched_tokens=64, enable_sleep_mode=True)
NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
# 23 tokens: five full blocks of 4, which the prefix cache registers (and a later run hits).
PROMPTS = [torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (23, 6)]


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=3)


@pytest.fixture(scope="module")
def model_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("s77") / "model")


@pytest.fixture(scope="module")
def reference(hf_model):
    return [hf_greedy(hf_model, p, NEW) for p in PROMPTS]


def run(llm):
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                               GREEDY, use_tqdm=False)]
    return ([o.token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])


def checkpoint_pairs(path):
    """The checkpoint's own (name, tensor) pairs, for load_weights after a level-2 sleep."""
    return list(load_file(os.path.join(path, "model.safetensors")).items())


def whole(tree) -> bool:
    """Whether every tensor of tree has its storage's bytes (none freed)."""
    return all(t.untyped_storage().nbytes() >= t.numel() * t.element_size()
               for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def fail_at(monkeypatch, runner, which: str, after: bool) -> None:
    """Make the runner's sleep raise Boom at the step that frees `which` ("cache" or "weights"):
    before anything of it is freed, or (after=True) once all of it is. The runner frees a tree
    through sleep.free (a staged tree; sleep.offload, the tree itself, before this session):
    both are wrapped."""
    tree = runner.cache if which == "cache" else runner.params
    ptrs = {s.data_ptr() for s in storages(tree)}

    def is_it(x) -> bool:
        if x is tree:
            return True
        return bool(getattr(x, "storages", None)) and x.storages[0].data_ptr() in ptrs

    def wrap(real):
        def fn(x, *a, **kw):
            if not is_it(x):
                return real(x, *a, **kw)
            if not after:
                raise Boom
            real(x, *a, **kw)
            raise Boom
        return fn

    for name in ("free", "offload"):
        if hasattr(runner_mod, name):
            monkeypatch.setattr(runner_mod, name, wrap(getattr(runner_mod, name)))


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("after", [False, True], ids=["before-freeing", "after-freeing"])
def test_a_sleep_that_fails_at_the_cache_leaves_the_engine_as_it_was(model_dir, reference,
                                                                    monkeypatch, level, after):
    """The weights used to be freed (level 2: discarded) before the cache: a failure at the
    cache lost them. Now the engine stays awake with its weights and a usable cache, gives the
    same tokens (and logprobs) as before, and sleeps and wakes up afterwards."""
    with LLM(model_dir, **SLEEPY) as llm:
        runner = llm.engine.runner
        before = run(llm)
        assert before[0] == reference
        run(llm)  # the long prompt's blocks are in the prefix cache now
        with monkeypatch.context() as m:
            fail_at(m, runner, "cache", after)
            with pytest.raises(Boom):
                llm.sleep(level)
        assert not llm.is_sleeping() and runner.asleep == {}
        assert whole(runner.params) and whole(runner.cache)
        hits = llm.engine.scheduler.num_prefix_cache_hits
        assert run(llm) == before
        # The cache's K/V may be zeros now: the prefix cache was forgotten, nothing was hit.
        assert llm.engine.scheduler.num_prefix_cache_hits == hits
        llm.sleep(level)
        assert llm.is_sleeping()
        llm.wake_up()
        if level == 2:
            llm.load_weights(checkpoint_pairs(model_dir))
        assert run(llm) == before


def test_a_sleep_that_fails_releasing_the_graphs_puts_back_what_it_freed(model_dir, reference,
                                                                        monkeypatch):
    """Both trees freed, then the graphs' release fails: their memory comes back (the weights'
    bytes from the host copy) and the graphs are captured again (none on the CPU)."""
    with LLM(model_dir, **SLEEPY) as llm:
        runner = llm.engine.runner
        before = run(llm)
        calls = []
        real = runner._drop_captures

        def drop():
            calls.append(1)
            if len(calls) == 1:
                raise Boom
            real()

        monkeypatch.setattr(runner, "_drop_captures", drop)
        with pytest.raises(Boom):
            llm.sleep(1)
        monkeypatch.undo()
        assert not llm.is_sleeping() and whole(runner.params) and whole(runner.cache)
        assert run(llm) == before and before[0] == reference


def test_level_2_failing_once_the_weights_are_discarded_sleeps(model_dir, reference, monkeypatch):
    """Level 2's discard of the weights cannot be undone: a failure after it leaves the engine
    asleep (both tags), as a level-2 sleep does, so that wake_up and load_weights bring it back;
    it used to report the engine awake with its weights gone."""
    with LLM(model_dir, **SLEEPY) as llm:
        runner = llm.engine.runner
        before = run(llm)
        with monkeypatch.context() as m:
            fail_at(m, runner, "weights", after=True)
            with pytest.raises(Boom):
                llm.sleep(2)
        assert llm.is_sleeping() and llm.engine.sleeping == {"weights", "kv_cache"}
        with pytest.raises(ValueError, match="sleeping"):
            run(llm)
        llm.wake_up()
        llm.load_weights(checkpoint_pairs(model_dir))
        assert run(llm) == before and before[0] == reference


# -- schedule() that raises part-way: the scheduler alone ----------------------------------------

class FailingList(list):
    """A list whose `method` raises `error` on its k-th call."""

    def __init__(self, items, method, k, error):
        super().__init__(items)
        self.fail = (method, k, error)
        self.calls = 0

    def _count(self, method):
        name, k, error = self.fail
        if method == name:
            self.calls += 1
            if self.calls == k:
                raise error

    def append(self, x):
        self._count("append")
        super().append(x)

    def remove(self, x):
        self._count("remove")
        super().remove(x)

    def pop(self, *a):
        self._count("pop")
        return super().pop(*a)

    def insert(self, i, x):  # bisect.insort calls it on a list subclass
        self._count("insert")
        super().insert(i, x)


# Where a failure is injected: a method of the block manager or the scheduler (raising on its
# k-th call, before it runs), or a list operation on the queues or the prefix cache's
# uncommitted blocks. _take and _evict, and uncommitted.append, fail inside allocate and
# register_full_blocks, after part of their work.
TARGETS = [("bm", m) for m in ("allocate", "register_full_blocks", "free_blocks", "match_prefix",
                               "can_allocate", "_take", "_evict")] + \
          [("sched", m) for m in ("preempt", "add", "_grow", "_schedule")] + \
          [("running", "append"), ("running", "remove"), ("waiting", "pop"),
           ("waiting", "insert"), ("uncommitted", "append")]


def state(sched: Scheduler, with_times: bool = True) -> dict:
    """Everything schedule() may change, as plain values (sequences by id)."""
    bm = sched.bm
    seqs = {}
    for s in sched.running + sched.waiting:
        seqs[s.seq_id] = (s.status, list(s.block_table), s.num_computed, s.num_registered_blocks,
                          s.num_preemptions, s.max_num_tokens, s.num_cached_prompt,
                          s.scheduled_time if with_times else None, list(s.token_ids),
                          s.num_pending)
    return dict(
        seqs=seqs, running=[s.seq_id for s in sched.running],
        waiting=[s.seq_id for s in sched.waiting],
        counters=(sched.num_preemptions, sched.num_prompt_tokens_cached,
                  sched.num_prefix_cache_queries, sched.num_prefix_cache_hits),
        blocks=[(b.ref, b.node) for b in bm.blocks], free=list(bm.free), trie=dict(bm.trie),
        node_key=dict(bm.node_key), node_blocks=dict(bm.node_blocks), next_node=bm.next_node,
        uncommitted=[(s.seq_id, i, b) for s, i, b in bm.uncommitted])


def summary(out) -> tuple:
    return ([(c.seq.seq_id, c.start, c.num_tokens, c.want_logits) for c in out.chunks],
            [s.seq_id for s in out.preempted], [c.seq.seq_id for c in out.sampled],
            [c.seq.seq_id for c in out.prefills], out.num_tokens)


class InterruptedScheduler(MockModelSteps, RuleBasedStateMachine):
    """Random requests and aborts, steps, and steps whose schedule() raises at a random point:
    after one, the scheduler's state equals what it was before the call (the free queue's
    order aside for a prefix-cache hit taken from it, which goes back to its end); the call
    made again schedules what an uninterrupted twin does and leaves the same state; and every
    request ends with the mock model's tokens for its prompt alone."""

    @initialize(num_blocks=st.integers(4, 16), max_num_seqs=st.integers(1, 4),
                max_tokens_per_step=st.integers(1, 12), caching=st.booleans(),
                asynchronous=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]))
    def setup(self, num_blocks, max_num_seqs, max_tokens_per_step, caching, asynchronous,
              policy):
        self.bm = BlockManager(num_blocks, BS, enable_prefix_caching=caching)
        self.max_model_len = 24
        self.sched = Scheduler(self.bm, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max_tokens_per_step,
                               max_model_len=self.max_model_len, policy=policy)
        self.policy = policy
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}
        self.all: list[Sequence] = []
        self.asynchronous = asynchronous
        self.in_flight = None  # (SchedulerOutput, sampled tokens) not yet resolved
        self.steps = 0
        self.failures = 0

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=14),
          max_tokens=st.integers(1, 10), stop_eos=st.booleans(), n=st.integers(1, 2),
          priority=st.integers(-1, 2))
    def add_request(self, prompt, max_tokens, stop_eos, n, priority):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=not stop_eos, n=n)
        longest = min(len(prompt) + max_tokens, self.max_model_len) - 1
        if self.bm.blocks_for(longest) > self.bm.num_blocks:
            return  # the engine refuses what can never fit
        for i in range(n):
            seq = Sequence(len(self.all), str(len(self.all)), i, prompt, params, 0,
                           eos_ids=(EOS,), priority=priority if self.policy == "priority" else 0)
            self.all.append(seq)
            self.sched.add(seq)

    @precondition(lambda self: self.sched.running or self.sched.waiting)
    @rule(data=st.data())
    def abort(self, data):
        self.sched.finish(data.draw(st.sampled_from(self.sched.sequences)), "abort")

    @precondition(lambda self: self.sched.has_unfinished() or self.in_flight)
    @rule(where=st.sampled_from(TARGETS), k=st.integers(1, 6), base=st.booleans())
    def step(self, where, k, base):
        """A step whose schedule() raises at the k-th call of `where`, if it makes that many."""
        sched, bm = self.sched, self.bm
        error = Interrupt() if base else Boom()
        before = state(sched)
        twin = copy.deepcopy(sched)
        twin_out = twin.schedule()
        free_before = set(bm.free)
        # Prefix-cache hits the call takes from the free queue: back at its end after a failure.
        moved = {b for c in twin_out.chunks if c.seq.seq_id in before["waiting"]
                 for b in c.seq.block_table[:c.start // BS] if b in free_before}
        where, name = where
        calls = [0]
        if where in ("bm", "sched"):
            obj = bm if where == "bm" else sched
            real = getattr(obj, name)

            def failing(*a, **kw):
                calls[0] += 1
                if calls[0] == k:
                    raise error
                return real(*a, **kw)
            setattr(obj, name, failing)
        else:
            holder = bm if where == "uncommitted" else sched
            setattr(holder, where, FailingList(getattr(holder, where), name, k, error))
        try:
            out = sched.schedule()
            failed = False
        except (Boom, Interrupt) as e:
            assert e is error
            failed = True
        finally:
            if where in ("bm", "sched"):
                delattr(bm if where == "bm" else sched, name)
            else:
                holder = bm if where == "uncommitted" else sched
                setattr(holder, where, list(getattr(holder, where)))
        if failed:
            self.failures += 1
            after = state(sched)
            for key in before:
                if key != "free":
                    assert after[key] == before[key], key
            assert set(after["free"]) == free_before
            assert [b for b in after["free"] if b not in moved] == \
                [b for b in before["free"] if b not in moved]
            bm.check(sched.sequences)
            out = sched.schedule()  # again: as if the failed call never ran
        assert summary(out) == summary(twin_out)
        assert state(sched, with_times=False) == state(twin, with_times=False)
        self._run(out)

    def _run(self, out):
        """The mock forward of a scheduled step (test_runtime_scheduler's), then its record."""
        self.steps += 1
        assert out.chunks or self.in_flight, "nothing scheduled while requests wait"
        self._forward(out, commit=True)

    @invariant()
    def blocks_agree(self):
        if hasattr(self, "sched"):
            self.bm.check(self.sched.sequences)
            for seq in self.sched.waiting:
                assert seq.block_table == [] and seq.num_computed == 0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        limit = self.steps + 2000
        while self.sched.has_unfinished() or self.in_flight:
            assert self.steps < limit, "requests never finish"
            self._run(self.sched.schedule())
        self.bm.check([])
        assert self.bm.num_free == self.bm.num_blocks
        for seq in self.all:
            assert seq.finished
            if seq.finish_reason != "abort":
                want = mock_reference(seq.prompt_ids, seq.params, self.max_model_len, (EOS,))
                assert seq.output_ids == want, (seq, seq.output_ids, want)


TestInterruptedScheduler = InterruptedScheduler.TestCase
TestInterruptedScheduler.settings = settings(TestInterruptedScheduler.settings, max_examples=80,
                                             stateful_step_count=40, deadline=None)


def _seq(i, prompt, **kw):
    return Sequence(i, str(i), 0, prompt, SamplingParams(ignore_eos=True, **kw), 0)


def run_to_end(eng, final: dict, fault=(), on_fault=None, steps: int = 400) -> int:
    """Step eng until no request is left (at most `steps` steps), each finished output's tokens
    into final[its request id]. A step that raises `fault` is handed to on_fault and stepping
    goes on. Returns how many steps raised it."""
    faults = 0
    for _ in range(steps):
        if not (eng.has_unfinished_requests() or eng.in_flight or eng.unread or eng.undelivered):
            break
        try:
            outs = eng.step()
        except fault as e:
            faults += 1
            on_fault(e)
            continue
        for o in outs:
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids
    return faults


def test_a_failure_after_an_admission_or_a_preemption_is_undone():
    """Two cases written out: a step that admits one sequence (blocks allocated, moved to
    running) and is interrupted admitting the next, which used to be left in no queue; a step
    that preempts a sequence to grow another and fails growing it, which used to leave the
    preempted one waiting, its blocks freed, and the step never run."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b = _seq(0, list(range(1, 8))), _seq(1, list(range(11, 18)))
    sched.add(a)
    sched.add(b)
    before = state(sched)
    real, calls = bm.allocate, []

    def allocate(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(*args)
    bm.allocate = allocate
    with pytest.raises(KeyboardInterrupt):
        sched.schedule()
    del bm.allocate
    assert len(calls) == 2 and state(sched) == before
    out = sched.schedule()
    assert [(c.seq.seq_id, c.start, c.num_tokens) for c in out.chunks] == [(0, 0, 7), (1, 0, 7)]
    sched.update(out, [1, 1])
    sched.update(sched.schedule(), [1, 1])  # 9 tokens each: a's next needs a third block
    before = state(sched)

    def no_room(*args):
        assert b.status is Status.WAITING  # b was preempted for it
        raise Boom
    bm.allocate = no_room
    with pytest.raises(Boom):
        sched.schedule()
    del bm.allocate
    assert state(sched) == before
    bm.check([a, b])
    out = sched.schedule()
    assert out.preempted == [b] and [c.seq for c in out.chunks] == [a]


# -- schedule() that raises part-way: the engine -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=0, std=0.3), tmp_path_factory.mktemp("tiny") / "m")


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("k", [2, 3, 5])
def test_ctrl_c_inside_schedule_loses_nothing(tiny_dir, device, async_scheduling, k):
    """A KeyboardInterrupt raised by the block manager's k-th allocate inside schedule(), with
    admissions and preemptions under way (a cache of 12 blocks of 4 for 5 requests): the
    engine's next steps complete every request with the tokens of an uninterrupted engine."""
    prompts = [[3, 4, 5, 6, 7, 8, 9], [8, 9, 10], [3, 4, 5, 6, 7, 8, 9, 11, 12], [20, 21, 22, 23],
               [30, 31, 32, 33, 34, 35]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16,
              async_scheduling=async_scheduling)

    solo = engine_helpers.make_llm(tiny_dir, device, **kw)
    want = {}
    ids = solo.engine.add_requests([{"prompt_token_ids": p} for p in prompts],
                                   [params] * len(prompts))
    run_to_end(solo.engine, want)
    want = [want[i] for i in ids]

    llm = engine_helpers.make_llm(tiny_dir, device, **kw)
    eng = llm.engine
    bm = eng.block_manager
    ids = eng.add_requests([{"prompt_token_ids": p} for p in prompts], [params] * len(prompts))
    final = {}
    real, calls = bm.allocate, [0]

    def allocate(*a, **kw):
        calls[0] += 1
        if calls[0] == k:
            raise KeyboardInterrupt
        return real(*a, **kw)

    bm.allocate = allocate
    interrupted = run_to_end(eng, final, KeyboardInterrupt,
                             lambda e: bm.check(eng.scheduler.sequences))
    del bm.allocate
    assert interrupted
    assert [final.get(i) for i in ids] == want
    assert bm.num_free == bm.num_blocks


# -- the scheduler's public preemption ----------------------------------------------------------


def test_preempt_is_public_and_the_engine_uses_it(tiny_dir, device, monkeypatch):
    """Scheduler.preempt frees a running sequence's blocks and queues it ahead of newer
    requests; LLMEngine._lose (a launched step's result lost: a device error) preempts through
    it, and the requests still end with an uninterrupted engine's tokens."""
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    a, b, c = (_seq(i, [1, 2, 3], max_tokens=10) for i in range(3))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.update(out, [0, 0])
    sched.add(c)
    sched.preempt(b)
    assert [s.seq_id for s in sched.waiting] == [1, 2] and b.block_table == []
    assert b.num_computed == 0 and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.token_ids == [1, 2, 3, 0]  # its tokens kept, to be computed again
    bm.check([a, b, c])

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3, 4, 5, 6, 7], [8, 9, 10]]
    kw = dict(block_size=4, async_scheduling=True)
    solo = engine_helpers.make_llm(tiny_dir, device, **kw)
    want = [o.outputs[0].token_ids for o in solo.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = engine_helpers.make_llm(tiny_dir, device, **kw)
    eng = llm.engine
    preempted = []
    real_preempt = eng.scheduler.preempt
    monkeypatch.setattr(eng.scheduler, "preempt",
                        lambda seq: preempted.append(seq.seq_id) or real_preempt(seq))
    real_launch, launches = eng.runner.launch, [0]

    class Lost:
        def result(self):
            raise RuntimeError("a device error")

    def launch(step):
        launches[0] += 1
        pending = real_launch(step)
        return Lost() if launches[0] == 3 else pending

    monkeypatch.setattr(eng.runner, "launch", launch)
    ids = eng.add_requests([{"prompt_token_ids": p} for p in prompts], [params] * 2)
    final = {}
    def device_error(e):
        assert "device error" in str(e)

    lost = run_to_end(eng, final, RuntimeError, device_error, steps=200)
    assert lost and preempted
    assert [final[i] for i in ids] == want
