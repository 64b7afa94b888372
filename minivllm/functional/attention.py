"""Attention over the paged KV cache: the backend interface and the pure-PyTorch reference.

A backend is a callable

    backend(q, k, v, k_cache, v_cache, batch, scale) -> out

  q:  [T, heads, head_dim]        this step's queries (RoPE applied)
  k, v: [T, kv_heads, head_dim]   this step's keys and values
  k_cache, v_cache: [num_blocks, block_size, kv_heads, head_dim]   one layer of the cache
  batch: Batch                    slot_mapping, cu_seqlens_q, context_lens, block_tables
  out: [T, heads, head_dim]

that first writes k/v into the cache slots named by batch.slot_mapping (-1: skip), in place, and
then computes causal attention of each sequence's new tokens over its whole context: the prefix
already in the cache (read through its block table) followed by the new tokens themselves.
A backend may also offer `decode_with_norm_rope(q, k, v, k_cache, v_cache, batch, scale,
norm_rope)` for decode steps and `prefill_with_norm_rope(...)` (the same arguments) for the
others, taking q and k before their per-head RMSNorm and RoPE (norm_rope = (q_weight, k_weight,
cos, sin, eps), as functional.layer.qk_norm_rope takes them).
Backends are objects with a `name`, chosen once (see minivllm.kernels.select_backend) and passed
to `forward` as static arguments.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..state.batch import Batch
from ..state.config import FP8_DTYPES

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class AttentionBackend(Protocol):
    name: str

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor: ...


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v: [T, kv_heads, head_dim] into their cache slots in place; slot -1 is skipped.

    Shapes stay static (no boolean indexing, so this compiles with fullgraph=True): a skipped
    row is redirected to the first written row's slot and value, a duplicate write of identical
    data; with no written row at all, slot 0 is rewritten with its own contents. The cache holds
    values, never gradients, so the written data is detached."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    valid = slot_mapping >= 0
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    # the first written row (the last row if none); a min, not an argmax over ties
    first = torch.where(valid, rows, slot_mapping.shape[0] - 1).min().reshape(1)
    any_valid = valid.index_select(0, first)  # [1]
    fallback_slot = torch.where(any_valid, slot_mapping.index_select(0, first), 0)  # [1]
    slots = torch.where(valid, slot_mapping, fallback_slot)
    for new, cache in ((k, k_cache), (v, v_cache)):
        flat = cache.view(num_slots, *cache.shape[2:])
        new = new.detach()
        if cache.dtype in FP8_DTYPES:
            # saturate as the GPU's conversion does (torch's gives NaN); index_copy_ has no fp8
            # kernel (CPU): copy the bytes
            new = new.clamp(-FP8_MAX, FP8_MAX).to(cache.dtype).view(torch.uint8)
            flat = flat.view(torch.uint8)
        else:
            new = new.to(cache.dtype)
        fallback_value = torch.where(any_valid[:, None, None], new.index_select(0, first), flat[:1])
        values = torch.where(valid[:, None, None], new, fallback_value)
        flat.index_copy_(0, slots, values)


def token_seq_ids(cu_seqlens_q: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to: a running count of the sequence
    starts at or before each token (the first start, 0, is not counted). A scatter and a cumsum
    rather than searchsorted, whose compiled CUDA lowering indexed out of bounds (torch 2.11).
    Sequences without tokens may end the batch (runtime/prefill_graph.py pads with them): their
    starts, at T, land in one spare slot."""
    starts = torch.zeros(num_tokens + 1, dtype=torch.int64, device=cu_seqlens_q.device)
    starts.index_add_(0, cu_seqlens_q[1:-1].long(), torch.ones_like(cu_seqlens_q[1:-1], dtype=torch.int64))
    return starts[:num_tokens].cumsum(0)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache: [num_blocks, block_size, kv_heads, d], block_tables: [B, M]
    -> [B, M * block_size, kv_heads, d]: each sequence's slots laid out contiguously."""
    b, m = block_tables.shape
    blocks = cache[block_tables.clamp(min=0).long()]  # [B, M, block_size, kv_heads, d]
    return blocks.reshape(b, m * cache.shape[1], *cache.shape[2:])


class ReferenceBackend:
    """Pure PyTorch, vectorised over the batch with static shapes: the CPU path, the oracle for
    every other backend, and differentiable with respect to q, k and v (the cached prefix is read
    from the cache, the new tokens' keys and values are used as computed; with an fp8 cache, as a
    decode step reads them: all but the query's own token from the cache)."""

    name = "reference"

    def __call__(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        return reference_attention(q, k, v, k_cache, v_cache, batch, scale)

    def __repr__(self):
        return "ReferenceBackend()"


def reference_attention(q, k, v, k_cache, v_cache, batch: Batch, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    seq = token_seq_ids(batch.cu_seqlens_q, t)  # [T]
    q_lens = batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]
    prefix_lens = (batch.context_lens - q_lens).long()  # [B] tokens read from the cache

    qf = q.float().reshape(t, hkv, group, d)
    # Scores against the cached prefix: [T, hkv, group, L]
    k_ctx = gather_context(k_cache, batch.block_tables)[seq].float()  # [T, L, hkv, d]
    v_ctx = gather_context(v_cache, batch.block_tables)[seq].float()
    s_ctx = torch.einsum("thgd,tlhd->thgl", qf, k_ctx) * scale
    ctx_pos = torch.arange(k_ctx.shape[1], device=q.device)
    ctx_mask = ctx_pos[None, :] < prefix_lens[seq][:, None]  # [T, L]
    # Scores against this step's tokens, causal within the same sequence: [T, hkv, group, T]
    s_new = torch.einsum("thgd,uhd->thgu", qf, k.float()) * scale
    idx = torch.arange(t, device=q.device)
    new_mask = (seq[:, None] == seq[None, :]) & (idx[None, :] <= idx[:, None])  # [T, T]
    if k_cache.dtype in FP8_DTYPES:
        # As a decode step reads them: every earlier token from the cache, this step's too
        # (written above, fp8-rounded), and only the query's own token as computed. So a
        # verification chunk [t, d1..dk], or a prompt in chunks, sees the values the engine
        # decoding one token a step would (fp8's rounding is far coarser than the compute
        # dtype's: speculation's outputs differed from the plain engine's).
        own = prefix_lens[seq] + idx - batch.cu_seqlens_q[:-1].long()[seq]  # [T] positions
        ctx_mask = ctx_pos[None, :] < own[:, None]
        new_mask = idx[None, :] == idx[:, None]

    scores = torch.cat([s_ctx, s_new], dim=-1)
    mask = torch.cat([ctx_mask, new_mask], dim=-1)[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    l = k_ctx.shape[1]
    # A masked value must weigh nothing, and 0 * nan is nan: a slot past the context (a freed
    # block's stale nan) or another sequence's non-finite token would spoil every row. The
    # context's are zeroed; the new tokens' are cleaned, and a row that attends a non-finite one
    # of its own sequence is made nan (as its own attention would be).
    v_ctx = torch.where(ctx_mask[:, :, None, None], v_ctx, 0.0)
    vf = v.float()
    finite = torch.isfinite(vf).flatten(1).all(1)  # [T]
    attends_bad = (new_mask & ~finite[None, :]).any(1)  # [T]
    out = torch.einsum("thgl,tlhd->thgd", probs[..., :l], v_ctx) + torch.einsum(
        "thgu,uhd->thgd", probs[..., l:], torch.where(finite[:, None, None], vf, 0.0))
    out = torch.where(attends_bad[:, None, None, None], float("nan"), out)
    return out.reshape(t, hq, d).to(q.dtype)


REFERENCE = ReferenceBackend()
