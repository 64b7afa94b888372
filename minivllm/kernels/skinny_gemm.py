"""Skinny GEMM for decode: out = x @ weight.T for a few rows (M <= 16), weight streamed once.
Any M runs, in tiles of up to MAX_M_PAD rows, for benchmarks/sweep_decode_gemm.py --rows 32,256;
the engine calls it at up to MAX_SKINNY_ROWS. Past 16 rows it beat cuBLAS for o_proj (3.8-5.9
against 6.1-6.7 us at 32-256 rows) and for down up to 64 rows, but its fp32 partials cost the norm
after it ~1 us more to read there, and each row range the dispatch tests is another compiled
variant of the layer: ~0.5% of the throughput run, estimated (BENCHMARKS.md, session 8).

  x: [M, K] (any row stride), weight: [N, K] row-major (nn.Linear layout), out: [M, N] (x.dtype)
  glu=True: x: [M, 2K] (gate, then up), out = (silu(gate) * up) @ weight.T, the MLP's down
  projection with its activation folded into the load of x (one launch fewer per layer).

At decode every byte of a linear layer's weight is read once for a handful of rows. Each program
owns BLOCK_N rows of the weight (output columns) and streams them along K in coalesced
[BLOCK_N, BLOCK_K] tiles, num_stages deep. When N alone cannot give ~2 programs per SM (o_proj,
down: N = 1024), K is split too: each split writes an fp32 partial [SPLIT, M, N] and a second
kernel sums the partials in a fixed order (deterministic, unlike atomics) and casts, or the caller
sums them (partials=True).

Measured on the H200 (benchmarks/bench_linear.py, BENCHMARKS.md): at the 0.6B shape's sizes
(4-13 MB) neither this kernel nor cuBLAS gets near the HBM bandwidth, each taking >= ~5 us of
launch, ramp-up and tail; this kernel wins where cuBLAS splits K badly (o_proj at 1-4 rows: 5.6
against 8.4-13 us; down: 6.6 against 7.7 us, session 4; since session 6's 64 x 64 split tiles
3.6 and 4.9-5.1 us with down's SiLU-and-mul) and on the LM head (4.3 against 4.1 TB/s), and
loses 5-15% on qkv and gate_up. The engine calls it for o_proj and down only
(functional/linear.py).

Launch choices come from shapes, dtype and the SM count only (no autotune, no .item()), so a call
traces under torch.compile(fullgraph=True) and replays under CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dot_precision, interpreting, next_pow2, num_sms

MAX_SKINNY_ROWS = 16  # the engine's dispatch (functional/linear.py); the kernel takes any M
M_PAD = 16  # rows of x per program up to 16 rows; tl.dot needs every dimension >= 16
MAX_M_PAD = 128  # rows per program beyond 16 rows: more M tiles above that
WAVES = 2  # programs per SM wanted: one wave leaves SMs idle at the tail and few bytes in flight
BLOCK_NS = (64, 32, 16)  # largest first; 16 is tl.dot's minimum
SUM_BLOCK = 512


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_per_split,
                   stride_xm, stride_xk, stride_wn, stride_om,
                   M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVEN_K: tl.constexpr, SPLIT: tl.constexpr, GLU: tl.constexpr,
                   PRECISION: tl.constexpr):
    # Program (pid_n, pid_k, pid_m): output columns [pid_n * BLOCK_N, +BLOCK_N) of rows
    # [pid_m * M_PAD, +M_PAD) over K range [pid_k * k_per_split, +k_per_split). Rows past M are
    # masked to zero. With SPLIT, out_ptr is the fp32 workspace [SPLIT, M, N].
    # With GLU, x is [M, 2K]: x_ptrs walk the gate half, and the up half is K columns further on.
    #
    # Why tl.dot and not broadcast-multiply + tl.sum: the product is computed transposed,
    # acc[BLOCK_N, M_PAD] = w[BLOCK_N, BLOCK_K] @ x[M_PAD, BLOCK_K]^T ("swap AB"), so the weight is
    # the MMA's A operand. Loads feeding a dot are what Triton's software pipeliner turns into
    # asynchronous copies into shared memory num_stages deep: the weight stream stays in flight
    # without holding registers, which is the whole game for a bandwidth-bound kernel. A
    # broadcast product would need [M, BLOCK_N, BLOCK_K] fp32 values in registers and CUDA-core
    # FMAs: at M = 16 the 8B lm head is 20 GFLOP, ~0.3 ms of fp32 FMA on Hopper, as long as its
    # 1.2 GB read; on tensor cores the padding of M to 16 costs nothing measurable.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(2) * M_PAD + tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    # Weight rows past N are clamped onto row N-1 (read, never stored) rather than masked, so
    # that with EVEN_K the weight loads carry no mask at all.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_ptrs = w_ptr + rows[:, None] * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            x_mask = mask_m[:, None]
        else:
            mask_k = (k0 + offs_k) < k_end
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
            x_mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if GLU:
            # silu_and_mul on the tile: silu in fp32, times up, rounded once to x's dtype so the
            # dot sees what silu_and_mul would have written (it rounds twice, silu then product;
            # once here). Masked elements load 0 and stay 0 (silu(0) = 0), so padding is inert.
            up = tl.load(x_ptrs + K * stride_xk, mask=x_mask, other=0.0).to(tl.float32)
            g = x.to(tl.float32)
            x = (g * tl.sigmoid(g) * up).to(x_ptr.dtype.element_ty)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)  # [BLOCK_N, M_PAD]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K * stride_xk
    mask = (offs_n < N)[:, None] & mask_m[None, :]
    if SPLIT:
        part = out_ptr + pid_k.to(tl.int64) * M * N  # workspace [SPLIT, M, N], contiguous
        tl.store(part + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits_kernel(ws_ptr, out_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    # ws: [SPLIT, M, N] fp32 -> out: [M, N] (contiguous), summed in split order: deterministic.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _splits_wanted(want: int, tiles: int) -> int:
    """K ranges that bring `tiles` output tiles to `want` programs, rounded (see skinny_config)."""
    return (want + tiles // 2) // tiles


def skinny_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                  **override) -> dict:
    """Tiles, split and launch settings for x: [m, k] @ weight[n, k].T; keys block_n, block_k,
    split, m_pad, num_warps, num_stages, any of which `override` may fix (benchmarks sweep them).

    - m_pad: rows per program, 16 up to 16 rows, else the next power of two up to MAX_M_PAD;
      the programs wanted below count the M tiles too.

    - block_n: the largest of 64/32/16 that still gives WAVES programs per SM from N alone.
      Every program rereads x from L2 for each weight tile ([M_PAD, BLOCK_K]; gate and up with
      glu), which is cheap against a split-K round trip while N gives enough programs.
    - split: where even block_n = 16 leaves fewer than WAVES programs per SM (o_proj and down:
      N = 1024), K is cut into round(WAVES * SMs / tiles) ranges of whole BLOCK_K chunks, and
      the tiles become 64 x 64: as many bytes a tile and programs as 16 x 256, but x is reread
      for a quarter of the weight bytes. On the H200 at 1-16 rows, alone in a CUDA graph
      (benchmarks/sweep_decode_gemm.py): down (glu) 4.9-5.1 us against 8.8-10.8 at 16 x 256
      and 7.8-8.0 at 32 x 128, o_proj 3.6 against 4.3-4.4 and 3.8; single stream in the engine
      877/866 against 789/787 tok/s at 16 x 256 (BENCHMARKS.md, session 6). Also where 16-wide
      tiles nearly fill the GPU (N = 4096: 256 tiles, 1.94 an SM; Qwen3-8B's o_proj and down):
      unsplit, each program streamed a 16-row column of K = 4,096-12,288 in 8 KB tiles; split,
      the 8B single stream went from 134-135 to 208-209 tok/s on the H200 (BENCHMARKS.md,
      session 58: a step's device time 6.7-7.0 ms -> 4.4).
    - block_k: 8-16 KB weight tiles (128 16-bit elements a row, 256 when block_n = 16, 64 when
      split; half as many in fp32): >= 128 bytes per weight row per load keeps the reads
      coalesced, and 3 tiles in flight per program (num_stages = 4) keep ~50-100 KB in flight
      per SM at 2-4 programs an SM, above HBM bandwidth x latency per SM (~4.8 TB/s x ~1 us /
      132 SMs = ~36 KB).
    - glu: k is the weight's K (x has 2k columns); the silu adds M_PAD * BLOCK_K exps a tile.
    - num_warps 4 (one warpgroup: block_n = 64 maps onto one wgmma of M = 64), num_stages 4 for
      16-bit, 3 for fp32 (twice the bytes a stage).
    """
    if m < 1:
        raise ValueError(f"skinny_linear takes at least one row, got {m}")
    m_pad = override.get("m_pad") or (M_PAD if m <= M_PAD else min(MAX_M_PAD, next_pow2(m)))
    m_tiles = triton.cdiv(m, m_pad)
    want = WAVES * num_sms(device)
    block_n = override.get("block_n")
    split_k = False  # K will be split (below): 64 x 64 tiles rather than 16 x 256
    if not block_n:
        block_n = next((b for b in BLOCK_NS if triton.cdiv(n, b) * m_tiles >= want), None)
        # None fills the GPU from N alone: split K into 64-wide tiles' ranges (below), unless
        # K is one such range.
        split_k = block_n is None and k > 64 * 2 // dtype.itemsize
        if block_n is None:
            block_n = 64 if split_k else BLOCK_NS[-1]
    elsize = dtype.itemsize
    bk = (64 if split_k else 256 if block_n == 16 else 128) * 2 // elsize
    block_k = override.get("block_k") or min(bk, max(16, next_pow2(k)))
    tiles = triton.cdiv(n, block_n) * m_tiles
    chunks = triton.cdiv(k, block_k)
    split = override.get("split") or max(1, min(chunks, _splits_wanted(want, tiles)))
    # Whole chunks per split, and no empty split: recount after rounding the range up.
    split = triton.cdiv(chunks, triton.cdiv(chunks, split))
    on_gpu = device.type == "cuda" and not interpreting()
    return dict(block_n=block_n, block_k=block_k, split=split, m_pad=m_pad,
                num_warps=override.get("num_warps") or 4,
                num_stages=override.get("num_stages") or (4 if on_gpu and elsize == 2 else 3))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, glu: bool = False,
                  partials: bool = False, config: dict | None = None) -> torch.Tensor:
    """x: [M, K] @ weight: [N, K].T -> [M, N] in x.dtype, fp32 accumulation, M >= 1 (the engine
    calls it at up to MAX_SKINNY_ROWS).

    glu=True: x is [M, 2K] (gate, then up; any strides) and the result is
    silu_and_mul(x) @ weight.T, the activation computed per tile in fp32 and rounded once to
    x.dtype before the dot (silu_and_mul rounds twice; results agree up to that rounding).

    partials=True: the fp32 partial products [split, M, N] (split >= 1), unsummed. The caller's
    `.sum(0)` then replaces the second kernel, and under torch.compile it fuses into whatever
    consumes the product (o_proj's into the add + RMSNorm after it: a launch fewer)."""
    m, kx = x.shape
    n, k = weight.shape
    if m < 1:
        raise ValueError(f"skinny_linear takes at least one row, got {m}")
    assert kx == (2 * k if glu else k) and x.dtype == weight.dtype, (
        glu, x.shape, x.dtype, weight.shape, weight.dtype)
    assert weight.stride(1) == 1, "weight rows must be contiguous (nn.Linear layout)"
    cfg = skinny_config(m, n, k, x.dtype, x.device, **(config or {}))
    block_n, block_k, split = cfg["block_n"], cfg["block_k"], cfg["split"]
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    to_workspace = partials or split > 1
    if to_workspace:
        ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    out = None if partials else torch.empty((m, n), device=x.device, dtype=x.dtype)
    _skinny_kernel[(triton.cdiv(n, block_n), split, triton.cdiv(m, cfg["m_pad"]))](
        x, weight, ws if to_workspace else out, m, n, k, k_per_split,
        x.stride(0), x.stride(1), weight.stride(0), n,
        M_PAD=cfg["m_pad"], BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        SPLIT=to_workspace, GLU=glu, PRECISION=dot_precision(x.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if partials:
        return ws
    if split > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            ws, out, m * n, SPLIT=split, BLOCK=SUM_BLOCK, num_warps=4)
    return out
