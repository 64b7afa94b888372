"""AWQ GEMM: out = x @ W for a 4-bit AWQ weight W, dequantized tile by tile inside the GEMM.

  x: [M, K] fp16 / bf16 / fp32 (any row stride), W: an AwqWeight (state/quant.py):
  qweight int32 [K, N / 8], qzeros int32 [K / G, N / 8], scales [K / G, N] (fp16 as stored),
  W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]; out: [M, N] in x.dtype, fp32 accumulation.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K in BLOCK_K steps. A step
loads the packed weights of its tile as they lie, [BLOCK_K, BLOCK_N / 8] int32 (each int once,
contiguous along a row), takes each int's eight nibbles out in registers as its eight columns
(AWQ's order puts column r of a group of 8 at bits 4 * [0, 4, 1, 5, 2, 6, 3, 7][r]), and
dequantizes them with the step's one row of zero points and scales: BLOCK_K divides the group
size G (or the whole input is one group), so a K step never straddles two groups. (q - z) * s is
computed in fp32 (exact: a 4-bit difference times an fp16 scale) and rounded once to x's dtype
for tl.dot: the weight a dequantize-then-matmul would use, so the torch path (functional.linear:
dequantize_awq then a matmul) and this kernel differ only by the order of the fp32 sums.
Until session 62 the step loaded [BLOCK_K, BLOCK_N] ints, the eight columns of an int each
loading its address: 8-17x slower at decode on an H100 (benchmarks/quant_gemm_probe.py; the 8B
shape's single stream ran at 14 tok/s).

Tiling (awq_config: kernels/dequant_tiles.py, shared with fp8_gemm), from shapes, dtype and the SM
count only (no autotune, no .item()), so a call traces under torch.compile(fullgraph=True) and
replays under CUDA graphs:
- decode (M <= 16): BLOCK_M 16 (tl.dot's minimum), BLOCK_N 128 where N's 128-column tiles are
  fewer than half the programs wanted (qkv, o_proj, down), else 64 (32 when N gives too few
  tiles), BLOCK_K 128 (or the group, 32 / 64); K is split where the output tiles alone give
  fewer than WAVES programs per SM, each split writing an fp32 partial [SPLIT, M, N] that the
  caller sums in torch (a fixed order: deterministic; under torch.compile the sum fuses into what
  follows). At decode the packed weights (a quarter of fp16's bytes) are what is read.
- mid (16 < M <= 64): BLOCK_M 32 / 64, BLOCK_N 64, split as above.
- prefill (M > 64): BLOCK_M 64 (128 past 256 rows), BLOCK_N 128, BLOCK_K 64 (or the group), no
  split; 8 warps for the 128 x 128 tiles.
functional.linear takes this kernel for steps of fewer than 256 rows and, as vLLM's AWQ method
does, dequantizes the whole weight and calls cuBLAS from 256 rows on (prefill); the prefill tiles
serve direct calls (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..state.quant import AWQ_PACK, AwqWeight
from .dequant_tiles import WAVES, dequant_gemm_config, finish, split_output
from .launch import dot_precision, next_pow2, num_sms

BLOCK_KS = (128, 64, 32, 16)  # largest first; 16 is tl.dot's minimum


@triton.jit
def _awq_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, G, k_per_split,
                     stride_xm, stride_xk, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    # Program (pid_m, pid_n, pid_k): rows [pid_m * BLOCK_M, +BLOCK_M) and columns
    # [pid_n * BLOCK_N, +BLOCK_N) of the output, over K range [pid_k * k_per_split, +k_per_split).
    # With SPLIT, out_ptr is the fp32 workspace [splits, M, N].
    BP: tl.constexpr = BLOCK_N // 8  # the tile's packed int32 columns
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = pid_n * BP + tl.arange(0, BP)
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, 8)
    shifts = ((r // 2) + (r % 2) * 4) * 4  # [8]: AWQ's nibble of an int's column r, in bits
    NP = N // 8  # int32s per packed row
    mask_m = offs_m < M
    mask_p = offs_p < NP
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = qw_ptr + (k_start + offs_k).to(tl.int64)[:, None] * NP + offs_p[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            qw = tl.load(w_ptrs, mask=mask_p[None, :], other=0)  # [BLOCK_K, BP]
            x_mask = mask_m[:, None]
        else:
            mask_k = (k0 + offs_k) < k_end
            qw = tl.load(w_ptrs, mask=mask_k[:, None] & mask_p[None, :], other=0)
            x_mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        g = k0 // G  # the step's group: BLOCK_K divides G, or K is one group
        qz = tl.load(qz_ptr + g * NP + offs_p, mask=mask_p, other=0)  # [BP]
        z = tl.reshape((qz[:, None] >> shifts[None, :]) & 0xF, (BLOCK_N,))
        s = tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        # each int's eight nibbles as its eight columns: [BLOCK_K, BP, 8] -> [BLOCK_K, BLOCK_N]
        q = tl.reshape((qw[:, :, None] >> shifts[None, None, :]) & 0xF, (BLOCK_K, BLOCK_N))
        w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * NP
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        part = out_ptr + pid_k.to(tl.int64) * M * N  # workspace [splits, M, N], contiguous
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def _block_k(k: int, group: int, most: int) -> int:
    """The K step: the largest of BLOCK_KS up to `most` that divides the group (so that a step
    reads one row of zero points and scales), or, where K is one group, up to K's power of two."""
    if group >= k:
        return max(16, min(most, next_pow2(k)))
    for b in BLOCK_KS:
        if b <= most and group % b == 0:
            return b
    raise ValueError(f"AWQ group size {group} is not a multiple of 16 (the kernel's K step)")


def awq_config(m: int, n: int, k: int, group: int, dtype: torch.dtype, device: torch.device,
               **override) -> dict:
    """Tiles, split and launch settings for x: [m, k] @ an AWQ weight [k, n] of groups of `group`
    input rows; keys block_m, block_n, block_k, split, num_warps, num_stages, any of which
    `override` may fix: kernels/dequant_tiles.py's choices, with this format's K step."""
    if m < 1:
        raise ValueError(f"awq_linear takes at least one row, got {m}")
    if m <= 16 and n >= 128 and "block_n" not in override and \
            2 * triton.cdiv(n, 128) < WAVES * num_sms(device):
        # Measured at decode on an H100 (session 62, the 8B shape's linears at 2 rows): for
        # qkv, o_proj and down, 128-column tiles with K split beat the 32-column ones the rule
        # below gives them by 1.3-1.5x (64 columns: by 1.03-1.09x); gate_up's 192 such tiles,
        # unsplit, lose to its 384 of 64 columns (94 against 69 us).
        override = {**override, "block_n": 128}
    return dequant_gemm_config(m, n, k, dtype, device, lambda most: _block_k(k, group, most),
                               **override)


def awq_linear(x: torch.Tensor, weight: AwqWeight, *, partials: bool = False,
               config: dict | None = None) -> torch.Tensor:
    """x: [M, K] @ the AWQ weight [K, N] -> [M, N] in x.dtype (fp32 accumulation), M >= 1.

    partials=True: the fp32 partial products [split, M, N] (split >= 1), unsummed, for a caller
    that sums them itself. Otherwise a split K is summed here, as a torch op (in split order)."""
    weight.check("awq_linear's weight")  # short zeros or scales would be read past their end
    m, k = x.shape
    n, g = weight.out_features, weight.group_size
    if m < 1:
        raise ValueError(f"awq_linear takes at least one row, got {m}")
    if k != weight.in_features:
        raise ValueError(f"awq_linear: x has {k} columns, the weight {weight.in_features} inputs")
    cfg = awq_config(m, n, k, g, x.dtype, x.device, **(config or {}))
    bk = cfg["block_k"]
    if not (g >= k or g % bk == 0):
        raise ValueError(f"awq_linear: block_k {bk} does not divide the group size {g}")
    out, grid, k_per_split = split_output(x, n, cfg, partials)
    # contiguous(): the loaded tensors themselves (no copy); a view's copy, as the kernel reads
    # rows of N / 8 words (the torch path reads a view where it lies)
    qw, qz, s = (t.contiguous() for t in (weight.qweight, weight.qzeros, weight.scales))
    _awq_gemm_kernel[grid](
        x, qw, qz, s, out, m, n, k, min(g, k), k_per_split, x.stride(0), x.stride(1), n,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=bk,
        EVEN_K=k % bk == 0, SPLIT=out.dim() == 3,
        PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return finish(out, partials, x.dtype)


__all__ = ["AWQ_PACK", "awq_config", "awq_linear"]
