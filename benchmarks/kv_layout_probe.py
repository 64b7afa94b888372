"""Does decode attention read a head-major KV cache faster than the engine's token-major one?

    PYTHONPATH=. python benchmarks/kv_layout_probe.py [--batch 256] [--contexts 200-1124]
        [--page 16] [--configs n128w4s3,n64w4s3,...]

The engine's cache is token-major, [num_blocks, page, kv_heads, head_dim]: a program (one
sequence, one KV head) reads 256-byte rows 2 KB apart, and the other seven heads' programs read
the bytes between them. Head-major, [num_blocks, kv_heads, page, head_dim], gives each program
its page's rows as one contiguous run (4 KB at page 16, bf16). Decode attention reads at 87-92%
of what a plain read reaches (4.06-4.28 against 4.66 TB/s, BENCHMARKS.md session 24). Part of
that gap may be the DRAM's: reads of 256 bytes scattered over rows that other programs reopen.

Timed here over the same random batch (contexts U[lo, hi] in shuffled pages), in CUDA graphs:
  engine          the engine's decode kernel (plain form, unsplit; token-major)
  read-T / read-H a kernel that only reads each program's K and V tiles (sums them): the
                  access pattern's own ceiling in either layout
  attn-T / attn-H a minimal attention loop, the same in both layouts but for the addresses
  stream          kernels.memory_read over a contiguous buffer of the same bytes
Outputs are checked against torch over the same tokens.

On the H200 (BENCHMARKS.md session 38): the layouts are within 2.5% of each other in every kernel
and tiling, and the read-only kernel is no faster than attention (3.64-4.03 TB/s against the
engine's 3.87-4.12 and a contiguous read's 4.30-4.42), which points to the program structure.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from benchmarks.bench_linear import graph_us
from benchmarks.tma_decode_probe import (group_rows, parse_config, probe_parser, problems,
                                         report, softmax_tile)
from minivllm.kernels.decode_attention import LOG2E
from minivllm.kernels.memory_read import READ_BLOCK, READ_PROGRAMS_PER_SM, stream_read


@triton.jit
def _layout_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, out_ptr, scale_log2, stride_bt,
                   KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_MAJOR: tl.constexpr, READ_ONLY: tl.constexpr, STAGES: tl.constexpr):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    q_offs, q_mask = group_rows(b, kvh, KV_HEADS, GROUP, HEAD_DIM, BLOCK_G)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    PAGE_ELEMS: tl.constexpr = PAGE * KV_HEADS * HEAD_DIM
    if HEAD_MAJOR:  # [blocks, kv_heads, page, head_dim]
        head_off = kvh * (PAGE * HEAD_DIM)
        SLOT: tl.constexpr = HEAD_DIM
    else:  # [blocks, page, kv_heads, head_dim]
        head_off = kvh * HEAD_DIM
        SLOT: tl.constexpr = KV_HEADS * HEAD_DIM
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    total = tl.zeros([HEAD_DIM], tl.float32)
    full_end = ctx // BLOCK_N * BLOCK_N
    for n0 in tl.range(0, tl.cdiv(ctx, BLOCK_N) * BLOCK_N, BLOCK_N, num_stages=STAGES):
        pos = n0 + offs_n
        valid = pos < ctx
        if PAGE % BLOCK_N == 0:  # the tile lies in one page
            blk = tl.load(bt_row + n0 // PAGE).to(tl.int64)
        else:
            blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        rows = blk * PAGE_ELEMS + head_off + (pos % PAGE).to(tl.int64) * SLOT
        kt = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
        vt = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
        if READ_ONLY:
            both = tl.where(valid[:, None], kt.to(tl.float32) + vt.to(tl.float32), 0.0)
            total += tl.sum(both, 0)
        else:
            acc, m_i, l_i = softmax_tile(q, kt, vt, acc, m_i, l_i, valid, n0 >= full_end,
                                         scale_log2)
    if READ_ONLY:  # every query head of the group gets the (K + V) sum: checkable, not dead
        out = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32) + total[None, :]
    else:
        out = acc / l_i[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def layout_launch(q, k_cache, v_cache, block_tables, context_lens, scale, *, head_major: bool,
                  read_only: bool, block_n: int, num_warps: int, num_stages: int, out=None):
    """q: [B, heads, D]; k_cache, v_cache: [blocks, kv_heads, page, D] if head_major, else
    [blocks, page, kv_heads, D]. Attention (or, read_only, the sum of K + V over the context)."""
    b, heads, d = q.shape
    kv_heads, page = (k_cache.shape[1], k_cache.shape[2]) if head_major else k_cache.shape[2:0:-1]
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    out = torch.empty_like(q) if out is None else out
    _layout_kernel[(kv_heads, b)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * LOG2E,
        block_tables.stride(0), KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=d,
        BLOCK_G=max(16, heads // kv_heads), PAGE=page, BLOCK_N=block_n, HEAD_MAJOR=head_major,
        READ_ONLY=read_only, STAGES=num_stages, num_warps=num_warps)
    return out


def kv_sums(p: dict) -> torch.Tensor:
    """[B, heads, D] fp32: each row's sum of K + V over its context, per KV head, repeated over
    the head's query group (what the read-only kernel writes)."""
    page = p["k_cache"].shape[1]
    heads = p["q"].shape[1]
    sums = []
    for r, n in enumerate(p["lens"]):
        pos = torch.arange(n, device=p["q"].device)
        slots = p["tables"][r, pos // page].long() * page + pos % page
        kv = (p["k_cache"].flatten(0, 1)[slots].float() + p["v_cache"].flatten(0, 1)[slots].float())
        sums.append(kv.sum(0))  # [kv_heads, D]
    s = torch.stack(sums)
    return s.repeat_interleave(heads // s.shape[1], dim=1)


def main() -> int:
    ap = probe_parser(__doc__, 16, "n128w4s3,n64w4s3,n64w4s4,n32w4s4,n128w8s3,n64w2s3")
    ap.add_argument("--read-configs", default="n128w4s3,n64w4s4,n32w4s4,n128w8s2")
    args = ap.parse_args()
    for p, cuda in problems(args):
        caches = {False: (p["k_cache"], p["v_cache"]),
                  True: (p["k_cache"].transpose(1, 2).contiguous(),
                         p["v_cache"].transpose(1, 2).contiguous())}
        sums = kv_sums(p)
        rows = [("engine (default config, token-major)", p["engine"])]
        for read_only, cfgs in ((True, args.read_configs), (False, args.configs)):
            for text in cfgs.split(","):
                cfg = parse_config(text)
                for head_major in (False, True):
                    k, v = caches[head_major]
                    name = f"{'read' if read_only else 'attn'}-{'H' if head_major else 'T'} {text}"
                    fn = (lambda out=None, k=k, v=v, hm=head_major, ro=read_only, cfg=cfg:
                          layout_launch(p["q"], k, v, p["tables"], p["ctx"], p["scale"],
                                        head_major=hm, read_only=ro, out=out, **cfg))
                    rows.append((name, fn, sums) if read_only else (name, fn))
        report(rows, p, cuda)
        if cuda:
            stream_us(p["kv_bytes"], p["q"].device, p["q"].dtype)
    return 0


def stream_us(nbytes: int, dev: torch.device, dtype: torch.dtype) -> None:
    """Print kernels.memory_read's rate over a contiguous buffer of nbytes (CUDA graph)."""
    n = -(-nbytes // dtype.itemsize // READ_BLOCK) * READ_BLOCK
    src = torch.randn(n, device=dev, dtype=dtype)
    sums = torch.empty(READ_PROGRAMS_PER_SM * torch.cuda.get_device_properties(dev)
                       .multi_processor_count, device=dev, dtype=torch.float32)
    us = graph_us(lambda i: stream_read(src, sums), calls=1)
    print(f"  stream (contiguous, same bytes): {us:.1f} us, "
          f"{n * dtype.itemsize / us / 1e6:.2f} TB/s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
