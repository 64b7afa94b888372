"""kernels.top_candidates against torch.topk: the same values, bit for bit, and ids that hold them,
every id above the k-th value among them, ties at the k-th value taken lowest id first; rows full
of ties and -inf, chunks small enough that a row spans many, and the last chunk partial."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.kernels.top_candidates import MAX_K, top_candidates


def _expected_ids(row: torch.Tensor, k: int) -> list[int]:
    """The k ids of the largest values, ties by id: a stable sort of the values, descending."""
    return torch.sort(row.float(), descending=True, stable=True).indices[:k].tolist()


@st.composite
def rows(draw):
    b = draw(st.integers(1, 4))
    v = draw(st.integers(2, 300))
    grid = draw(st.sampled_from([0.25, 1.0, 0.0]))  # 0: every value equal
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    logits = torch.randint(-8, 8, (b, v), generator=gen).float() * grid
    if draw(st.booleans()):  # a masked row: -inf in most places, perhaps more than V - k
        logits[torch.rand(b, v, generator=gen) < draw(st.sampled_from([0.5, 0.95]))] = -float("inf")
    logits[0, draw(st.integers(0, v - 1))] = -0.0
    return logits, draw(st.integers(1, min(v, MAX_K)))


@settings(max_examples=40)
@given(rows(), st.sampled_from([16, 64, 4096]),
       st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_values_equal_torch_topks_and_ids_are_the_lowest_among_ties(device, batch, chunk, dtype):
    logits, k = batch
    logits = logits.to(dtype).to(device)
    vals, ids = top_candidates(logits, k, kernel=True, chunk=chunk)
    want_vals, _ = logits.float().topk(k, dim=-1)
    assert torch.equal(vals, want_vals)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert ids.shape == (len(logits), k)
    for row, row_ids in zip(logits.cpu(), ids.cpu()):
        assert row_ids.tolist() == _expected_ids(row, k)


def test_rows_of_many_chunks_of_random_logits(device):
    """Random logits (few ties): the ids torch.topk gives, in its order. Qwen3's vocabulary at
    the kernel's chunk on the GPU; on CPU a shorter row in smaller chunks (the interpreter
    takes ~1 s a chunk)."""
    vocab, chunk = (151936, None) if device.type == "cuda" else (3000, 1024)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, vocab, generator=gen) * 4).to(device)
    for k in (1, 20, MAX_K):
        vals, ids = top_candidates(logits, k, kernel=True, chunk=chunk)
        want_vals, want_ids = logits.topk(k, dim=-1)
        assert torch.equal(vals, want_vals) and torch.equal(ids, want_ids)


def test_k_above_the_kernels_bound_is_torch_topk(device):
    logits = torch.randn(2, 500).to(device)
    vals, ids = top_candidates(logits, MAX_K + 1, kernel=True)
    want_vals, want_ids = logits.topk(MAX_K + 1, dim=-1)
    assert torch.equal(vals, want_vals) and torch.equal(ids, want_ids)


@pytest.mark.parametrize("k", [0, 11])
def test_k_outside_the_row_is_refused(k):
    with pytest.raises(ValueError, match="k must be in"):
        top_candidates(torch.zeros(2, 10), k)
