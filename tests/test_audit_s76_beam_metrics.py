"""Session 76's audit of LLM.beam_search and the Prometheus metrics.

Beam search against a brute force over transformers' log-probabilities: on a model of a tiny
vocabulary and a beam width of 10 (every id is a candidate of every beam, and no open beam is
ever dropped) the search is exhaustive, so its beams must be the best of every continuation by
vLLM's score (cumulative logprob / len ** length_penalty, a final EOS not counted, an EOS ending
a continuation unless ignore_eos), whatever the temperature (beams are scored by raw logprobs).

The metrics against a count kept here from the requests' own outputs: tokens, requests by finish
reason, per-request histograms, with preemptions, aborts and n > 1, and the max_tokens a request
without one observes (vLLM's processor gives it max_model_len - prompt_len)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from minivllm import BeamSearchParams, SamplingParams
from minivllm.runtime import metrics as prom

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint
from test_metrics import parse

EOS = 2


# -- beam search: a brute force over every continuation ----------------------------------------

def _tiny_vocab(vocab: int, path):
    """(transformers model, checkpoint dir) of a random Qwen3 of `vocab` ids, EOS id 2."""
    model = make_hf_model(seed=vocab, std=0.5, vocab_size=vocab)
    model.config.eos_token_id = EOS
    model.generation_config.eos_token_id = EOS
    return model, save_checkpoint(model, path)


def brute_force(model, prompt, *, max_tokens, length_penalty, ignore_eos, width):
    """Every continuation of `prompt` (max_tokens ids, or fewer ending in EOS unless ignore_eos)
    with its cumulative logprob from transformers' full recomputation; the best `width` by
    vLLM's score, best first."""
    vocab = model.config.vocab_size

    @functools.lru_cache(maxsize=None)
    def logprobs(tokens: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        return torch.log_softmax(logits, -1).tolist()

    every = []

    def walk(tokens, cum):
        if len(tokens) - len(prompt) == max_tokens:
            every.append((tokens, cum))
            return
        lp = logprobs(tuple(tokens))
        for t in range(vocab):
            if t == EOS and not ignore_eos:
                every.append((tokens + [t], cum + lp[t]))
            else:
                walk(tokens + [t], cum + lp[t])

    walk(list(prompt), 0.0)

    def score(c):
        tokens, cum = c
        return cum / (len(tokens) - (tokens[-1] == EOS)) ** length_penalty
    return sorted(every, key=score, reverse=True)[:width]


# (vocab, max_tokens): at width 10 every id is a candidate (2 * 10 >= vocab) and every open
# beam is kept (at most (vocab - 1) ** (max_tokens - 1), or vocab ** ... with ignore_eos, <= 10).
@pytest.mark.parametrize("vocab, max_tokens", [(3, 3), (6, 2)])
def test_beam_search_is_the_best_of_every_continuation(device, tmp_path, vocab, max_tokens):
    model, path = _tiny_vocab(vocab, tmp_path / "model")
    llm = make_llm(path, device, block_size=4)
    prompts = [[1, 0, 1], [0] * 5, [EOS]]
    for length_penalty, ignore_eos, temperature in [
            (1.0, False, 0.0), (0.0, False, 0.0), (0.5, True, 0.0), (2.0, False, 1.5),
            (-1.0, True, 0.7)]:
        params = BeamSearchParams(beam_width=10, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                  length_penalty=length_penalty, temperature=temperature)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs, strict=True):
            want = brute_force(model, prompt, max_tokens=max_tokens, width=10,
                               length_penalty=length_penalty, ignore_eos=ignore_eos)
            case = (vocab, prompt, length_penalty, ignore_eos, temperature)
            assert [b.tokens for b in out.sequences] == [t for t, _ in want], case
            assert [b.cum_logprob for b in out.sequences] == \
                pytest.approx([c for _, c in want], abs=1e-4), case
            for b in out.sequences:
                ended = b.tokens[-1] == EOS and not ignore_eos
                assert b.finish_reason == ("stop" if ended else "length"), case
    assert not llm.engine.requests


# -- metrics: against a count of what the requests got ------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=1, std=0.3), tmp_path_factory.mktemp("m") / "m")


def _value(fams, name, **labels):
    family = name
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name[:-len(suffix)] in fams:
            family = name[:-len(suffix)]
    hits = [v for n, lab, v in fams[family]["samples"]
            if n == name and all(lab.get(k) == w for k, w in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


def _scrape(llm):
    return parse(prom.render(prom.snapshot(llm.engine), "m"))


def test_a_request_without_max_tokens_observes_what_vllm_gives_it(tiny_dir, device):
    """vLLM's input processor sets an unset max_tokens to max_model_len - prompt_len before the
    request is queued, so vllm:request_params_max_tokens observes every completion."""
    llm = make_llm(tiny_dir, device, block_size=4, max_model_len=24)
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}],
                 SamplingParams(max_tokens=None, n=2, temperature=1.0, ignore_eos=True),
                 use_tqdm=False)
    llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}],
                 SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    fams = _scrape(llm)
    assert _value(fams, "vllm:e2e_request_latency_seconds_count") == 3
    assert _value(fams, "vllm:request_params_max_tokens_count") == 3
    assert _value(fams, "vllm:request_params_max_tokens_sum") == 2 * (24 - 4) + 3
    assert _value(fams, "vllm:request_params_max_tokens_bucket", le="10.0") == 1
    assert _value(fams, "vllm:request_params_max_tokens_bucket", le="20.0") == 3


@pytest.mark.parametrize("async_scheduling, blocks", [(True, 10), (False, 16)])
def test_counters_and_histograms_match_what_the_requests_got(tiny_dir, device,
                                                             async_scheduling, blocks):
    """Requests of 1 to 12 tokens, some of n=2, stop ids, a cache small enough to preempt (the
    first case), and two requests aborted after a few steps: every count from the outputs."""
    llm = make_llm(tiny_dir, device, block_size=4, num_kv_blocks=blocks, max_num_seqs=3,
                   max_num_batched_tokens=24, async_scheduling=async_scheduling)
    engine = llm.engine
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(8):
        n = rng.choice([1, 1, 2])
        prompts.append({"prompt_token_ids": [rng.randrange(101)
                                             for _ in range(rng.choice([3, 9, 20]))]})
        params.append(SamplingParams(max_tokens=rng.choice([1, 5, 12]), n=n, seed=i,
                                     temperature=0.8 if n > 1 else 0.0, ignore_eos=True,
                                     stop_token_ids=[rng.randrange(101) for _ in range(5)]))
    ids = engine.add_requests(prompts, params)
    final, aborted, steps = {}, {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        steps += 1
        if steps == 4:
            for rid in (ids[1], ids[7]):
                request = engine.requests.get(rid)
                if request is not None:
                    aborted[rid] = [(len(s.output_ids), s.finish_reason or "abort", s.prompt_len)
                                    for s in request.seqs]
                    engine.abort_request(rid)
    assert aborted  # some abort came while its request ran
    completions = []  # (generated, finish reason, prompt length)
    for rid, prompt in zip(ids, prompts):
        if rid in final:
            completions += [(len(c.token_ids), c.finish_reason, len(prompt["prompt_token_ids"]))
                            for c in final[rid].outputs]
        else:
            completions += aborted[rid]
    generated = sum(g for g, _, _ in completions)
    prompt_tokens = sum(p for g, _, p in completions if g)  # counted with the first token
    fams = _scrape(llm)
    if blocks == 10:
        assert _value(fams, "vllm:num_preemptions_total") > 0
    assert _value(fams, "vllm:generation_tokens_total") == generated
    assert _value(fams, "vllm:request_generation_tokens_sum") == generated
    assert _value(fams, "vllm:prompt_tokens_total") == prompt_tokens
    assert _value(fams, "vllm:iteration_tokens_total_sum") == prompt_tokens + generated
    for reason in ("stop", "length", "abort", "error"):
        assert _value(fams, "vllm:request_success_total", finished_reason=reason) == \
            sum(r == reason for _, r, _ in completions), reason
    assert _value(fams, "vllm:e2e_request_latency_seconds_count") == len(completions)
    assert _value(fams, "vllm:request_prompt_tokens_sum") == sum(p for _, _, p in completions)
    assert _value(fams, "vllm:time_to_first_token_seconds_count") == \
        sum(g > 0 for g, _, _ in completions)
    assert _value(fams, "vllm:inter_token_latency_seconds_count") == \
        sum(g - 1 for g, _, _ in completions if g)
    assert _value(fams, "vllm:request_time_per_output_token_seconds_count") == \
        sum(g > 1 for g, _, _ in completions)
    assert _value(fams, "vllm:request_params_n_count") == len(prompts)
    assert _value(fams, "vllm:request_params_n_sum") == sum(p.n for p in params)
    assert _value(fams, "vllm:request_params_max_tokens_sum") == \
        sum(p.max_tokens * p.n for p in params)
    # Each histogram's buckets are cumulative, +Inf its count (parse checks both), and the
    # generation histogram's buckets count the completions up to each bound.
    gens = [g for g, _, _ in completions]
    for le in (1, 2, 5, 10, 20):
        assert _value(fams, "vllm:request_generation_tokens_bucket", le=f"{le}.0") == \
            sum(g <= le for g in gens)
    assert not engine.requests and engine.scheduler.num_preemptions == \
        _value(fams, "vllm:num_preemptions_total")
