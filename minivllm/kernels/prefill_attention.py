"""Varlen causal prefill attention over a paged cache: one kernel for prefix-cache hits, chunked
prefill and fresh prompts (and mixed batches: a decode row is a chunk of length one).

Sequence b brings q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens at positions
prefix_b .. context_lens[b] - 1, where prefix_b = context_lens[b] - q_len_b tokens are read from
the cache through block_tables; the new tokens' keys and values are read from k/v (packed, like q),
so the result matches the reference even for rows whose cache write was skipped (slot -1). With
an fp8 cache, a new token's earlier new tokens are read from the cache too (written before the
kernel, so fp8-rounded), and only its own from k/v, as a decode step reads them: a chunk then
gives what one token a step would (functional.attention.reference_attention does the same).

  q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim], out: [T, heads, head_dim]
  k_cache/v_cache: [num_blocks, PAGE, kv_heads, head_dim], block_tables: [B, M] int32

GQA-aware: with packing, a program covers all query heads of one KV head (tile rows are
(token, head) pairs), so each K/V tile is loaded once per group instead of once per head.

The grid is (T // TOK + B, heads // PACK) for TOK tokens per tile: sequence b's tiles start at
program cu_seqlens_q[b] // TOK + b, an upper-bound layout that needs no host-side tile count; a
program finds its sequence by binary search and programs past a sequence's last tile exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..state.config import FP8_DTYPES
from .launch import dot_block, dot_precision, runs_ptx
from .paged import load_rows, page_rows

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(acc, l_i, m_i, q, kt, vt, valid, scale_log2, MASKED: tl.constexpr,
                         PRECISION: tl.constexpr):
    """Fold one key tile into the running (acc, l, m) of a query tile; m is in scaled log2 units,
    valid: [BLOCK_M, BLOCK_N] (ignored unless MASKED). Rows that see no key yet keep m = -inf
    without producing NaN. The scale is applied inside exp2's argument (one FMA per score, not a
    multiply and a subtract), and P @ V accumulates into the rescaled acc in the MMA itself."""
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION)
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s * scale_log2 - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, cu_ptr, ctx_ptr, out_ptr,
                    scale_log2, num_seqs,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, PACK: tl.constexpr, PRECISION: tl.constexpr,
                    CHUNK_FROM_CACHE: tl.constexpr):
    """Program (pid, hp): PACK query heads hp * PACK ... of one KV head over TOK = BLOCK_M // PACK
    tokens; tile row r is token r // PACK, head r % PACK, so each K/V tile serves PACK heads."""
    scale_log2 = tl.cast(scale_log2, tl.float32)  # fp64 under torch.compile; the softmax state is fp32
    pid = tl.program_id(0)
    head0 = tl.program_id(1) * PACK
    kvh = head0 // GROUP
    TOK: tl.constexpr = BLOCK_M // PACK
    ROW: tl.constexpr = KV_HEADS * HEAD_DIM
    dt = q_ptr.dtype.element_ty  # the compute dtype; an fp8 cache is widened to it as loaded

    # The last sequence whose first tile index cu[b] // TOK + b is <= pid.
    lo = pid * 0  # int32 tensors from the start: loop-carried types must not change
    hi = pid * 0 + num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(cu_ptr + mid) // TOK + mid <= pid
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    b = lo
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    m0 = (pid - (q_start // TOK + b)) * TOK  # first token of this tile
    if m0 >= q_len:
        return
    prefix = tl.load(ctx_ptr + b) - q_len

    offs_r = tl.arange(0, BLOCK_M)
    tok = m0 + offs_r // PACK  # [BLOCK_M] token of each row
    head = head0 + offs_r % PACK
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = tok < q_len
    mask_d = offs_d < HEAD_DIM
    D_MASKED: tl.constexpr = BLOCK_D != HEAD_DIM
    rows_q = (q_start + tok).to(tl.int64)
    q = load_rows(q_ptr + rows_q[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                  mask_m, mask_d, True, D_MASKED).to(dt)

    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    head_off = kvh * HEAD_DIM
    prefix_full = (prefix // BLOCK_N) * BLOCK_N
    if CHUNK_FROM_CACHE:
        # An fp8 cache: each query's own token as computed, folded in first (its K/V then need
        # no registers past this), and every earlier token from the cache, this step's too.
        own_k = load_rows(k_ptr + rows_q[:, None] * stride_kt + kvh * stride_kh + offs_d[None, :],
                          mask_m, mask_d, True, D_MASKED).to(dt)
        m_i = tl.sum(q.to(tl.float32) * own_k.to(tl.float32), axis=1) * scale_log2
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        acc = load_rows(v_ptr + rows_q[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask_m, mask_d, True, D_MASKED).to(dt).to(tl.float32)
        # Cache tiles wholly before the tile's first own position need no mask.
        cached_full = ((prefix + m0) // BLOCK_N) * BLOCK_N
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        cached_full = prefix_full

    # 1. The cached prefix: every query sees all of it; only the last tile needs a bound.
    for n0 in range(0, cached_full, BLOCK_N):
        rows = page_rows(bt_row, n0, offs_n, offs_n < BLOCK_N, PAGE, BLOCK_N, ROW) + head_off
        kt = load_rows(k_cache_ptr + rows[:, None] + offs_d[None, :], offs_n, mask_d, False, D_MASKED)
        vt = load_rows(v_cache_ptr + rows[:, None] + offs_d[None, :], offs_n, mask_d, False, D_MASKED)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kt.to(dt), vt.to(dt), mask_m[:, None],
                                             scale_log2, False, PRECISION)
    if CHUNK_FROM_CACHE:
        # The rest before each row's own position, masked by it.
        end = prefix + tl.minimum(q_len, m0 + TOK) - 1  # the last row's own position
        own_pos = prefix + tok
        for n0 in range(cached_full, end, BLOCK_N):
            pos = n0 + offs_n
            mask_n = pos < end
            rows = page_rows(bt_row, n0, offs_n, mask_n, PAGE, BLOCK_N, ROW) + head_off
            kt = load_rows(k_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, True,
                           D_MASKED)
            vt = load_rows(v_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, True,
                           D_MASKED)
            valid = pos[None, :] < own_pos[:, None]
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kt.to(dt), vt.to(dt), valid,
                                                 scale_log2, True, PRECISION)
    else:
        if prefix_full < prefix:
            mask_n = (prefix_full + offs_n) < prefix
            rows = page_rows(bt_row, prefix_full, offs_n, mask_n, PAGE, BLOCK_N, ROW) + head_off
            kt = load_rows(k_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, True,
                           D_MASKED)
            vt = load_rows(v_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, True,
                           D_MASKED)
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kt.to(dt), vt.to(dt),
                                                 mask_n[None, :], scale_log2, True, PRECISION)

        # 2. This step's tokens, causal. Key tiles that end at or before the tile's first token
        # need no mask.
        k_base = k_ptr + q_start.to(tl.int64) * stride_kt + kvh * stride_kh
        v_base = v_ptr + q_start.to(tl.int64) * stride_vt + kvh * stride_vh
        unmasked_end = (m0 // BLOCK_N) * BLOCK_N
        for n0 in range(0, unmasked_end, BLOCK_N):
            rows_k = (n0 + offs_n).to(tl.int64)
            kt = load_rows(k_base + rows_k[:, None] * stride_kt + offs_d[None, :], offs_n, mask_d,
                           False, D_MASKED)
            vt = load_rows(v_base + rows_k[:, None] * stride_vt + offs_d[None, :], offs_n, mask_d,
                           False, D_MASKED)
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kt.to(dt), vt.to(dt),
                                                 mask_m[:, None], scale_log2, False, PRECISION)
        end = tl.minimum(q_len, m0 + TOK)
        for n0 in range(unmasked_end, end, BLOCK_N):
            cols = n0 + offs_n
            mask_n = cols < q_len
            rows_k = cols.to(tl.int64)
            kt = load_rows(k_base + rows_k[:, None] * stride_kt + offs_d[None, :], mask_n, mask_d,
                           True, D_MASKED)
            vt = load_rows(v_base + rows_k[:, None] * stride_vt + offs_d[None, :], mask_n, mask_d,
                           True, D_MASKED)
            valid = (cols[None, :] <= tok[:, None]) & mask_n[None, :]
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, q, kt.to(dt), vt.to(dt), valid,
                                                 scale_log2, True, PRECISION)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows_q[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def prefill_config(device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    if not runs_ptx(device):
        return dict(block_m=16, block_n=16, num_warps=1, num_stages=1, pack=True)
    if dtype == torch.float32:  # fp32 dot products run on FMA units: small tiles
        return dict(block_m=32, block_n=16, num_warps=4, num_stages=2, pack=True)
    if head_dim > 128:
        return dict(block_m=64, block_n=32, num_warps=4, num_stages=2, pack=True)
    # Measured on the H200 (BENCHMARKS.md, ten configs): the best balance between fresh prompts
    # and prompts with a cached prefix. 128x128 tiles win with a prefix (+1 to +6%) but lose 12-15%
    # without one; 128x64 with 8 warps is 5-10% behind both.
    return dict(block_m=64, block_n=64, num_warps=4, num_stages=3, pack=True)


def pack_heads(group: int, block_m: int, pack: bool) -> int:
    """Query heads per program: the whole GQA group when packing is on and it divides the tile."""
    return group if pack and group & (group - 1) == 0 and group <= block_m else 1


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             k_cache: torch.Tensor, v_cache: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                             block_tables: torch.Tensor, scale: float, *,
                             out: torch.Tensor | None = None, config: dict | None = None
                             ) -> torch.Tensor:
    """out: [T, heads, head_dim], causal attention of each sequence's new tokens over its context."""
    t, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    num_seqs = context_lens.shape[0]
    assert heads == group * kv_heads and k.shape == (t, kv_heads, head_dim), (q.shape, k.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    cfg = prefill_config(q.device, q.dtype, head_dim) | dict(config or {})
    pack = pack_heads(group, cfg["block_m"], cfg.get("pack", True))
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    tokens_per_tile = cfg["block_m"] // pack
    grid = (t // tokens_per_tile + num_seqs, heads // pack)
    _prefill_kernel[grid](
        q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        scale * LOG2E, num_seqs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=dot_block(head_dim), PAGE=page,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], PACK=pack,
        PRECISION=dot_precision(q.dtype), CHUNK_FROM_CACHE=k_cache.dtype in FP8_DTYPES,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
