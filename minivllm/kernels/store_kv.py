"""store_kvcache: this step's keys and values into their paged cache slots, in place.

k, v: [T, kv_heads, head_dim] (any row and head strides, head_dim contiguous)
k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim] (contiguous)
slot_mapping: [T] int64, slot = block * block_size + offset; -1 skips the token (padding rows).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2


@triton.jit
def _store_kvcache_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # A slot's rows for all heads are one contiguous run of KV_HEADS * HEAD_DIM elements.
    dst = slot.to(tl.int64) * (KV_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    t64 = t.to(tl.int64)
    kv = tl.load(k_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, kv.to(k_cache_ptr.dtype.element_ty), mask=mask)
    vv = tl.load(v_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, vv.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k, v: [T, kv_heads, head_dim] into the cache slots named by slot_mapping [T]."""
    t, kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape, (k.shape, v.shape, k_cache.shape)
    assert k_cache.shape[2:] == (kv_heads, head_dim), (k_cache.shape, k.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the paged cache must be contiguous"
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    if t == 0:
        return
    _store_kvcache_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim), num_warps=4)
