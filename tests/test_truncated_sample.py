"""The truncated rows' draw kernel (kernels.truncated_sample) against the Gumbel kernel over the
truncated logits written out (functional.truncation.truncated_logits, its dropped ids set to
-inf in the logits): the same token in every row, bit for bit (the same score and noise), on
logits full of ties at the k-th value and -inf entries, with tilings that split a row's tied
ids over many chunks. On CPU under Triton's interpreter (tests/conftest.py)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.functional.sampling import (SamplingRow, _truncated_gumbel, cut_bounds,
                                          make_sampling_batch, sample, truncated_logits,
                                          truncated_rows)
from minivllm.kernels.sample_kernel import gumbel_argmax
from minivllm.kernels.truncated_sample import cut_gumbel_argmax

VOCAB = 300
TILINGS = [(16, 32), (64, 64), (32, 128), (1024, None)]


def _reference(logits: torch.Tensor, sb, tiling) -> torch.Tensor:
    """The plain Gumbel kernel over the logits with truncation's dropped ids at -inf."""
    rows = truncated_rows(sb, logits.shape[-1])
    dropped = rows[:, None] & (truncated_logits(logits.float(), sb) == float("-inf"))
    block, chunk = tiling
    return gumbel_argmax(logits.float().masked_fill(dropped, float("-inf")), sb.temperature,
                         sb.seeds, sb.steps, block=block, chunk=chunk)


def _kernel(logits: torch.Tensor, sb, tiling) -> torch.Tensor:
    block, chunk = tiling
    rows = truncated_rows(sb, logits.shape[-1])
    lo, top_p_cut = cut_bounds(logits, sb, rows, block=block, chunk=chunk)
    return cut_gumbel_argmax(logits, sb.temperature, sb.seeds, sb.steps, lo, top_p_cut,
                             block=block, chunk=chunk)


@st.composite
def batches(draw):
    """A batch of rows on a coarse grid of logits (many ties, some -inf), each row greedy,
    plain or truncated, its top-k below the bound where it has top-p (the kernel's batches)."""
    b = draw(st.integers(1, 5))
    rows, logits = [], []
    for i in range(b):
        grid = draw(st.sampled_from([0.25, 0.5, 1.0]))
        vals = draw(st.lists(st.integers(-6, 3), min_size=8, max_size=8))
        row = torch.tensor(vals, dtype=torch.float32).repeat(VOCAB // 8 + 1)[:VOCAB] * grid
        gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        perm = torch.randperm(VOCAB, generator=gen)
        row = row[perm]
        if draw(st.booleans()):
            row[perm[: draw(st.integers(1, VOCAB - 2))]] = float("-inf")
        logits.append(row)
        kind = draw(st.sampled_from(["greedy", "plain", "top_k", "top_p", "min_p", "all"]))
        temperature = draw(st.sampled_from([0.3, 0.7, 1.0, 1.9]))
        kw = dict(temperature=0.0 if kind == "greedy" else temperature,
                  seed=draw(st.integers(0, 2**40)))
        if kind in ("top_k", "top_p", "all"):
            kw["top_k"] = draw(st.integers(1, 40))
        if kind in ("top_p", "all"):
            kw["top_p"] = draw(st.sampled_from([0.05, 0.3, 0.6, 0.9, 0.99]))
        if kind in ("min_p", "all"):
            kw["min_p"] = draw(st.sampled_from([0.01, 0.1, 0.5]))
        rows.append(SamplingRow(**kw))
    return torch.stack(logits), rows


@settings(max_examples=40)
@given(batches(), st.sampled_from(TILINGS), st.sampled_from([torch.float32, torch.float16]))
def test_kernel_draws_the_token_of_the_gumbel_kernel_over_truncated_logits(device, batch, tiling,
                                                                          dtype):
    logits, rows = batch
    logits = logits.to(dtype).to(device)
    sb = make_sampling_batch(rows, vocab_size=VOCAB, device=device)
    if (sb.do_top_k or sb.do_top_p) and not sb.top_k_bound:
        return  # a sort's batch: not the kernel's (none here: every top-p row has a top-k)
    assert _kernel(logits, sb, tiling).tolist() == _reference(logits, sb, tiling).tolist()


def test_the_draw_over_the_top_candidates_kernels_candidates(device, monkeypatch):
    """cut_bounds with kernels.top_candidates' Triton passes for the candidates (off by default
    until timed on a GPU): the bounds torch.topk's candidates give, and the reference's tokens,
    on rows whose k-th value is tied and whose top-p cuts within ids tied above it."""
    from minivllm.kernels import top_candidates as module

    by_torch = module.top_candidates
    by_kernels = functools.partial(by_torch, kernel=True, chunk=64)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randint(-4, 4, (6, VOCAB), generator=gen).float() * 0.5
    logits[:, [7, 50, 120, 200, 260]] = 4.0  # above the k-th value, tied where top-p cuts:
    logits[:, [9, 99, 150]] = 3.5  # the last kept id decides
    logits = logits.to(device)
    rows = [SamplingRow(temperature=0.6, top_k=20, top_p=0.95, seed=1),
            SamplingRow(temperature=1.0, top_k=5, seed=2), SamplingRow(temperature=0.0),
            SamplingRow(temperature=1.3, top_k=40, top_p=0.3, min_p=0.1, seed=3),
            SamplingRow(temperature=0.9, top_k=1, top_p=0.5, seed=4),
            SamplingRow(temperature=0.7, min_p=0.2, seed=5)]
    sb = make_sampling_batch(rows, vocab_size=VOCAB, device=device)
    bounds = []
    for candidates in (by_torch, by_kernels):
        monkeypatch.setattr(module, "top_candidates", candidates)
        lo, cut = cut_bounds(logits, sb, truncated_rows(sb, VOCAB), block=16, chunk=32)
        bounds.append([lo, *cut])
    cut = bounds[0][2].bool()
    assert cut.tolist() == [True, False, False, True, True, False]  # the rows with top-p
    for field, (by_topk, by_kernel) in enumerate(zip(*bounds)):
        if field in (1, 3, 4, 5):  # kth, last_val, last_id, n_tied: read in the rows cut only
            by_topk, by_kernel = by_topk[cut], by_kernel[cut]
        assert torch.equal(by_topk, by_kernel), field
    for tiling in ((16, 32), (1024, None)):
        assert _kernel(logits, sb, tiling).tolist() == _reference(logits, sb, tiling).tolist()


def test_tied_ids_past_top_ps_mass_go_in_id_order_across_chunks(device):
    """One id above 60 ids tied at the k-th value, spread over every chunk: top-p keeps the
    top id and as many tied ids, lowest first, as its mass needs. With each tied id far more
    likely than the others, the draw names the kept tied ids only, and over many seeds each."""
    vocab, tied = 256, torch.arange(3, 256, 4)[:60]
    row = torch.full((vocab,), -30.0)
    row[tied] = 0.0
    row[100] = 1.0
    row = row.to(device)
    n = 120
    rows = [SamplingRow(temperature=1.0, top_k=2, top_p=0.2, seed=s) for s in range(n)]
    sb = make_sampling_batch(rows, vocab_size=vocab, device=device)
    lo, cut = cut_bounds(row.expand(n, -1), sb, truncated_rows(sb, vocab), block=16, chunk=32)
    # mass: top e / (e + 60), each tied 1 / (e + 60); kept: those with mass before < 0.2
    e = torch.tensor(1.0).exp().item()
    keep = int(torch.tensor((0.2 - e / (e + 60)) * (e + 60)).ceil())
    assert cut[4][0].item() == keep and keep > 1
    ids = cut_gumbel_argmax(row.expand(n, -1).contiguous(), sb.temperature, sb.seeds, sb.steps,
                            lo, cut, block=16, chunk=32)
    assert set(ids.tolist()) == {100, *tied[:keep].tolist()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_on_the_kernel_path_equals_the_reference_path_token_for_token(device, dtype):
    """sample() with the kernel (the GPU's default) against sample() with the torch reference:
    Qwen3's top-k 20 / top-p 0.95 rows, min-p and plain rows, greedy ones and a penalised one.
    On the GPU in bf16, under the interpreter in fp32 (its bf16 arithmetic is wrong); the two
    differ only where the noise's logs round apart by an ulp between two candidates."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the interpreter's bf16")
    vocab = 151936 if device.type == "cuda" else 3000
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(24, vocab, generator=gen) * 3).to(dtype).to(device)
    rows = [[SamplingRow(temperature=0.6, top_k=20, top_p=0.95, seed=i),
             SamplingRow(temperature=0.0),
             SamplingRow(temperature=1.0, min_p=0.05, seed=i),
             SamplingRow(temperature=0.7, top_k=5, seed=i),
             SamplingRow(temperature=0.9, seed=i),
             SamplingRow(temperature=0.8, top_k=7, top_p=0.5, presence_penalty=1.0,
                         output_ids=(1, 2, 3), seed=i)][i % 6] for i in range(24)]
    sb = make_sampling_batch(rows, vocab_size=vocab, device=device)
    assert sb.top_k_bound == 20
    got = sample(logits, sb, kernel=True).token_ids
    want = sample(logits, sb, kernel=False).token_ids
    assert (got == want).float().mean().item() >= 23 / 24, (got, want)
    kept = torch.stack([truncated_logits(logits[i:i + 1].float(), make_sampling_batch(
        [r], vocab_size=vocab, device=device))[0] for i, r in enumerate(rows)])
    assert (kept.gather(1, got[:, None]) > float("-inf")).all()
