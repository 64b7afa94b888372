"""Session 78's audit of SamplingParams' checks and the sampler's semantics against current vLLM.

Compared against: vllm/sampling_params.py (__post_init__ and _verify_args), vllm/v1/sample/
sampler.py (the order: allowed token ids, bad words, min-tokens and logit bias, penalties; greedy;
temperature, min-p, top-k / top-p), vllm/model_executor/layers/utils.py apply_penalties with
vllm/_custom_ops.py apply_repetition_penalties_torch (repetition over prompt and output ids,
frequency and presence over output ids), vllm/v1/sample/logits_processor/builtin.py (min-p,
logit bias, min-tokens) and vllm/v1/sample/ops/topk_topp_sampler.py.

Disagreements found, each fixed and tested here:
- temperature above 2: vLLM refuses it ("temperature must be in [0, 2]", PR 44965, so does its
  LLM.beam_search, whose steps are SamplingParams); minivllm took any up to fp32's max.
- a positive temperature below 1e-2: vLLM's __post_init__ raises it to 1e-2 (_MAX_TEMP) with a
  warning, so that only 0 is greedy; minivllm sampled at 1e-3 as given and took 5e-6 as greedy.
- seed=-1: vLLM's "no seed" (__post_init__ sets None); minivllm used -1 as a seed, so every
  request sent with seed -1 drew the same tokens.
- repetition_penalty=inf: vLLM refuses it ("must be a finite number"); minivllm took it.
- a repetition penalty past fp32's range (1e39, which vLLM takes): the fp32 tensor held inf, a
  seen id's logit of exactly 0 became 0 * inf = nan, and nan wins every arg-max: the penalty made
  the sampler pick the very id it penalises.

The oracle for the sampler is a float64 per-row reference written here from vLLM's code (not
minivllm's helpers); for the engine, transformers' logits of the same checkpoint."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.sampling import (SamplingRow, make_sampling_batch, processed_logits,
                                          sample)
from minivllm.runtime.sampling_params import BeamSearchParams

NEG_INF = float("-inf")
# Where the Triton kernels run: the GPU when there is one, else the CPU under the interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# SamplingParams' checks.

@pytest.mark.parametrize("t", [2.0000001, 2.5, 3.0, 100.0, 1e38])
def test_a_temperature_above_two_is_refused_naming_it(t):
    with pytest.raises(ValueError, match=r"temperature must be .*\[0, 2\]"):
        SamplingParams(temperature=t)
    with pytest.raises(ValueError, match=r"temperature must be .*\[0, 2\]"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=t)
    for ok in (0, 0.0, 0.01, 0.7, 1, 2, 2.0):  # what vLLM takes is taken, as given
        assert SamplingParams(temperature=ok).temperature == float(ok)
        assert BeamSearchParams(beam_width=2, max_tokens=4, temperature=ok).temperature == ok


@pytest.mark.parametrize("t", [1e-300, 1e-9, 5e-6, 1e-5, 2e-5, 1e-3, 0.0099])
def test_a_tiny_positive_temperature_is_raised_to_one_hundredth(t, caplog):
    """vLLM: `if 0 < temperature < _MAX_TEMP: temperature = _MAX_TEMP` (1e-2, a warning), before
    its greedy check `temperature < _SAMPLING_EPS`: a positive temperature is never greedy, and
    n > 1 is then taken (vLLM refuses n > 1 only when greedy)."""
    with caplog.at_level(logging.WARNING, logger="minivllm"):
        p = SamplingParams(temperature=t, n=2)
    assert p.temperature == 0.01 and not p.greedy
    assert "temperature" in caplog.text
    assert dataclasses.replace(p, max_tokens=3).temperature == 0.01
    assert BeamSearchParams(beam_width=2, max_tokens=4, temperature=t).step_params().temperature \
        == 0.01
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=0.0).greedy


@pytest.mark.parametrize("value", [float("inf"), float("nan"), np.float64("inf")])
def test_a_non_finite_repetition_penalty_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="repetition_penalty must be a finite number"):
        SamplingParams(repetition_penalty=value)
    for ok in (1e-300, 0.5, 1, 2.0, 1e39, 1e300):  # finite ones vLLM takes are taken
        assert SamplingParams(repetition_penalty=ok).repetition_penalty == ok


@pytest.mark.parametrize("seed", [-1, np.int64(-1), torch.tensor(-1)])
def test_seed_minus_one_is_no_seed(seed):
    p = SamplingParams(seed=seed)
    assert p.seed is None
    assert dataclasses.replace(p, max_tokens=2).seed is None
    assert SamplingParams(seed=-2).seed == -2 and SamplingParams(seed=0).seed == 0


# ----------------------------------------------------------------------------------------------
# The sampler against vLLM's order, in float64.

def ref_processed(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
                  presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                  output_ids=(), prompt_ids=(), banned_ids=(), logit_bias=(), allowed_ids=(),
                  **_) -> np.ndarray:
    """The logits vLLM v1's Sampler draws a row from, in float64: allowed ids (the others
    -inf), banned ids (bad words, min-tokens) -inf, the logit bias added; repetition penalty on
    every id of prompt or output (positive divided, others multiplied), frequency per output
    occurrence, presence once per output id; a greedy row stops there; else / temperature,
    min-p (p < min_p * p_max goes), top-k (ids tied with the k-th value stay), top-p (an id
    goes when the mass before it, largest first, reaches top_p; the top one stays)."""
    x = np.array(logits, dtype=np.float64)
    vocab = len(x)
    if allowed_ids:
        keep = np.zeros(vocab, dtype=bool)
        keep[list(allowed_ids)] = True
        x[~keep] = NEG_INF
    x[list(banned_ids)] = NEG_INF
    for tok, bias in logit_bias:
        x[tok] += bias
    for tok in set(output_ids) | set(prompt_ids):
        x[tok] = x[tok] / repetition_penalty if x[tok] > 0 else x[tok] * repetition_penalty
    for tok in set(output_ids):
        x[tok] -= frequency_penalty * list(output_ids).count(tok) + presence_penalty
    if temperature < 1e-5:
        return x

    def probs(v):
        finite = np.isfinite(v)
        e = np.where(finite, np.exp(np.where(finite, v, 0) - v[finite].max()), 0.0)
        return e / e.sum()

    x = x / temperature
    if min_p > 0:
        p = probs(x)
        x[p < min_p * p.max()] = NEG_INF
    if 0 < top_k < vocab:
        x[x < np.sort(x)[::-1][top_k - 1]] = NEG_INF
    if top_p < 1:
        p = probs(x)
        order = np.lexsort((np.arange(vocab), -p))  # largest first, equal ones by id
        before = np.cumsum(p[order]) - p[order]
        drop = before >= top_p
        drop[0] = False
        x[order[drop]] = NEG_INF
    return x


V = 48
LOGITS = np.random.default_rng(78).normal(0, 3, size=V).round(2)
LOGITS[[0, 9]] = 0.0  # exactly 0: what a huge repetition penalty multiplies
TOP = int(np.argmax(LOGITS))

# The brief's edge cases, one row each, in one batch.
EDGE_CASES = [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_k=V), dict(top_k=V + 7),
    dict(top_p=1e-9), dict(top_p=1e-45), dict(top_p=0.3, top_k=5),
    dict(temperature=0.5, min_p=0.3), dict(temperature=1.7, min_p=0.05, top_k=10, top_p=0.8),
    dict(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
         prompt_ids=(3, 3, 3, 5, TOP), output_ids=(3, 7, 7)),
    dict(repetition_penalty=0.5, prompt_ids=(1, 2, 1), temperature=0.7, top_p=0.9),
    dict(banned_ids=(4,), logit_bias=((4, 100.0), (6, -3.0))),
    dict(allowed_ids=(1, 2, 3, 4), banned_ids=(2,)),
    dict(allowed_ids=(1, 2, 3, 4), banned_ids=(2,), logit_bias=((9, 50.0), (3, 1.0))),
    dict(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0, output_ids=(TOP,)),
    dict(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9),
    # Past fp32's range (vLLM takes 1e39): ids 0 and 9 hold exactly 0.
    dict(temperature=0.0, repetition_penalty=1e39, prompt_ids=(0, 9, TOP)),
    dict(repetition_penalty=1e39, prompt_ids=(0, 9, TOP), output_ids=(0,)),
    dict(repetition_penalty=1e39, prompt_ids=(0, 9), top_p=0.95, temperature=0.8),
]


@pytest.mark.parametrize("kernel", [False, True])
def test_processed_logits_of_edge_cases_equal_vllms_float64_order(kernel):
    """Every row's processed logits (the distribution it draws from) equal the reference's, and
    its token is one the reference allows, greedy rows its arg-max; on the torch paths and the
    Triton kernels (interpreted on the CPU)."""
    rows = [SamplingRow(seed=i, logprobs=V, **case) for i, case in enumerate(EDGE_CASES)]
    dev = KERNEL_DEVICE if kernel else "cpu"
    sb = make_sampling_batch(rows, vocab_size=V, device=dev, logprobs_mode="processed_logits")
    logits = torch.tensor(LOGITS, dtype=torch.float32).expand(len(rows), V).contiguous().to(dev)
    got = processed_logits(logits, sb).double().cpu().numpy()
    out = sample(logits, sb, kernel=kernel)
    tokens = out.token_ids.cpu().numpy()
    for i, case in enumerate(EDGE_CASES):
        want = ref_processed(LOGITS, **case)
        finite = np.isfinite(want)
        assert not np.isnan(got[i]).any(), (case, got[i])
        assert np.array_equal(np.isfinite(got[i]), finite), (case, np.nonzero(finite)[0],
                                                              np.nonzero(np.isfinite(got[i]))[0])
        np.testing.assert_allclose(got[i][finite], want[finite], rtol=1e-6, atol=1e-6,
                                   err_msg=str(case))
        assert finite[tokens[i]], (case, tokens[i])
        if case.get("temperature", 1.0) == 0:
            assert tokens[i] == int(np.argmax(want)), (case, tokens[i])
    returned = out.logprobs.cpu().numpy()  # processed_logits mode: the sampled ids' values
    assert not np.isnan(returned).any(), returned


def test_a_penalty_past_fp32_never_draws_the_id_it_penalises():
    """Ids 0 and 1 are in the prompt with logits of exactly 0 and repetition penalty 1e39: by
    vLLM's definition they stay at 0 (0 * 1e39), far below id 2's 3.0, so at temperature 0.1
    (and greedily) a draw is id 2 or, rarely, id 3, on every path (the Gumbel-max and inverse
    CDF torch paths took id 0, nan, every time before the fix)."""
    logits = torch.tensor([[0.0, 0.0, 3.0, 2.5, -1.0, -2.0, -3.0, -4.0]])
    rows = [SamplingRow(temperature=0.1 if s % 4 else 0.0, seed=s, repetition_penalty=1e39,
                        prompt_ids=(0, 1)) for s in range(64)]
    for gumbel, kernel in ((True, False), (False, False), (True, True)):
        dev = KERNEL_DEVICE if kernel else "cpu"
        sb = make_sampling_batch(rows, vocab_size=8, device=dev)
        ids = sample(logits.expand(len(rows), -1).contiguous().to(dev), sb, gumbel=gumbel,
                     kernel=kernel).token_ids.cpu()
        assert set(ids.tolist()) <= {2, 3} and 2 in ids.tolist(), (gumbel, kernel, ids.tolist())
        assert all(ids[::4] == 2), (gumbel, kernel)  # the greedy rows


# ----------------------------------------------------------------------------------------------
# The engine, against transformers' logits.

@pytest.fixture(scope="module")
def hf_model():
    from hf_tiny import make_hf_model
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory):
    from hf_tiny import save_checkpoint
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("s78") / "model")


PROMPT = [5, 5, 5, 17, 17, 3, 42, 99, 0, 5]


def test_engine_requests_with_seed_minus_one_sample_as_unseeded(checkpoint, device):
    """vLLM takes seed -1 as no seed: two such requests draw independently (as two without a
    seed do), where two of one real seed draw the same tokens."""
    from engine_helpers import make_llm

    llm = make_llm(checkpoint, device)
    prompts = [{"prompt_token_ids": PROMPT}] * 2

    def tokens(**kw):
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, **kw)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    seeded = tokens(seed=7)
    assert seeded[0] == seeded[1]
    unseeded = tokens(seed=None)
    assert unseeded[0] != unseeded[1]
    minus_one = tokens(seed=-1)
    assert minus_one[0] != minus_one[1]


def test_engine_samples_a_tiny_temperature_at_vllms_floor(checkpoint, hf_model, device):
    """temperature=1e-3 samples at 1e-2, as vLLM: the processed logprobs of the first token are
    log_softmax(logits / 0.01) of transformers' logits (the whole vocabulary returned)."""
    from engine_helpers import make_llm

    llm = make_llm(checkpoint, device, logprobs_mode="processed_logprobs", max_logprobs=-1)
    params = SamplingParams(temperature=1e-3, max_tokens=1, logprobs=-1, seed=3)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT])).logits[0, -1].double()
    want = torch.log_softmax(logits / 0.01, dim=-1).numpy()
    got = np.array([out.logprobs[0][i].logprob for i in range(len(want))])
    finite = np.isfinite(want) & (want > -80)  # fp32 underflows the far tail to -inf
    np.testing.assert_allclose(got[finite], want[finite], atol=2e-2)
