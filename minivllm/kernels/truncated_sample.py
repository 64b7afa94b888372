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
blocks, plus the tied ids of the chunks before it, counted by a first pass.

The numbers come from each row's top-k candidates (candidate_bounds: a ties-counting pass over
the row, then one program a row doing truncation._kth's and _top_p_bounds' arithmetic).
They are those numbers in exact arithmetic; the kernel sums the candidates' mass in another
order than torch, so a row whose top-p boundary falls within rounding of a candidate's mass
may keep one id more or less than truncated_logits would (as truncated_logits' own sort and
candidate paths may differ there).

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

from ..functional.sampling_batch import MAX_TOP_K_BOUND
from .launch import next_pow2, runs_ptx
from .sample_kernel import (BLOCK, MAX_TEMPERATURE, NUM_WARPS, _check_fast_log, _counter_bits,
                            _counter_key, _final_argmax_kernel, _gumbel, _keep_better,
                            _store_chunk_best, chunk_size)
from .top_candidates import key_ids, value_id_keys

# Candidates a row the bounds kernel sorts on a GPU: one compile for every top-k up to the bound
# (a 1,024-key sort is a few microseconds a row). The interpreter sorts the next power of two of
# the candidates (its sort of 1,024 took seconds).
MAX_CANDIDATES = MAX_TOP_K_BOUND


@triton.jit
def _divisor(temp_ptr, row):
    """What the row's logits are divided by: its temperature, 1 when 0 (greedy)."""
    t = tl.load(temp_ptr + row)
    return tl.where(t > 0, t, 1.0)


@triton.jit
def _scaled(logits_ptr, divisor, row, v, mask, stride_row):
    """A block of the row's logits (fp32) and the same divided by `divisor` (_divisor's)."""
    l = tl.load(logits_ptr + row.to(tl.int64) * stride_row + v, mask=mask,
                other=float("-inf")).to(tl.float32)
    return l, tl.math.div_rn(l, divisor)


@triton.jit
def _candidate_floor_kth(vals_ptr, t, top_k_ptr, log_min_p_ptr, row, K, MIN_P: tl.constexpr):
    """A row's min-p floor and k-th largest value (-inf: none) on x = logits / t (t: _divisor's),
    from its K candidates (their values, largest first): truncation.cut_bounds' arithmetic."""
    base = vals_ptr + row.to(tl.int64) * K
    k = tl.load(top_k_ptr + row)
    kth = tl.math.div_rn(tl.load(base + tl.minimum(k, K) - 1).to(tl.float32), t)
    floor = float("-inf")
    if MIN_P:
        floor = tl.math.div_rn(tl.load(base).to(tl.float32), t) + tl.load(log_min_p_ptr + row)
        kth = tl.where(kth < floor, float("-inf"), kth)
    return floor, tl.where(k <= K, kth, float("-inf"))


@triton.jit
def _tie_count_kernel(logits_ptr, temp_ptr, vals_ptr, top_k_ptr, log_min_p_ptr, count_ptr, V,
                      stride_row, num_chunks, CHUNK, K, BLOCK: tl.constexpr,
                      MIN_P: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    divisor = _divisor(temp_ptr, row)
    # [1]: a name for the floor, unused, would be a loop-carried variable of the loop below
    kth = _candidate_floor_kth(vals_ptr, divisor, top_k_ptr, log_min_p_ptr, row, K, MIN_P)[1]
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        v = off + offs
        mask = v < V
        _, x = _scaled(logits_ptr, divisor, row, v, mask, stride_row)
        acc += ((x == kth) & (x > float("-inf")) & mask).to(tl.int32)  # kth -inf: none
    tl.store(count_ptr + row * num_chunks + chunk, tl.sum(acc, axis=0))


@triton.jit
def _bounds_kernel(vals_ptr, ids_ptr, temp_ptr, top_k_ptr, top_p_ptr, log_min_p_ptr, rows_ptr,
                   count_ptr, lo_ptr, kth_ptr, cut_ptr, last_val_ptr, last_id_ptr, n_tied_ptr,
                   ties_before_ptr, K, num_chunks, BLOCK_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, MIN_P: tl.constexpr, TOP_P: tl.constexpr):
    """One program a row: truncation._kth and _top_p_bounds on its K candidates."""
    row = tl.program_id(0)
    divisor = _divisor(temp_ptr, row)
    floor, kth = _candidate_floor_kth(vals_ptr, divisor, top_k_ptr, log_min_p_ptr, row, K, MIN_P)
    truncated = tl.load(rows_ptr + row) != 0
    tl.store(lo_ptr + row, tl.where(truncated, tl.maximum(floor, kth), float("-inf")))
    if TOP_P:
        offs = tl.arange(0, BLOCK_K)
        in_k = offs < K
        x = tl.math.div_rn(tl.load(vals_ptr + row.to(tl.int64) * K + offs, mask=in_k,
                                   other=float("-inf")).to(tl.float32), divisor)
        if MIN_P:
            x = tl.where(x < floor, float("-inf"), x)
        ids = tl.load(ids_ptr + row.to(tl.int64) * K + offs, mask=in_k, other=0)
        # The candidates by value down, id up (top_candidates' keys; padding lanes last).
        ids = key_ids(tl.sort(value_id_keys(x, ids, in_k), descending=True))
        x = tl.sort(x, descending=True)
        # The ties' count: the whole row's, and that of the chunks before each.
        n_offs = tl.arange(0, BLOCK_N)
        counts = tl.load(count_ptr + row * num_chunks + n_offs, mask=n_offs < num_chunks, other=0)
        tl.store(ties_before_ptr + row * num_chunks + n_offs, tl.cumsum(counts, axis=0) - counts,
                 mask=n_offs < num_chunks)
        t = tl.sum(counts, axis=0).to(tl.float32)
        top_p = tl.load(top_p_ptr + row)
        cut = (tl.load(top_k_ptr + row) <= K) & (top_p < 1)
        top_p = tl.where(cut, top_p, float("inf"))
        top = tl.max(x, axis=0)
        in_g = x > kth
        w = tl.where(in_g, tl.exp(x - top), 0.0)
        w_tied = tl.where(t > 0, tl.exp(kth - top), 0.0)
        z = tl.sum(w, axis=0) + t * w_tied
        p = tl.math.div_rn(w, z)
        keep_g = in_g & (tl.cumsum(p, axis=0) - p < top_p)
        mass_g = tl.sum(p, axis=0)
        q = tl.math.div_rn(w_tied, z)
        n_tied = tl.where((mass_g < top_p) & (t > 0),
                          tl.minimum(tl.math.ceil(tl.math.div_rn(top_p - mass_g, q)), t), 0.0)
        last = tl.maximum(tl.sum(keep_g.to(tl.int32), axis=0) - 1, 0)
        at_last = offs == last
        any_g = tl.sum(keep_g.to(tl.int32), axis=0) > 0
        tl.store(kth_ptr + row, kth)
        tl.store(cut_ptr + row, (cut & truncated).to(tl.int8))
        tl.store(last_val_ptr + row,
                 tl.where(any_g, tl.max(tl.where(at_last, x, float("-inf")), axis=0), float("inf")))
        tl.store(last_id_ptr + row, tl.max(tl.where(at_last, ids, -1), axis=0))
        tl.store(n_tied_ptr + row, n_tied)


@triton.jit
def _cut_partial_argmax_kernel(logits_ptr, temp_ptr, seeds_ptr, steps_ptr, lo_ptr, kth_ptr,
                               cut_ptr, last_val_ptr, last_id_ptr, n_tied_ptr, ties_before_ptr,
                               val_ptr, idx_ptr, V, stride_row, num_chunks, CHUNK,
                               BLOCK: tl.constexpr, FAST_LOG: tl.constexpr, TOP_P: tl.constexpr):
    """TOP_P: some row may be cut by top-p (cut_ptr ... ties_before_ptr are read)."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.minimum(tl.load(temp_ptr + row), MAX_TEMPERATURE)
    divisor = _divisor(temp_ptr, row)
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
        l, x = _scaled(logits_ptr, divisor, row, v, mask, stride_row)
        drop = x < lo
        if TOP_P:
            tied = (x == kth) & (x > float("-inf")) & mask  # kth -inf: none
            rank = ties + tl.cumsum(tied.to(tl.int32), axis=0)  # 1 + rank among the tied, by id
            ties += tl.sum(tied.to(tl.int32), axis=0)
            past = (x < last_val) | ((x == last_val) & (v > last_id))
            drop = drop | (cut & (((x > kth) & past) | (tied & (rank.to(tl.float32) > n_tied))))
        g = _gumbel(_counter_bits(key, v), FAST_LOG)
        s = tl.where(t > 0, l + t * g, l)
        best, best_id = _keep_better(tl.where(drop, float("-inf"), s), v, best, best_id)
    _store_chunk_best(best, best_id, val_ptr, idx_ptr, row * num_chunks + chunk)


def candidate_bounds(logits: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor,
                     temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     log_min_p: torch.Tensor | None, rows: torch.Tensor, *, top_p_cut: bool,
                     block: int = BLOCK, chunk: int | None = None):
    """truncation.cut_bounds for a batch that truncates on candidates, as two kernels (three
    launches in all where torch took ~40 small ones): logits [B, V]; vals / ids [B, K] its top-k
    (vals in any float dtype: kernels.top_candidates'); temperature, top_k, top_p [B];
    log_min_p [B] fp32 (torch.log(min_p), the very floor truncated_logits adds) or None without
    min-p; rows [B] bool, the rows that truncate.
    -> (lo, top_p_cut) for cut_gumbel_argmax with the same tiling."""
    b, v = logits.shape
    k = vals.shape[1]
    assert k <= MAX_CANDIDATES, k
    chunk = chunk or chunk_size(b, v, logits.device, block)
    n = triton.cdiv(v, chunk)
    min_p = log_min_p is not None
    log_min_p = log_min_p if min_p else temperature  # not read
    dev, f32 = logits.device, torch.float32
    lo, kth, last_val, n_tied = (torch.empty(b, dtype=f32, device=dev) for _ in range(4))
    cut = torch.empty(b, dtype=torch.int8, device=dev)
    last_id = torch.empty(b, dtype=torch.int64, device=dev)
    counts = ties_before = torch.empty(b, n, dtype=torch.int32, device=dev)
    if top_p_cut:
        ties_before = torch.empty(b, n, dtype=torch.int32, device=dev)
        _tie_count_kernel[(b, n)](logits, temperature, vals, top_k, log_min_p, counts, v,
                                  logits.stride(0), n, chunk, k, BLOCK=block, MIN_P=min_p,
                                  num_warps=NUM_WARPS)
    _bounds_kernel[(b,)](vals, ids, temperature, top_k, top_p, log_min_p, rows.to(torch.int8),
                         counts, lo, kth, cut, last_val, last_id, n_tied, ties_before, k, n,
                         BLOCK_K=MAX_CANDIDATES if runs_ptx(dev) else next_pow2(k),
                         BLOCK_N=next_pow2(triton.cdiv(v, block)),
                         MIN_P=min_p, TOP_P=top_p_cut, num_warps=4)
    return lo, ((kth, cut, last_val, last_id, n_tied, ties_before) if top_p_cut else None)


def cut_gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      steps: torch.Tensor, lo: torch.Tensor, top_p_cut=None, *,
                      block: int = BLOCK, chunk: int | None = None,
                      fast_log: bool | None = None) -> torch.Tensor:
    """logits [B, V], temperature [B] fp32, seeds / steps [B] int64, lo [B] fp32 (ids with
    logits / T < lo are dropped; -inf: none) -> ids [B] int64. top_p_cut: None (no row cut by
    top-p) or (kth, cut, last_val, last_id, n_tied, ties_before) as the module docstring says:
    [B] fp32, int8 / bool, fp32, int64, fp32 and [B, n] int32 (the ids tied at kth in the chunks
    before each, for the same tiling): candidate_bounds'."""
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
        cut = cut.to(torch.int8)  # a no-op on candidate_bounds' own
        assert ties_before.shape == (b, n), (ties_before.shape, (b, n))
    _cut_partial_argmax_kernel[(b, n)](
        logits, temperature, seeds, steps, lo, kth, cut, last_val, last_id, n_tied, ties_before,
        vals, ids, v, logits.stride(0), n, chunk, BLOCK=block, FAST_LOG=fast_log,
        TOP_P=top_p_cut is not None, num_warps=NUM_WARPS)
    _final_argmax_kernel[(b,)](vals, ids, out, n, BLOCK_S=next_pow2(n), num_warps=1)
    return out
