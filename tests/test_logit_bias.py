"""SamplingParams.logit_bias and allowed_token_ids (vLLM's): the sampler against the same
logits biased and masked by hand (both act before the penalties, as vLLM's logits processors
do, and leave the reported logprobs raw), and the engine end to end against transformers."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample

from engine_helpers import make_llm
from hf_tiny import DEVICE, make_hf_model, save_checkpoint

VOCAB = 50
ROWS = [  # (row parameters, logit_bias, allowed ids)
    (dict(temperature=0.0), {3: 5.0, 7: -2.5}, ()),
    (dict(temperature=1.0, seed=1), {}, (4, 9, 31)),
    (dict(temperature=0.7, seed=2, top_k=5), {9: 30.0}, (4, 9, 31, 40)),
    (dict(temperature=1.3, seed=3, top_p=0.8, min_p=0.05), {1: -1.0}, ()),
    (dict(temperature=1.0, seed=4, presence_penalty=0.5, repetition_penalty=1.4,
          output_ids=(3, 3, 8), prompt_ids=(8, 12)), {3: 2.0, 12: 4.0}, (3, 8, 12, 20)),
    (dict(temperature=0.0, repetition_penalty=2.0, prompt_ids=(0, 1, 2)), {2: 1.5}, (0, 1, 2)),
    (dict(temperature=1.0, seed=5), {}, ()),  # a row with neither, beside rows with them
]


def by_hand(logits):
    """The logits each row of ROWS samples from once its bias and allowed ids apply."""
    x = logits.clone()
    for b, (_, bias, allowed) in enumerate(ROWS):
        if allowed:
            keep = torch.zeros(VOCAB, dtype=torch.bool, device=x.device)
            keep[list(allowed)] = True
            x[b] = x[b].masked_fill(~keep, float("-inf"))
        for tok, value in bias.items():
            x[b, tok] += value
    return x


@pytest.mark.parametrize("draw", range(4))
def test_the_sampler_biases_and_masks_before_the_penalties(draw):
    gen = torch.Generator().manual_seed(draw)
    logits = (3 * torch.randn(len(ROWS), VOCAB, generator=gen)).to(DEVICE)
    with_them = [SamplingRow(step=draw, logprobs=2, logit_bias=tuple(bias.items()),
                             allowed_ids=allowed, **kw) for kw, bias, allowed in ROWS]
    without = [SamplingRow(step=draw, logprobs=2, **kw) for kw, _, _ in ROWS]
    got = sample(logits, make_sampling_batch(with_them, vocab_size=VOCAB, device=DEVICE))
    want = sample(by_hand(logits), make_sampling_batch(without, vocab_size=VOCAB, device=DEVICE))
    assert got.token_ids.tolist() == want.token_ids.tolist()
    for b, (_, _, allowed) in enumerate(ROWS):
        assert not allowed or got.token_ids[b].item() in allowed
    # The logprobs are the model's raw ones (vLLM's raw_logprobs), not the biased ones.
    raw = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(got.logprobs, raw.gather(1, got.token_ids[:, None])[:, 0])
    torch.testing.assert_close(got.top_logprobs, torch.topk(raw, 2).values)


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(temperature=1.0),
                                dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, top_k=3)])
def test_a_row_with_no_id_left_still_gives_an_id_of_the_vocabulary(kw):
    """Nothing to sample (the engine refuses the requests it can see this in; a multi-token bad
    word can still do it mid-output): every path gives an id inside the vocabulary, never -1."""
    rows = [SamplingRow(allowed_ids=(5,), banned_ids=(5,), **kw)]
    got = sample(torch.randn(1, VOCAB, device=DEVICE),
                 make_sampling_batch(rows, vocab_size=VOCAB, device=DEVICE)).token_ids.item()
    assert 0 <= got < VOCAB


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=4, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("bias") / "model")


PROMPT = [5, 17, 3, 88, 41, 9, 60]


def test_the_engine_samples_only_allowed_ids_and_follows_the_bias(tiny_dir, hf_model, device):
    llm = make_llm(tiny_dir, device)
    with torch.no_grad():
        raw = torch.log_softmax(hf_model(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    first = int(raw.argmax())
    allowed = [2, 30, 77, first]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True,
                             allowed_token_ids=allowed) for s in range(4)]
    for out in llm.generate([{"prompt_token_ids": PROMPT}] * 4, params, use_tqdm=False):
        assert set(out.outputs[0].token_ids) <= set(allowed)
    # Greedy: a bias of -100 on transformers' greedy token moves the first pick to the runner-up;
    # +100 on an unlikely id makes it the pick every step. Logprobs stay raw.
    runner_up = int(torch.topk(raw, 2).indices[1])
    unlikely = int(raw.argmin())
    down, up = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 2,
        [SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, logit_bias={first: -100.0}),
         SamplingParams(temperature=0.0, max_tokens=5, logprobs=0, logit_bias={unlikely: 100.0})],
        use_tqdm=False)
    assert down.outputs[0].token_ids == [runner_up]
    assert up.outputs[0].token_ids == [unlikely] * 5
    assert up.outputs[0].logprobs[0][unlikely].logprob == pytest.approx(raw[unlikely].item(),
                                                                         abs=1e-4)


@pytest.mark.parametrize("kw, match", [
    (dict(logit_bias={101: 1.0}), "logit_bias token id 101 is outside the vocabulary"),
    (dict(allowed_token_ids=[3, 101]), "allowed token id 101 is outside the vocabulary"),
    # nothing left to sample before min_tokens: the sampler bans stop ids until then
    (dict(allowed_token_ids=[5, 6], stop_token_ids=[6, 5], min_tokens=1),
     "min_tokens=1 bans every id this request may sample: its allowed_token_ids"),
    (dict(stop_token_ids=list(range(101)), min_tokens=2),
     "min_tokens=2 bans every id this request may sample: its vocabulary ids"),
])
def test_ids_outside_the_vocabulary_are_refused_before_any_work(tiny_dir, device, kw, match):
    llm = make_llm(tiny_dir, device)
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, [SamplingParams(), SamplingParams(**kw)],
                     use_tqdm=False)
    assert not llm.engine.requests and llm.stats.steps == 0


@pytest.mark.parametrize("kw", [dict(logit_bias=[1]), dict(logit_bias={-1: 1.0}),
                                dict(logit_bias={1: float("inf")}), dict(logit_bias={1: -1e39}),
                                dict(logit_bias={2: float("nan")}), dict(logit_bias={"a": 1.0}),
                                dict(logit_bias={1: True}), dict(allowed_token_ids=[]),
                                dict(allowed_token_ids=[-2]), dict(allowed_token_ids=7)])
def test_bad_values_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_allowed_stop_ids_end_the_output_once_min_tokens_are_out(tiny_dir, device):
    """Allowed ids that are all stop ids: banned for the first min_tokens tokens, so the request
    is refused then (above); with one allowed id that is not a stop id, the output takes it until
    min_tokens, then may stop."""
    llm = make_llm(tiny_dir, device)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=20, min_tokens=3,
                            allowed_token_ids=[8, 9], stop_token_ids=[9])
    for out in llm.generate([{"prompt_token_ids": PROMPT}] * 3, params, use_tqdm=False):
        ids = out.outputs[0].token_ids
        assert ids[:3] == [8, 8, 8] and set(ids) <= {8, 9}
        assert (ids[-1] == 9) == (out.outputs[0].finish_reason == "stop") and 9 not in ids[:-1]
