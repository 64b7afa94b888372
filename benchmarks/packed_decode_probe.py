"""Decode attention with all of a sequence's KV heads in one program: does it read faster?

    PYTHONPATH=. python benchmarks/packed_decode_probe.py [--batch 256] [--contexts 200-1124]
        [--splits 2,4,8] [--configs n16w8s3,...]

The engine's kernel gives each (sequence, KV head) a program. With Qwen3-0.6B's 2 query heads
a KV head, its dots pad the 2 rows to 16 (the MMA's least M), so 14 of every 16 rows of its
softmax are padding, and it reads each cache row as a 256-byte piece of a 2 KB row. Session 37
found that kernel bound by what each SM issues or keeps in flight (its time grows with every SM
taken from it; two_stream_probe.py green-G), not by the memory.

Here one program takes a sequence's whole rows: K and V tiles [BLOCK_N tokens, kv_heads *
head_dim] (a page of 16 tokens is 32 KB, contiguous), and all 16 query heads as the 16 rows of a
block-diagonal q [16, kv_heads * head_dim] (head h's q in its KV head's columns, zeros
elsewhere). Then s = q @ K^T gives every head its own scores with no padded rows, the softmax
runs on real rows only (1/8 of the engine's work a byte), and p @ V gives [16, kv_heads *
head_dim] of which each row keeps its KV head's block. The MMA work a byte is the engine's (8x
the useful either way). Contexts are split (--splits) so that 256 sequences still make enough
programs; the engine's merge kernel combines the splits.

On the H200 (BENCHMARKS.md session 37): 41-143% slower than the engine's kernel at every split
count and tiling (at 256 sequences of U[200, 1124], page 16: best 248.8 µs, 2.81 TB/s, against
175.8). A program holds [16, 1,024] fp32 of output and 32 KB tiles a stage, so an SM runs one or
two programs: fewer bytes in flight than the engine's three small ones, which is what bounds it.
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from benchmarks.tma_decode_probe import parse_config, probe_parser, problems, report
from minivllm.kernels.decode_attention import LOG2E, MAX_SPLITS, _merge_splits_kernel
from minivllm.kernels.launch import next_pow2


@triton.jit
def _packed_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, out_ptr, part_out_ptr,
                   part_lse_ptr, scale_log2, num_splits, stride_bt,
                   HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr):
    b = tl.program_id(0)
    split = tl.program_id(1)
    ROW: tl.constexpr = HEADS // GROUP * HEAD_DIM  # a cache row: every KV head's
    offs_h = tl.arange(0, HEADS)
    offs_c = tl.arange(0, ROW)
    offs_n = tl.arange(0, BLOCK_N)
    own = (offs_c[None, :] // HEAD_DIM) == (offs_h[:, None] // GROUP)  # [HEADS, ROW]
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + (b64 * HEADS + offs_h[:, None]) * HEAD_DIM + offs_c[None, :] % HEAD_DIM,
                mask=own, other=0.0)  # block-diagonal
    ctx = tl.load(ctx_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    bt_row = bt_ptr + b64 * stride_bt
    m_i = tl.full([HEADS], float("-inf"), tl.float32)
    l_i = tl.zeros([HEADS], tl.float32)
    acc = tl.zeros([HEADS, ROW], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        valid = pos < end
        blk = tl.load(bt_row + pos // PAGE, mask=valid, other=0).to(tl.int64)
        rows = (blk * PAGE + pos % PAGE) * ROW
        kt = tl.load(k_cache_ptr + rows[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(kt)) * scale_log2  # [HEADS, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_cache_ptr + rows[:, None] + offs_c[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m_i = m_new
    nonempty = l_i > 0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    col = offs_c[None, :] % HEAD_DIM
    if SPLIT:
        row = (b64 * HEADS + offs_h) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + col, out, mask=own)
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse)
    else:
        tl.store(out_ptr + (b64 * HEADS + offs_h[:, None]) * HEAD_DIM + col,
                 out.to(out_ptr.dtype.element_ty), mask=own)


def packed_attention(q, k_cache, v_cache, block_tables, context_lens, scale, *, splits: int,
                     block_n: int, num_warps: int, num_stages: int, out=None):
    """Attention of q: [B, heads, D] over each row's context_lens cached tokens."""
    b, heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    assert heads & (heads - 1) == 0 and heads <= 64, "the heads are the dots' rows"
    out = torch.empty_like(q) if out is None else out
    if splits > 1:
        part_out = torch.empty((b, heads, splits, d), device=q.device, dtype=torch.float32)
        part_lse = torch.empty((b, heads, splits), device=q.device, dtype=torch.float32)
    else:
        part_out = part_lse = out
    _packed_kernel[(b, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale * LOG2E,
        splits, block_tables.stride(0), HEADS=heads, GROUP=heads // kv_heads, HEAD_DIM=d,
        PAGE=page, BLOCK_N=block_n, SPLIT=splits > 1, num_warps=num_warps,
        num_stages=num_stages)
    if splits > 1:
        _merge_splits_kernel[(b, heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), splits, HEADS=heads,
            HEAD_DIM=d, BLOCK_S=max(2, next_pow2(MAX_SPLITS)), BLOCK_D=next_pow2(d), num_warps=4)
    return out


def main() -> int:
    ap = probe_parser(__doc__, 16, "n16w8s3,n16w4s3,n32w8s2,n16w8s2")
    ap.add_argument("--splits", default="2,4,8")
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    for p, cuda in problems(args):
        rows = [("engine (default config)", p["engine"])]
        for splits in (int(s) for s in args.splits.split(",")):
            for cfg in configs:
                name = (f"packed splits {splits} "
                        f"n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}")
                rows.append((name, lambda out=None, cfg=cfg, splits=splits: packed_attention(
                    p["q"], p["k_cache"], p["v_cache"], p["tables"], p["ctx"], p["scale"],
                    splits=splits, out=out, **cfg)))
        report(rows, p, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
