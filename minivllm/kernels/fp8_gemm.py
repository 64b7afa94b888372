"""Block-fp8 GEMM: out = x @ W.T for a block-fp8 weight W, dequantized tile by tile inside the GEMM.

  x: [M, K] fp16 / bf16 / fp32 (any row stride), W: an Fp8BlockWeight (state/quant.py):
  weight float8_e4m3fn [N, K] (nn.Linear's layout), scale_inv float32 [ceil(N / B0), ceil(K / B1)],
  W[n, k] = weight[n, k] * scale_inv[n // B0, k // B1]; out: [M, N] in x.dtype, fp32 accumulation.

Each program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K in BLOCK_K steps. A step
loads the fp8 weights of its tile as [BLOCK_K, BLOCK_N] (K contiguous in memory), widens them to
fp32 and multiplies each column n by scale_inv[n // B0, k0 // B1]: BLOCK_K divides B1, so a step
reads one scale column, and the scales are gathered per output row (BLOCK_N values from L1/L2),
so a tile may span scale rows and BLOCK_N need not divide B0 (the simplest scheme that is right
for any tile; a per-tile scalar would save a few loads where BLOCK_N divides B0). The product is
rounded once to x's dtype for tl.dot: the weight a dequantize-then-matmul would use
(state/quant.dequantize_fp8_weight), so the torch path and this kernel differ only by the order
of the fp32 sums. Rows past N are clamped onto row N - 1 (read, never stored); K past the end is
masked.

Tiling (fp8_config: kernels/dequant_tiles.py, shared with awq_gemm), from shapes, dtype and the SM
count only (no autotune, no .item()), so a call traces under torch.compile(fullgraph=True) and
replays under CUDA graphs, as awq_gemm's:
- decode (M <= 16): BLOCK_M 16 (tl.dot's minimum), BLOCK_N 64 (32 when N gives too few tiles),
  BLOCK_K 128 (64 in fp32; at most B1, and dividing it); K is split where the output tiles alone
  give fewer than WAVES programs per SM (o_proj, down), each split writing an fp32 partial
  [SPLIT, M, N] that the caller sums in torch (a fixed order: deterministic).
- mid (16 < M <= 64): BLOCK_M 32 / 64, BLOCK_N 64, split as above.
- prefill (M > 64): BLOCK_M 64 (128 past 256 rows), BLOCK_N 128, BLOCK_K 64, no split.
functional.linear takes this kernel for steps of fewer than 256 rows and dequantizes the whole
weight for torch's matmul from 256 rows on (as for AWQ). Its GPU tests passed on an H100 (session
56: tests/test_fp8_weights.py -k gpu); there the Qwen3-8B shape's single stream ran 222 tok/s with
it against 117 with the weights dequantized to bf16. Its tiles are not tuned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..state.quant import Fp8BlockWeight
from .dequant_tiles import dequant_gemm_config, finish, split_output
from .launch import dot_precision

BLOCK_KS = (128, 64, 32, 16)  # largest first; 16 is tl.dot's minimum


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, B0, B1, SK, k_per_split,
                     stride_xm, stride_xk, stride_om,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr):
    # Program (pid_m, pid_n, pid_k): rows [pid_m * BLOCK_M, +BLOCK_M) and columns
    # [pid_n * BLOCK_N, +BLOCK_N) of the output, over K range [pid_k * k_per_split, +k_per_split).
    # With SPLIT, out_ptr is the fp32 workspace [splits, M, N]. SK: scale columns per scale row.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    rows = tl.minimum(offs_n, N - 1)  # the weight's rows (output columns), clamped
    s_rows = s_ptr + (rows // B0) * SK  # each row's scale row
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = w_ptr + rows.to(tl.int64)[None, :] * K + (k_start + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            q = tl.load(w_ptrs)
            x_mask = mask_m[:, None]
        else:
            mask_k = (k0 + offs_k) < k_end
            q = tl.load(w_ptrs, mask=mask_k[:, None], other=0.0)
            x_mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        s = tl.load(s_rows + k0 // B1)  # [BLOCK_N]: BLOCK_K divides B1, one scale column
        w = (q.to(tl.float32) * s[None, :]).to(x_ptr.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        part = out_ptr + pid_k.to(tl.int64) * M * N  # workspace [splits, M, N], contiguous
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_k_for(block_in: int, most: int) -> int:
    """The K step: the largest of BLOCK_KS up to `most` that divides the scale block's columns
    (so that a step reads one scale column); a ValueError where none does (block_in not a
    multiple of 16: state/load.py dequantizes such a checkpoint at load instead)."""
    for b in BLOCK_KS:
        if b <= most and block_in % b == 0:
            return b
    raise ValueError(f"fp8 weight_block_size columns {block_in} are not a multiple of 16 (the "
                     f"kernel's K step)")


def fp8_config(m: int, n: int, k: int, block: tuple[int, int], dtype: torch.dtype,
               device: torch.device, **override) -> dict:
    """Tiles, split and launch settings for x: [m, k] @ a block-fp8 weight [n, k].T in `block`
    scale blocks; keys block_m, block_n, block_k, split, num_warps, num_stages, any of which
    `override` may fix: kernels/dequant_tiles.py's choices, with this format's K step."""
    if m < 1:
        raise ValueError(f"fp8_linear takes at least one row, got {m}")
    return dequant_gemm_config(m, n, k, dtype, device, lambda most: block_k_for(block[1], most),
                               **override)


def fp8_linear(x: torch.Tensor, weight: Fp8BlockWeight, *, partials: bool = False,
               config: dict | None = None) -> torch.Tensor:
    """x: [M, K] @ the block-fp8 weight [N, K].T -> [M, N] in x.dtype (fp32 accumulation),
    M >= 1. The kernel reads the weight and its scales as contiguous (as load makes them): a
    view (a column slice, say) is copied first, so that it computes what the torch path does.

    partials=True: the fp32 partial products [split, M, N] (split >= 1), unsummed, for a caller
    that sums them itself. Otherwise a split K is summed here, as a torch op (in split order)."""
    weight.check_grid("fp8_linear's weight")  # a short scale grid would be read past its end
    m, k = x.shape
    n = weight.out_features
    bn, bk = weight.block
    if m < 1:
        raise ValueError(f"fp8_linear takes at least one row, got {m}")
    if k != weight.in_features:
        raise ValueError(f"fp8_linear: x has {k} columns, the weight {weight.in_features} inputs")
    cfg = fp8_config(m, n, k, weight.block, x.dtype, x.device, **(config or {}))
    block_k = cfg["block_k"]
    if bk % block_k:
        raise ValueError(f"fp8_linear: block_k {block_k} does not divide the scale block's {bk} "
                         f"columns")
    out, grid, k_per_split = split_output(x, n, cfg, partials)
    # contiguous(): the loaded tensors themselves (no copy); a view's copy
    w, s = weight.weight.contiguous(), weight.scale_inv.contiguous()
    _fp8_gemm_kernel[grid](
        x, w, s, out, m, n, k, bn, bk, s.shape[1], k_per_split, x.stride(0), x.stride(1), n,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, SPLIT=out.dim() == 3,
        PRECISION=dot_precision(x.dtype), num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return finish(out, partials, x.dtype)


__all__ = ["fp8_config", "fp8_linear", "block_k_for"]
