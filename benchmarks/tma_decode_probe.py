"""Would decode attention read the KV cache faster through bulk tensor copies (TMA)?

    PYTHONPATH=. python benchmarks/tma_decode_probe.py [--batch 256] [--contexts 200-1124]
        [--page 128] [--configs n128w4s3,n64w4s3,...]

Session 37's green-context probe (two_stream_probe.py green-G) found decode attention's time
growing with every SM taken from it (at 256 sequences, 100 SMs of 132 already lost more than
overlapping the GEMMs won), so the kernel is bound by what each SM can keep in flight or issue,
not by the memory. A TMA load moves a whole [BLOCK_N, head_dim] tile with one instruction and
no registers, where the engine's kernel issues ~16 16-byte async copies a thread a tile plus
their address arithmetic. With KV pages at least as long as a tile (the engine runs pages of 256
level with 16: session 36), each tile is one box of a 2-D view of the cache, [slots, kv_heads *
head_dim], so a paged cache can be read this way.

Three kernels over the same random cache and batch, unsplit, no norm/RoPE or store (the plain
form): the engine's (`engine`), a minimal loop with pointer loads (`pointer`: the same loop as
`tma`, so that the two differ only in the load), and the minimal loop with TMA loads (`tma`).
Outputs are checked against the engine's; times are CUDA-graph replays, µs and TB/s of K/V read.
`swapped` variants compute the scores as K @ q^T and the output as V^T @ p^T (the tile's 128 rows
as the dots' M dimension, the padded query group as N) instead of q @ K^T and p @ V.

On the H200 (BENCHMARKS.md session 37): TMA loads are within -6% to +5% of pointer loads in the
same minimal loop, and neither beats the engine's kernel (at 256 sequences, page 128: 178.9 µs
against the best minimal loop's 180.7); the swapped dots are level to 42% slower.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch
import triton
import triton.language as tl

from benchmarks.bench_linear import graph_us
from minivllm.kernels.decode_attention import LOG2E, paged_decode_attention


@triton.jit
def group_rows(b, kvh, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_G: tl.constexpr):
    """Offsets [BLOCK_G, HEAD_DIM] of sequence b's query heads of KV head kvh in a contiguous
    [B, heads, HEAD_DIM] q or output, and their mask (BLOCK_G pads the group to the dot's M)."""
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + offs_g
    offs = (b * KV_HEADS * GROUP + heads[:, None]) * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    return offs, (offs_g < GROUP)[:, None]


@triton.jit
def softmax_tile(q, kt, vt, acc, m_i, l_i, valid, last, scale_log2):
    """One tile of the online softmax, q: [BLOCK_G, D] against kt, vt: [BLOCK_N, D]: (acc, m_i,
    l_i) updated. last: the context's partial tile, whose rows where `valid` is off are another
    slot's and are masked."""
    s = tl.dot(q, tl.trans(kt)) * scale_log2
    if last:
        s = tl.where(valid[None, :], s, float("-inf"))
        vt = tl.where(valid[:, None], vt, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt), m_new, l_i


@triton.jit
def _probe_kernel(q_ptr, k_ptr, v_ptr, k_desc, v_desc, bt_ptr, ctx_ptr, out_ptr, scale_log2,
                  stride_bt, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_G: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  TMA: tl.constexpr, STAGES: tl.constexpr, SWAP: tl.constexpr):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    ROW: tl.constexpr = KV_HEADS * HEAD_DIM
    q_offs, q_mask = group_rows(b, kvh, KV_HEADS, GROUP, HEAD_DIM, BLOCK_G)
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    ctx = tl.load(ctx_ptr + b)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    acc_t = tl.zeros([HEAD_DIM, BLOCK_G], tl.float32)
    qt = tl.trans(q)
    full_end = ctx // BLOCK_N * BLOCK_N
    for n0 in tl.range(0, tl.cdiv(ctx, BLOCK_N) * BLOCK_N, BLOCK_N, num_stages=STAGES):
        blk = tl.load(bt_row + n0 // PAGE)
        row0 = blk * PAGE + n0 % PAGE
        if TMA:
            kt = k_desc.load([row0, kvh * HEAD_DIM])
            vt = v_desc.load([row0, kvh * HEAD_DIM])
        else:
            rows = (row0.to(tl.int64) + offs_n) * ROW + kvh * HEAD_DIM
            kt = tl.load(k_ptr + rows[:, None] + offs_d[None, :])
            vt = tl.load(v_ptr + rows[:, None] + offs_d[None, :])
        if SWAP:  # scores as [BLOCK_N, BLOCK_G]: the tile's rows are the dots' M
            st = tl.dot(kt, qt) * scale_log2
            if n0 >= full_end:
                valid = (n0 + offs_n) < ctx
                st = tl.where(valid[:, None], st, float("-inf"))
                vt = tl.where(valid[:, None], vt, 0.0)
            m_new = tl.maximum(m_i, tl.max(st, 0))
            alpha = tl.exp2(m_i - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pt, 0)
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(vt), pt.to(vt.dtype))
        else:
            acc, m_new, l_i = softmax_tile(q, kt, vt, acc, m_i, l_i, (n0 + offs_n) < ctx,
                                           n0 >= full_end, scale_log2)
        m_i = m_new
    if SWAP:
        acc = tl.trans(acc_t)
    out = acc / l_i[:, None]
    tl.store(out_ptr + q_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def probe_launch(q, k_cache, v_cache, block_tables, context_lens, scale, *, tma: bool,
                 block_n: int, num_warps: int, num_stages: int, swap: bool = False, out=None):
    """Attention of q: [B, heads, D] over each row's context_lens cached tokens."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, heads, d = q.shape
    _, page, kv_heads, _ = k_cache.shape
    assert page % block_n == 0, "a tile must lie in one page"
    out = torch.empty_like(q) if out is None else out
    flat_k = k_cache.view(-1, kv_heads * d)
    flat_v = v_cache.view(-1, kv_heads * d)
    k_desc = TensorDescriptor.from_tensor(flat_k, [block_n, d]) if tma else flat_k
    v_desc = TensorDescriptor.from_tensor(flat_v, [block_n, d]) if tma else flat_v
    _probe_kernel[(kv_heads, b)](
        q, flat_k, flat_v, k_desc, v_desc, block_tables, context_lens, out, scale * LOG2E,
        block_tables.stride(0), KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=d,
        BLOCK_G=max(16, heads // kv_heads), PAGE=page, BLOCK_N=block_n, TMA=tma,
        STAGES=num_stages, SWAP=swap, num_warps=num_warps)
    return out


def parse_config(text: str) -> dict:
    n, rest = text[1:].split("w")
    w, s = rest.split("s")
    return dict(block_n=int(n), num_warps=int(w), num_stages=int(s))


def make_problem(batch: int, lo: int, hi: int, page: int, dev: torch.device, dtype: torch.dtype,
                 heads: int = 16, kv_heads: int = 8, d: int = 128, seed: int = 0):
    """A random decode batch over a paged cache (Qwen3-0.6B's heads by default), contexts
    U[lo, hi] in shuffled pages: a dict of q, k_cache, v_cache, tables, ctx (tokens in the
    cache, all attended), lens, kv_bytes, and `engine(out=None)`, the engine's kernel (plain
    form, unsplit) over the same tokens."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    width = -(-hi // page)
    blocks = list(range(1, 1 + sum(-(-n // page) for n in lens)))
    rng.shuffle(blocks)
    tables = torch.zeros(batch, width, dtype=torch.int32)
    i = 0
    for r, n in enumerate(lens):
        nb = -(-n // page)
        tables[r, :nb] = torch.tensor(blocks[i:i + nb])
        i += nb
    tables = tables.to(dev)
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    shape = (len(blocks) + 1, page, kv_heads, d)
    k_cache = torch.randn(shape, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, device=dev, dtype=dtype)
    q = torch.randn(batch, heads, d, device=dev, dtype=dtype)
    scale = d ** -0.5
    # The engine's kernel attends to context_lens - 1 cached tokens plus the new k/v: give it
    # the row's last cached token as the new one, so that both attend to the same tokens.
    last = torch.tensor([tables[r, (n - 1) // page].item() * page + (n - 1) % page
                         for r, n in enumerate(lens)], device=dev)
    k_new = k_cache.view(-1, kv_heads, d)[last]
    v_new = v_cache.view(-1, kv_heads, d)[last]

    def engine(out=None):
        return paged_decode_attention(q, k_new, v_new, k_cache, v_cache, tables, ctx, scale,
                                      num_splits=1, out=out)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, tables=tables, ctx=ctx, lens=lens,
                scale=scale, engine=engine,
                kv_bytes=sum(lens) * kv_heads * d * 2 * k_cache.element_size())


def report(rows, p: dict, cuda: bool) -> None:
    """Each (name, fn(out=None)) or (name, fn(out=None), reference) of rows: its relative error
    against the reference (default: the engine's kernel) and, on a GPU, its CUDA-graph replay
    time."""
    engine = p["engine"]().float()
    for name, fn, *reference in rows:
        try:
            ref = reference[0].float() if reference else engine
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            line = f"  {name}: rel err {err:.2e}"
            if cuda:
                out = torch.empty_like(p["q"])
                us = graph_us(lambda i: fn(out), calls=1)
                line += f", {us:.1f} us, {p['kv_bytes'] / us / 1e6:.2f} TB/s"
        except Exception as e:  # a config the compiler refuses: say so, go on
            line = f"  {name}: failed: {type(e).__name__}: {str(e)[:200]}"
        print(line, flush=True)


def probe_parser(doc: str, page: int, configs: str) -> argparse.ArgumentParser:
    """The decode-attention probes' common arguments (batch, contexts, page, configs, device)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="200-1124,700-1624")
    ap.add_argument("--page", type=int, default=page)
    ap.add_argument("--configs", default=configs)
    ap.add_argument("--device", default="cuda")
    return ap


def problems(args):
    """make_problem for each of args.contexts (bf16 on a GPU, fp32 on the CPU's interpreter),
    each announced by a header line: yields (problem, cuda)."""
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    for contexts in args.contexts.split(","):
        lo, hi = (int(v) for v in contexts.split("-"))
        p = make_problem(args.batch, lo, hi, args.page, dev, dtype)
        print(f"B={args.batch} contexts U[{lo},{hi}] page {args.page}, {dtype}, "
              f"{p['kv_bytes'] / 1e6:.0f} MB of K/V:", flush=True)
        yield p, cuda


def main() -> int:
    args = probe_parser(__doc__, 128, "n128w4s3,n128w4s2,n64w4s3,n64w4s4,n128w8s3").parse_args()
    configs = [parse_config(c) for c in args.configs.split(",")]
    for p, cuda in problems(args):
        rows = [("engine (default config)", p["engine"])]
        for cfg in configs:
            for tma, swap in ((False, False), (True, False), (False, True), (True, True)):
                name = (f"{'tma' if tma else 'pointer'}{' swapped' if swap else ''} "
                        f"n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}")
                rows.append((name, lambda out=None, cfg=cfg, tma=tma, swap=swap: probe_launch(
                    p["q"], p["k_cache"], p["v_cache"], p["tables"], p["ctx"], p["scale"],
                    tma=tma, swap=swap, out=out, **cfg)))
        report(rows, p, cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
