"""Random paged-attention problems: shared by the kernel tests, the GPU check and the benchmark.

A problem is a batch of sequences, each with `cached` tokens already in a paged cache and `q_len`
new ones, their blocks scattered at random through the cache, block tables padded with -1. Slots
outside every sequence's context hold NaN ("poison"): a kernel that reads past a context, or a
table entry it should not follow, turns its output into NaN.
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
import torch.utils._pytree as pytree

from ..state.batch import Batch, SeqChunk, make_batch


@attrs.frozen
class Problem:
    q: torch.Tensor        # [T, heads, d]
    k: torch.Tensor        # [T, kv_heads, d]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page, kv_heads, d], NaN outside every context
    v_cache: torch.Tensor
    batch: Batch
    poison: torch.Tensor   # [num_blocks, page] bool, the NaN slots
    scale: float

    def clean_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The caches with poison zeroed: what the reference (which multiplies masked rows by
        zero, and 0 * NaN = NaN) reads."""
        return tuple(c.float().nan_to_num(0.0).to(c.dtype) for c in (self.k_cache, self.v_cache))


def make_problem(q_lens: Sequence[int], cached: Sequence[int], *, page: int, kv_heads: int,
                 group: int, head_dim: int, dtype=torch.float32, device="cpu", seed: int = 0,
                 skip: Sequence[int] = (), extra_blocks: int = 2, table_pad: int = 1,
                 poison: bool = True, cache_dtype=None) -> Problem:
    """`skip`: token rows whose slot_mapping is -1 (not written). The cache holds
    sum(ceil(ctx / page)) + extra_blocks blocks; tables get `table_pad` extra -1 columns.
    cache_dtype: the cache's (default dtype; fp8 for an fp8 cache)."""
    g = torch.Generator().manual_seed(seed)
    ctx = [c + n for c, n in zip(cached, q_lens)]
    need = [-(-c // page) for c in ctx]
    num_blocks = sum(need) + extra_blocks
    order = torch.randperm(num_blocks, generator=g).tolist()
    chunks, at = [], 0
    for n, c, nb in zip(q_lens, cached, need):
        chunks.append(SeqChunk([0] * n, c, order[at:at + nb]))
        at += nb
    batch = make_batch(chunks, block_size=page, max_blocks=max(need) + table_pad)
    if skip:
        slots = batch.slot_mapping.clone()
        slots[list(skip)] = -1
        batch = attrs.evolve(batch, slot_mapping=slots)
    batch = pytree.tree_map(lambda t: t.to(device), batch)

    t, heads = sum(q_lens), kv_heads * group

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    k_cache = rand(num_blocks, page, kv_heads, head_dim)
    v_cache = rand(num_blocks, page, kv_heads, head_dim)
    used = torch.zeros(num_blocks * page, dtype=torch.bool)
    for chunk, c in zip(chunks, ctx):
        pos = torch.arange(c)
        used[torch.tensor(chunk.block_table, dtype=torch.long)[pos // page] * page + pos % page] = True
    bad = (~used).reshape(num_blocks, page).to(device) if poison else torch.zeros(
        num_blocks, page, dtype=torch.bool, device=device)
    k_cache[bad] = float("nan")
    v_cache[bad] = float("nan")
    if cache_dtype is not None:
        k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    return Problem(q=rand(t, heads, head_dim), k=rand(t, kv_heads, head_dim),
                   v=rand(t, kv_heads, head_dim), k_cache=k_cache, v_cache=v_cache, batch=batch,
                   poison=bad, scale=head_dim ** -0.5)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; NaN anywhere in out gives inf (never passes)."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
