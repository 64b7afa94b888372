"""The batched sampler (minivllm.functional.sampling) against independent references: target
distributions written out by hand and checked with a chi-square test (on both paths, Gumbel-max
and inverse CDF), penalties computed row by row, logprobs from log_softmax, and per-row seeds that
do not depend on the batch."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.functional import sampling
from minivllm.functional.sampling import (SamplingRow, gumbel_argmax_reference, gumbel_from_bits,
                                          make_sampling_batch, sample, sample_from_probs,
                                          uniform_from_counter)

V = 6
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -3.0])


def chi_square_pvalue(counts: list[int], probs: list[float]) -> float:
    """P(chi2 >= observed) for counts against probs (cells with probability 0 must be empty)."""
    n = sum(counts)
    stat, cells = 0.0, 0
    for c, p in zip(counts, probs):
        if p == 0:
            assert c == 0, f"an id of probability 0 was sampled {c} times"
            continue
        stat += (c - n * p) ** 2 / (n * p)
        cells += 1
    df = cells - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if x != -math.inf)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def expected(logits: list[float], *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> list[float]:
    """The target distribution, written plainly: sort, cut, renormalise."""
    x = [v / temperature for v in logits]
    order = sorted(range(len(x)), key=lambda i: -x[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    p = softmax(x)
    mass = 0.0
    for i in order:
        if mass >= top_p:
            keep.discard(i)
        mass += p[i]
    q = [p[i] if i in keep else 0.0 for i in range(len(x))]
    if min_p > 0:
        top = max(q)
        q = [v if v >= min_p * top else 0.0 for v in q]
    s = sum(q)
    return [v / s for v in q]


def draw(n: int, logits=LOGITS, gumbel=True, **kw) -> list[int]:
    """n draws: n rows of the same logits with seeds 0..n-1 (one draw per seed). gumbel=False
    samples plain-temperature rows by inverse CDF too."""
    rows = [SamplingRow(seed=s, step=0, **kw) for s in range(n)]
    sb = make_sampling_batch(rows, vocab_size=logits.shape[-1])
    ids = sample(logits.expand(n, -1).clone(), sb, gumbel=gumbel).token_ids
    return torch.bincount(ids, minlength=logits.shape[-1]).tolist()


CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0, top_k=3),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=0.7, top_k=4, top_p=0.9),
    dict(temperature=1.0, min_p=0.2),
]


# Plain-temperature rows take the Gumbel-max path by default and the inverse CDF with
# gumbel=False; truncated rows always take the inverse CDF.
PATHS = {"gumbel": True, "inverse_cdf": False}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kw", CASES, ids=[str(c) for c in CASES])
def test_sampled_frequencies_match_target_distribution(kw, path):
    counts = draw(20000, gumbel=PATHS[path], **kw)
    target = expected(LOGITS.tolist(), **kw)
    assert chi_square_pvalue(counts, target) > 1e-3, (counts, target)


@pytest.mark.parametrize("path", PATHS)
def test_chi_square_test_has_power(path):
    # The same draws tested against a slightly wrong target must be rejected, or the test above
    # could not fail.
    counts = draw(20000, temperature=1.0, gumbel=PATHS[path])
    wrong = expected(LOGITS.tolist(), temperature=1.1)
    assert chi_square_pvalue(counts, wrong) < 1e-6


def test_gumbel_frequencies_on_a_flat_vocabulary():
    # Many equal logits, where noise that ties (too few bits) would favour the lowest ids.
    logits = torch.zeros(64)
    logits[:8] = 1.0
    counts = draw(40000, logits=logits, temperature=0.8)
    assert chi_square_pvalue(counts, expected(logits.tolist(), temperature=0.8)) > 1e-3, counts


def test_uniforms_are_uniform_and_counter_based():
    seeds = torch.arange(50000, dtype=torch.int64)
    u = uniform_from_counter(seeds, torch.zeros_like(seeds))
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    counts = torch.histc(u.float(), bins=20, min=0, max=1).long().tolist()
    assert chi_square_pvalue(counts, [0.05] * 20) > 1e-3
    # A pure function of (seed, step): steps and seeds both change it, the batch does not.
    u2 = uniform_from_counter(seeds, torch.ones_like(seeds))
    assert (u != u2).float().mean() > 0.99
    sub = uniform_from_counter(seeds[123:124], torch.zeros(1, dtype=torch.int64))
    assert sub.item() == u[123].item()
    big = torch.tensor([2**63 - 1, -(2**63), -1], dtype=torch.int64)
    ub = uniform_from_counter(big, torch.zeros_like(big))
    assert bool((ub > 0).all()) and bool((ub < 1).all()) and len(set(ub.tolist())) == 3


def test_greedy_rows_take_the_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 50)
    rows = [SamplingRow(temperature=0.0, seed=i) for i in range(7)]
    out = sample(logits, make_sampling_batch(rows, vocab_size=50))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_1_equals_greedy_for_any_temperature_and_seed():
    torch.manual_seed(1)
    logits = torch.randn(64, 200)
    rows = [SamplingRow(temperature=0.3 + i / 10, top_k=1, seed=i, step=i) for i in range(64)]
    out = sample(logits, make_sampling_batch(rows, vocab_size=200))
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_rows_are_independent_of_batch_composition():
    torch.manual_seed(2)
    vocab = 300
    logits = torch.randn(9, vocab) * 2
    rows = [SamplingRow(temperature=1.0, seed=42, step=3),
            SamplingRow(temperature=0.0),
            SamplingRow(temperature=0.8, top_k=20, seed=7, step=0),
            SamplingRow(temperature=1.2, top_p=0.7, seed=9, step=5, presence_penalty=0.5,
                        output_ids=(1, 2, 3)),
            SamplingRow(temperature=1.0, min_p=0.1, seed=11, step=1, logprobs=3),
            SamplingRow(temperature=0.5, repetition_penalty=1.3, seed=5, step=2,
                        prompt_ids=(4, 5), output_ids=(6,)),
            SamplingRow(temperature=1.0, seed=100, step=0, banned_ids=(0, 1, 2)),
            SamplingRow(temperature=2.0, frequency_penalty=1.0, seed=3, step=9, output_ids=(7, 7, 7)),
            SamplingRow(temperature=1.0, top_k=5, top_p=0.5, min_p=0.05, seed=8, step=4)]
    together = sample(logits, make_sampling_batch(rows, vocab_size=vocab)).token_ids.tolist()
    alone = [sample(logits[i:i + 1], make_sampling_batch([r], vocab_size=vocab)).token_ids.item()
             for i, r in enumerate(rows)]
    assert together == alone
    reversed_ = sample(logits.flip(0), make_sampling_batch(rows[::-1], vocab_size=vocab)).token_ids
    assert reversed_.tolist()[::-1] == together


def test_penalties_match_a_row_by_row_reference():
    torch.manual_seed(3)
    vocab = 40
    logits = torch.randn(3, vocab) * 3
    specs = [dict(presence_penalty=0.7, output_ids=(1, 1, 5), prompt_ids=(9,)),
             dict(frequency_penalty=0.4, output_ids=(2, 2, 2, 8)),
             dict(repetition_penalty=1.5, output_ids=(3, 4), prompt_ids=(4, 10, 11))]
    rows = [SamplingRow(temperature=0.0, **s) for s in specs]
    from minivllm.functional.sampling import apply_penalties
    got = apply_penalties(logits.clone(), make_sampling_batch(rows, vocab_size=vocab))
    want = logits.clone()
    for b, s in enumerate(specs):
        out_ids, prompt_ids = list(s.get("output_ids", ())), list(s.get("prompt_ids", ()))
        rep = s.get("repetition_penalty", 1.0)
        for t in set(out_ids) | (set(prompt_ids) if rep != 1.0 else set()):
            v = want[b, t].item()
            want[b, t] = v / rep if v > 0 else v * rep
        for t in set(out_ids):
            want[b, t] -= s.get("frequency_penalty", 0.0) * out_ids.count(t)
            want[b, t] -= s.get("presence_penalty", 0.0)
    torch.testing.assert_close(got, want)


def test_banned_ids_are_never_sampled():
    logits = torch.tensor([[5.0, 4.0, -1.0, -2.0]]).expand(500, -1).clone()
    rows = [SamplingRow(temperature=1.0 if s % 2 else 0.0, seed=s, banned_ids=(0, 1)) for s in range(500)]
    ids = sample(logits, make_sampling_batch(rows, vocab_size=4)).token_ids
    assert set(ids.tolist()) <= {2, 3}


def test_logprobs_are_raw_log_softmax_with_rank_and_top_n():
    torch.manual_seed(4)
    logits = torch.randn(5, 30)
    rows = [SamplingRow(temperature=1.5, seed=i, logprobs=4, presence_penalty=1.0, output_ids=(0,))
            for i in range(5)]
    out = sample(logits, make_sampling_batch(rows, vocab_size=30))
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.top_logprobs, ref.topk(4, -1).values)
    assert out.top_ids.tolist() == ref.topk(4, -1).indices.tolist()
    for b in range(5):
        t = out.token_ids[b].item()
        assert out.logprobs[b].item() == pytest.approx(ref[b, t].item(), abs=1e-6)
        assert out.ranks[b].item() == int((ref[b] > ref[b, t]).sum()) + 1




@pytest.mark.parametrize("vocab, chunk", [(1000, 256), (257, 16), (64, 64), (5, 8)])
def test_two_level_inverse_cdf_equals_the_full_cdf(vocab, chunk):
    """The chunked inverse CDF picks the same id as one float64 CDF over the whole vocabulary,
    and never an id of probability zero (here about half of them, whole chunks included)."""
    from minivllm.functional.sampling import sample_from_probs

    gen = torch.Generator().manual_seed(vocab)
    probs = torch.rand(64, vocab, generator=gen)
    probs[torch.rand(64, vocab, generator=gen) < 0.5] = 0.0
    probs[:, : min(vocab, 2 * chunk) // 2] = 0.0  # leading zero chunks
    probs[:, -1] = 0.3  # every row has mass
    u = torch.rand(64, generator=gen, dtype=torch.float64).clamp(1e-9, 1 - 1e-9)
    u[0], u[1] = 1e-300, 1.0 - 1e-16  # the extremes
    got = sample_from_probs(probs, u, chunk=chunk)
    cdf = probs.double().cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1).clamp(max=vocab - 1)
    assert torch.all(probs.gather(1, got[:, None]) > 0)
    assert (got == expected).float().mean() >= 62 / 64  # the extremes may round differently
    assert torch.equal(got[2:], expected[2:])


def test_gumbel_noise_is_standard_gumbel_with_32_bit_resolution_where_it_wins():
    bits = sampling.counter_bits(sampling.counter_key(torch.arange(20, dtype=torch.int64),
                                                      torch.zeros(20, dtype=torch.int64)), 50000)
    g = gumbel_from_bits(bits).double()
    assert g.dtype == torch.float64 and bool(torch.isfinite(g).all())
    assert abs(g.mean().item() - 0.5772156649) < 0.01  # Euler's constant
    assert abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    # The largest noise (smallest hashes) wins the arg-max: there every hash gives its own value,
    # strictly ordered, where a 24-bit uniform would lump the lowest 256 hashes together.
    small = gumbel_from_bits(torch.arange(1 << 16, dtype=torch.int64))
    assert bool((small[1:] < small[:-1]).all())
    # Monotone across the whole range and the switch from the series to the log, finite at the ends.
    sweep = gumbel_from_bits(torch.linspace(0, 2**32 - 1, 100001, dtype=torch.float64).long())
    assert bool((sweep[1:] <= sweep[:-1]).all()) and bool(torch.isfinite(sweep).all())
    edge = gumbel_from_bits(torch.tensor([2**28 - 1, 2**28, 2**32 - 1], dtype=torch.int64))
    assert abs(edge[0] - edge[1]).item() < 1e-5 and math.isfinite(edge[2].item())


def test_plain_rows_take_the_gumbel_path_and_gumbel_false_the_inverse_cdf():
    torch.manual_seed(6)
    logits = torch.randn(64, 100) * 2
    rows = [SamplingRow(temperature=0.6, seed=i, step=i % 5) for i in range(64)]
    sb = make_sampling_batch(rows, vocab_size=100)
    t, seeds, steps = sb.temperature, sb.seeds, sb.steps
    gumbel = gumbel_argmax_reference(logits, t, seeds, steps)
    assert sample(logits, sb).token_ids.tolist() == gumbel.tolist()
    old = sample_from_probs(torch.softmax(logits / 0.6, -1), uniform_from_counter(seeds, steps))
    assert sample(logits, sb, gumbel=False).token_ids.tolist() == old.tolist()


PLAIN = SamplingRow(temperature=0.6, seed=1234, step=17)
OTHERS = [SamplingRow(temperature=0.0),
          SamplingRow(temperature=0.9, top_p=0.7, seed=5, step=2),
          SamplingRow(temperature=1.0, top_k=3, min_p=0.1, seed=6),
          SamplingRow(temperature=0.6, seed=1234, step=18),
          SamplingRow(temperature=1.5, presence_penalty=1.0, output_ids=(3, 4), seed=2)]


@pytest.mark.parametrize("kernel", [False, True], ids=["reference", "kernel"])
def test_a_plain_row_gets_its_token_whatever_the_batch(kernel):
    """The same seeded plain-temperature row, alone, with greedy rows, with top-p / top-k rows
    (a batch that takes both paths), with penalised rows, in any position."""
    vocab = 300
    row_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(8)) * 2
    other_logits = torch.randn(len(OTHERS), vocab, generator=torch.Generator().manual_seed(9))
    batches = [[], [0], [1], [0, 1], [2, 1, 0], [3, 4], list(range(len(OTHERS)))]
    # The kernel runs under the interpreter on CPU, for real on a GPU (which needs its tensors).
    dev = "cuda" if kernel and torch.cuda.is_available() else "cpu"
    tokens = set()
    for i, others in enumerate(batches):
        at = i % (len(others) + 1)
        rows = [OTHERS[k] for k in others]
        logits = [other_logits[k] for k in others]
        rows.insert(at, PLAIN)
        logits.insert(at, row_logits)
        sb = make_sampling_batch(rows, vocab_size=vocab, device=dev)
        tokens.add(sample(torch.stack(logits).to(dev), sb, kernel=kernel).token_ids[at].item())
    assert len(tokens) == 1, tokens


def test_static_flags_route_the_paths(monkeypatch):
    vocab = 50
    logits = torch.randn(3, vocab)
    plain = [SamplingRow(temperature=0.7, seed=1), SamplingRow(temperature=0.0, top_k=5),
             SamplingRow(temperature=1.0, presence_penalty=0.5, output_ids=(1,))]
    truncated = [SamplingRow(temperature=0.7, top_p=0.9), SamplingRow(temperature=0.0, top_k=5),
                 SamplingRow(temperature=1.0, min_p=0.1)]
    sb = make_sampling_batch(plain, vocab_size=vocab)
    assert not sb.any_truncated and not sb.all_truncated  # a greedy row's top-k does not count
    sbt = make_sampling_batch(truncated, vocab_size=vocab)
    assert sbt.any_truncated and not sbt.all_truncated
    assert make_sampling_batch(truncated[:1], vocab_size=vocab).all_truncated

    def boom(*a, **k):
        raise AssertionError("this path should not run")

    # The common batch never sorts nor builds a CDF...
    with monkeypatch.context() as m:
        m.setattr(sampling, "truncated_probs", boom)
        m.setattr(sampling, "sample_from_probs", boom)
        sample(logits, sb)
    # ... a batch with truncated rows draws by Gumbel-max too (no CDF) ...
    with monkeypatch.context() as m:
        m.setattr(sampling, "sample_from_probs", boom)
        sample(logits, sbt)
        sample(logits[:1], make_sampling_batch(truncated[:1], vocab_size=vocab))
    # ... and gumbel=False takes no Gumbel pass.
    with monkeypatch.context() as m:
        m.setattr(sampling, "_gumbel_pass", boom)
        m.setattr(sampling, "_truncated_gumbel", boom)
        sample(logits, sbt, gumbel=False)
        sample(logits, make_sampling_batch(plain, vocab_size=vocab), gumbel=False)


def test_half_precision_logits_sample_as_their_fp32_values():
    logits = (torch.randn(4, 64, generator=torch.Generator().manual_seed(10)) * 3).bfloat16()
    rows = [SamplingRow(temperature=0.6, seed=1), SamplingRow(temperature=0.0),
            SamplingRow(temperature=1.0, top_p=0.9, seed=2),
            SamplingRow(temperature=0.8, seed=3, logprobs=2)]
    sb = make_sampling_batch(rows, vocab_size=64)
    half, full = sample(logits, sb), sample(logits.float(), sb)
    assert half.token_ids.tolist() == full.token_ids.tolist()
    torch.testing.assert_close(half.top_logprobs, full.top_logprobs)
