"""Ask the L2 for the first pages of a decode step's KV cache before its attention runs
(H200 experiment for issue 5's throughput; it lost, and no engine change rests on it).

At 256 sequences a layer's o_proj, MLP, norms and qkv take ~40 us and read ~31 MB of weights at
~1 TB/s: the DRAM idles. The next layer's attention then starts ~400 programs at once, each
filling a 3-stage pipeline from DRAM. `prefetch_first_pages` asks, with one
`cp.async.bulk.prefetch.L2` a thread, for the first `pages` pages (K and V) of the first `seqs`
sequences, which the attention's first wave reads first (its grid runs a sequence's KV heads
side by side, sequences in row order). Measured by two_stream_probe.py's kvpf modes
(BENCHMARKS.md session 44): no variant sped up the 28-layer stack: 0.1-6.4% slower at 64-256
sequences, so the first wave's start does not wait on DRAM in a way an L2 prefetch can hide.
"""

from __future__ import annotations

import triton
import triton.language as tl

from benchmarks.l2_prefetch import bulk_prefetch_l2

THREADS = 32  # one warp a program, one prefetch a thread


@triton.jit
def _prefetch_first_pages_kernel(k_ptr, v_ptr, bt_ptr, ctx_ptr, stride_bt, seqs, record_ptr,
                                 PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr,
                                 PAGES: tl.constexpr, THREADS: tl.constexpr,
                                 RECORD: tl.constexpr):
    # THREADS // (2 * PAGES) sequences a program; thread t: sequence t // (2 PAGES), its page
    # (t % PAGES) of K (t % 2 PAGES < PAGES) or of V.
    offs = tl.arange(0, THREADS)
    per: tl.constexpr = THREADS // (2 * PAGES)
    s = tl.program_id(0) * per + offs // (2 * PAGES)
    j = offs % PAGES
    in_batch = s < seqs
    prefix = tl.load(ctx_ptr + s, mask=in_batch, other=1) - 1
    valid = in_batch & (j * PAGE < prefix)
    blk = tl.load(bt_ptr + s.to(tl.int64) * stride_bt + j, mask=valid, other=0).to(tl.int64)
    off = blk * PAGE_BYTES
    is_k = (offs % (2 * PAGES)) < PAGES
    addr = tl.where(is_k, k_ptr.to(tl.pointer_type(tl.int8)) + off,
                    v_ptr.to(tl.pointer_type(tl.int8)) + off)
    size = tl.where(valid, PAGE_BYTES, 0).to(tl.int32)
    if RECORD:  # what each thread would ask for, (cache 0/1, byte offset, size): for the CPU test
        row = record_ptr + (tl.program_id(0) * THREADS + offs) * 3
        tl.store(row, tl.where(is_k, 0, 1).to(tl.int64))
        tl.store(row + 1, off)
        tl.store(row + 2, size.to(tl.int64))
        return
    bulk_prefetch_l2(addr, size)


def prefetch_first_pages(k_cache, v_cache, block_tables, context_lens, seqs: int, pages: int,
                         record=None):
    """k_cache/v_cache: [num_blocks, PAGE, kv_heads, head_dim] (one layer's), block_tables:
    [B, M] int32, context_lens: [B] int32 (the new token included). Pages: 1, 2, 4, 8 or 16.
    record: an int64 tensor [programs * THREADS, 3] to receive the requests instead (CPU test)."""
    assert pages in (1, 2, 4, 8, 16) and k_cache.is_contiguous() and v_cache.is_contiguous()
    page = k_cache.shape[1]
    page_bytes = k_cache[0].numel() * k_cache.element_size()
    seqs = min(seqs, block_tables.shape[0])
    per = THREADS // (2 * pages)
    _prefetch_first_pages_kernel[(triton.cdiv(seqs, per),)](
        k_cache, v_cache, block_tables, context_lens, block_tables.stride(0), seqs,
        record if record is not None else context_lens,
        PAGE=page, PAGE_BYTES=page_bytes, PAGES=pages,
        THREADS=THREADS, RECORD=record is not None, num_warps=1)
