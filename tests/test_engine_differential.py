"""The engine under pressure against itself at ease: random mixes of requests (seeded sampling,
penalties, logit bias, allowed ids, min_tokens, stop ids, logprobs, prompt_logprobs, n, shared
prefixes) run together in an engine whose KV cache, batch budget and sequence limit force
preemption by recompute, chunked prefill and prefix-cache hits, with asynchronous scheduling;
each request must come out as it does alone in a roomy synchronous engine. A seeded request's
samples depend on nothing but its seed, and penalties on nothing but its own tokens, so any
difference is state leaking between requests or lost across a recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import SamplingParams

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

VOCAB = 101
BLOCK = 4
STRESS_BLOCKS = 12  # 48 tokens: two long requests cannot both stay cached
LONGEST = STRESS_BLOCKS * BLOCK  # a request's prompt + max_tokens stays within it


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # std 0.3 as in test_engine.py: margins well above the rounding that batching changes
    model = make_hf_model(seed=0, std=0.3)
    return save_checkpoint(model, tmp_path_factory.mktemp("diff") / "model")


@pytest.fixture(scope="module", params=[True, False], ids=["prefix_cache", "no_prefix_cache"])
def engines(tiny_dir, device, request):
    # Without the prefix cache a preempted sequence recomputes its generated tokens too; with it,
    # most come back as hits.
    stressed = make_llm(tiny_dir, device, num_kv_blocks=STRESS_BLOCKS, block_size=BLOCK,
                        max_num_batched_tokens=9, max_num_seqs=3, async_scheduling=True,
                        enable_prefix_caching=request.param)
    roomy = make_llm(tiny_dir, device, num_kv_blocks=64, block_size=BLOCK, async_scheduling=False,
                     enable_prefix_caching=False)
    return stressed, roomy


@st.composite
def requests(draw):
    """(prompt ids, SamplingParams) pairs; later prompts may start with an earlier one's ids."""
    out = []
    for _ in range(draw(st.integers(2, 6))):
        # short prompts with long outputs too: preempted after sampling, they recompute their
        # generated tokens (the newest sequence goes first, often still in its prefill)
        max_tokens = draw(st.integers(1, 24))
        length = draw(st.integers(1, min(LONGEST - max_tokens, 30)))
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
        if out and draw(st.booleans()):  # share a prefix with an earlier prompt
            shared = out[draw(st.integers(0, len(out) - 1))][0]
            prompt = (shared + prompt)[:length]
        greedy = draw(st.booleans())
        params = SamplingParams(
            n=draw(st.sampled_from([1, 1, 2])),
            temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.5])),
            seed=None if greedy else draw(st.integers(0, 2**31 - 1)),
            top_k=draw(st.sampled_from([0, 0, 5])),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.8])),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.05])),
            presence_penalty=draw(st.sampled_from([0.0, 0.8, -0.5])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.6])),
            repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.4])),
            min_tokens=draw(st.integers(0, max_tokens)),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=12)),
            logprobs=draw(st.sampled_from([None, None, 2])),
            prompt_logprobs=draw(st.sampled_from([None, None, 1])),
            logit_bias=draw(st.one_of(st.none(), st.dictionaries(
                st.integers(0, VOCAB - 1), st.sampled_from([-5.0, 2.0, 8.0]), max_size=4))),
            # more ids than stop ids, so that min_tokens' ban of stop ids never leaves none
            allowed_token_ids=draw(st.one_of(st.none(), st.lists(
                st.integers(0, VOCAB - 1), min_size=13, max_size=24, unique=True))),
            max_tokens=max_tokens)
        out.append((prompt, params))
    return out


def completions(outputs):
    return [[(tuple(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]


def prompt_scores(outputs):
    """Each request's prompt_logprobs as [(id, logprob, rank), ...] per position (None: none)."""
    return [None if o.prompt_logprobs is None else
            [None if e is None else [(t, lp.logprob, lp.rank) for t, lp in e.items()]
             for e in o.prompt_logprobs] for o in outputs]


def sampled_logprobs(outputs):
    """Each completion's logprob of each token it sampled (None without logprobs)."""
    return [[None if c.logprobs is None else
             [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in o.outputs]
            for o in outputs]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=requests())
def test_each_request_comes_out_as_it_does_alone_in_a_roomy_engine(engines, batch):
    stressed, roomy = engines
    prompts = [{"prompt_token_ids": p} for p, _ in batch]
    params = [sp for _, sp in batch]
    together = stressed.generate(prompts, params, use_tqdm=False)
    alone = [roomy.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    assert completions(together) == completions(alone)
    for got, want, sp in zip(prompt_scores(together), prompt_scores(alone), params):
        assert (got is None) == (want is None) == (sp.prompt_logprobs is None)
        for g, w in zip(got or (), want or ()):
            assert (g is None) == (w is None)
            if g is not None:
                assert [(t, r) for t, _, r in g] == [(t, r) for t, _, r in w]
                assert [lp for _, lp, _ in g] == pytest.approx([lp for _, lp, _ in w], abs=1e-4)
    for got, want in zip(sampled_logprobs(together), sampled_logprobs(alone)):
        for g, w in zip(got, want):
            assert (g is None) == (w is None)
            if g is not None:
                assert torch.allclose(torch.tensor(g), torch.tensor(w), atol=1e-4)
    # Every completion obeys its own limits: a stop id ends it (kept) unless before min_tokens.
    for out, sp in zip(together, params):
        for c in out.outputs:
            ids = list(c.token_ids)
            assert len(ids) <= sp.max_tokens
            stops = set(sp.stop_token_ids or ())
            early = [i for i, t in enumerate(ids) if t in stops and i + 1 >= sp.min_tokens]
            if early:
                assert c.finish_reason == "stop" and early[0] == len(ids) - 1
            else:
                assert c.finish_reason == "length" and len(ids) == sp.max_tokens


def test_the_stressed_engine_does_preempt_chunk_and_hit_the_prefix_cache(engines):
    """The property above is only worth its name if the stressed engine meets the pressure it is
    built for: three requests growing to 32 tokens cannot all stay cached in its 48 slots."""
    stressed, roomy = engines
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, VOCAB, (10,), generator=g).tolist()
    prompts = [{"prompt_token_ids": base + [i] * 2} for i in range(3)]  # 8 blocks each at the end
    params = SamplingParams(temperature=1.0, seed=7, presence_penalty=0.8, repetition_penalty=1.4,
                            max_tokens=20, ignore_eos=True)
    before = copy.copy(stressed.stats)  # the engine updates its stats in place
    together = stressed.generate(prompts, params, use_tqdm=False)
    alone = [roomy.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert completions(together) == completions(alone)
    after = stressed.stats
    assert after.preemptions > before.preemptions
    assert after.max_step_tokens == 9  # prefill split into chunks of the budget
    if stressed.engine.config.enable_prefix_caching:
        assert after.prompt_tokens_cached > before.prompt_tokens_cached
    else:
        assert after.tokens_recomputed > before.tokens_recomputed
