"""LLM.beam_search (vLLM's): against a beam search written here over transformers' logits, with
EOS ending beams, length penalties, max_model_len and prompts searched a few at a time; at beam
width 1 without EOS it is greedy decoding; bad parameters are refused before any step runs."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from minivllm import BeamSearchParams, SamplingParams
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

LENGTHS = (1, 5, 9)  # with block_size 4: beams share full blocks with their parents, and not
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=1, std=0.3)


@pytest.fixture(scope="module")
def next_logprobs(hf_model):
    """tokens -> transformers' log-softmax [vocab] of the next token."""
    @functools.lru_cache(maxsize=None)
    def run(tokens: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf_model(torch.tensor([tokens])).logits[0, -1].float(), -1)
    return run


@pytest.fixture(scope="module")
def eos(next_logprobs, prompts):
    """The EOS id: the second token greedy decoding gives the first prompt, so that beams meet
    it early."""
    first = int(next_logprobs(tuple(prompts[0])).argmax())
    return int(next_logprobs(tuple(prompts[0]) + (first,)).argmax())


@pytest.fixture(scope="module")
def tiny_dir(hf_model, eos, tmp_path_factory):
    hf_model.config.eos_token_id = eos
    hf_model.generation_config.eos_token_id = eos
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("beam") / "model")


@pytest.fixture(scope="module")
def llm(tiny_dir, device):
    return make_llm(tiny_dir, device, block_size=4)


def reference_beam_search(next_logprobs, prompt, *, width, max_tokens, eos, length_penalty=1.0,
                          ignore_eos=False, max_len=None):
    """Beam search as transformers and vLLM define it, on transformers' logits: each beam offers
    its top 2 * width next tokens; an EOS candidate is done; the best `width` open ones go on.
    -> [(tokens, cum_logprob)], best first."""
    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    beams, done = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if max_len is not None:
            done += [b for b in beams if len(b[0]) >= max_len]
            beams = [b for b in beams if len(b[0]) < max_len]
        if not beams:
            break
        candidates = []
        for tokens, cum in beams:
            top = torch.topk(next_logprobs(tuple(tokens)), 2 * width)
            for v, t in zip(top.values.tolist(), top.indices.tolist()):
                child = (tokens + [t], cum + v)
                (done if t == eos and not ignore_eos else candidates).append(child)
        beams = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


def check(outputs, wants, eos, ignore_eos=False):
    for out, want in zip(outputs, wants, strict=True):
        assert [b.tokens for b in out.sequences] == [t for t, _ in want]
        for beam, (tokens, cum) in zip(out.sequences, want):
            assert beam.cum_logprob == pytest.approx(cum, abs=1e-4)
            ended = tokens[-1] == eos and not ignore_eos
            assert beam.finish_reason == ("stop" if ended else "length")
            # Each generated token's step offered it, with the logprob its score summed.
            generated = beam.tokens[len(beam.tokens) - len(beam.logprobs):]
            assert sum(e[t].logprob for t, e in zip(generated, beam.logprobs)) == \
                pytest.approx(beam.cum_logprob, abs=1e-5)


# eos_returned: whether, on this model, some best beam ends in EOS (a short beam wins at a low
# length penalty), so that both ways a beam ends are compared.
@pytest.mark.parametrize("width, length_penalty, ignore_eos, eos_returned", [
    (1, 1.0, False, True), (2, 1.0, False, False), (3, 0.5, False, True), (3, 2.0, False, False),
    (2, 1.0, True, False)])
def test_beam_search_equals_a_search_over_transformers(llm, prompts, next_logprobs, eos, width,
                                                       length_penalty, ignore_eos, eos_returned):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=ignore_eos,
                              length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    wants = [reference_beam_search(next_logprobs, p, width=width, max_tokens=MAX_TOKENS, eos=eos,
                                   length_penalty=length_penalty, ignore_eos=ignore_eos)
             for p in prompts]
    check(outs, wants, eos, ignore_eos)
    for out in outs:
        assert all(len(e) == 2 * width for b in out.sequences for e in b.logprobs)
    assert any(b.tokens[-1] == eos for out in outs for b in out.sequences) == eos_returned
    assert not llm.engine.requests  # every step's requests are done and forgotten


def test_one_beam_scored_by_its_logprob_is_greedy_decoding(llm, prompts):
    """Width 1, length penalty 0 (the score is the cumulative logprob), EOS ignored: each step
    keeps the most likely token. (At a length penalty above 0 a final EOS, which does not count
    to the length, lowers its beam's score, even with ignore_eos, as in vLLM.)"""
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    beams = llm.beam_search(token_prompts, BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True, length_penalty=0.0))
    greedy = llm.generate(token_prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                        ignore_eos=True), use_tqdm=False)
    for b, g, p in zip(beams, greedy, prompts):
        assert b.sequences[0].tokens == p + g.outputs[0].token_ids


def test_beams_end_at_max_model_len(tiny_dir, device, prompts, next_logprobs, eos):
    llm = make_llm(tiny_dir, device, block_size=4, max_model_len=12)
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    wants = [reference_beam_search(next_logprobs, p, width=2, max_tokens=10, eos=eos,
                                   ignore_eos=True, max_len=12) for p in prompts]
    check(outs, wants, eos, ignore_eos=True)
    assert {len(b.tokens) for out in outs for b in out.sequences} == {11, 12}  # 1 + 10, then 12


def test_prompts_a_few_at_a_time_give_the_same_beams(llm, prompts):
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    stats = dataclasses.replace(llm.stats)
    together = llm.beam_search(token_prompts, params)
    # A step's beam reads the full blocks it shares with its parent from the prefix cache and
    # computes at most its last block (block_size 4); each step request samples one token.
    steps = llm.stats.generation_tokens - stats.generation_tokens
    computed = llm.stats.prompt_tokens_computed - stats.prompt_tokens_computed
    assert computed <= sum(map(len, prompts)) + 4 * steps
    for limit in (1, 2):
        apart = llm.beam_search(token_prompts, params, concurrency_limit=limit, use_tqdm=True)
        assert [[(b.tokens, b.finish_reason) for b in o.sequences] for o in apart] == \
            [[(b.tokens, b.finish_reason) for b in o.sequences] for o in together]
        for a, t in zip(apart, together):
            assert [b.cum_logprob for b in a.sequences] == \
                pytest.approx([b.cum_logprob for b in t.sequences], abs=1e-5)
    llm.engine.block_manager.check([])  # no block left held by a finished step


def test_sampled_ids_join_the_candidates_at_a_temperature(tiny_dir, device, prompts):
    """At temperature > 0 each step's candidates are its top 2 * width ids and the id it sampled
    (vLLM's), and the search is reproducible from the LLM's seed."""
    params = BeamSearchParams(beam_width=2, max_tokens=5, temperature=2.0, ignore_eos=True)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    runs = [make_llm(tiny_dir, device, block_size=4, seed=7).beam_search(token_prompts, params)
            for _ in range(2)]
    sizes = {len(e) for out in runs[0] for b in out.sequences for e in b.logprobs}
    assert sizes <= {4, 5} and 5 in sizes  # at temperature 2 some sample is outside the top 4
    assert [[b.tokens for b in o.sequences] for o in runs[0]] == \
        [[b.tokens for b in o.sequences] for o in runs[1]]


def test_text_is_the_beams_tokens_decoded(device, tmp_path_factory):
    llm = make_llm(ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model")), device)
    tok = llm.get_tokenizer()
    outs = llm.beam_search(["The quick brown fox", "Hello"], BeamSearchParams(beam_width=2, max_tokens=4))
    for out, prompt in zip(outs, ["The quick brown fox", "Hello"]):
        assert len(out.sequences) == 2
        for b in out.sequences:
            assert b.tokens[:len(tok.encode(prompt))] == tok.encode(prompt)
            assert b.text == tok.decode(b.tokens)
            assert all(e[t].decoded_token == tok.decode([t])
                       for t, e in zip(b.tokens[-len(b.logprobs):], b.logprobs))


@pytest.mark.parametrize("kwargs, match", [
    (dict(beam_width=0, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos="no"), "ignore_eos"),
])
def test_bad_parameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_bad_requests_are_refused_before_any_step(llm, prompts):
    before = llm.stats.generation_tokens
    ok = BeamSearchParams(beam_width=2, max_tokens=4)
    good = {"prompt_token_ids": prompts[0]}
    with pytest.raises(TypeError, match="BeamSearchParams"):
        llm.beam_search([good], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="beam_width=11.*max_logprobs=20"):
        llm.beam_search([good], BeamSearchParams(beam_width=11, max_tokens=4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.beam_search([good, {"prompt_token_ids": [1, 500]}], ok)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.beam_search([good, {"prompt_token_ids": [1] * 512}], ok)
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search([good], ok, concurrency_limit=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.beam_search(["text"], ok)
    assert llm.stats.generation_tokens == before and not llm.engine.requests


def test_a_beam_that_could_outgrow_the_cache_is_refused(tiny_dir, device, prompts):
    """Checked for the longest beam's last step, not only the first step's prompt."""
    llm = make_llm(tiny_dir, device, block_size=4, num_kv_blocks=4)  # 16 tokens
    llm.beam_search([{"prompt_token_ids": prompts[1]}], BeamSearchParams(beam_width=1, max_tokens=12))
    with pytest.raises(ValueError, match="never fit the KV cache"):
        llm.beam_search([{"prompt_token_ids": prompts[1]}],
                        BeamSearchParams(beam_width=1, max_tokens=13))
