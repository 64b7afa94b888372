"""The `triton` attention backend: paged decode attention, which also writes the new K/V to the
cache (and, through decode_with_norm_rope, norms and rotates q and k first), when every sequence
brings one token (T == B, static); else store_kvcache (through prefill_with_norm_rope,
norm_rope_store: the norm and RoPE too), then the varlen prefill kernel (prefix hits, chunked
prefill and mixed batches alike)."""

from __future__ import annotations

from ..state.batch import Batch
from .decode_attention import paged_decode_attention
from .norm_rope_store import norm_rope_store
from .prefill_attention import varlen_prefill_attention
from .store_kv import store_kvcache


class TritonBackend:
    name = "triton"

    def __call__(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float):
        if batch.is_decode:  # the decode kernel writes the new K/V itself
            return paged_decode_attention(q, k, v, k_cache, v_cache, batch.block_tables,
                                          batch.context_lens, scale, slot_mapping=batch.slot_mapping)
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        return varlen_prefill_attention(q, k, v, k_cache, v_cache, batch.cu_seqlens_q,
                                        batch.context_lens, batch.block_tables, scale)

    def decode_with_norm_rope(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float,
                              norm_rope: tuple):
        """A decode step from the raw q and k projections: the kernel RMS-norms and rotates them
        (norm_rope = (q_weight, k_weight, cos, sin, eps)), which saves a kernel per layer."""
        return paged_decode_attention(q, k, v, k_cache, v_cache, batch.block_tables,
                                      batch.context_lens, scale, slot_mapping=batch.slot_mapping,
                                      norm_rope=norm_rope)

    def prefill_with_norm_rope(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float,
                               norm_rope: tuple):
        """A prefill or mixed step from the raw q and k projections: one kernel norms and rotates
        them and stores the new K/V (kernels.norm_rope_store), where the compiled torch form took
        three (two of Inductor's and store_kvcache)."""
        q, k = norm_rope_store(q, k, v, k_cache, v_cache, batch.slot_mapping, norm_rope)
        return varlen_prefill_attention(q, k, v, k_cache, v_cache, batch.cu_seqlens_q,
                                        batch.context_lens, batch.block_tables, scale)

    def __repr__(self):
        return "TritonBackend()"


TRITON = TritonBackend()
