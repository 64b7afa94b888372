"""Three cheaper ways for kernels/awq_gemm.py to turn a nibble into a weight, for
quant_gemm_probe.py to time against it (session 62: not yet run on a GPU).

At decode the AWQ kernel reads a quarter of the dense weight's bytes yet ran no faster than
cuBLAS on the dense weight (gate_up at 2 rows: 69 us for 50 MB, ~0.7 TB/s on an H100): it is
bound by the instructions that unpack each weight, and two of them are conversions, which a
Hopper SM issues at a quarter of the rate of its other arithmetic (int32 -> fp32 for q - z, fp32
-> x's dtype for the product). All variants take the nibble out as awq_gemm.py does (a shift
and a mask) and differ after it:
- "magic32": OR the nibble into the bits of 2^23 (0x4B000000) and read them as fp32: 2^23 + q,
  exactly; minus 2^23 + z, times the scale: the same fp32 value as awq_gemm.py's (q - z) * s,
  rounded once to x's dtype, so the same weights and products. One conversion a weight, not two.
- "half": OR the nibble into the bits of 1024 (fp16 0x6400) or 128 (bf16 0x4300) and read them
  as x's dtype: 1024 + q (128 + q) exactly; minus 1024 + z: q - z exactly; times the scale in
  x's dtype (Marlin's way: two weights an instruction, no conversion). In fp16, the dtype of
  Qwen's AWQ checkpoints, the scales are exact and the product correctly rounded: the same
  weights as awq_gemm.py's. In bf16 the fp16 scale is rounded to bf16 first (other weights:
  two roundings). fp32 inputs take magic32's path.
- "exact": as "half" up to q - z, then the tile's partial product x @ (q - z) (fp32
  accumulation) multiplied by the scale once per column after tl.dot (the K step lies in one
  group). The weights are then the exact (q - z) * s, not rounded to x's dtype: other numerics
  than the torch path's (dequantize_awq rounds each weight), closer to the checkpoint's. fp32
  inputs take 2^23 as the magic number.
awq_variant(x, weight, mode) takes awq_gemm.py's tiles and split (awq_config).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.kernels.awq_gemm import awq_config
from minivllm.kernels.dequant_tiles import finish, split_output
from minivllm.kernels.launch import dot_precision

MODES = ("magic32", "half", "exact")  # the kernel's MODE: their index


@triton.jit
def _awq_variant_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, G, k_per_split,
                        stride_xm, stride_xk, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_K: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                        MODE: tl.constexpr):
    # awq_gemm.py's program; only the weights' dequantization differs (module docstring).
    BP: tl.constexpr = BLOCK_N // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_p = pid_n * BP + tl.arange(0, BP)
    offs_k = tl.arange(0, BLOCK_K)
    r = tl.arange(0, 8)
    shifts = ((r // 2) + (r % 2) * 4) * 4
    NP = N // 8
    mask_m = offs_m < M
    mask_p = offs_p < NP
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = qw_ptr + (k_start + offs_k).to(tl.int64)[:, None] * NP + offs_p[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    xdt = x_ptr.dtype.element_ty
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            qw = tl.load(w_ptrs, mask=mask_p[None, :], other=0)
            x_mask = mask_m[:, None]
        else:
            mask_k = (k0 + offs_k) < k_end
            qw = tl.load(w_ptrs, mask=mask_k[:, None] & mask_p[None, :], other=0)
            x_mask = mask_m[:, None] & mask_k[None, :]
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        g = k0 // G
        qz = tl.load(qz_ptr + g * NP + offs_p, mask=mask_p, other=0)
        z = tl.reshape((qz[:, None] >> shifts[None, :]) & 0xF, (BLOCK_N,))  # [BLOCK_N] int32
        s = tl.load(s_ptr + g * N + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        nib = (qw[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_K, BP, 8] int32
        if MODE != 0 and xdt != tl.float32:  # half, exact: q - z exactly in x's dtype
            if xdt == tl.bfloat16:
                q = (nib | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)  # 128 + q
                zq = (z + 128).to(tl.bfloat16)
            else:
                q = (nib | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)  # 1024 + q
                zq = (z + 1024).to(tl.float16)
            w = tl.reshape(q, (BLOCK_K, BLOCK_N)) - zq[None, :]
            if MODE == 1:
                w = w * s.to(xdt)[None, :]
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            else:
                acc += tl.dot(x, w, input_precision=PRECISION) * s[None, :]
        else:  # magic32 (and fp32 inputs): 2^23 + q, minus 2^23 + z, in fp32
            q = (nib | 0x4B000000).to(tl.float32, bitcast=True)
            zq = (z | 0x4B000000).to(tl.float32, bitcast=True)
            w = tl.reshape(q, (BLOCK_K, BLOCK_N)) - zq[None, :]
            if MODE == 2:
                acc += tl.dot(x, w, input_precision=PRECISION) * s[None, :]
            else:
                acc = tl.dot(x, (w * s[None, :]).to(xdt), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * NP
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        part = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


def awq_variant(x: torch.Tensor, weight, mode: str, **override) -> torch.Tensor:
    """x: [M, K] @ the AWQ weight [K, N] -> [M, N] in x.dtype, by the `mode` variant, at
    awq_gemm.py's tiles (override: awq_config's)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    m, k = x.shape
    n, g = weight.out_features, weight.group_size
    cfg = awq_config(m, n, k, g, x.dtype, x.device, **override)
    bk = cfg["block_k"]
    out, grid, k_per_split = split_output(x, n, cfg, False)
    _awq_variant_kernel[grid](
        x, weight.qweight, weight.qzeros, weight.scales, out, m, n, k, min(g, k), k_per_split,
        x.stride(0), x.stride(1), n,
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=bk,
        EVEN_K=k % bk == 0, SPLIT=out.dim() == 3, PRECISION=dot_precision(x.dtype),
        MODE=MODES.index(mode), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return finish(out, False, x.dtype)
