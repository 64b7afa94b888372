"""LLM(tensor_parallel_size=2) on CPU (gloo): it spawns its worker and gives the outputs of
tensor_parallel_size=1 (greedy tokens and logprobs, seeded sampling, chunked prefill, streaming
with an early stop), and stops its worker cleanly. One spawned engine serves every test here
(starting it is most of the cost)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.runtime.executor import TPExecutor

from hf_tiny import make_hf_model, save_checkpoint

# vocab 101 (odd: padded to 102 over two ranks), 4 heads, 2 KV heads; chunked prefill (16-token
# steps) mixes prefill chunks with decodes.
ENGINE = dict(num_kv_blocks=64, attention_backend="reference", max_num_batched_tokens=16,
              device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, n=2, seed=7)
# Penalised: asynchronously each rank completes the rows' ids with its own last tokens.
PENALISED = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, max_tokens=12, ignore_eos=True,
                           seed=3, presence_penalty=1.5, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=5), tmp_path_factory.mktemp("tp") / "model")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [{"prompt_token_ids": torch.randint(0, 101, (n,), generator=g).tolist()}
            for n in (1, 5, 23, 40)]


def run(llm, prompts):
    """What the engine produced: greedy tokens and logprobs, and seeded samples (penalised
    ones too)."""
    greedy = llm.generate(prompts, GREEDY, use_tqdm=False)
    sampled = llm.generate(prompts[:2], SAMPLED, use_tqdm=False)
    penalised = llm.generate(prompts[1:3], PENALISED, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in greedy],
            [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
             for o in greedy],
            [[c.token_ids for c in o.outputs] for o in sampled + penalised])


@pytest.fixture(scope="module")
def tp1(tiny_dir, prompts):
    # Synchronous steps: TP=2 runs asynchronously (each rank feeds back its own sampled tokens),
    # so the comparison covers that too.
    with LLM(tiny_dir, async_scheduling=False, **ENGINE) as llm:
        return run(llm, prompts)


@pytest.fixture(scope="module")
def tp2(tiny_dir):
    llm = LLM(tiny_dir, tensor_parallel_size=2, **ENGINE)
    yield llm
    llm.shutdown()


def test_tp2_engine_equals_tp1(tp2, tp1, prompts):
    assert isinstance(tp2.engine.runner, TPExecutor)
    assert tp2.engine.async_scheduling
    assert tp2.engine.num_blocks == 64
    tokens, logprobs, sampled = run(tp2, prompts)
    assert tokens == tp1[0]
    torch.testing.assert_close(logprobs, tp1[1], rtol=0, atol=1e-4)
    assert sampled == tp1[2]


def test_tp2_prompt_logprobs_equal_tp1(tp2, tiny_dir, prompts):
    """Every rank runs the scoring head on the gathered logits; rank 0's scores are TP=1's."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)

    def scores(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [[None if e is None else {t: (lp.logprob, lp.rank) for t, lp in e.items()}
                 for e in o.prompt_logprobs] for o in outs]
    with LLM(tiny_dir, async_scheduling=False, **ENGINE) as llm:
        want = scores(llm)
    got = scores(tp2)
    assert [[None if e is None else list(e) for e in s] for s in got] == \
        [[None if e is None else list(e) for e in s] for s in want]
    for g, w in zip(got, want):
        for ge, we in zip(g[1:], w[1:]):
            for t in we:
                assert ge[t][1] == we[t][1] and ge[t][0] == pytest.approx(we[t][0], abs=1e-4)


def test_tp2_stream_stopped_early_keeps_the_ranks_in_step(tp2, tp1, prompts):
    """Closing a stream aborts its request between steps; the next requests still match."""
    stream = tp2.stream(prompts[2:], GREEDY)
    next(stream)
    stream.close()
    assert run(tp2, prompts)[0] == tp1[0]


def test_tp2_shutdown_stops_the_worker_cleanly(tp2, prompts):
    procs = tp2.engine.runner.workers.procs
    assert [p.is_alive() for p in procs] == [True]
    tp2.shutdown()
    tp2.shutdown()  # idempotent
    # Exit code 0: it left on rank 0's stop message, not by being terminated.
    assert [p.exitcode for p in procs] == [0]
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minivllm")]
    with pytest.raises(RuntimeError, match="shut down"):
        tp2.generate(prompts[:1], GREEDY, use_tqdm=False)


def test_tp2_with_an_fp8_cache_equals_tp1(tiny_dir, prompts, tp1):
    """kv_cache_dtype reaches the worker rank: each rank's shard of the fp8 cache gives the
    greedy tokens and logprobs of one rank's whole fp8 cache (a rank on an fp32 cache would move
    the logprobs by fp8's rounding, ~1e-2)."""
    def tokens_and_logprobs(llm):
        outs = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        return [o.token_ids for o in outs], [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]
                                             for o in outs]

    with LLM(tiny_dir, kv_cache_dtype="fp8", async_scheduling=False, **ENGINE) as llm:
        want = tokens_and_logprobs(llm)
    with LLM(tiny_dir, tensor_parallel_size=2, kv_cache_dtype="fp8", **ENGINE) as llm:
        got = tokens_and_logprobs(llm)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-4)
    # ... and fp8's rounding is visible in them, so that the comparison can fail
    moved = max(abs(a - b) for row, ref in zip(want[1], tp1[1]) for a, b in zip(row, ref))
    assert moved > 1e-3
