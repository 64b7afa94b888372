"""Audit of the engine's state across a request's lifecycle (session 75): aborts while waiting,
mid-prefill and mid-decode, streams closed or dropped early, preemption under a cache of a few
blocks, n > 1 siblings sharing prefix blocks, prompts that fill whole blocks, max_tokens=1.
The oracle is each request alone on a fresh engine (greedy, or seeded sampling), and the block
manager's own check: every block back in the free queue once nothing runs, each reference
count equal to the tables that hold it."""

from __future__ import annotations

import gc

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minivllm import SamplingParams

import engine_helpers
from hf_tiny import make_hf_model, save_checkpoint

BS = 4
BASE = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 11]  # a shared prefix: prompts cut from it share blocks


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=0, std=0.3),
                           tmp_path_factory.mktemp("tiny") / "model")


def make_llm(path, device, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("skip_tokenizer_init", True)
    return engine_helpers.make_llm(path, device, **kw)


def alone(path, device, prompt, params) -> list[list[int]]:
    """Each completion's token ids with the request alone on a fresh engine of ample cache."""
    llm = make_llm(path, device, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return [c.token_ids for c in out.outputs]


def drain(eng) -> dict:
    """Step until nothing runs; the finished outputs' token ids by request id."""
    done = {}
    while eng.has_unfinished_requests() or eng.in_flight is not None:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
    return done


def test_abort_takes_one_id_or_a_list_as_vllm_and_refuses_an_id_that_is_no_string(tiny_dir, device):
    """vLLM's abort_request takes a request id or a list of them (v0: str | Iterable[str], v1:
    list[str]) and skips ids it does not hold. A list raised "unhashable type: 'list'" here, and
    an int id (abort_request(0) for request "0") matched nothing and was skipped without a word,
    the request running on."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=16)
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    a, b, c = eng.add_requests([{"prompt_token_ids": BASE[:5]}] * 3, [sp] * 3)
    eng.step()
    eng.abort_request([a, b])
    assert set(eng.requests) == {c}
    eng.abort_request(a)  # twice: skipped, as vLLM
    eng.abort_request(["never-added", b])  # unknown: skipped, as vLLM
    for bad in (int(c), [c, int(c)], None, 1.5):
        with pytest.raises(TypeError, match="string"):
            eng.abort_request(bad)
    assert set(eng.requests) == {c}  # a refused call aborts none of its ids
    eng.abort_request((i for i in [c]))
    assert not eng.has_unfinished_requests()
    drain(eng)
    eng.block_manager.check([])
    assert eng.block_manager.num_free == eng.num_blocks


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_every_lifecycle_event_frees_its_blocks_and_leaves_the_others_outputs_alone(
        tiny_dir, device, async_scheduling):
    """One engine of 7 blocks of 4 tokens and a budget of 5 tokens a step: requests aborted while
    waiting, mid-prefill (a chunk in) and mid-decode, n=3 siblings sharing their prompt's blocks
    aborted together, a prompt that fills whole blocks, max_tokens=1, a stream closed and one
    dropped (garbage-collected) early, and preemption. The survivors give what they give alone;
    every block is free at the end."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=7, max_num_batched_tokens=5, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    eng, bm = llm.engine, llm.engine.block_manager
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=6, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    keep = {  # request -> (prompt, params), added up front so that they queue behind each other
        "full": (BASE[:8], greedy),  # exactly two blocks
        "seeded": (BASE[:6], seeded),
        "one": (BASE[:4], one),
    }
    ids = eng.add_requests([{"prompt_token_ids": p} for p, _ in keep.values()],
                           [sp for _, sp in keep.values()])
    keep = dict(zip(ids, keep.values()))
    siblings = eng.add_request({"prompt_token_ids": BASE[:9]},
                               SamplingParams(temperature=1.0, seed=1, n=3, max_tokens=5,
                                              ignore_eos=True))
    prefill = eng.add_request({"prompt_token_ids": BASE[:3] + [40, 41, 42, 43, 44, 45]}, greedy)
    waiting = eng.add_request({"prompt_token_ids": [50, 51]}, greedy)
    eng.abort_request(waiting)  # never scheduled
    done, seen = {}, set()
    for _ in range(60):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = [c.token_ids for c in o.outputs]
        bm.check(eng.scheduler.sequences)
        seqs = {s.request_id: s for s in eng.scheduler.running}
        sib = [s for s in eng.scheduler.running if s.request_id == siblings]
        if len(sib) >= 2 and siblings in eng.requests and \
                set(sib[0].block_table) & set(sib[1].block_table):
            seen.add("siblings share")
            eng.abort_request(siblings)  # while their shared prompt blocks are held
        s = seqs.get(prefill)
        if s is not None and 0 < s.num_computed < s.prompt_len and prefill in eng.requests:
            seen.add("mid-prefill")
            eng.abort_request(prefill)
        if not eng.has_unfinished_requests():
            break
    assert seen == {"siblings share", "mid-prefill"}
    done.update(drain(eng))
    # A decode aborted, a stream closed after its first output and one dropped without a close.
    decoding = eng.add_request({"prompt_token_ids": BASE[:5]}, greedy)
    while not any(s.num_output >= 2 for s in eng.scheduler.running):
        eng.step()
    eng.abort_request(decoding)
    closed = llm.stream([{"prompt_token_ids": BASE[:7]}], greedy)
    next(closed)
    closed.close()
    dropped = llm.stream([{"prompt_token_ids": BASE[2:9]}, {"prompt_token_ids": BASE[:2]}],
                         greedy)
    next(dropped)
    del dropped
    gc.collect()
    assert not eng.has_unfinished_requests() and not llm._owned
    drain(eng)
    assert eng.stats.preemptions > 0
    assert sorted(done) == sorted(keep)
    for rid, (prompt, params) in keep.items():
        assert done[rid] == alone(tiny_dir, device, prompt, params), rid
    bm.check([])
    assert bm.num_free == eng.num_blocks


class LifecycleMachine(RuleBasedStateMachine):
    """Random adds, aborts (live, finished, unknown) and steps on an engine of a few blocks,
    with streams opened, read, closed and dropped through LLM: the blocks' bookkeeping holds
    after every operation, every block is free once nothing runs, and every request that
    finished gives what it gives alone."""

    path = device = None
    solo: dict = {}

    @initialize(num_blocks=st.integers(5, 10), budget=st.integers(2, 12),
                asynchronous=st.booleans(), caching=st.booleans())
    def setup(self, num_blocks, budget, asynchronous, caching):
        self.llm = make_llm(self.path, self.device, num_kv_blocks=num_blocks,
                            max_num_batched_tokens=budget, max_num_seqs=3,
                            async_scheduling=asynchronous, enable_prefix_caching=caching)
        self.eng = self.llm.engine
        self.live: dict[str, tuple] = {}
        self.gone: list[str] = []  # aborted, finished
        self.streams: list[list] = []  # [generator, [(prompt, params)], {rid: {index: ids}}]
        self.finished: list[tuple] = []  # (prompt, params, outputs)

    def _request(self, data):
        n = data.draw(st.integers(1, 16), label="length")
        prompt = BASE[:n] if n <= len(BASE) else \
            [data.draw(st.integers(0, 100)) for _ in range(n - 8)]
        params = SamplingParams(temperature=data.draw(st.sampled_from([0.0, 1.0])),
                                seed=data.draw(st.integers(0, 3)), n=data.draw(st.integers(1, 3)),
                                max_tokens=data.draw(st.sampled_from([1, 2, 5, 9])),
                                ignore_eos=True)
        return prompt, params

    @precondition(lambda self: len(self.live) < 5)
    @rule(data=st.data())
    def add(self, data):
        prompt, params = self._request(data)
        rid = self.eng.add_request({"prompt_token_ids": prompt}, params)
        self.live[rid] = (prompt, params)

    @precondition(lambda self: self.live or self.gone)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live) + self.gone + ["unknown"]))
        self.eng.abort_request(rid)
        if self.live.pop(rid, None) is not None:
            self.gone.append(rid)

    @rule()
    def step(self):
        for o in self.eng.step():
            if o.finished and o.request_id in self.live:
                prompt, params = self.live.pop(o.request_id)
                self.finished.append((prompt, params, [c.token_ids for c in o.outputs]))
                self.gone.append(o.request_id)

    @precondition(lambda self: len(self.streams) < 2)
    @rule(data=st.data(), k=st.integers(1, 2))
    def open_stream(self, data, k):
        reqs = [self._request(data) for _ in range(k)]
        gen = self.llm.stream([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs])
        self.streams.append([gen, reqs, {}])

    @precondition(lambda self: self.streams)
    @rule(data=st.data())
    def read_stream(self, data):
        s = data.draw(st.sampled_from(self.streams))
        try:
            delta = next(s[0])
        except StopIteration:
            self.streams.remove(s)
            for (prompt, params), rid in zip(s[1], sorted(s[2], key=int)):
                got = s[2][rid]
                self.finished.append((prompt, params, [got[i] for i in range(params.n)]))
            return
        for c in delta.outputs:
            s[2].setdefault(delta.request_id, {}).setdefault(c.index, []).extend(c.token_ids)

    @precondition(lambda self: self.streams)
    @rule(data=st.data(), close=st.booleans())
    def end_stream(self, data, close):
        s = self.streams.pop(data.draw(st.integers(0, len(self.streams) - 1)))
        if close:
            s[0].close()
        del s  # the last reference: the generator is finalized, as a caller dropping it
        gc.collect()

    @invariant()
    def blocks_add_up(self):
        if hasattr(self, "eng"):
            self.eng.block_manager.check(self.eng.scheduler.sequences)

    def teardown(self):
        if not hasattr(self, "eng"):
            return
        self.streams.clear()
        gc.collect()
        for rid in list(self.live):
            for o in self.eng.step():
                if o.finished and o.request_id in self.live:
                    prompt, params = self.live.pop(o.request_id)
                    self.finished.append((prompt, params, [c.token_ids for c in o.outputs]))
        self.eng.abort_request(sorted(self.live))
        drain(self.eng)
        bm = self.eng.block_manager
        bm.check([])
        assert bm.num_free == bm.num_blocks and not self.llm._owned and not self.llm._parked
        for prompt, params, got in self.finished:
            key = (tuple(prompt), repr(params))
            if key not in self.solo:
                self.solo[key] = alone(self.path, self.device, prompt, params)
            assert got == self.solo[key], (prompt, params)


def test_random_lifecycles_free_every_block_and_keep_every_output(tiny_dir, device):
    LifecycleMachine.path, LifecycleMachine.device = tiny_dir, device
    LifecycleMachine.solo = {}
    run = LifecycleMachine.TestCase
    run.settings = settings(run.settings, max_examples=20, stateful_step_count=30)
    run().runTest()


def test_a_bad_prompt_id_is_named_in_a_bounded_message():
    """A nested list among the ids was named by its whole repr: a 400 of megabytes."""
    import torch

    from minivllm.runtime.demo import ensure_demo_model

    llm = engine_helpers.make_llm(ensure_demo_model(), torch.device("cpu"))
    with pytest.raises(ValueError, match="not an int token id") as e:
        llm.generate({"prompt_token_ids": [1, list(range(100_000))]}, use_tqdm=False)
    assert len(str(e.value)) < 200 and not llm.engine.requests
