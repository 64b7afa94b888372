"""The stem of a decode step of a few rows as one kernel: each row's embedding, a zero residual,
and RoPE's cos and sin at its position (functional.model.stem, which compiled is four kernels of
~1-2 us each, plus their launch gaps inside the decode graph).

  ids, positions: [M] int64; embed: [vocab, hidden]; inv_freq: [head_dim // 2] fp32 (computed
  once, by rope_inv_freq) -> x, residual: [M, hidden] in embed's dtype; cos, sin: [M, head_dim]
  fp32, each frequency repeated for both halves.

The embedding row is copied and the residual is exact zeros; cos and sin take the same fp32
product position * inv_freq as rope_cos_sin, and libdevice's cos and sin on the GPU (times YaRN's
attention scale, as rope_cos_sin; a product by 1.0 without it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..functional.model import stem as functional_stem
from ..functional.rope import rope_attention_scale, rope_inv_freq
from ..state.batch import Batch
from ..state.params import Params
from .launch import next_pow2, triton_usable

MAX_ROWS = 16  # rows a step may have for this stem (decode steps of the persistent buckets)


@triton.jit
def _decode_stem_kernel(ids_ptr, pos_ptr, embed_ptr, inv_freq_ptr, x_ptr, res_ptr, cos_ptr,
                        sin_ptr, hidden, scale, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    token = tl.load(ids_ptr + row)
    offs = part * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    e = tl.load(embed_ptr + token * hidden + offs, mask=mask)
    tl.store(x_ptr + row * hidden + offs, e, mask=mask)
    tl.store(res_ptr + row * hidden + offs, tl.zeros_like(e), mask=mask)
    if part == 0:
        j = tl.arange(0, 2 * HALF)
        angle = tl.load(pos_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + j % HALF)
        tl.store(cos_ptr + row * 2 * HALF + j, tl.cos(angle) * scale)
        tl.store(sin_ptr + row * 2 * HALF + j, tl.sin(angle) * scale)


def decode_stem(ids: torch.Tensor, positions: torch.Tensor, embed: torch.Tensor,
                inv_freq: torch.Tensor, *, scale: float = 1.0, block_h: int = 1024
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, residual, cos, sin) of the module docstring, in one launch of [M, hidden / block_h]
    programs; cos and sin are multiplied by `scale` (rope_attention_scale: YaRN's)."""
    (m,), (vocab, hidden), (half,) = ids.shape, embed.shape, inv_freq.shape
    if positions.shape != (m,) or ids.dtype != torch.int64 or positions.dtype != torch.int64:
        raise ValueError(f"ids and positions must be int64 [{m}], got {ids.dtype} "
                         f"{list(ids.shape)} and {positions.dtype} {list(positions.shape)}")
    if inv_freq.dtype != torch.float32 or half != next_pow2(half) or not embed.is_contiguous():
        raise ValueError("inv_freq must be fp32 of a power-of-two length and embed contiguous")
    dev = embed.device
    x = torch.empty(m, hidden, dtype=embed.dtype, device=dev)
    residual = torch.empty_like(x)
    cos = torch.empty(m, 2 * half, dtype=torch.float32, device=dev)
    sin = torch.empty_like(cos)
    block_h = min(block_h, next_pow2(hidden))
    _decode_stem_kernel[(m, triton.cdiv(hidden, block_h))](
        ids, positions, embed, inv_freq, x, residual, cos, sin, hidden, float(scale), HALF=half,
        BLOCK_H=block_h, num_warps=4)
    return x, residual, cos, sin


def stem_for(params: Params, fallback=functional_stem):
    """functional.model.stem's replacement for the persistent decode: the kernel for decode
    batches of at most MAX_ROWS rows on one rank where Triton runs, `fallback` (the functional
    stem or a compiled one) for anything else. RoPE's inverse frequencies are computed here,
    once."""
    inv_freq = rope_inv_freq(params.config, params.device)
    if params.shard.world_size != 1 or not triton_usable(params.device) or \
            inv_freq.shape[0] != next_pow2(inv_freq.shape[0]):
        return fallback
    return functools.partial(_stem, inv_freq=inv_freq, scale=rope_attention_scale(params.config),
                             fallback=fallback)


def _stem(params: Params, batch: Batch, *, inv_freq: torch.Tensor, scale: float, fallback):
    # The kernel looks every row's id up: a step with input embeddings takes the fallback's.
    if batch.is_decode and batch.num_seqs <= MAX_ROWS and batch.input_embeds is None:
        return decode_stem(batch.input_ids, batch.positions, params.embed, inv_freq, scale=scale)
    return fallback(params, batch)
