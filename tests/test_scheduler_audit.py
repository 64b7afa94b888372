"""Regression tests from an audit of the runtime's scheduling and KV-block bookkeeping: each one
failed before its fix. The oracle is the engine itself on each request alone, or the engine's own
promises (README: a step that raises leaves the engine usable; every call gets all its outputs)."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams

import engine_helpers
from hf_tiny import make_hf_model, save_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=0, std=0.3), tmp_path_factory.mktemp("tiny") / "model")


def make_llm(path, device, **kw):
    # On CUDA eager (engine_helpers.make_llm says why; this file builds 12 engines): the failed
    # launches here raise before the runner runs anything, and an eager engine's steps are as
    # asynchronous as a captured one's. What graphs change about an interrupted launch is
    # test_engine_bad_input.py's test_an_interrupted_step_leaves_a_paused_streams_tokens_right.
    kw.setdefault("block_size", 4)
    return engine_helpers.make_llm(path, device, **kw)


class Boom(Exception):
    pass


def test_two_failed_steps_in_a_row_lose_no_output(tiny_dir, device):
    """A failed asynchronous step reads the step before it into `undelivered`, for the next
    step() to return. If that next step() failed too, those outputs were dropped: a request that
    had finished was never reported (its record already deleted), so an engine loop waited on it
    forever, and a paused stream died with "no longer in the engine"."""
    a, b = [3, 4, 5, 6, 7], [8, 9, 10]
    solo = make_llm(tiny_dir, device)
    want = {tuple(p): solo.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
            for p, sp in ((a, SamplingParams(temperature=0, max_tokens=1)), (b, GREEDY))}

    # A's prompt fills the first step's budget; B is admitted in the second.
    llm = make_llm(tiny_dir, device, max_num_batched_tokens=len(a), async_scheduling=True)
    eng = llm.engine
    assert eng.async_scheduling
    real, fail = eng.runner.launch, [False]

    def launch(step):
        if fail[0]:
            raise Boom
        return real(step)

    eng.runner.launch = launch
    ids = eng.add_requests([{"prompt_token_ids": a}, {"prompt_token_ids": b}],
                           [SamplingParams(temperature=0, max_tokens=1), GREEDY])
    final = {}

    def collect(outs):
        for o in outs:
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids

    collect(eng.step())  # launches A's prefill
    fail[0] = True
    for _ in range(2):  # B's admission fails twice; the first failure reads A's (last) token
        with pytest.raises(Boom):
            eng.step()
    fail[0] = False
    for _ in range(50):
        if not (eng.has_unfinished_requests() or eng.in_flight or eng.undelivered):
            break
        collect(eng.step())
    assert final == {ids[0]: want[tuple(a)], ids[1]: want[tuple(b)]}
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_a_paused_stream_survives_two_failed_steps_of_another_call(tiny_dir, device):
    """The user-facing form of the test above: a stream is paused while generate() runs, and
    generate's steps fail twice in a row (an error, Ctrl-C). The stream used to die with
    "requests ... are no longer in the engine", its finished requests' outputs lost."""
    a = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]
    b = [[20, 21, 22, 23], [30]]
    solo = make_llm(tiny_dir, device)
    want = {tuple(p): solo.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
            .outputs[0].token_ids for p in a + b}
    for fail_at in range(1, 8):  # which of generate's launches fails first (twice in a row)
        llm = make_llm(tiny_dir, device, num_kv_blocks=12, max_num_batched_tokens=4)
        eng = llm.engine
        real, count = eng.runner.launch, [None]

        def launch(step):
            if count[0] is not None:
                count[0] += 1
                if fail_at <= count[0] < fail_at + 2:
                    raise Boom
            return real(step)

        eng.runner.launch = launch
        stream = llm.stream([{"prompt_token_ids": p} for p in a], GREEDY)
        got: dict[str, list[int]] = {}

        def take(delta):
            for c in delta.outputs:
                got.setdefault(delta.request_id, []).extend(c.token_ids)

        take(next(stream))
        count[0] = 0
        outs = None
        for _ in range(3):
            try:
                outs = llm.generate([{"prompt_token_ids": p} for p in b], GREEDY, use_tqdm=False)
                break
            except Boom:
                pass
        for delta in stream:
            take(delta)
        assert [got[k] for k in sorted(got, key=int)] == [want[tuple(p)] for p in a], fail_at
        assert [o.outputs[0].token_ids for o in outs] == [want[tuple(p)] for p in b], fail_at
        assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_recomputed_tokens_are_counted_when_the_recompute_is_chunked(tiny_dir, device):
    """Every position a step computes is a prompt position (stats.prompt_tokens_computed), a
    generated one computed again after a preemption (tokens_recomputed), or a generated token
    fed for the first time (all but each sequence's last). A recompute chunked over several
    steps used to be undercounted by one position per chunk that did not end the sequence."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(0, 40, 5)]
    for budget in (64, 3):
        llm = make_llm(tiny_dir, device, num_kv_blocks=6, max_num_batched_tokens=budget,
                       enable_prefix_caching=False)
        computed, real = [0], llm.engine.runner.launch

        def launch(step, computed=computed, real=real):
            computed[0] += sum(len(c.token_ids) for c in step.chunks)
            return real(step)

        llm.engine.runner.launch = launch
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        s = llm.stats
        assert s.preemptions > 0
        first_time = len(prompts) * (params.max_tokens - 1)
        assert computed[0] == s.prompt_tokens_computed + s.tokens_recomputed + first_time, budget
