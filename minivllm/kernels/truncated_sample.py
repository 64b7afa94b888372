"""The Gumbel-max draw of rows that top-k, top-p and min-p truncate, without writing their
truncated logits: each program tests its ids against a few numbers a row that say which ids
truncation keeps (functional.truncation.cut_bounds) and takes the arg-max of the kept ones.

For each row b the token is argmax over the kept ids v of
    logits[b, v] + T * g[b, v]   (T > 0; T = 0: the plain arg-max, nothing dropped)
the score and noise of kernels.sample_kernel, so a row that truncation leaves whole draws the
same token as there. Which ids are kept is decided on x = logits / T (T = 1 for greedy rows),
divided with IEEE rounding as torch divides, so that the comparisons below see the very values
functional.truncation.truncated_logits compares:
    x < lo                                   dropped (min-p's floor, top-k's k-th value)
and, in rows that top-p may cut (`cut`):
    x > kth and (x, v) after (last_val, last_id) in the order value down, id up
                                             dropped (the ids above the k-th value past the mass)
    x == kth and rank among those ids > n_tied  dropped (the tied ids past the mass, by id)
The rank of a tied id counts the tied ids up to it: within a program a running sum over its
blocks, plus the tied ids of the chunks before it, which count_ties writes first.

  logits: [B, V] fp32 / bf16 / fp16, unit stride along V; temperature [B] fp32; seeds / steps
  [B] int64; the bounds [B] each -> token ids [B] int64
Chunking as sample_kernel's: a chunk's (max, first id of it), then the row's first maximum, so the
tiling never changes a token. The chunk is a run-time argument here, not a compile-time one: one
compile serves every row count (runtime.warmup runs each variant once at start-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2
from .sample_kernel import (BLOCK, MAX_TEMPERATURE, NUM_WARPS, _check_fast_log, _counter_bits,
                            _counter_key, _final_argmax_kernel, _gumbel, chunk_size)


@triton.jit
def _scaled(logits_ptr, temp_ptr, row, v, mask, stride_row):
    """A block of the row's logits (fp32) and the same divided by its temperature (1 when 0)."""
    t = tl.load(temp_ptr + row)
    l = tl.load(logits_ptr + row.to(tl.int64) * stride_row + v, mask=mask,
                other=float("-inf")).to(tl.float32)
    return l, tl.math.div_rn(l, tl.where(t > 0, t, 1.0))


@triton.jit
def _tie_count_kernel(logits_ptr, temp_ptr, kth_ptr, count_ptr, V, stride_row, num_chunks, CHUNK,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    kth = tl.load(kth_ptr + row)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        v = off + offs
        mask = v < V
        _, x = _scaled(logits_ptr, temp_ptr, row, v, mask, stride_row)
        acc += ((x == kth) & (x > float("-inf")) & mask).to(tl.int32)  # kth -inf: none
    tl.store(count_ptr + row * num_chunks + chunk, tl.sum(acc, axis=0))


@triton.jit
def _cut_partial_argmax_kernel(logits_ptr, temp_ptr, seeds_ptr, steps_ptr, lo_ptr, kth_ptr,
                               cut_ptr, last_val_ptr, last_id_ptr, n_tied_ptr, ties_before_ptr,
                               val_ptr, idx_ptr, V, stride_row, num_chunks, CHUNK,
                               BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, TOP_P: tl.constexpr):
    """TOP_P: some row may be cut by top-p (cut_ptr ... ties_before_ptr are read)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.minimum(tl.load(temp_ptr + row), MAX_TEMPERATURE)
    key = _counter_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    lo = tl.load(lo_ptr + row)
    if TOP_P:
        kth = tl.load(kth_ptr + row)
        cut = tl.load(cut_ptr + row) != 0
        last_val = tl.load(last_val_ptr + row)
        last_id = tl.load(last_id_ptr + row)
        n_tied = tl.load(n_tied_ptr + row)
        ties = tl.load(ties_before_ptr + row * num_chunks + chunk)
    start = chunk * CHUNK
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = start + offs
    for off in range(start, start + CHUNK, BLOCK):
        v = off + offs
        mask = v < V
        l, x = _scaled(logits_ptr, temp_ptr, row, v, mask, stride_row)
        drop = x < lo
        if TOP_P:
            tied = (x == kth) & (x > float("-inf")) & mask  # kth -inf: none
            rank = ties + tl.cumsum(tied.to(tl.int32), axis=0)  # 1 + rank among the tied, by id
            ties += tl.sum(tied.to(tl.int32), axis=0)
            past = (x < last_val) | ((x == last_val) & (v > last_id))
            drop = drop | (cut & (((x > kth) & past) | (tied & (rank.to(tl.float32) > n_tied))))
        g = _gumbel(_counter_bits(key, v), FAST_LOG)
        s = tl.where(t > 0, l + t * g, l)
        s = tl.where(drop, float("-inf"), s)
        better = s > best
        best = tl.where(better, s, best)
        best_id = tl.where(better, v, best_id)
    m = tl.max(best, axis=0)
    first = tl.min(tl.where(best == m, best_id, 2147483647), axis=0)
    tl.store(val_ptr + row * num_chunks + chunk, m)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


def count_ties(logits: torch.Tensor, temperature: torch.Tensor, kth: torch.Tensor, *,
               block: int = BLOCK, chunk: int | None = None) -> torch.Tensor:
    """[B, n] int32: per chunk of `chunk` ids (the tiling cut_gumbel_argmax uses for the same
    arguments), how many ids have logits / T == kth (kth [B] fp32, -inf: none)."""
    b, v = logits.shape
    chunk = chunk or chunk_size(b, v, logits.device, block)
    n = triton.cdiv(v, chunk)
    counts = torch.empty(b, n, dtype=torch.int32, device=logits.device)
    _tie_count_kernel[(b, n)](logits, temperature, kth, counts, v, logits.stride(0), n, chunk,
                              BLOCK=block, num_warps=NUM_WARPS)
    return counts


def cut_gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      steps: torch.Tensor, lo: torch.Tensor, top_p_cut=None, *,
                      block: int = BLOCK, chunk: int | None = None,
                      fast_log: bool | None = None) -> torch.Tensor:
    """logits [B, V], temperature [B] fp32, seeds / steps [B] int64, lo [B] fp32 (ids with
    logits / T < lo are dropped; -inf: none) -> ids [B] int64. top_p_cut: None (no row cut by
    top-p) or (kth, cut, last_val, last_id, n_tied, ties_before) as the module docstring says:
    [B] fp32, bool, fp32, int64, fp32 and [B, n] int32 (count_ties' counts of the chunks before
    each, for the same tiling)."""
    b, v = logits.shape
    assert v < 2**31, "ids are int32 inside the kernel"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = chunk or chunk_size(b, v, logits.device, block)
    assert chunk % block == 0, (chunk, block)
    fast_log = _check_fast_log(fast_log, logits.device)
    n = triton.cdiv(v, chunk)
    vals = torch.empty(b, n, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, n, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if top_p_cut is None:
        kth = cut = last_val = last_id = n_tied = ties_before = lo  # not read
    else:
        kth, cut, last_val, last_id, n_tied, ties_before = top_p_cut
        cut = cut.to(torch.int8)
        assert ties_before.shape == (b, n), (ties_before.shape, (b, n))
    _cut_partial_argmax_kernel[(b, n)](
        logits, temperature, seeds, steps, lo, kth, cut, last_val, last_id, n_tied, ties_before,
        vals, ids, v, logits.stride(0), n, chunk, BLOCK=block, FAST_LOG=fast_log,
        TOP_P=top_p_cut is not None, num_warps=NUM_WARPS)
    _final_argmax_kernel[(b,)](vals, ids, out, n, BLOCK_S=next_pow2(n), num_warps=1)
    return out
