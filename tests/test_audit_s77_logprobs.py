"""Session 77 audit of sample and prompt logprobs against vLLM v1's behaviour.

vLLM applies a structured output's grammar bitmask to the model's logits in the model runner,
before its Sampler takes the raw logprobs / raw logits (vllm/v1/worker/gpu_model_runner.py:
apply_grammar_bitmask, then self.sampler(logits, ...); vllm/v1/sample/sampler.py takes
raw_logprobs first thing): the raw values of a constrained request are those of the
constrained logits, the ids the grammar drops at -inf. allowed_token_ids, bad words, the logit
bias and the penalties act inside the Sampler, after the raw values are taken: those stay out
of the raw modes. The oracles: plain torch on given logits (fp64), and transformers' logits of
the demo checkpoint teacher-forced on the engine's outputs, with the ids a choice constraint
allows found by brute force over the vocabulary (every token's text tried after the output's).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample
from minivllm.runtime.guide import pack_ids
from minivllm.runtime.sampling_params import StructuredOutputsParams

from engine_helpers import make_llm

RAW_MODES = ("raw_logprobs", "raw_logits")


def raw_reference(logits: torch.Tensor, allowed: list[int] | None, mode: str) -> torch.Tensor:
    """[V] values under a raw mode, the ids outside `allowed` (a grammar's; None: no grammar)
    at -inf first, as vLLM's runner masks them before its sampler."""
    x = logits.double().clone()
    if allowed is not None:
        keep = torch.zeros_like(x, dtype=torch.bool)
        keep[allowed] = True
        x[~keep] = -math.inf
    return torch.log_softmax(x, -1) if mode == "raw_logprobs" else x


@pytest.mark.parametrize("mode", RAW_MODES)
def test_raw_values_of_a_constrained_row_are_those_of_the_constrained_logits(mode):
    """sample() alone: a row with a structured output's constraint (allowed_bits) reports raw
    values with the dropped ids at -inf and the kept ones renormalised among themselves; its
    allowed_token_ids, bias and penalties stay out (vLLM applies them inside the sampler); a row
    without a constraint, batched with it, keeps the whole vocabulary's values."""
    vocab, n = 40, 6
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, vocab, generator=g) * 2
    grammar = [3, 7, 8, 20, 31]
    rows = [SamplingRow(temperature=0.0, logprobs=n, allowed_bits=pack_ids(np.array(grammar),
                                                                          vocab)),
            # The request's own allowed ids inside the constraint, a bias and a penalty: the
            # sampling obeys them, the raw values do not.
            SamplingRow(temperature=0.9, seed=3, logprobs=n, allowed_ids=(7, 20),
                        allowed_bits=pack_ids(np.array(grammar), vocab),
                        logit_bias=((20, 4.0),), presence_penalty=1.0, output_ids=(7,)),
            SamplingRow(temperature=0.7, seed=1, logprobs=n)]
    for step in range(4):
        sb = make_sampling_batch(rows, vocab_size=vocab, steps=[step] * 3, logprobs_mode=mode)
        out = sample(logits, sb, kernel=False)
        assert int(out.token_ids[0]) in grammar and int(out.token_ids[1]) in (7, 20)
        for r, allowed in enumerate([grammar, grammar, None]):
            ref = raw_reference(logits[r], allowed, mode)
            tok = int(out.token_ids[r])
            assert out.logprobs[r].item() == pytest.approx(ref[tok].item(), abs=1e-5), (r, step)
            assert int(out.ranks[r]) == int((ref >= ref[tok]).sum()), (r, step)
            top = ref.topk(n)
            finite = [(int(i), v.item()) for i, v in zip(top.indices, top.values)
                      if math.isfinite(v.item())]
            got = dict(zip(out.top_ids[r].tolist(), out.top_logprobs[r].tolist()))
            for i, v in finite:
                assert got[i] == pytest.approx(v, abs=1e-5), (r, step, i)
            # The rest of the top n are ids the grammar drops, at -inf.
            for i in set(got) - {i for i, _ in finite}:
                assert got[i] == -math.inf and allowed is not None and i not in allowed


CHOICES = ["Paris", "London", "no"]


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from minivllm.runtime.demo import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def demo_hf(demo_dir):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def grammar_ids(tokenizer, vocab: int, text: str, eos_ids) -> list[int]:
    """The ids a choice among CHOICES allows after output text `text`, by brute force: those
    whose text extends it to a prefix of a choice, and the EOS ids once it is a whole one."""
    allowed = [i for i in range(vocab)
               if (piece := tokenizer.decode([i])) and
               any(c.startswith(text + piece) for c in CHOICES)]
    if text in CHOICES:
        allowed += [i for i in eos_ids if i < vocab]
    return sorted(set(allowed))


@pytest.mark.parametrize("mode", RAW_MODES)
def test_engine_raw_logprobs_of_a_structured_output_match_vllms(demo_dir, demo_hf, device,
                                                                  mode):
    """Through the engine (the rows the engine builds, the constraint beside a request's own
    allowed_token_ids): each step's raw values are transformers' logits with the ids the
    choice does not allow at -inf, whatever allowed_token_ids narrows the sampling to."""
    llm = make_llm(demo_dir, device, logprobs_mode=mode, max_model_len=256)
    tok = llm.get_tokenizer()
    vocab = llm.engine.vocab_size
    eos = llm.engine.eos_ids
    paris = tok.encode("Pa") + tok.encode("ris")
    so = StructuredOutputsParams(choice=CHOICES)
    params = [SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, structured_outputs=so),
              SamplingParams(temperature=1.0, seed=4, max_tokens=8, logprobs=5,
                             structured_outputs=so),
              # Only "Paris"'s tokens (and EOS, and ids no choice uses) may be sampled.
              SamplingParams(temperature=1.0, seed=2, max_tokens=8, logprobs=5,
                             structured_outputs=so,
                             allowed_token_ids=sorted(set(paris) | set(eos) | {5, 6}))]
    prompt = "The capital of France is"
    outs = llm.generate([prompt] * 3, params, use_tqdm=False)
    assert outs[2].outputs[0].text == "Paris"
    for out in outs:
        c = out.outputs[0]
        assert c.text in CHOICES
        ids = list(out.prompt_token_ids) + list(c.token_ids)
        with torch.no_grad():
            logits = demo_hf(torch.tensor([ids])).logits[0].float()
        start = len(out.prompt_token_ids) - 1
        for t, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            allowed = grammar_ids(tok, vocab, tok.decode(c.token_ids[:t]), eos)
            assert token in allowed
            ref = raw_reference(logits[start + t], allowed, mode)
            assert entry[token].logprob == pytest.approx(ref[token].item(), abs=1e-4), (t, mode)
            assert entry[token].rank == int((ref >= ref[token] - 1e-9).sum()), t
            for i, lp in entry.items():
                if i in allowed:
                    assert lp.logprob == pytest.approx(ref[i].item(), abs=1e-4), (t, i)
                else:  # a top-n filler past the allowed ids
                    assert lp.logprob == -math.inf, (t, i)
            # Every id the choice allows here is among the top 5 (at most 4 of them).
            assert len(allowed) <= 5 and set(allowed) <= set(entry), (t, allowed)
