"""A prefill or mixed step's q/k RMSNorm and RoPE, with the new keys and values written to the
paged cache, as one kernel: what functional.layer.qk_norm_rope then store_kvcache do.

  q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] (views of the qkv projection: any row and
  head strides, head_dim contiguous), q_weight/k_weight: [head_dim], cos/sin: [T, head_dim] fp32
  k_cache/v_cache: [num_blocks, PAGE, kv_heads, head_dim], slot_mapping: [T] int64 (-1: skip)
  -> q_out [T, heads, head_dim], k_out [T, kv_heads, head_dim] (normed and rotated, contiguous)

Compiled, the torch form was two Inductor kernels of 120 and 50 us a layer at a prefill step's
~8,100 tokens on the H200, and the store 18 more (BENCHMARKS.md session 25); its norm took one
(token, head) row of 256 bytes a program, ~194,000 programs. Here a program takes one token's
heads, all of them, and rounds where the eager torch form rounds (decode_attention's
_load_norm_rope, which the decode kernel also uses). At 8,192 tokens it took 44.6 us against
the compiled form and store's 109 (benchmarks/norm_rope_probe.py, session 26). There, in bf16,
77% of its values equaled the eager form's and 19% were one ulp off: LLVM had fused one of the
rotation's products into its sum, which _norm_rope now prevents (tests/test_norm_rope_store.py
checks the sm_90 code); since, 99.999% equal it (session 27). About half equal the compiled
form's, the one the engine took before (Inductor keeps some intermediates in fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_attention import _load_norm_rope, _rope_lanes
from .launch import next_pow2


@triton.jit
def _norm_rope_store_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr,
                            q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, eps,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                            stride_rope,
                            HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    eps = tl.cast(eps, tl.float32)  # under torch.compile a Python float can arrive as fp64
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    partner, cos, sin = _rope_lanes(cos_ptr + t * stride_rope, sin_ptr + t * stride_rope,
                                    offs_d, mask_d, HEAD_DIM)
    offs_h = tl.arange(0, BLOCK_H)
    q_mask = (offs_h < HEADS)[:, None] & mask_d[None, :]
    q = _load_norm_rope(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh, q_mask, qw_ptr,
                        offs_d, partner, mask_d, cos, sin, eps, HEAD_DIM)
    tl.store(q_out_ptr + (t * HEADS + offs_h[:, None]) * HEAD_DIM + offs_d[None, :], q,
             mask=q_mask)
    offs_kv = tl.arange(0, BLOCK_KV)
    kv_mask = (offs_kv < KV_HEADS)[:, None] & mask_d[None, :]
    k = _load_norm_rope(k_ptr + t * stride_kt + offs_kv[:, None] * stride_kh, kv_mask, kw_ptr,
                        offs_d, partner, mask_d, cos, sin, eps, HEAD_DIM)
    row = offs_kv[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_out_ptr + t * (KV_HEADS * HEAD_DIM) + row, k, mask=kv_mask)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # a slot's rows for all heads are one contiguous run
        dst = slot.to(tl.int64) * (KV_HEADS * HEAD_DIM) + row
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=kv_mask)
        v = tl.load(v_ptr + t * stride_vt + offs_kv[:, None] * stride_vh + offs_d[None, :],
                    mask=kv_mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=kv_mask)


def norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor, norm_rope: tuple
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out): q and k RMS-normed per head and rotated, as functional.layer.qk_norm_rope
    gives them; k_out and v are also written to the cache slots of slot_mapping (see module).
    norm_rope = (q_weight, k_weight, cos, sin, eps)."""
    q_weight, k_weight, cos, sin, eps = norm_rope
    t, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    assert k.shape == v.shape == (t, kv_heads, head_dim), (q.shape, k.shape, v.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (kv_heads, head_dim)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the paged cache must be contiguous"
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    assert head_dim % 2 == 0 and q_weight.shape == k_weight.shape == (head_dim,)
    assert q_weight.is_contiguous() and k_weight.is_contiguous()
    assert cos.shape == sin.shape == (t, head_dim) and cos.stride() == sin.stride()
    assert cos.stride(1) == 1 and slot_mapping.shape == (t,), (cos.shape, slot_mapping.shape)
    q_out = torch.empty((t, heads, head_dim), device=q.device, dtype=q.dtype)
    k_out = torch.empty((t, kv_heads, head_dim), device=k.device, dtype=k.dtype)
    if t == 0:
        return q_out, k_out
    _norm_rope_store_kernel[(t,)](
        q, k, v, q_weight, k_weight, cos, sin, slot_mapping, q_out, k_out, k_cache, v_cache,
        float(eps), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(heads), BLOCK_KV=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
        num_warps=4)
    return q_out, k_out
