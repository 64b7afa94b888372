"""Add + RMSNorm + GEMM for decode, one kernel: the pre-norm block's entry at a few rows (M <= 16).

    h = x + residual                        x: [M, K], or fp32 split-K partials [S, M, K] summed
    out = rms_norm(h, norm_weight) @ weight.T              weight: [N, K] (nn.Linear layout)
    glu=True: weight is [2 * N, K] (gate rows, then up rows), out = silu(gate) * up: [M, N]
    returns (out, h): h is the new residual stream, [M, K] in residual's dtype

Why: at decode a layer's add + RMSNorm before qkv, and again before gate_up, ran as Inductor
kernels of ~1.5 us each, plus a kernel summing down's split-K partials, each with its launch gap
(about 6 us of a layer's ~43 us at one sequence on the H200, session 5's trace). Here the GEMM
that consumes the normed rows computes them while it streams its weight: each program covers
the whole K (no split-K), so it sees every element of its rows and accumulates their sum of
squares next to the dot products. RMSNorm's per-row scale r = rsqrt(mean(h^2) + eps) commutes
with the product, (r h * g) @ W.T = r ((h * g) @ W.T), so it multiplies the fp32 accumulator at
the end. Program 0 writes h. With glu, each program streams the gate and the up rows of the
same output columns and applies SiLU-and-mul to its accumulators: down then reads the
activation as a plain GEMM.

Rounding follows the PyTorch path (functional.norm.add_rms_norm) where it is cheap: the partials
are summed in fp32 and rounded to the residual's dtype, added to the residual and rounded again
(h matches bit for bit up to the partials' summation order). The normed product is rounded once
as h * g before the dot rather than as r * h, then g * that: results agree to the operands'
rounding (one ulp of 16-bit inputs), not bit for bit.

Cost: every program reloads its rows' x (and partials) from L2, [M, K] x (2 + 4 S) bytes, which
at M = 16 and S = 4 is 0.3 MB a program (from L2), and Triton stages those loads in shared memory
beside the weight's (norm_gemm_config fits them). The engine takes this path where the skinny
GEMM applies, up to 16 rows, and only with MINIVLLM_FUSED_NORM=1 (functional.linear.
fused_norm_applies) until an engine A/B on the GPU says where it pays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dot_precision
from .skinny_gemm import M_PAD, MAX_SKINNY_ROWS, skinny_config


@triton.jit
def _norm_gemm_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, out_ptr, res_out_ptr, M, N, K, eps,
                      stride_xs, stride_xm, stride_rm, stride_wn, stride_om, stride_hm,
                      PARTS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GLU: tl.constexpr,
                      PRECISION: tl.constexpr):
    # Program pid: output columns [pid * BLOCK_N, +BLOCK_N) over the whole K. PARTS = 0: x is
    # [M, K] in the residual's dtype; PARTS = S > 0: x is S fp32 partial sums [S, M, K].
    # The product is computed transposed (acc[BLOCK_N, M_PAD] = w @ x^T) as in skinny_gemm.py,
    # so the weight is the MMA's A operand and its loads pipeline.
    eps = tl.cast(eps, tl.float32)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    dt = res_ptr.dtype.element_ty
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped, never stored: see skinny_gemm.py
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    if GLU:
        acc_up = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    sumsq = tl.zeros([M_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            x_mask = mask_m[:, None]
            w = tl.load(w_ptrs)
            if GLU:
                w_up = tl.load(w_ptrs + N * stride_wn)
        else:
            mask_k = k < K
            x_mask = mask_m[:, None] & mask_k[None, :]
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
            if GLU:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=mask_k[None, :], other=0.0)
        xk = offs_m[:, None] * stride_xm + k[None, :]
        if PARTS > 0:
            s = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
            for p in tl.static_range(PARTS):
                s += tl.load(x_ptr + p * stride_xs + xk, mask=x_mask, other=0.0)
            x = s.to(dt)
        else:
            x = tl.load(x_ptr + xk, mask=x_mask, other=0.0)
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + k[None, :], mask=x_mask, other=0.0)
        h = (x.to(tl.float32) + res.to(tl.float32)).to(dt)  # the residual stream, as torch adds
        if pid == 0:
            tl.store(res_out_ptr + offs_m[:, None] * stride_hm + k[None, :], h, mask=x_mask)
        hf = h.to(tl.float32)
        sumsq += tl.sum(hf * hf, 1)
        g = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        xg = (hf * g[None, :]).to(w_ptr.dtype.element_ty)  # masked lanes: 0
        acc = tl.dot(w, tl.trans(xg), acc, input_precision=PRECISION)  # [BLOCK_N, M_PAD]
        if GLU:
            acc_up = tl.dot(w_up, tl.trans(xg), acc_up, input_precision=PRECISION)
        w_ptrs += BLOCK_K
    r = 1.0 / tl.sqrt(sumsq / K + eps)  # [M_PAD]
    out = acc * r[None, :]
    if GLU:
        out = out * tl.sigmoid(out) * (acc_up * r[None, :])
    mask = (offs_n < N)[:, None] & mask_m[None, :]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None],
             out.to(out_ptr.dtype.element_ty), mask=mask)


SMEM_BUDGET = 96 * 1024  # bytes of pipeline buffers a program: two programs fit an H200 SM


def stage_bytes(parts: int, glu: bool, block_n: int, block_k: int, elsize: int) -> int:
    """Shared memory one pipeline buffer takes (num_stages - 1 of them are allocated): Triton's
    pipeliner stages every load of the loop, not only the weight's: x (or its fp32 partials) and
    the residual [M_PAD, BLOCK_K], the norm weight [BLOCK_K], the weight tile(s)."""
    x = parts * 4 if parts else elsize
    return M_PAD * block_k * (x + elsize) + block_k * elsize + (2 if glu else 1) * block_n * block_k * elsize


def norm_gemm_config(m: int, n: int, k: int, parts: int, glu: bool, dtype: torch.dtype,
                     device: torch.device) -> dict:
    """The skinny GEMM's tiles (skinny_config), never split along K (the norm needs whole rows),
    with num_stages, then block_k, cut until the buffers fit SMEM_BUDGET: x's fp32 partials are
    staged at M_PAD rows whatever M is, and 4 stages of 4 partials at 16 x 256 take 272 KB (above
    an SM's 227 KB; an sm_90 compile in tests/test_norm_gemm.py checks the model)."""
    cfg = skinny_config(m, n, k, dtype, device, split=1)
    elsize = dtype.itemsize
    while cfg["num_stages"] > 1 and (
            (cfg["num_stages"] - 1) * stage_bytes(parts, glu, cfg["block_n"], cfg["block_k"], elsize)
            > SMEM_BUDGET):
        if cfg["num_stages"] > 2:
            cfg["num_stages"] -= 1
        elif cfg["block_k"] > 64:
            cfg["block_k"] //= 2
        else:
            cfg["num_stages"] = 1
    return cfg


def norm_gemm(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
              weight: torch.Tensor, eps: float, *, glu: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) @ weight.T [or silu(gate) * up with glu], x + residual).

    x: [M, K] in residual's dtype, or fp32 partial sums [S, M, K] (a row-parallel GEMM's split-K
    output, summed here); residual: [M, K]; norm_weight: [K]; weight: [N, K] ([2N, K] with glu,
    gate rows then up rows). 1 <= M <= 16. Returns out: [M, N] and the new residual [M, K], both
    in residual's dtype."""
    m, k = residual.shape
    parts = x.shape[0] if x.dim() == 3 else 0
    if not 1 <= m <= MAX_SKINNY_ROWS:
        raise ValueError(f"norm_gemm takes 1..{MAX_SKINNY_ROWS} rows, got {m}")
    if x.shape[-2:] != (m, k) or (parts and x.dtype != torch.float32) or (
            not parts and x.dtype != residual.dtype):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit residual "
                         f"{tuple(residual.shape)} {residual.dtype}")
    n2, kw = weight.shape
    n = n2 // 2 if glu else n2
    if kw != k or (glu and n2 % 2) or norm_weight.shape != (k,):
        raise ValueError(f"weight {tuple(weight.shape)} / norm_weight {tuple(norm_weight.shape)} "
                         f"do not fit K={k}{' (glu: 2N rows)' if glu else ''}")
    assert weight.stride(1) == 1 and x.stride(-1) == 1 and residual.stride(1) == 1
    assert norm_weight.is_contiguous() and weight.dtype == residual.dtype
    cfg = norm_gemm_config(m, n, k, parts, glu, weight.dtype, weight.device)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    out = torch.empty((m, n), device=weight.device, dtype=residual.dtype)
    h = torch.empty_like(residual)
    _norm_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, residual, norm_weight, weight, out, h, m, n, k, eps,
        x.stride(0) if parts else 0, x.stride(-2), residual.stride(0), weight.stride(0),
        out.stride(0), h.stride(0),
        PARTS=parts, M_PAD=M_PAD, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        GLU=glu, PRECISION=dot_precision(weight.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, h
