"""The tile choices of the Triton GEMMs that dequantize their weight tile by tile inside the
GEMM (awq_gemm.py: 4-bit AWQ; fp8_gemm.py: block fp8), from shapes, dtype and the SM count only
(no autotune, no .item()), so a call traces under torch.compile(fullgraph=True) and replays
under CUDA graphs. The two differ only in the K step their format allows (block_k below):
- decode (M <= 16): BLOCK_M 16 (tl.dot's minimum), BLOCK_N 64 (32 when N gives too few tiles),
  BLOCK_K up to 128 (64 in fp32); K is split where the output tiles alone give fewer than WAVES
  programs per SM (o_proj, down), each split writing an fp32 partial [SPLIT, M, N] that the
  caller sums in torch (a fixed order: deterministic).
- mid (16 < M <= 64): BLOCK_M 32 / 64, BLOCK_N 64, split as above.
- prefill (M > 64): BLOCK_M 64 (128 past 256 rows), BLOCK_N 128, BLOCK_K up to 64 (32 in fp32),
  no split; 8 warps for the 128 x 128 tiles.
Guesses from skinny_gemm's reasoning, not tuned on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton

from .launch import interpreting, next_pow2, num_sms

WAVES = 2  # programs per SM wanted at decode (see skinny_gemm.py)


def dequant_gemm_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                        k_step: Callable[[int], int], **override) -> dict:
    """block_m, block_n, block_k, split, num_warps, num_stages for x: [m, k] @ a weight of n
    outputs (m >= 1), any of which `override` may fix. k_step(most): the format's K step, at
    most `most` (a divisor of AWQ's group, of fp8's scale block)."""
    want = WAVES * num_sms(device)
    if m <= 64:
        block_m = 16 if m <= 16 else next_pow2(m)
        m_tiles = triton.cdiv(m, block_m)
        block_n = 64 if triton.cdiv(n, 64) * m_tiles >= want or n <= 32 else 32
        step = k_step(128 if dtype.itemsize == 2 else 64)
    else:
        block_m = 64 if m <= 256 else 128
        block_n = 128
        step = k_step(64 if dtype.itemsize == 2 else 32)
    block_m = override.get("block_m") or block_m
    block_n = override.get("block_n") or block_n
    step = override.get("block_k") or step
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    chunks = triton.cdiv(k, step)
    split = 1 if m > 64 else max(1, min(chunks, (want + tiles // 2) // tiles))
    split = override.get("split") or split
    split = triton.cdiv(chunks, triton.cdiv(chunks, split))  # whole chunks, none empty
    on_gpu = device.type == "cuda" and not interpreting()
    big = block_m * block_n >= 128 * 128
    return dict(block_m=block_m, block_n=block_n, block_k=step, split=split,
                num_warps=override.get("num_warps") or (8 if big else 4),
                num_stages=override.get("num_stages") or (3 if on_gpu and big else
                                                          4 if on_gpu else 2))


def split_output(x: torch.Tensor, n: int, cfg: dict, partials: bool
                 ) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """For x: [m, k] times a weight of n outputs under `cfg` (dequant_gemm_config's): the output,
    x's dtype [m, n], or where K is split or the caller wants the partials an fp32 workspace
    [split, m, n] (the kernels' SPLIT is then out.dim() == 3); the grid (m tiles, n tiles,
    splits); and the K columns each split takes (whole block_k steps)."""
    m, k = x.shape
    step, split = cfg["block_k"], cfg["split"]
    to_workspace = partials or split > 1
    out = torch.empty((split, m, n) if to_workspace else (m, n), device=x.device,
                      dtype=torch.float32 if to_workspace else x.dtype)
    grid = (triton.cdiv(m, cfg["block_m"]), triton.cdiv(n, cfg["block_n"]), split)
    return out, grid, triton.cdiv(triton.cdiv(k, step), split) * step


def finish(out: torch.Tensor, partials: bool, dtype: torch.dtype) -> torch.Tensor:
    """split_output's output as the caller asked: the partials unsummed, else [m, n] in
    `dtype` (a split K summed here, as a torch op in split order: deterministic)."""
    if partials or out.dim() == 2:
        return out
    return out.sum(0).to(dtype)
