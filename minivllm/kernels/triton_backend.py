"""The `triton` attention backend: store_kvcache, then paged decode attention when every sequence
brings one token (T == B, static), else the varlen prefill kernel (prefix hits, chunked prefill and
mixed batches alike)."""

from __future__ import annotations

from ..state.batch import Batch
from .decode_attention import paged_decode_attention
from .prefill_attention import varlen_prefill_attention
from .store_kv import store_kvcache


class TritonBackend:
    name = "triton"

    def __call__(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float):
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        if batch.is_decode:
            return paged_decode_attention(q, k, v, k_cache, v_cache, batch.block_tables,
                                          batch.context_lens, scale)
        return varlen_prefill_attention(q, k, v, k_cache, v_cache, batch.cu_seqlens_q,
                                        batch.context_lens, batch.block_tables, scale)

    def __repr__(self):
        return "TritonBackend()"


TRITON = TritonBackend()
