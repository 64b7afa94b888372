"""Audit of the sampler (minivllm.functional.sampling, kernels.sample_kernel) and of the logprobs
the engine reports, against vLLM v1's semantics, written out independently here in numpy float64
on the logits (nothing below calls minivllm's own helpers to build an expectation):

- vLLM v1's order (vllm/v1/sample/sampler.py): raw logprobs are taken first; then min-tokens /
  banned ids, penalties (repetition on prompt and output ids: positive logits divided, negative
  multiplied; frequency and presence on output ids only); greedy rows take the arg-max there;
  temperature; min-p (an argmax-invariant logits processor); top-k (every id tied with the k-th
  value kept, vllm/v1/sample/ops/topk_topp_sampler.py); top-p over the min-p / top-k survivors,
  renormalised, keeping at least the top id.
- Ranks of the sampled token: vLLM v1 counts the ids whose logprob is >= its own
  (vllm/v1/sample/ops/logprobs.py batched_count_greater_than).

Distributions are checked exactly where the code exposes them (truncated_probs) and by chi-square
tests of many seeded draws where it does not (the Gumbel-max path)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.functional.sampling import (SamplingRow, apply_penalties, make_sampling_batch, sample,
                                          truncated_probs)

NEG_INF = float("-inf")
# Where the Triton kernel runs: the GPU when there is one, else the CPU under the interpreter.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ----------------------------------------------------------------------------------------------
# The independent reference (vLLM v1's definitions, float64).

def ref_softmax(x: np.ndarray) -> np.ndarray:
    finite = np.isfinite(x)
    m = x[finite].max()
    e = np.where(finite, np.exp(np.where(finite, x, m) - m), 0.0)
    return e / e.sum()


def ref_penalise(logits, *, output_ids=(), prompt_ids=(), presence_penalty=0.0,
                 frequency_penalty=0.0, repetition_penalty=1.0) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)
    out = list(output_ids)
    for t in set(out) | set(prompt_ids):
        x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
    for t in set(out):
        x[t] -= frequency_penalty * out.count(t) + presence_penalty
    return x


def ref_probs(logits, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, **penalties) -> np.ndarray:
    """The distribution vLLM v1 samples a row from (one-hot on the first arg-max when greedy)."""
    x = ref_penalise(logits, **penalties)
    if temperature < 1e-5:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    x = x / temperature
    if min_p > 0:
        p = ref_softmax(x)
        x = np.where(p < min_p * p.max(), NEG_INF, x)
    if 0 < top_k < len(x):
        kth = np.sort(x)[::-1][top_k - 1]
        x = np.where(x < kth, NEG_INF, x)  # ids tied with the k-th value stay
    if top_p < 1:
        p = ref_softmax(x)
        ids = np.arange(len(x))
        # Ascending, as vLLM: drop ids while the mass up to them is <= 1 - top_p, keep the last.
        # Among equal probabilities the higher id goes first (vLLM leaves that order unspecified;
        # minivllm's stable sort keeps the lower ids).
        order = np.lexsort((-ids, p))
        drop = np.cumsum(p[order]) <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = NEG_INF
    return ref_softmax(x)


def chi_square_pvalue(counts, probs) -> float:
    counts, probs = np.asarray(counts, dtype=np.float64), np.asarray(probs, dtype=np.float64)
    zero = probs == 0
    assert counts[zero].sum() == 0, f"ids of probability 0 were sampled: {np.nonzero(counts * zero)}"
    n = counts.sum()
    stat = float((((counts - n * probs) ** 2)[~zero] / (n * probs[~zero])).sum())
    df = int((~zero).sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def draws(logits, n: int, *, gumbel=True, kernel=False, seed0=0, **kw) -> np.ndarray:
    """Counts of n draws (seeds seed0.., step 0) from one row of logits under the params kw."""
    logits = torch.as_tensor(logits, dtype=torch.float32)
    rows = [SamplingRow(seed=seed0 + s, **kw) for s in range(n)]
    sb = make_sampling_batch(rows, vocab_size=logits.shape[-1])
    ids = sample(logits.expand(n, -1).clone(), sb, gumbel=gumbel, kernel=kernel).token_ids
    return np.bincount(ids.numpy(), minlength=logits.shape[-1])


def probs_of(logits, rows) -> np.ndarray:
    """truncated_probs of rows (one logits row each), each row renormalised."""
    logits = torch.as_tensor(np.asarray(logits), dtype=torch.float32)
    sb = make_sampling_batch(rows, vocab_size=logits.shape[-1])
    x = apply_penalties(logits, sb)
    p = truncated_probs(x, sb).double().numpy()
    return p / p.sum(-1, keepdims=True)


# ----------------------------------------------------------------------------------------------
# The order of the stages and the truncation rules.

def test_min_p_applies_before_top_p_as_in_vllm():
    # probs .5 .3 .1 .1; min_p .3 keeps {0, 1} -> .625 .375; top_p .6 over those keeps {0} only.
    # Applied after top_p (over the full distribution, which keeps {0, 1}) it would keep both.
    logits = np.log([0.5, 0.3, 0.1, 0.1])
    kw = dict(temperature=1.0, top_p=0.6, min_p=0.3)
    want = ref_probs(logits, **kw)
    assert want.tolist() == [1.0, 0.0, 0.0, 0.0]
    np.testing.assert_allclose(probs_of([logits], [SamplingRow(**kw)])[0], want, atol=1e-6)
    assert draws(logits, 400, **kw).tolist() == [400, 0, 0, 0]


def test_top_k_keeps_every_id_tied_with_the_kth_value():
    logits = [3.0, 1.0, 2.0, 2.0, 0.0]
    want = ref_probs(logits, top_k=2)
    assert (want > 0).tolist() == [True, False, True, True, False]
    np.testing.assert_allclose(probs_of([logits], [SamplingRow(top_k=2)])[0], want, atol=1e-6)
    counts = draws(logits, 20000, top_k=2)
    assert chi_square_pvalue(counts, want) > 1e-3, (counts, want)
    # top_k=1 with a tie at the top samples among the tied ids (not the lowest one only).
    counts = draws([1.0, 5.0, 5.0, 0.0], 4000, top_k=1, temperature=0.7)
    assert chi_square_pvalue(counts, [0, 0.5, 0.5, 0]) > 1e-3, counts


def test_top_p_of_one_drops_nothing_whatever_the_batch():
    """A row with top_k but top_p=1 keeps its tiny-probability ids when another row of the batch
    asks for top-p (the float32 cumulative mass reaching 1.0 must not drop them)."""
    logits = [[20.0, 0.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]
    row = SamplingRow(top_k=3)
    alone = probs_of(logits[:1], [row])[0]
    batched = probs_of(logits, [row, SamplingRow(top_p=0.5)])[0]
    want = ref_probs(logits[0], top_k=3)
    assert (want > 0).tolist() == [True, True, True, False]
    assert (alone > 0).tolist() == (want > 0).tolist()
    assert (batched > 0).tolist() == (want > 0).tolist()
    np.testing.assert_allclose(batched, alone, rtol=1e-6, atol=0)


def test_tiny_top_p_keeps_the_top_id_and_ties_resolve_to_the_lowest_ids():
    logits = [0.0, 3.0, 1.0, 3.0]
    for top_p in (1e-12, 1e-30, 0.3):
        p = probs_of([logits], [SamplingRow(top_p=top_p)])[0]
        assert p.tolist() == [0.0, 1.0, 0.0, 0.0], (top_p, p)  # tied ids: the lower one stays
    # Four equal ids, top_p 0.5: exactly two stay, the lower ids (deterministic).
    p = probs_of([[1.0] * 4], [SamplingRow(top_p=0.5)])[0]
    np.testing.assert_allclose(p, ref_probs([1.0] * 4, top_p=0.5))
    assert p.tolist() == [0.5, 0.5, 0.0, 0.0]


def test_min_p_of_one_keeps_the_top_id_and_an_id_at_the_threshold_stays():
    """min_p keeps ids whose probability is at least min_p times the top one's: min_p 1 keeps
    the top id alone (dropping it too would leave no id, token -1), and an id exactly at the
    threshold stays (p(1) / p(0) = 1/2 with min_p 0.5)."""
    assert probs_of([[0.5, 2.0, 1.0, -1.0]], [SamplingRow(min_p=1.0)])[0].tolist() == [0, 1, 0, 0]
    p = probs_of([[0.0, -np.log(2.0), -10.0]], [SamplingRow(min_p=0.5)])[0]
    np.testing.assert_allclose(p, [2 / 3, 1 / 3, 0.0], rtol=1e-6)
    for top_p in (1e-300, 1e-45):  # below fp32's smallest normal: rounds to 0 in fp32
        assert probs_of([[0.5, 2.0, 1.0, -1.0]], [SamplingRow(top_p=top_p)])[0].tolist() == \
            [0, 1, 0, 0], top_p


GRID_TEMPS = [0.5, 1.0, 1.7]
TOP_PS = [1.0, 0.8713, 0.6291, 0.3137, 1e-9]
MIN_PS = [0.0, 0.07, 0.33]


@st.composite
def truncated_rows(draw, vocab):
    """(logits on a coarse grid, with ties and -inf entries; the row's parameters)."""
    vals = draw(st.lists(st.integers(-4, 4), min_size=vocab, max_size=vocab))
    dead = draw(st.lists(st.integers(0, 3), min_size=vocab, max_size=vocab))  # 0: -inf
    logits = [NEG_INF if d == 0 else v * 0.5 for v, d in zip(vals, dead)]
    if all(d == 0 for d in dead):
        logits[0] = 0.0
    kw = dict(temperature=draw(st.sampled_from(GRID_TEMPS)), top_k=draw(st.integers(-1, vocab + 3)),
              top_p=draw(st.sampled_from(TOP_PS)), min_p=draw(st.sampled_from(MIN_PS)))
    return logits, kw


@settings(max_examples=60)
@given(st.integers(1, 4).flatmap(lambda b: st.lists(truncated_rows(12), min_size=b, max_size=b)))
def test_truncated_distribution_equals_vllms_for_every_row_of_a_batch(batch):
    logits = [lg for lg, _ in batch]
    got = probs_of(logits, [SamplingRow(**kw) for _, kw in batch])
    for b, (lg, kw) in enumerate(batch):
        want = ref_probs(lg, **kw)
        assert ((got[b] > 0) == (want > 0)).all(), (b, lg, kw, got[b], want)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-7)


@settings(max_examples=80)
@given(st.integers(1, 4).flatmap(lambda b: st.lists(truncated_rows(12), min_size=b, max_size=b)),
       st.lists(st.integers(1, 11), min_size=4, max_size=4))
def test_truncation_by_candidates_equals_vllms_for_every_row_of_a_batch(batch, top_ks):
    """Every row with a top-k below the vocabulary: top-k and top-p run on that many candidates
    a row (sb.top_k_bound), not on a sort of the vocabulary; the grid's ties at the k-th value
    (the tied ids kept in id order by top-p's mass) and its -inf entries included."""
    rows = [SamplingRow(**(kw | {"top_k": k})) for (_, kw), k in zip(batch, top_ks)]
    sb = make_sampling_batch(rows, vocab_size=12)
    assert sb.top_k_bound == max(top_ks[:len(batch)])
    got = probs_of([lg for lg, _ in batch], rows)
    for b, ((lg, kw), k) in enumerate(zip(batch, top_ks)):
        want = ref_probs(lg, **(kw | {"top_k": k}))
        assert ((got[b] > 0) == (want > 0)).all(), (b, lg, kw, k, got[b], want)
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-7)


def test_top_p_over_many_ids_tied_at_the_kth_value_keeps_the_lowest_ids():
    """Top-k 2 over a row whose 2nd value is shared by 6 ids: all 7 survive top-k (more than
    the 2 candidates), and top-p keeps the top id and then as many tied ids, lowest first, as
    its mass needs: 0.5 of the top's 0.25 leaves 0.25 / 0.125 = 2 (the third's mass before it,
    0.5, reaches top_p)."""
    logits = [-10.0] * 10
    logits[5] = 0.0  # mass 1 / 4 of the survivors, each tied id's 1 / 8
    for i in (1, 2, 4, 6, 8, 9):
        logits[i] = np.log(0.5)
    rows = [SamplingRow(top_k=2, top_p=0.5), SamplingRow(top_k=2), SamplingRow(top_k=2, top_p=0.9)]
    assert make_sampling_batch(rows, vocab_size=10).top_k_bound == 2
    got = probs_of([logits] * 3, rows)
    for row, g in zip(rows, got):
        want = ref_probs(logits, top_k=2, top_p=row.top_p)
        np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7)
    assert (got[0] > 0).tolist() == [False, True, True, False, False, True] + [False] * 4
    assert (got[1] > 0).sum() == 7


# ----------------------------------------------------------------------------------------------
# Sampled frequencies against the reference distribution, on both paths and in mixed batches.

LOGITS = [2.0, 1.5, 1.0, 0.2, -0.5, -3.0, NEG_INF]

CASES = [dict(temperature=1.0), dict(temperature=0.45), dict(temperature=3.0),
         dict(temperature=1.2, top_k=3), dict(top_k=50), dict(top_p=0.7),
         dict(temperature=0.8, min_p=0.15), dict(temperature=1.5, top_k=5, top_p=0.8, min_p=0.1),
         dict(temperature=2.0, top_p=0.765, min_p=0.2)]  # min-p first: id 3 drops (0.775 >= 0.765)


@pytest.mark.parametrize("gumbel", [True, False], ids=["gumbel", "inverse_cdf"])
@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_sampled_frequencies_match_vllms_distribution(kw, gumbel):
    counts = draws(LOGITS, 12000, gumbel=gumbel, **kw)
    assert chi_square_pvalue(counts, ref_probs(LOGITS, **kw)) > 1e-4, (counts, kw)


def test_mixed_batch_rows_each_follow_their_own_distribution():
    """Greedy, plain, truncated and penalised rows interleaved in one batch: per parameter set,
    the frequencies over many seeds are that set's distribution."""
    specs = [dict(temperature=0.0),
             dict(temperature=0.7),
             dict(temperature=1.3, top_k=4, min_p=0.05),
             dict(temperature=1.0, top_p=0.6),
             dict(temperature=0.9, repetition_penalty=1.8, presence_penalty=0.3, frequency_penalty=0.2,
                  output_ids=(0, 0, 2), prompt_ids=(1, 1, 4))]
    reps = 4000
    rows = [SamplingRow(seed=1000 * k + r, **specs[k]) for r in range(reps) for k in range(len(specs))]
    logits = torch.tensor(LOGITS).expand(len(rows), -1).clone()
    ids = sample(logits, make_sampling_batch(rows, vocab_size=len(LOGITS))).token_ids.numpy()
    for k, spec in enumerate(specs):
        counts = np.bincount(ids[k::len(specs)], minlength=len(LOGITS))
        assert chi_square_pvalue(counts, ref_probs(LOGITS, **spec)) > 1e-4, (spec, counts)


def test_a_huge_temperature_samples_uniformly_on_the_gumbel_path():
    """T up to fp32's max is accepted (SamplingParams); logits / T ~ 0 is the uniform distribution
    over the finite ids, on both paths (T * noise must not overflow to inf, where the lowest id of
    the infinities would win)."""
    logits = np.array([3.0, -2.0, 0.5, NEG_INF] + [1.0] * 12)
    want = ref_probs(logits, temperature=3e38)
    for t in (1e38, 3.4e38):
        for gumbel in (True, False):
            counts = draws(logits, 6000, temperature=t, gumbel=gumbel)
            assert chi_square_pvalue(counts, want) > 1e-4, (t, gumbel, counts)


def test_tiny_temperatures():
    logits = [1.0, 2.0, 2.0, 1.9999, NEG_INF]
    # Below vLLM's 1e-5 it is greedy: the first arg-max, for every seed.
    assert draws(logits, 300, temperature=5e-6).tolist() == [0, 300, 0, 0, 0]
    assert draws(logits, 300, temperature=5e-6, top_p=0.5).tolist() == [0, 300, 0, 0, 0]
    # Greedy to the engine's in-graph pick (plain_greedy) and to SamplingParams too.
    from minivllm import SamplingParams
    from minivllm.functional.sampling import plain_greedy
    # SamplingParams raises a positive temperature below 1e-2 to 1e-2 (vLLM's _MAX_TEMP), so only
    # 0 is greedy there.
    assert plain_greedy(SamplingRow(temperature=5e-6)) and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=5e-6).greedy
    assert not plain_greedy(SamplingRow(temperature=2e-5)) and not SamplingParams(temperature=2e-5).greedy
    # Just above it samples: the tied maxima half and half (1.9999 / 2e-5 is 5 units below).
    for kw in (dict(), dict(top_k=3), dict(min_p=0.01)):
        for gumbel in (True, False):
            counts = draws(logits, 4000, temperature=2e-5, gumbel=gumbel, **kw)
            assert counts[[0, 3, 4]].sum() <= 40, (kw, gumbel, counts)  # e^-5 ~ 0.7% to id 3
            assert chi_square_pvalue(counts[1:3], [0.5, 0.5]) > 1e-4, (kw, gumbel, counts)


def test_the_kernel_draws_the_reference_paths_tokens_at_any_temperature():
    """The Triton kernel (interpreted on the CPU) picks the tokens of the torch path that the
    tests above check statistically, huge temperatures included, through sample() and when a raw
    temperature near fp32's max reaches it directly; never a -inf id."""
    from minivllm.functional.sampling import gumbel_argmax_reference
    from minivllm.kernels.sample_kernel import gumbel_argmax

    b, vocab = 24, 16
    logits = torch.randn(b, vocab, generator=torch.Generator().manual_seed(5)) * 2
    logits[:, 3] = NEG_INF
    temps = [0.0, 0.9, 1e38, 3.4e38]
    rows = [SamplingRow(temperature=temps[i % 4], seed=i, step=i) for i in range(b)]
    sb = make_sampling_batch(rows, vocab_size=vocab)
    dev = KERNEL_DEVICE
    sbd = make_sampling_batch(rows, vocab_size=vocab, device=dev)
    got = sample(logits.to(dev), sbd, kernel=True).token_ids.cpu()
    assert got.tolist() == sample(logits, sb, kernel=False).token_ids.tolist()
    raw = torch.full((b,), 3.4e38)
    direct = gumbel_argmax(logits.to(dev), raw.to(dev), sbd.seeds, sbd.steps).cpu()
    assert direct.tolist() == gumbel_argmax_reference(logits, raw, sb.seeds, sb.steps).tolist()
    assert 3 not in got.tolist() and 3 not in direct.tolist()


# ----------------------------------------------------------------------------------------------
# Greedy: the exact arg-max of the penalised logits, ties to the lowest id, on every path.

@settings(max_examples=25)
@given(st.lists(st.lists(st.integers(-3, 3), min_size=24, max_size=24), min_size=1, max_size=4),
       st.sampled_from(["all_greedy", "with_plain", "with_truncated", "inverse_cdf", "kernel"]),
       st.booleans())
def test_greedy_is_the_first_argmax_on_every_path(grid, mix, penalised):
    vocab = 24
    logits = [[v * 0.5 for v in row] for row in grid]
    pen = dict(repetition_penalty=1.5, frequency_penalty=0.25, output_ids=(3, 3, 7),
               prompt_ids=(1, 7, 7)) if penalised else {}
    rows = [SamplingRow(temperature=0.0 if i % 2 == 0 else 1e-6, seed=i, top_k=3, **pen)
            for i in range(len(logits))]
    others = {"all_greedy": [], "with_plain": [SamplingRow(temperature=0.8, seed=9)],
              "with_truncated": [SamplingRow(temperature=0.8, top_p=0.5)],
              "inverse_cdf": [SamplingRow(temperature=0.8, seed=9)],
              "kernel": [SamplingRow(temperature=0.8, seed=9)]}[mix]
    other_logits = [[0.0] * vocab] * len(others)
    dev = KERNEL_DEVICE if mix == "kernel" else "cpu"
    sb = make_sampling_batch(rows + others, vocab_size=vocab, device=dev)
    out = sample(torch.tensor(logits + other_logits, device=dev), sb, gumbel=mix != "inverse_cdf",
                 kernel=mix == "kernel").token_ids.tolist()
    for b, lg in enumerate(logits):
        assert out[b] == int(np.argmax(ref_penalise(lg, **pen))), (b, lg, mix)


# ----------------------------------------------------------------------------------------------
# Penalties.

@settings(max_examples=40)
@given(st.integers(0, 2**31), st.lists(st.integers(0, 19), max_size=12),
       st.lists(st.integers(0, 19), max_size=12), st.floats(-2, 2), st.floats(-2, 2),
       st.floats(0.1, 3.0))
def test_penalties_are_vllms(seed, output_ids, prompt_ids, presence, frequency, repetition):
    vocab = 20
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(seed)) * 3
    logits[1, 5] = 0.0
    kw = dict(output_ids=tuple(output_ids), prompt_ids=tuple(prompt_ids), presence_penalty=presence,
              frequency_penalty=frequency, repetition_penalty=repetition)
    # Two sequences of one prompt (n=2): each is penalised by its own output only.
    rows = [SamplingRow(**kw), SamplingRow(**{**kw, "output_ids": tuple(output_ids[:3])})]
    got = apply_penalties(logits, make_sampling_batch(rows, vocab_size=vocab)).double().numpy()
    f32 = lambda v: float(np.float32(v))  # the batch holds the penalties in float32
    for b, row in enumerate(rows):
        want = ref_penalise(logits[b].double().numpy(), output_ids=row.output_ids,
                            prompt_ids=row.prompt_ids, presence_penalty=f32(presence),
                            frequency_penalty=f32(frequency), repetition_penalty=f32(repetition))
        np.testing.assert_allclose(got[b], want, rtol=1e-5, atol=1e-5)


def test_presence_and_frequency_ignore_the_prompt_and_repetition_counts_ids_once():
    logits = np.array([2.0, -2.0, 1.0, 0.5])
    rows = [SamplingRow(presence_penalty=1.0, frequency_penalty=0.5, prompt_ids=(0, 0, 1)),
            SamplingRow(repetition_penalty=2.0, prompt_ids=(0, 0, 0, 1), output_ids=(1, 1))]
    got = apply_penalties(torch.tensor(np.stack([logits, logits]), dtype=torch.float32),
                          make_sampling_batch(rows, vocab_size=4)).numpy()
    np.testing.assert_allclose(got[0], logits)
    np.testing.assert_allclose(got[1], [1.0, -4.0, 1.0, 0.5])


# ----------------------------------------------------------------------------------------------
# Seeds: a row's token depends on its logits, parameters, seed and step only.

ROW_PARAMS = st.fixed_dictionaries(dict(
    temperature=st.sampled_from([0.0, 0.3, 1.0, 1.7]), top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.9, 0.5]), min_p=st.sampled_from([0.0, 0.05, 0.2]),
    presence_penalty=st.sampled_from([0.0, 0.5]), repetition_penalty=st.sampled_from([1.0, 1.3]),
    seed=st.integers(-(2**63), 2**64 - 1), step=st.integers(0, 2**32 - 1),
    logprobs=st.sampled_from([None, 0, 3])))


@settings(max_examples=30)
@given(ROW_PARAMS, st.lists(ROW_PARAMS, max_size=5), st.integers(0, 5), st.booleans())
def test_a_seeded_row_gets_the_same_token_whatever_the_batch(target, others, at, gumbel):
    vocab = 64
    gen = torch.Generator().manual_seed(abs(target["seed"]) % 1000)
    logits = torch.randn(1 + len(others), vocab, generator=gen) * 2
    rows = [SamplingRow(output_ids=(1, 2, 2), prompt_ids=(3,), **p) for p in [target] + others]
    alone = sample(logits[:1], make_sampling_batch(rows[:1], vocab_size=vocab), gumbel=gumbel)
    at = at % (len(others) + 1)
    order = list(range(1, len(rows)))
    order.insert(at, 0)
    batched = sample(logits[order], make_sampling_batch([rows[i] for i in order], vocab_size=vocab),
                     gumbel=gumbel)
    assert batched.token_ids[at].item() == alone.token_ids[0].item()
    if target["logprobs"] is not None:
        assert batched.logprobs[at].item() == alone.logprobs[0].item()
        assert batched.ranks[at].item() == alone.ranks[0].item()


# ----------------------------------------------------------------------------------------------
# Logprobs: raw, whatever the sampling parameters; ranks as vLLM counts them.

def test_logprobs_are_raw_with_vllms_ranks_even_with_ties():
    logits = torch.tensor([[2.0, 2.0, 1.0, 1.0, 0.0, -1.0]] * 4)
    rows = [SamplingRow(temperature=0.0, logprobs=2),                     # picks id 0 (tied)
            SamplingRow(temperature=0.0, banned_ids=(0, 1), logprobs=0),  # picks id 2 (tied)
            SamplingRow(temperature=2.0, top_k=3, min_p=0.2, repetition_penalty=2.0,
                        prompt_ids=(0, 1), presence_penalty=1.0, output_ids=(2,), seed=3, logprobs=5),
            SamplingRow(temperature=0.0, banned_ids=(0, 1, 2, 3, 4), logprobs=1)]  # id 5
    out = sample(logits, make_sampling_batch(rows, vocab_size=6))
    raw = torch.log_softmax(logits.double(), -1).numpy()
    assert out.token_ids.tolist()[0:2] == [0, 2] and out.token_ids[3].item() == 5
    assert out.top_ids.shape == (4, 5)
    for b in range(4):
        t = out.token_ids[b].item()
        assert out.logprobs[b].item() == pytest.approx(raw[b, t], abs=1e-6)
        assert out.ranks[b].item() == int((raw[b] >= raw[b, t]).sum())  # vLLM: ties count
        np.testing.assert_allclose(out.top_logprobs[b].numpy(), np.sort(raw[b])[::-1][:5], atol=1e-6)
    assert out.ranks.tolist()[0:2] == [2, 4] and out.ranks[3].item() == 6


# ----------------------------------------------------------------------------------------------
# The engine end to end, against transformers.

@pytest.fixture(scope="module")
def hf_model():
    from hf_tiny import make_hf_model
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def llm(hf_model, tmp_path_factory):
    from engine_helpers import make_llm
    from hf_tiny import save_checkpoint
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("audit") / "model")
    return make_llm(path, torch.device("cpu"))


def hf_logits(model, ids) -> np.ndarray:
    """[len(ids), vocab] float64 next-token logits of every position, one causal forward."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].double().numpy()


PROMPT = [5, 5, 5, 17, 17, 3, 42, 99, 0, 5]


def test_engine_logprobs_are_the_raw_model_logprobs(llm, hf_model):
    from minivllm import SamplingParams
    params = SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=8, logprobs=3, ignore_eos=True)
    c = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    lg = hf_logits(hf_model, PROMPT + c.token_ids[:-1])[len(PROMPT) - 1:]
    m = lg.max(-1, keepdims=True)
    raw = lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))  # log_softmax, float64
    assert len(c.logprobs) == len(c.token_ids) == 8
    total = 0.0
    for tok, entry, ref in zip(c.token_ids, c.logprobs, raw):
        top3 = np.argsort(-ref)[:3].tolist()
        assert tok in entry and set(entry) == set(top3) | {tok}  # 3 or 4 entries
        assert tok in np.argsort(-ref)[:5]  # top_k=5 on the (unpenalised) model distribution
        for i, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[i], abs=1e-4)
            assert lp.rank == int((ref >= ref[i]).sum())
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # logprobs=0: the sampled token's alone.
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=4, logprobs=0, ignore_eos=True)
    c = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0]
    assert [list(e) for e in c.logprobs] == [[t] for t in c.token_ids]


def test_engine_greedy_with_penalties_matches_vllms_definition(llm, hf_model):
    """Greedy decoding with repetition (prompt and output), presence and frequency penalties,
    n=2: every completion is the reference's, each penalised by its own output."""
    from minivllm import SamplingParams
    pen = dict(repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3)
    params = SamplingParams(temperature=0.0, max_tokens=10, n=2, ignore_eos=True, **pen)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs

    def reference(**penalties):
        out_ids = []
        for _ in range(10):
            x = ref_penalise(hf_logits(hf_model, PROMPT + out_ids)[-1], output_ids=out_ids,
                             prompt_ids=PROMPT, **penalties)
            out_ids.append(int(np.argmax(x)))
        return out_ids

    want = reference(**pen)
    assert [c.token_ids for c in out] == [want, want]
    assert want != reference()  # the penalties changed the output


def test_the_repetition_penalty_reaches_the_prompts_ids(llm, hf_model):
    """Prompts that hold the model's greedy id, where penalising the prompt's ids changes the
    pick and penalising only the output's would not: the engine picks as the reference with the
    prompt's ids does."""
    from minivllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, repetition_penalty=5.0)
    checked = 0
    for start in range(60):
        prompt = [start, start + 1, start + 2]
        prompt = [int(np.argmax(hf_logits(hf_model, prompt)[-1]))] + prompt
        logits = hf_logits(hf_model, prompt)[-1]
        want = int(np.argmax(ref_penalise(logits, prompt_ids=prompt, repetition_penalty=5.0)))
        if want == int(np.argmax(ref_penalise(logits, repetition_penalty=5.0))):
            continue
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [want], prompt
        checked += 1
        if checked == 3:
            break
    assert checked == 3
