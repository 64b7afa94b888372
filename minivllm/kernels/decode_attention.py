"""Paged decode attention: one new token per sequence over its whole context.

GQA-aware: a program holds all GROUP query heads of one KV head, so each K/V row is read from
memory once for the group. When batch x kv_heads programs cannot fill the GPU, the context is
split into num_splits ranges whose partial results (normalised output and log2-sum-exp) a second
kernel merges.

  q: [B, heads, head_dim], k/v: [B, kv_heads, head_dim]   this step's token (not read from cache)
  k_cache/v_cache: [num_blocks, PAGE, kv_heads, head_dim], block_tables: [B, M] int32
  context_lens: [B] int32, tokens including the new one; the cached prefix is context_lens - 1.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..state.config import FP8_DTYPES
from .launch import cuda_capability, dot_block, dot_precision, next_pow2, num_sms, runs_ptx
from .paged import load_rows, page_rows

LOG2E = 1.4426950408889634


@triton.jit
def _norm_rope(x, x_partner, w, w_partner, cos, signed_sin, eps, HEAD_DIM: tl.constexpr):
    """RMSNorm then rotate-half RoPE of rows x: [R, BLOCK_D], rounded to x's dtype wherever the
    PyTorch reference (functional.layer.qk_norm_rope) rounds. x_partner / w_partner: x and the
    norm weight at each lane's rotation partner; signed_sin: sin negated on the first half."""
    dt = x.dtype
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)  # [R]: the partner lanes share it
    n = (w.to(tl.float32) * (xf * r[:, None]).to(dt).to(tl.float32)).to(dt)
    n_partner = (w_partner.to(tl.float32)
                 * (x_partner.to(tl.float32) * r[:, None]).to(dt).to(tl.float32)).to(dt)
    # Each product rounded before the sum, as the reference rounds x * cos and rotated * sin. As
    # plain products of 16-bit values LLVM made them 16-bit multiplies and fused one into the
    # sum's add (fma.rn.bf16: one rounding fewer; session 26's probe found a fifth of the values
    # an ulp off the eager form). An fma with a zero addend is a product it may not fuse (-0 + 0
    # is +0); tests/test_norm_rope_store.py checks the sm_90 code.
    a = tl.fma(n.to(tl.float32), cos.to(dt).to(tl.float32), 0.0).to(dt)
    b = tl.fma(n_partner.to(tl.float32), signed_sin.to(dt).to(tl.float32), 0.0).to(dt)
    return (a.to(tl.float32) + b.to(tl.float32)).to(dt)


@triton.jit
def _rope_lanes(cos_ptr, sin_ptr, offs_d, mask_d, HEAD_DIM: tl.constexpr):
    """One token's RoPE lanes (cos_ptr / sin_ptr: its row of the tables): each lane's rotate-half
    partner (d -/+ HEAD_DIM/2), cos, and sin negated on the first half, for _load_norm_rope."""
    half = HEAD_DIM // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    cos = tl.load(cos_ptr + offs_d, mask=mask_d, other=0.0)
    sin = tl.load(sin_ptr + offs_d, mask=mask_d, other=0.0)
    return partner, cos, tl.where(offs_d < half, -sin, sin)


@triton.jit
def _load_norm_rope(rows, mask, w_ptr, offs_d, partner, mask_d, cos, signed_sin, eps,
                    HEAD_DIM: tl.constexpr):
    """The rows at `rows` (each row's start, [R, 1] or a scalar for one row) loaded under `mask`
    ([R, BLOCK_D]), then RMS-normed by w_ptr's weight and rotated (_norm_rope): [R, BLOCK_D].
    The partner lanes are loaded as a second, permuted copy."""
    return _norm_rope(tl.load(rows + offs_d[None, :], mask=mask, other=0.0),
                      tl.load(rows + partner[None, :], mask=mask, other=0.0),
                      tl.load(w_ptr + offs_d, mask=mask_d, other=0.0)[None, :],
                      tl.load(w_ptr + partner, mask=mask_d, other=0.0)[None, :],
                      cos[None, :], signed_sin[None, :], eps, HEAD_DIM)


@triton.jit
def _e4m3_to_f16(x):
    """x: an e4m3 tile widened to fp16 by inline PTX, 4 values (two cvt.f16x2.e4m3x2) a
    register. Not pure on purpose: Triton may not move it, so the widening stays where the tile
    is loaded and every layout conversion after it (the smem transpose V's dot needs) moves
    16-bit values with ldmatrix; Triton's own cast there was moved after the transpose or, held
    by a select, cost 1,275 SASS instructions a 128-token tile against 749 with V widened here
    (BENCHMARKS.md, session 11). The price: torch.compile cannot analyse an impure asm, so it
    takes every argument of a kernel using it as written. sm_89+."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _tile_k(rows, mask_n, offs_d, mask_d, k_cache_ptr, dt: tl.constexpr, D_MASKED: tl.constexpr,
            PTX_WIDEN: tl.constexpr, MASKED: tl.constexpr):
    """A tile's K rows [BLOCK_N, BLOCK_D] (rows: their cache offsets, page_rows' plus the head's;
    MASKED: zeros where mask_n is off), widened to dt."""
    kt = load_rows(k_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, MASKED, D_MASKED)
    return _e4m3_to_f16(kt) if PTX_WIDEN == 2 else kt.to(dt)


@triton.jit
def _tile_v(rows, mask_n, offs_d, mask_d, v_cache_ptr, dt: tl.constexpr, D_MASKED: tl.constexpr,
            PTX_WIDEN: tl.constexpr, FP8_CACHE: tl.constexpr, MASKED: tl.constexpr):
    """The same tile's V rows, widened to dt in the form V's dot wants."""
    vt = load_rows(v_cache_ptr + rows[:, None] + offs_d[None, :], mask_n, mask_d, MASKED,
                   D_MASKED)
    if PTX_WIDEN >= 1:  # masked rows loaded as zeros, and p is 0 there
        vt = _e4m3_to_f16(vt)
    elif FP8_CACHE:
        # V is the dot's k-major operand: its rows must be transposed through shared memory.
        # Left alone, Triton moves the widening after that transpose, which for 1-byte
        # elements is 128 byte-wide shared loads a tile (and stalls); a select on a tensor
        # operand keeps the widening here, so the transpose moves 16-bit values with
        # ldmatrix.trans as a 16-bit cache does (the sm_90 PTX, BENCHMARKS.md session 10).
        vt = tl.where(mask_n[:, None], vt.to(dt), 0.0)
    else:
        vt = vt.to(dt)
    return vt


@triton.jit
def _decode_tile(q, acc, m_i, l_i, n0, end, offs_n, offs_d, mask_d, bt_row, head_off, k_cache_ptr,
                 v_cache_ptr, scale_log2, dt: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 ROW: tl.constexpr, D_MASKED: tl.constexpr, PRECISION: tl.constexpr,
                 PTX_WIDEN: tl.constexpr, FP8_CACHE: tl.constexpr, MASKED: tl.constexpr,
                 kt_loaded, vt_loaded, LOADED: tl.constexpr):
    """One BLOCK_N-token tile of the online softmax: (acc, m_i, l_i) updated. MASKED: the tile
    may run past `end` (its rows there are loaded as zeros and their scores set to -inf).
    LOADED: its K and V rows are kt_loaded and vt_loaded (_tile_k's and _tile_v's, MASKED),
    loaded earlier by the caller; otherwise they are loaded here."""
    mask_n = (n0 + offs_n) < end
    if LOADED:
        kt = kt_loaded
    else:
        rows = page_rows(bt_row, n0, offs_n, mask_n, PAGE, BLOCK_N, ROW) + head_off
        kt = _tile_k(rows, mask_n, offs_d, mask_d, k_cache_ptr, dt, D_MASKED, PTX_WIDEN, MASKED)
    s = tl.dot(q, tl.trans(kt), input_precision=PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: the tile holds a valid position
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if LOADED:
        vt = vt_loaded
    else:
        vt = _tile_v(rows, mask_n, offs_d, mask_d, v_cache_ptr, dt, D_MASKED, PTX_WIDEN, FP8_CACHE,
                     MASKED)
    acc = acc * alpha[:, None] + tl.dot(p.to(dt), vt, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _split_range(b, split, ctx_ptr, num_splits, BLOCK_N: tl.constexpr):
    """Tokens [start, end) of sequence b's cached prefix that context split `split` attends to
    (whole BLOCK_N tiles a split; a split past the prefix is empty)."""
    prefix = tl.load(ctx_ptr + b) - 1
    per_split = tl.cdiv(tl.cdiv(prefix, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, prefix)


@triton.jit
def _first_tile(b, kvh, split, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, stride_bt, num_splits,
                dt: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                PTX_WIDEN: tl.constexpr, FP8_CACHE: tl.constexpr):
    """The K and V rows of unit (b, kvh, split)'s first tile as _decode_unit's EARLY_TILE takes
    them (MASKED: zeros past the split's end; all zeros for an empty split)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    start, end = _split_range(b, split, ctx_ptr, num_splits, BLOCK_N)
    mask_n = (start + offs_n) < end
    # An empty split's start can lie past the block table's end, and a page-aligned tile reads
    # its block id unmasked: address tile 0 instead (every row is masked off anyway).
    rows = page_rows(bt_ptr + tl.cast(b, tl.int64) * stride_bt, tl.where(start < end, start, 0),
                     offs_n, mask_n, PAGE, BLOCK_N, KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
    D_MASKED: tl.constexpr = BLOCK_D != HEAD_DIM
    return (_tile_k(rows, mask_n, offs_d, mask_d, k_cache_ptr, dt, D_MASKED, PTX_WIDEN, True),
            _tile_v(rows, mask_n, offs_d, mask_d, v_cache_ptr, dt, D_MASKED, PTX_WIDEN, FP8_CACHE,
                    True))


@triton.jit
def _decode_unit(b, kvh, split, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                 slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps,
                 out_ptr, part_out_ptr, part_lse_ptr, scale_log2, num_splits,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_bt, stride_rope, stride_ot, stride_oh,
                 KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STORE: tl.constexpr,
                 NORM_ROPE: tl.constexpr, PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
                 FP8_CACHE: tl.constexpr, PTX_WIDEN: tl.constexpr, PEEL: tl.constexpr,
                 kt0, vt0, EARLY_TILE: tl.constexpr):
    """One program's work of _decode_kernel: sequence b's KV head kvh, context split `split`.
    A function of its own so that a kernel that keeps its programs resident can run it too.
    EARLY_TILE: the split's first tile is kt0, vt0 (_first_tile's), loaded by the caller before
    the q/k/v this reads were written (the prefix's rows never depend on them)."""
    # Under torch.compile a Python-float argument can arrive as fp64; the loop-carried softmax
    # state must stay fp32.
    scale_log2 = tl.cast(scale_log2, tl.float32)
    eps = tl.cast(eps, tl.float32)
    ROW: tl.constexpr = KV_HEADS * HEAD_DIM
    dt = q_ptr.dtype.element_ty  # the compute dtype; an fp8 cache is widened to it as loaded
    if F16_DOTS:  # e4m3 widens to fp16 in one instruction, to bf16 in two
        dt = tl.float16
    cache_dt = k_cache_ptr.dtype.element_ty

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    D_MASKED: tl.constexpr = BLOCK_D != HEAD_DIM
    heads = kvh * GROUP + offs_g
    b64 = tl.cast(b, tl.int64)
    q_rows = q_ptr + b64 * stride_qt + heads[:, None] * stride_qh
    q_mask = mask_g[:, None] & mask_d[None, :]
    k_row = k_ptr + b64 * stride_kt + kvh * stride_kh
    if NORM_ROPE:
        # q and k arrive straight from the qkv GEMM: each head is RMS-normed and rotated here
        # (a kernel fewer per layer).
        partner, cos, sin = _rope_lanes(cos_ptr + b64 * stride_rope, sin_ptr + b64 * stride_rope,
                                        offs_d, mask_d, HEAD_DIM)
        q = _load_norm_rope(q_rows, q_mask, qw_ptr, offs_d, partner, mask_d, cos, sin, eps,
                            HEAD_DIM).to(dt)
        k_new = _load_norm_rope(k_row, mask_d[None, :], kw_ptr, offs_d, partner, mask_d, cos,
                                sin, eps, HEAD_DIM)
        k_new = tl.reshape(k_new, [BLOCK_D])
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0).to(dt)
        k_new = tl.load(k_row + offs_d, mask=mask_d, other=0.0)

    # The new token seeds split 0's running softmax; other splits start empty. Every split loads
    # it (one row) so that the seed needs no branch.
    v_new = tl.load(v_ptr + b64 * stride_vt + kvh * stride_vh + offs_d, mask=mask_d, other=0.0)
    s_new = tl.sum(q.to(tl.float32) * k_new.to(dt).to(tl.float32)[None, :], 1) * scale_log2
    first = split == 0
    m_i = tl.where(first, s_new, float("-inf"))
    l_i = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_G], tl.float32)
    acc = tl.where(first, 1.0, 0.0) * v_new.to(dt).to(tl.float32)[None, :] + tl.zeros(
        [BLOCK_G, BLOCK_D], tl.float32)
    if STORE:
        # Split 0 also writes the new token's K/V into its cache slot (-1: a padding row, none),
        # which saves the step a store kernel per layer. No program reads that slot: every
        # program takes the new token from k/v and reads only the prefix from the cache.
        slot = tl.load(slot_ptr + b)
        if (split == 0) & (slot >= 0):
            dst = slot.to(tl.int64) * ROW + kvh * HEAD_DIM + offs_d
            tl.store(k_cache_ptr + dst, k_new.to(cache_dt), mask=mask_d)
            tl.store(v_cache_ptr + dst, v_new.to(cache_dt), mask=mask_d)

    start, end = _split_range(b, split, ctx_ptr, num_splits, BLOCK_N)
    bt_row = bt_ptr + b64 * stride_bt
    head_off = kvh * HEAD_DIM
    if EARLY_TILE:
        if start < end:
            acc, m_i, l_i = _decode_tile(
                q, acc, m_i, l_i, start, end, offs_n, offs_d, mask_d, bt_row, head_off,
                k_cache_ptr, v_cache_ptr, scale_log2, dt, PAGE, BLOCK_N, ROW, D_MASKED,
                PRECISION, PTX_WIDEN, FP8_CACHE, True, kt0, vt0, True)
        start += BLOCK_N
    # Whole tiles first, without masks (at 128-token tiles ~140 fewer SASS instructions a tile
    # of an fp8 cache, ~200 of bf16: no predicated loads, no -inf select), then the last,
    # partial tile with them.
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end if PEEL else start, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            q, acc, m_i, l_i, n0, end, offs_n, offs_d, mask_d, bt_row, head_off, k_cache_ptr,
            v_cache_ptr, scale_log2, dt, PAGE, BLOCK_N, ROW, D_MASKED, PRECISION, PTX_WIDEN,
            FP8_CACHE, False, 0, 0, False)
    for n0 in range(full_end if PEEL else start, end, BLOCK_N):
        acc, m_i, l_i = _decode_tile(
            q, acc, m_i, l_i, n0, end, offs_n, offs_d, mask_d, bt_row, head_off, k_cache_ptr,
            v_cache_ptr, scale_log2, dt, PAGE, BLOCK_N, ROW, D_MASKED, PRECISION, PTX_WIDEN,
            FP8_CACHE, True, 0, 0, False)

    # An empty split (short context) has l = 0: it writes zeros and lse = -inf, weight 0 later.
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    o_mask = mask_g[:, None] & mask_d[None, :]
    if not SPLIT:
        tl.store(out_ptr + b64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        row = (b64 * (KV_HEADS * GROUP) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=o_mask)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr,
                   qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps,
                   out_ptr, part_out_ptr, part_lse_ptr, scale_log2, num_splits,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                   stride_bt, stride_rope, stride_ot, stride_oh,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, STORE: tl.constexpr,
                   NORM_ROPE: tl.constexpr, PRECISION: tl.constexpr, HEADS_FASTEST: tl.constexpr,
                   F16_DOTS: tl.constexpr, FP8_CACHE: tl.constexpr, PTX_WIDEN: tl.constexpr,
                   PEEL: tl.constexpr):
    if HEADS_FASTEST:  # grid (kv_heads, B, splits): a sequence's heads run side by side
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    _decode_unit(b, kvh, split, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                 slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps, out_ptr, part_out_ptr,
                 part_lse_ptr, scale_log2, num_splits, stride_qt, stride_qh, stride_kt, stride_kh,
                 stride_vt, stride_vh, stride_bt, stride_rope, stride_ot, stride_oh, KV_HEADS,
                 GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, PAGE, BLOCK_N, SPLIT, STORE, NORM_ROPE,
                 PRECISION, F16_DOTS, FP8_CACHE, PTX_WIDEN, PEEL, 0, 0, False)


@triton.jit
def _merge_unit(b, h, part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """Row b's head h: its splits' partial outputs weighted by their log2-sum-exps."""
    b = tl.cast(b, tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < num_splits
    base = (b * HEADS + h) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always holds the new token: the max is finite
    w = w / tl.sum(w, 0)
    o = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=mask_s[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_splits,
                         HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    _merge_unit(tl.program_id(0), tl.program_id(1), part_out_ptr, part_lse_ptr, out_ptr,
                stride_ot, stride_oh, num_splits, HEADS, HEAD_DIM, BLOCK_S, BLOCK_D)


MIN_SPLIT_TOKENS = 256  # below this a split's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 64
WAVES = 16  # programs per SM wanted before splitting stops paying (H200; see SHORT_CONTEXT_WAVES)
SHORT_TILE_BATCH = 2  # up to this many sequences, split contexts take 64-token tiles (decode_config)
MID_TILE_BATCH = 64  # up to this many, 64-token tiles in two stages (decode_config)


# A 16-bit cache at contexts up to 4096 on the GPU (the throughput run's; on the H200,
# sweep_decode_attention.py at contexts U[400, 1400] and U[900, 1824], BENCHMARKS.md session 24):
# - from about two programs an SM unsplit (B x KV heads >= 1.9 x SMs: 32 sequences x 8 KV heads
#   on 132 SMs): at 32 / 48 / 96 / 128 sequences 41.7 / 54.2 / 94.3 / 92.4 us against 45.5 /
#   60.8 / 101.3 / 106.5 at 7 / 5 / 2 / 2 splits (16 waves give 8 / 5 / 2 / 2; at 128, U[200,
#   1124]). A split adds the merge kernel, fp32 partials, and q's norm and RoPE once more per
#   program;
# - below that, about 4 programs an SM, not 16: at 8 / 16 / 20 sequences 19.2 / 27.6 / 32.2 us
#   against 22.5 / 33.8 / 38.6 at 16 / 16 / 13 splits; 1-4 sequences keep their 16.
# Longer contexts, an fp8 cache (unsplit, it lost at 32-96 sequences), an fp32 one (not
# measured) and the interpreter (tests that must take the split paths) keep 16 waves.
SHORT_CONTEXT = 4096
SHORT_CONTEXT_WAVES = 4
UNSPLIT_PROGRAMS_PER_SM = 1.9


def decode_splits(batch_size: int, kv_heads: int, max_context: int, device: torch.device,
                  waves: int | None = None, cache_dtype: torch.dtype | None = None) -> int:
    """How many ranges to split each context into: up to `waves` programs per SM, none shorter
    than MIN_SPLIT_TOKENS. From shapes only (max_context = block_tables.shape[1] * page). Rounded
    down: at B=256 x 8 KV heads a second split cost 4% on short contexts (BENCHMARKS.md).
    waves=None: WAVES, or for a 16-bit cache (cache_dtype None: taken as one) of short contexts
    on the GPU SHORT_CONTEXT_WAVES and no split from UNSPLIT_PROGRAMS_PER_SM (above)."""
    programs = batch_size * kv_heads
    sms = num_sms(device)
    if waves is None:
        short = (runs_ptx(device) and max_context <= SHORT_CONTEXT
                 and (cache_dtype is None or cache_dtype.itemsize == 2))
        if short and programs >= UNSPLIT_PROGRAMS_PER_SM * sms:
            return 1
        waves = SHORT_CONTEXT_WAVES if short else WAVES
    want = waves * sms // programs
    return max(1, min(want, max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


# An fp8 cache's unsplit tiles (the throughput run's 256 rows), for rows in the engine's order
# for an fp8 cache (longest context first): see decode_config.
FP8_UNSPLIT_TILES = dict(block_n=32, num_warps=2, num_stages=2)


def decode_config(device: torch.device, dtype: torch.dtype, head_dim: int, splits: int = 1,
                  max_context: int = 0, batch_size: int = 0, cache_dtype: torch.dtype | None = None
                  ) -> dict:
    """Tile config. 128-token tiles halve the loop trips and won on the H200 whenever a program
    reads a whole short context; with many splits of long contexts, 64-token tiles (39 KB of
    shared memory against 74 KB) keep five programs resident per SM instead of three.

    At one or two sequences (the single stream) a split's range is rounded up to whole tiles, so
    128-token tiles leave 11 of the 16 splits of a ~600-token context empty; 64-token tiles
    spread it over 10. With the merge, 9.4 against 10.1 us at one sequence and 10.5 against
    10.7 at two (sweep_decode_attention.py --batch 1 / 2 --contexts 512-768, BENCHMARKS.md
    session 9). From 3 to 64 sequences (split contexts up to 4096 tokens), 64-token tiles in two
    stages: at contexts U[400, 1400] 38.7 against 45.5 us at 24 sequences, 58.6 against 63.1 at
    48, 73.4 against 75.4 at 64; level at 96 and 128 (BENCHMARKS.md session 10). Since session
    24 a 16-bit cache's launch of 32 or more sequences on the H200 is unsplit (decode_splits),
    so it takes 128-token tiles: faster than any split count with 64-token ones.

    The grid runs a sequence's KV heads side by side (paged_decode_attention's heads_fastest,
    the default): they read neighbouring 256-byte pieces of the same cache rows at the same
    time. At 256 sequences (benchmarks/sweep_decode_attention.py, BENCHMARKS.md session 7) that
    read K/V at 4.00 against 3.91 TB/s over the throughput run's step-100 contexts, 4.22 against
    4.18 at step ~600; in the engine it was measured only with that session's other changes.

    An fp8 cache (cache_dtype) unsplit: FP8_UNSPLIT_TILES, small programs (32-token tiles, two
    warps). Its kernel is latency-bound (~8 cycles a warp per instruction, ~35% of issue slots
    used), so a launch's tail counts; the engine schedules an fp8 cache's decodes longest
    context first, and in that order these tiles took 116.6 against 131.2 µs (U[200, 1124]) and
    198.5 against 215.5 (U[700, 1624]); in random order they were slower (156.1 against 141.2;
    BENCHMARKS.md session 14)."""
    if not runs_ptx(device):
        return dict(block_n=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:  # fp32 dot products run on FMA units: small tiles, no spills
        return dict(block_n=32, num_warps=4, num_stages=2)
    if splits == 1 and cache_dtype in FP8_DTYPES:
        return dict(FP8_UNSPLIT_TILES)
    if splits > 1 and max_context <= 4096 and SHORT_TILE_BATCH < batch_size <= MID_TILE_BATCH:
        return dict(block_n=64, num_warps=4, num_stages=2)
    if splits == 1 or (max_context <= 4096 and not 0 < batch_size <= SHORT_TILE_BATCH):
        return dict(block_n=128, num_warps=4, num_stages=3)
    return dict(block_n=64, num_warps=4, num_stages=3)


def _launch_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                   slots: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, eps: float, out: torch.Tensor,
                   part_out: torch.Tensor, part_lse: torch.Tensor, scale_log2: float,
                   num_splits: int, block_n: int, num_warps: int, num_stages: int, store: bool,
                   norm_rope: bool, heads_fastest: bool, f16_dots: bool, ptx_widen: int,
                   peel: bool) -> None:
    """_decode_kernel on paged_decode_attention's checked arguments (it writes k_cache and
    v_cache at slots if store, and out or, split, part_out and part_lse)."""
    b, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    fp8_cache = k_cache.dtype in FP8_DTYPES
    grid = (kv_heads, b, num_splits) if heads_fastest else (b, kv_heads, num_splits)
    _decode_kernel[grid](
        q, k, v, k_cache, v_cache, block_tables, context_lens, slots, q_weight, k_weight, cos, sin,
        eps, out, part_out, part_lse, scale_log2, num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_tables.stride(0), cos.stride(0), out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_G=dot_block(group),
        BLOCK_D=dot_block(head_dim), PAGE=page, BLOCK_N=block_n, SPLIT=num_splits > 1,
        STORE=store, NORM_ROPE=norm_rope,
        PRECISION=dot_precision(torch.float16 if f16_dots else q.dtype),
        HEADS_FASTEST=heads_fastest, F16_DOTS=f16_dots, FP8_CACHE=fp8_cache, PTX_WIDEN=ptx_widen,
        PEEL=peel, num_warps=num_warps, num_stages=num_stages)


_launch_decode_opaque = torch.library.custom_op(
    "minivllm::decode_attention_launch", _launch_decode,
    mutates_args=("k_cache", "v_cache", "out", "part_out", "part_lse"))


@_launch_decode_opaque.register_fake
def _(*args) -> None:
    return None


def paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, *, out: torch.Tensor | None = None,
                           num_splits: int | None = None, config: dict | None = None,
                           slot_mapping: torch.Tensor | None = None,
                           norm_rope: tuple | None = None) -> torch.Tensor:
    """out: [B, heads, head_dim]; the new token's K/V come from k/v, the prefix from the cache.
    slot_mapping: [B] int64, if given the new K/V are also written to these cache slots (-1
    skips a row), as store_kvcache would.
    norm_rope: (q_weight [head_dim], k_weight [head_dim], cos [B, head_dim], sin, eps), if given
    q and k are raw projections, RMS-normed per head and rotated here as
    functional.layer.qk_norm_rope would (and k is stored so).
    config: overrides of decode_config's block_n, num_warps, num_stages and heads_fastest (grid
    (kv_heads, B, splits) if true, the default, else (B, kv_heads, splits)); f16_dots: the dots
    in fp16 whatever q's dtype. The default for an fp8 cache under a 16-bit q: e4m3 widens to
    fp16 in one instruction and to bf16 in two more (sm_90 PTX: 128 scalar cvt.bf16.f16 a
    64-token tile); exact for e4m3 values, q and p rounded to fp16 (10 mantissa bits, bf16 has 7).
    ptx_widen: with fp16 dots over an fp8 cache, how the cache's tiles are widened: 0 Triton's
    cast, 1 V by inline PTX (_e4m3_to_f16; the default on sm_89+, the interpreter runs no PTX),
    2 K and V by it (slower: K then takes a trip through shared memory). opaque: launch the
    kernel through the custom op minivllm::decode_attention_launch, which declares what it
    writes (default: when ptx_widen is not 0). peel: whole tiles in a loop without masks, the
    partial one after (default: 16-bit caches past SHORT_TILE_BATCH rows)."""
    b, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    assert heads == group * kv_heads and k.shape == (b, kv_heads, head_dim), (q.shape, k.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    max_context = block_tables.shape[1] * page
    if num_splits is None:
        num_splits = decode_splits(b, kv_heads, max_context, q.device, cache_dtype=k_cache.dtype)
    cfg = decode_config(q.device, q.dtype, head_dim, num_splits, max_context, b,
                        k_cache.dtype) | dict(config or {})
    assert 1 <= num_splits <= MAX_SPLITS, num_splits
    if out is None:
        out = torch.empty_like(q)
    if num_splits > 1:
        part_out = torch.empty((b, heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((b, heads, num_splits), device=q.device, dtype=torch.float32)
    else:  # unused; empty, as a custom op's written arguments may not alias out
        part_out, part_lse = q.new_empty(0, dtype=torch.float32), q.new_empty(0, dtype=torch.float32)
    block_d = next_pow2(head_dim)
    store = slot_mapping is not None
    assert not store or slot_mapping.shape == (b,), (slot_mapping.shape, b)
    if norm_rope is not None:
        q_weight, k_weight, cos, sin, eps = norm_rope
        assert head_dim % 2 == 0 and q_weight.shape == k_weight.shape == (head_dim,)
        assert cos.shape == sin.shape == (b, head_dim) and cos.stride() == sin.stride()
        assert cos.stride(1) == 1 and q_weight.is_contiguous() and k_weight.is_contiguous()
    else:
        q_weight = k_weight = cos = sin = q  # unused
        eps = 0.0
    heads_fastest = bool(cfg.get("heads_fastest", True))
    fp8_cache = k_cache.dtype in FP8_DTYPES
    f16_dots = bool(cfg.get("f16_dots", fp8_cache and q.element_size() == 2))
    ptx_widen = int(cfg.get("ptx_widen", 1 if fp8_cache and f16_dots
                                and cuda_capability(q.device) >= (8, 9) else 0))
    assert ptx_widen == 0 or (fp8_cache and f16_dots), "ptx_widen widens e4m3 to fp16 dots"
    # The impure asm of ptx_widen defeats torch.compile's analysis of what the kernel writes (it
    # then takes every argument as written): launched through a custom op, what it writes is
    # declared instead.
    opaque = bool(cfg.get("opaque", ptx_widen > 0))
    # Peeling measured +0.8% engine throughput at 256 rows over a bf16 cache, -1% at the single
    # stream (1-2 rows, short split tiles), and a slower kernel over an fp8 one (BENCHMARKS.md
    # session 12).
    peel = bool(cfg.get("peel", not fp8_cache and b > SHORT_TILE_BATCH))
    (_launch_decode_opaque if opaque else _launch_decode)(
        q, k, v, k_cache, v_cache, block_tables, context_lens,
        slot_mapping if store else context_lens, q_weight, k_weight, cos, sin, float(eps),
        out, part_out, part_lse, scale * LOG2E, num_splits, cfg["block_n"], cfg["num_warps"],
        cfg["num_stages"], store, norm_rope is not None, heads_fastest, f16_dots, ptx_widen,
        peel)
    if num_splits > 1:
        _merge_splits_kernel[(b, heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            HEADS=heads, HEAD_DIM=head_dim, BLOCK_S=max(2, next_pow2(MAX_SPLITS)), BLOCK_D=block_d,
            num_warps=4)
    return out
