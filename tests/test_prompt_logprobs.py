"""SamplingParams.prompt_logprobs (vLLM's): each prompt token after the first scored by the
model, against transformers' log-softmax of the whole prompt; the same under chunked prefill,
preemption, asynchronous steps, a warm prefix cache, n > 1 and streaming; the generation itself
unchanged; bad values refused."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

LENGTHS = (1, 2, 5, 17, 30)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("plp") / "model")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_logprobs(hf_model, prompts):
    """[len(prompt), vocab] log-softmax of transformers' logits at each prompt position."""
    with torch.no_grad():
        return [torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
                for p in prompts]


def as_token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def check_against_transformers(prompt_logprobs, prompt, lps, k):
    """Entry i scores prompt[i] under row i - 1: its logprob and rank (vLLM's: ids at least as
    likely), then the top k ids by logprob, each ranked by position."""
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        row, tok, entry = lps[i - 1], prompt[i], prompt_logprobs[i]
        top = torch.topk(row, k)
        want_ids = [tok] + [t for t in top.indices.tolist() if t != tok]
        assert list(entry) == want_ids
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert entry[tok].rank == int((row >= row[tok]).sum())
        for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            assert entry[t].rank == r + 1 and entry[t].logprob == pytest.approx(v, abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("budget", [7, 512], ids=["chunked", "whole"])
def test_prompt_logprobs_equal_transformers(tiny_dir, device, prompts, hf_logprobs, k, budget):
    llm = make_llm(tiny_dir, device, block_size=4, max_num_batched_tokens=budget)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=k)
    outs = llm.generate(as_token_prompts(prompts), params, use_tqdm=False)
    for out, prompt, lps in zip(outs, prompts, hf_logprobs):
        check_against_transformers(out.prompt_logprobs, prompt, lps, k)
    # Scoring changes no completion.
    unscored = llm.generate(as_token_prompts(prompts), unscored_params(params), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in unscored]
    assert all(o.prompt_logprobs is None for o in unscored)


def unscored_params(params):
    return SamplingParams(temperature=params.temperature, max_tokens=params.max_tokens,
                          ignore_eos=params.ignore_eos)


def test_scoring_skips_the_prefix_cache_and_leaves_others_hits_and_outputs_alone(
        tiny_dir, device, prompts, hf_logprobs):
    """A scored request reads no prefix-cache hit (a hit would skip positions it must score), as
    in vLLM; requests without prompt_logprobs still hit, and nobody's tokens change."""
    llm = make_llm(tiny_dir, device, block_size=4)
    plain = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=2)
    scored = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, n=2,
                            prompt_logprobs=2)
    long = prompts[-1]
    first = llm.generate(as_token_prompts([long]), plain, use_tqdm=False)[0]
    again = llm.generate(as_token_prompts([long]), scored, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_against_transformers(again.prompt_logprobs, long, hf_logprobs[-1], 2)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in first.outputs]
    hit = llm.generate(as_token_prompts([long]), plain, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 28 and hit.prompt_logprobs is None  # 7 full blocks of 4
    assert [c.token_ids for c in hit.outputs] == [c.token_ids for c in first.outputs]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_prompt_logprobs_survive_preemption(tiny_dir, device, prompts, hf_logprobs,
                                            async_scheduling):
    """14 blocks of 4 for prompts of up to 30 tokens and 12 new ones: sequences are preempted
    and recomputed; each prompt is still scored once, position by position."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=14, block_size=4, max_num_batched_tokens=9,
                   async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(as_token_prompts(prompts[::-1]), params, use_tqdm=False)
    assert llm.stats.preemptions > 0
    for out, prompt, lps in zip(outs, prompts[::-1], hf_logprobs[::-1]):
        check_against_transformers(out.prompt_logprobs, prompt, lps, 1)


def test_stream_sends_the_prompt_logprobs_once(tiny_dir, device, prompts, hf_logprobs):
    llm = make_llm(tiny_dir, device, block_size=4, max_num_batched_tokens=7)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    got = {}
    for delta in llm.stream(as_token_prompts(prompts[2:]), params):
        if delta.prompt_logprobs is not None:
            assert delta.request_id not in got
            got[delta.request_id] = delta.prompt_logprobs
    assert len(got) == 3
    for scores, prompt, lps in zip(got.values(), prompts[2:], hf_logprobs[2:]):
        check_against_transformers(scores, prompt, lps, 2)


@pytest.mark.parametrize("value", [-2, 1.5, False, "2"])
def test_bad_prompt_logprobs_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_above_max_logprobs_are_refused_before_any_work(tiny_dir, device, prompts):
    llm = make_llm(tiny_dir, device, max_logprobs=4)
    with pytest.raises(ValueError, match="prompt_logprobs=5 asks for 5 logprobs, more than "
                                         "max_logprobs=4"):
        llm.generate(as_token_prompts(prompts[:2]),
                     [SamplingParams(max_tokens=2),
                      SamplingParams(max_tokens=2, prompt_logprobs=5)],
                     use_tqdm=False)
    assert not llm.engine.requests and llm.stats.steps == 0


@pytest.mark.parametrize("chunk", [2, 256])
def test_the_functional_scorer_equals_transformers_whatever_its_chunk(tmp_path, hf_model, prompts,
                                                                      hf_logprobs, chunk):
    """model.prompt_logprobs as forward's head (the engine's use): any rows of the step, scored
    `chunk` rows at a time, give transformers' logprob, rank and top n of their next token."""
    import minivllm
    from minivllm.functional import model as fn
    from minivllm.state import SeqChunk, make_batch

    device = torch.device("cpu")
    params = minivllm.load(save_checkpoint(hf_model, tmp_path), device=device)
    prompt, lps = prompts[-1], hf_logprobs[-1]  # 30 tokens
    rows = torch.tensor([0, 3, 4, 17, 28])
    targets = torch.tensor([prompt[r + 1] for r in rows.tolist()])

    def scoring_head(params, x, residual, logits_rows):
        return fn.prompt_logprobs(params, x, residual, rows, targets, 3, chunk=chunk)
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    batch = make_batch([SeqChunk(prompt, 0, list(range(8)))], block_size=4, device=device)
    (logprob, rank, top_ids, top_lps), _ = fn.forward(params, cache, batch, head=scoring_head)
    want = lps[rows]
    torch.testing.assert_close(logprob, want.gather(1, targets[:, None])[:, 0], rtol=0, atol=1e-4)
    assert rank.tolist() == [int((w >= w[t]).sum()) for w, t in zip(want, targets.tolist())]
    assert top_ids.tolist() == torch.topk(want, 3).indices.tolist()
    torch.testing.assert_close(top_lps, torch.topk(want, 3).values, rtol=0, atol=1e-4)


def test_each_request_gets_its_own_count_and_minus_one_the_vocabulary(tiny_dir, device, prompts,
                                                                      hf_logprobs):
    """Requests scored in one step with different prompt_logprobs each get their own top N; -1
    (and logprobs=-1) is the whole vocabulary when max_logprobs allows it (-1: no cap), True is
    1 (as vLLM); detokenize=False leaves decoded_token None."""
    llm = make_llm(tiny_dir, device, block_size=4, max_logprobs=-1)
    assert llm.engine.config.max_logprobs == 101
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k)
              for k in (1, 3, -1, True)]
    outs = llm.generate(as_token_prompts(prompts[2:]) + as_token_prompts(prompts[2:3]), params,
                        use_tqdm=False)
    for out, prompt, lps, k in zip(outs, prompts[2:] + prompts[2:3],
                                   hf_logprobs[2:] + hf_logprobs[2:3], (1, 3, 101, 1)):
        check_against_transformers(out.prompt_logprobs, prompt, lps, k)
    every = llm.generate(as_token_prompts(prompts[3:4]),
                         SamplingParams(temperature=0.0, max_tokens=2, logprobs=-1), use_tqdm=False)
    assert all(len(e) == 101 for e in every[0].outputs[0].logprobs)
    with pytest.raises(ValueError, match="prompt_logprobs=-1 asks for 101 logprobs, more than "
                                         "max_logprobs=20"):
        make_llm(tiny_dir, device).generate(as_token_prompts(prompts[:1]),
                                            SamplingParams(prompt_logprobs=-1), use_tqdm=False)


def test_detokenize_false_leaves_decoded_tokens_out(device, tmp_path):
    from minivllm.runtime.demo import ensure_demo_model

    llm = make_llm(ensure_demo_model(str(tmp_path / "demo")), device)
    for detokenize in (True, False):
        out = llm.generate(["The quick brown fox"],
                           SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=1,
                                          detokenize=detokenize), use_tqdm=False)[0]
        decoded = [lp.decoded_token for e in out.prompt_logprobs[1:] + out.outputs[0].logprobs
                   for lp in e.values()]
        assert all((d is not None) == detokenize for d in decoded)
