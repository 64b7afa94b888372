"""The head of a decode step of a few rows on one GPU as one kernel: the final add + RMSNorm,
the LM head, the logits' cast to fp32, and the first half of the greedy pick (each program's
(max, first id of it) over its vocabulary tile), where functional.model.head compiled is an add +
norm kernel, cuBLAS's GEMV and a cast, and the pick two more kernels after them.

  x, residual: [M, hidden] (the last layer's output and residual stream; x may be fp32 split-K
  partials [S, M, hidden]), norm_weight: [hidden], head_weight: [>= vocab, hidden]
  -> logits [M, vocab] fp32, tile_max [M, tiles] fp32, tile_argmax [M, tiles] int32

A program streams tiles of BLOCK_N rows of the head's weight as the skinny GEMM does (the weight is
tl.dot's A operand, so the pipeliner keeps its tiles in flight in shared memory; skinny_gemm.py),
and norms its x chunk on the fly from each row's 1 / RMS, which it computes itself from the whole
row (2-4 KB from L2), as the persistent decode layers do. Two programs an SM share the tiles, each
taking every 264th (at 132 SMs), so that each row's RMS is computed 264 times, not once a tile
(2,374 times): 81.3 / 82.5 us at 1 / 2 rows against 84.0 / 87.6 with a program a tile, cuBLAS's
GEMV of the same weight without the norm 74.7 / 75.4 (H200, BENCHMARKS.md session 22; one and three
programs an SM were 15-20% slower). Values are rounded to the activation dtype where
functional.model.head rounds them (the add, the norm, the weight's product, the logits), so the
logits differ from it only by the GEMV's order of summation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..functional.linear import sum_partials
from .decode_layer import _row_rms
from .launch import dot_precision, next_pow2, num_sms, runs_ptx

BLOCK_N = 64  # head rows a tile: 2,374 tiles at Qwen3's vocabulary
PROGRAMS_PER_SM = 2
M_PAD = 16  # tl.dot's minimum; rows past M load as zeros
MAX_ROWS = M_PAD


@triton.jit
def _decode_head_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, logits_ptr, max_ptr, arg_ptr, N, tiles,
                        eps, M: tl.constexpr, K: tl.constexpr, M_PAD: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
                        PRECISION: tl.constexpr, TILE_LOOP: tl.constexpr):
    offs_m = tl.arange(0, M_PAD)
    # Each row's 1 / RMS of x + residual, as the persistent layers compute it: once a program,
    # whichever number of tiles it then takes.
    rms = tl.zeros([M_PAD], dtype=tl.float32)
    for m in tl.static_range(M):
        rms = tl.where(offs_m == m, _row_rms(x_ptr + m * K, res_ptr + m * K, K, eps, BLOCK_H, True),
                       rms)
    if TILE_LOOP:  # fewer programs than tiles, each taking every num_programs-th tile
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            _head_tile(x_ptr, res_ptr, nw_ptr, w_ptr, logits_ptr, max_ptr, arg_ptr, N, tiles,
                       tile, rms, M, K, M_PAD, BLOCK_N, BLOCK_K, PRECISION)
    else:
        _head_tile(x_ptr, res_ptr, nw_ptr, w_ptr, logits_ptr, max_ptr, arg_ptr, N, tiles,
                   tl.program_id(0), rms, M, K, M_PAD, BLOCK_N, BLOCK_K, PRECISION)


@triton.jit
def _head_tile(x_ptr, res_ptr, nw_ptr, w_ptr, logits_ptr, max_ptr, arg_ptr, N, tiles, tile, rms,
               M: tl.constexpr, K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One vocabulary tile: its logits and its (max, first id) for each row."""
    dtype = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, M_PAD)
    mask_m = offs_m < M
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Weight rows past N are clamped onto row N - 1 (read, never stored): no mask on the loads.
    w_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_N, M_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs)
        rows = offs_m[:, None] * K + (k0 + offs_k)[None, :]
        added = (tl.load(x_ptr + rows, mask=mask_m[:, None], other=0.0).to(tl.float32) +
                 tl.load(res_ptr + rows, mask=mask_m[:, None], other=0.0).to(tl.float32)
                 ).to(dtype)
        n = (added.to(tl.float32) * rms[:, None]).to(dtype)
        h = (tl.load(nw_ptr + k0 + offs_k).to(tl.float32)[None, :] * n.to(tl.float32)).to(dtype)
        acc = tl.dot(w, tl.trans(h), acc, input_precision=PRECISION)  # [BLOCK_N, M_PAD]
        w_ptrs += BLOCK_K
    logits = acc.to(dtype).to(tl.float32)  # the model's logits are in its dtype, then widened
    mask_n = offs_n < N
    tl.store(logits_ptr + offs_m[None, :] * N + offs_n[:, None], logits,
             mask=mask_n[:, None] & mask_m[None, :])
    cand = tl.where(mask_n[:, None], logits, float("-inf"))
    best = tl.max(cand, axis=0)  # [M_PAD]
    first = tl.min(tl.where(cand == best[None, :], offs_n[:, None], 2147483647), axis=0)
    tl.store(max_ptr + offs_m * tiles + tile, best, mask=mask_m)
    tl.store(arg_ptr + offs_m * tiles + tile, first, mask=mask_m)


def decode_head(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor,
                head_weight: torch.Tensor, *, vocab_size: int, eps: float,
                programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, tile_max, tile_argmax) of the module docstring, in one launch. tile_argmax's
    entries are vocabulary ids; kernels.sample_kernel.argmax_of_tiles finishes the pick.
    programs: how many programs share the tiles (default PROGRAMS_PER_SM an SM, at most one a
    tile; see the module docstring; benchmarks/sweep_decode_head.py times the counts)."""
    x = sum_partials(x, residual.dtype)
    m, k = x.shape
    dtype = x.dtype
    if not 1 <= m <= MAX_ROWS or residual.shape != x.shape or residual.dtype != dtype:
        raise ValueError(f"decode_head takes 1-{MAX_ROWS} rows of x and a residual alike, got "
                         f"{tuple(x.shape)} {dtype} and {tuple(residual.shape)} {residual.dtype}")
    if head_weight.shape[1] != k or head_weight.shape[0] < vocab_size or \
            norm_weight.shape != (k,) or head_weight.dtype != dtype:
        raise ValueError(f"head weight [>= {vocab_size}, {k}] and norm weight [{k}] in {dtype} "
                         f"expected, got {tuple(head_weight.shape)} {head_weight.dtype} and "
                         f"{tuple(norm_weight.shape)}")
    block_k = _block_k(dtype)
    if k % block_k or not (x.is_contiguous() and residual.is_contiguous() and
                           head_weight.is_contiguous()):
        raise ValueError(f"decode_head needs contiguous inputs and hidden a multiple of {block_k}")
    tiles = triton.cdiv(vocab_size, BLOCK_N)
    if programs is None:
        programs = min(PROGRAMS_PER_SM * num_sms(x.device), tiles)
    if not 1 <= programs <= tiles:
        raise ValueError(f"decode_head runs 1-{tiles} programs here, got {programs}")
    logits = torch.empty(m, vocab_size, dtype=torch.float32, device=x.device)
    tile_max = torch.empty(m, tiles, dtype=torch.float32, device=x.device)
    tile_argmax = torch.empty(m, tiles, dtype=torch.int32, device=x.device)
    on_gpu = runs_ptx(x.device)
    _decode_head_kernel[(programs,)](
        x, residual, norm_weight, head_weight, logits, tile_max, tile_argmax, vocab_size, tiles,
        float(eps), M=m, K=k, M_PAD=M_PAD, BLOCK_N=BLOCK_N, BLOCK_K=block_k,
        BLOCK_H=next_pow2(k), PRECISION=dot_precision(dtype), TILE_LOOP=programs < tiles,
        num_warps=4,
        num_stages=4 if on_gpu and dtype.itemsize == 2 else 3)
    return logits, tile_max, tile_argmax


def _block_k(dtype: torch.dtype) -> int:
    """Hidden columns a weight tile: 8 KB tiles of 64 rows, as the skinny GEMM's."""
    return 256 // dtype.itemsize


def head_fits(params) -> bool:
    """Whether decode_head takes this model's head (one rank; hidden a multiple of its tiles)."""
    return params.shard.world_size == 1 and params.config.hidden_size % _block_k(params.dtype) == 0


def picking_head(params, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor):
    """functional.model.head's signature for a decode step, which wants logits at every row:
    decode_head's (logits, tile_max, tile_argmax) from params' final norm and LM head."""
    if rows.shape[0] != residual.shape[0]:
        raise ValueError(f"picking_head gives logits at every row: {rows.shape[0]} rows asked "
                         f"for, {residual.shape[0]} computed")
    config = params.config
    return decode_head(x, residual, params.final_norm, params.head_weight,
                       vocab_size=config.vocab_size, eps=config.rms_norm_eps)
