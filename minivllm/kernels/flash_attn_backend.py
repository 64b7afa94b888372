"""The `flash_attn` backend: flash-attn-4 (flash_attn.cute) over the paged cache, after our
store_kvcache kernel writes this step's K/V. It reads the new tokens back from the cache, so a row
whose write was skipped (slot -1, padding) gets a meaningless output, as padding may."""

from __future__ import annotations

import functools

import torch

from ..state.batch import Batch
from .store_kv import store_kvcache


@functools.lru_cache(maxsize=1)
def flash_attn_varlen():
    """flash_attn.cute.flash_attn_varlen_func, or None when flash-attn-4 is not importable."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:  # ImportError, or a CUDA/DSL mismatch raised at import
        return None
    return flash_attn_varlen_func


def fa4_num_splits(device) -> int:
    """flash-attn-4 splits the KV length by its own heuristic (0), except on Hopper (sm_90), where
    its forward asserts "SplitKV not supported on SM 9.0" (4.0.0b36): one split there."""
    return 1 if torch.cuda.get_device_capability(device)[0] == 9 else 0


class FlashAttnBackend:
    name = "flash_attn"

    def __call__(self, q, k, v, k_cache, v_cache, batch: Batch, scale: float):
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        fn = flash_attn_varlen()
        # Unused table entries are -1; a tile may read a page index past seqused_k, so keep them
        # in range. max_seqlen_q: 1 in decode, else the T upper bound (no host sync).
        out = fn(q, k_cache, v_cache, cu_seqlens_q=batch.cu_seqlens_q,
                 seqused_k=batch.context_lens, page_table=batch.block_tables.clamp(min=0),
                 max_seqlen_q=1 if batch.is_decode else None, softmax_scale=scale, causal=True,
                 num_splits=fa4_num_splits(q.device))
        return out[0] if isinstance(out, tuple) else out

    def __repr__(self):
        return "FlashAttnBackend()"


FLASH_ATTN = FlashAttnBackend()
