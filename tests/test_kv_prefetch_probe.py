"""benchmarks/kv_prefetch.py asks the L2 for the right bytes (BENCHMARKS.md session 44's kvpf
figures come from it): each sequence's first pages of K and of V, none past its cached prefix and
none for sequences past the ones asked for. The kernel records its requests instead of issuing
them (the prefetch is PTX, which the interpreter cannot run)."""

import random

import pytest
import torch
import triton

from benchmarks.kv_prefetch import THREADS, prefetch_first_pages
from minivllm.kernels.launch import triton_usable


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.mark.parametrize("pages", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("seqs", [1, 3, 40])
def test_requests_are_each_sequences_first_pages(device, pages, seqs):
    rng = random.Random(pages * 100 + seqs)
    page, kv_heads, head_dim, num_blocks, batch = 16, 2, 8, 64, 7
    lens = [rng.randint(1, 300) for _ in range(batch)]  # the new token included
    width = max(-(-n // page) for n in lens) + 1
    tables = torch.tensor([rng.sample(range(num_blocks), width) for _ in range(batch)],
                          dtype=torch.int32, device=device)
    k = torch.zeros(num_blocks, page, kv_heads, head_dim, dtype=torch.float16, device=device)
    asked = min(seqs, batch)
    record = torch.full((triton.cdiv(asked, THREADS // (2 * pages)) * THREADS, 3), -1,
                        dtype=torch.int64, device=device)
    prefetch_first_pages(k, torch.zeros_like(k), tables, torch.tensor(lens, dtype=torch.int32,
                         device=device), seqs, pages, record=record)
    page_bytes = page * kv_heads * head_dim * 2
    got = sorted(tuple(r) for r in record.tolist() if r[2] > 0)
    want = sorted((cache, int(tables[s, j]) * page_bytes, page_bytes)
                  for s in range(asked) for j in range(pages) if j * page < lens[s] - 1
                  for cache in (0, 1))
    assert got == want
    assert all(r[2] >= 0 for r in record.tolist())  # every thread recorded: a size, or 0 when idle
