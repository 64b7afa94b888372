"""Attention kernels on the GPU, side by side in one run: our Triton kernels, flash-attn-4
(flash_attn.cute.flash_attn_varlen_func) and torch.nn.attention.varlen.varlen_attn, against the
measured device-to-device copy bandwidth.

    PYTHONPATH=. python benchmarks/bench_attention.py [--out DIR] [--budget SECONDS]

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128), bf16.
  decode:  B in {1, 32, 256}, contexts U[512, 2048] and U[8k, 32k], pages 16 and 256. Achieved
           bandwidth = bytes of K and V in the contexts (+ q and out) / time. Each timing replays a
           CUDA graph of many calls that rotate over enough independent problems to exceed the L2
           (60 MB), so launch gaps and cache hits do not flatter either side. Our kernel is swept
           over a few tile configs and split counts; "default" is what the backend runs today.
  prefill: ~35k new tokens in sequences of U[100, 1024] tokens (seed 0), causal, without and with a
           cached prefix of U[512, 2048] tokens per sequence, pages 16 and 256. TFLOP/s counts the
           causal FLOPs: 4 * head_dim * heads * sum_b q_b * (prefix_b + (q_b + 1) / 2).
Every figure is a median over replays; prints a table at the end and writes bench.json to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback

import torch

from minivllm.kernels.decode_attention import MAX_SPLITS, decode_config, decode_splits, paged_decode_attention
from minivllm.kernels.flash_attn_backend import fa4_num_splits, flash_attn_varlen
from minivllm.kernels.prefill_attention import prefill_config, varlen_prefill_attention
from minivllm.kernels.store_kv import store_kvcache

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
DT = torch.bfloat16
L2_BYTES = 60 * 2**20
DEV = torch.device("cuda")
DECODE_BATCHES = (1, 32, 256)
DECODE_DISTS = (("U[512,2048]", 512, 2048), ("U[8k,32k]", 8192, 32768))
PREFILL_TOKENS, Q_RANGE, PREFIX_RANGE = 35_000, (100, 1024), (512, 2048)
COPY_BYTES = 2 * 2**30

DECODE_CONFIGS = [  # (block_n, num_warps, num_stages)
    (64, 4, 3), (128, 4, 3), (32, 4, 4), (64, 8, 3), (64, 4, 4),
]
PREFILL_CONFIGS = [  # (block_m, block_n, num_warps, num_stages, pack GQA group into the tile)
    (128, 64, 8, 3, True), (128, 64, 8, 3, False), (64, 64, 4, 3, False), (64, 64, 4, 3, True),
    (64, 64, 4, 2, False), (64, 64, 4, 2, True), (64, 32, 4, 3, False), (64, 32, 4, 3, True),
    (128, 128, 8, 2, True), (128, 64, 8, 2, True),
]


class Budget:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def log(*a):
    print(*a, flush=True)


# --- timing ---------------------------------------------------------------------------------------

def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def time_calls(calls, *, target_ms: float = 4.0, replays: int = 12, graph: bool = True):
    """Median microseconds per call over `calls` (a list rotated through). With graph=True the
    calls are captured into one CUDA graph of many rounds; returns (us, "graph" | "stream")."""
    if DEV.type != "cuda":  # --smoke: exercise the code paths on CPU, timings meaningless
        t0 = time.perf_counter()
        for c in calls:
            c()
        return (time.perf_counter() - t0) * 1e6 / len(calls), "cpu"
    for c in calls:
        c()
    torch.cuda.synchronize()
    e0, e1 = _events()
    e0.record()
    for c in calls:
        c()
    e1.record()
    e1.synchronize()
    est_ms = max(e0.elapsed_time(e1) / len(calls), 1e-3)
    rounds = max(1, min(500, math.ceil(target_ms / (est_ms * len(calls)))))
    method = "stream"
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for c in calls:
                    c()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(rounds):
                    for c in calls:
                        c()
            g.replay()
            torch.cuda.synchronize()
            run = g.replay
            method = "graph"
        except Exception as e:  # a library that cannot be captured: time it launched from Python
            log(f"    (graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing launches)")
            torch.cuda.synchronize()
            graph = False
    if not graph:
        def run():
            for _ in range(rounds):
                for c in calls:
                    c()
    times = []
    for _ in range(replays):
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times) * 1e3 / (rounds * len(calls)), method


def copy_bandwidth() -> float:
    """Device-to-device copy of 4 GiB, bytes read + written per second (TB/s)."""
    n = COPY_BYTES
    x = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    us, _ = time_calls([lambda: y.copy_(x)], target_ms=20, replays=10, graph=False)
    del x, y
    return 2 * n / (us * 1e-6) / 1e12


# --- problems built on the GPU --------------------------------------------------------------------

def block_tables_for(nblk: torch.Tensor, perm: torch.Tensor, offset: int) -> torch.Tensor:
    """[B, max nblk] int32 table: sequence b owns perm[offset + start_b : ... + nblk_b]; -1 pads."""
    m = int(nblk.max())
    starts = torch.cumsum(nblk, 0) - nblk
    j = torch.arange(m, device=DEV)
    idx = (offset + starts[:, None] + j[None, :]).clamp(max=perm.numel() - 1)
    return torch.where(j[None, :] < nblk[:, None], perm[idx], -1).to(torch.int32).contiguous()


def decode_problem(b: int, lo: int, hi: int, page: int, seed: int, cache_dtype=DT,
                   longest_first: bool = False):
    """cache_dtype: the KV cache's (DT, or torch.float8_e4m3fn for an fp8 cache). longest_first:
    the rows sorted by context, longest first (the same contexts, in the order the scheduler
    puts its decodes)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ctx = torch.randint(lo, hi + 1, (b,), generator=g, device=DEV, dtype=torch.int32)
    if longest_first:
        ctx = ctx.sort(descending=True).values
    nblk = (ctx + page - 1) // page
    kv_bytes = int(ctx.sum()) * KV_HEADS * HEAD_DIM * 2 * cache_dtype.itemsize
    io_bytes = b * (2 * HEADS + 2 * KV_HEADS) * HEAD_DIM * 2
    sets = max(1, min(32, math.ceil(4 * L2_BYTES / kv_bytes)))
    per_set = int(nblk.sum())
    total = per_set * sets
    k_cache = torch.randn(total, page, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT).to(cache_dtype)
    v_cache = torch.randn(total, page, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT).to(cache_dtype)
    perm = torch.randperm(total, generator=g, device=DEV).to(torch.int32)
    problems = []
    for s in range(sets):
        problems.append(dict(
            q=torch.randn(b, HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
            k=torch.randn(b, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
            v=torch.randn(b, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
            bt=block_tables_for(nblk, perm, s * per_set), out=torch.empty(b, HEADS, HEAD_DIM, device=DEV, dtype=DT)))
    pos = (ctx - 1).long()  # the new token's position: its K/V slot, as the engine's batch has it
    for p in problems:
        p["bt0"] = p["bt"].clamp(min=0)
        p["slots"] = p["bt"].long().gather(1, (pos // page)[:, None])[:, 0] * page + pos % page
    cu = torch.arange(b + 1, device=DEV, dtype=torch.int32)
    return dict(ctx=ctx, k_cache=k_cache, v_cache=v_cache, problems=problems, cu=cu,
                bytes=kv_bytes + io_bytes, sets=sets, max_context=int(nblk.max()) * page)


def prefill_lengths(target: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q_lens = []
    while sum(q_lens) < target:
        q_lens.append(int(torch.randint(Q_RANGE[0], Q_RANGE[1] + 1, (1,), generator=g)))
    prefix = [int(x) for x in torch.randint(PREFIX_RANGE[0], PREFIX_RANGE[1] + 1, (len(q_lens),), generator=g)]
    return q_lens, prefix


def prefill_problem(q_lens, prefix, page: int, seed: int, cache_dtype=DT):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q_t = torch.tensor(q_lens, dtype=torch.int32, device=DEV)
    ctx = q_t + torch.tensor(prefix, dtype=torch.int32, device=DEV)
    t = int(q_t.sum())
    nblk = (ctx + page - 1) // page
    total = int(nblk.sum())
    k_cache = torch.randn(total, page, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT).to(cache_dtype)
    v_cache = torch.randn(total, page, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT).to(cache_dtype)
    perm = torch.randperm(total, generator=g, device=DEV).to(torch.int32)
    bt = block_tables_for(nblk, perm, 0)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32, device=DEV)
    cu[1:] = torch.cumsum(q_t, 0)
    ctx_cpu = [q + p for q, p in zip(q_lens, prefix)]
    cu_k = torch.tensor([0] + list(torch.tensor(ctx_cpu).cumsum(0)), dtype=torch.int32, device=DEV)
    flops = 4 * HEAD_DIM * HEADS * sum(q * (p + (q + 1) / 2) for q, p in zip(q_lens, prefix))
    return dict(
        q=torch.randn(t, HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
        k=torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
        v=torch.randn(t, KV_HEADS, HEAD_DIM, generator=g, device=DEV, dtype=DT),
        k_cache=k_cache, v_cache=v_cache, bt=bt, cu=cu, cu_k=cu_k, ctx=ctx, max_q=max(q_lens),
        max_k=max(ctx_cpu), flops=flops, tokens=t, total_ctx=sum(ctx_cpu), page=page)


# --- sections -------------------------------------------------------------------------------------

def decode_cases():
    """The headline case first (B=256, short contexts, page 16), so a tight budget keeps it."""
    cases = [(page, dist, b) for page in (16, 256) for dist in DECODE_DISTS for b in DECODE_BATCHES]
    cases = sorted(cases, key=lambda c: (c[2] != DECODE_BATCHES[-1], c[1] != DECODE_DISTS[0], c[0]))
    # flash-attn-4's TMA path wants a page of one key tile (128 at head_dim 128): its best case.
    return cases + [(128, DECODE_DISTS[0], DECODE_BATCHES[-1])]


def bench_decode(results, budget: Budget, fa):
    scale = HEAD_DIM ** -0.5
    for page, (dist, lo, hi), b in decode_cases():
        if budget.left() < 12:
            log(f"decode page={page} {dist} B={b}: skipped (budget)")
            continue
        pr = decode_problem(b, lo, hi, page, seed=b + page)
        row = dict(section="decode", page=page, contexts=dist, batch=b, sets=pr["sets"],
                   bytes=pr["bytes"], triton={})
        default_splits = decode_splits(b, KV_HEADS, pr["max_context"], DEV)
        default_cfg = decode_config(DEV, DT, HEAD_DIM, default_splits, pr["max_context"], b,
                                    pr["k_cache"].dtype)

        def ours(cfg, splits):
            return [lambda p=p: paged_decode_attention(
                p["q"], p["k"], p["v"], pr["k_cache"], pr["v_cache"], p["bt"], pr["ctx"], scale,
                out=p["out"], num_splits=splits, config=cfg) for p in pr["problems"]]

        variants = [(dict(block_n=n, num_warps=w, num_stages=s), default_splits)
                    for n, w, s in DECODE_CONFIGS]
        for waves in (2, 4, 8, 32):  # split counts around the default's
            sp = decode_splits(b, KV_HEADS, pr["max_context"], DEV, waves=waves)
            if sp != default_splits and (default_cfg, sp) not in variants:
                variants.append((default_cfg, sp))
        for cfg, splits in variants:
            key = f"n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}/splits{splits}"
            try:
                us, how = time_calls(ours(cfg, splits))
                row["triton"][key] = us
            except Exception as e:
                log(f"    triton {key}: {type(e).__name__}: {str(e)[:200]}")
        dkey = (f"n{default_cfg['block_n']}w{default_cfg['num_warps']}s{default_cfg['num_stages']}"
                f"/splits{default_splits}")
        row["triton_default_key"] = dkey
        if fa is not None:
            try:
                calls = [lambda p=p: fa(p["q"], pr["k_cache"], pr["v_cache"], cu_seqlens_q=pr["cu"],
                                        seqused_k=pr["ctx"], page_table=p["bt0"], max_seqlen_q=1,
                                        softmax_scale=scale, causal=True,
                                        num_splits=fa4_num_splits(DEV))
                         for p in pr["problems"]]
                row["fa4_us"], row["fa4_timing"] = time_calls(calls)
            except Exception as e:
                log(f"    fa4: {type(e).__name__}: {str(e)[:300]}")
        finish_decode_row(row)
        results.append(row)
        del pr
        torch.cuda.empty_cache()


def finish_decode_row(row):
    tb = lambda us: row["bytes"] / (us * 1e-6) / 1e12  # noqa: E731
    t = row["triton"]
    if not t:
        log(f"decode page={row['page']} {row['contexts']} B={row['batch']}: no triton timing")
        return
    best = min(t, key=t.get)
    row["best_key"], row["best_us"] = best, t[best]
    row["default_us"] = t.get(row["triton_default_key"], float("nan"))
    row["best_tbs"], row["default_tbs"] = tb(row["best_us"]), tb(row["default_us"])
    if "fa4_us" in row:
        row["fa4_tbs"] = tb(row["fa4_us"])
        row["ratio_best"] = row["best_tbs"] / row["fa4_tbs"]
        row["ratio_default"] = row["default_tbs"] / row["fa4_tbs"]
    log(f"decode page={row['page']:3d} {row['contexts']:12s} B={row['batch']:3d}: "
        f"default {row['default_us']:8.1f} us {row['default_tbs']:.2f} TB/s | best {best} "
        f"{row['best_us']:8.1f} us {row['best_tbs']:.2f} TB/s | fa4 "
        f"{row.get('fa4_us', float('nan')):8.1f} us {row.get('fa4_tbs', float('nan')):.2f} TB/s "
        f"| ratio {row.get('ratio_best', float('nan')):.2f} (sets={row['sets']})")
    log("    all: " + ", ".join(f"{k}={v:.1f}" for k, v in sorted(t.items(), key=lambda kv: kv[1])))


def varlen_attn_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None, None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def bench_prefill(results, budget: Budget, fa):
    scale = HEAD_DIM ** -0.5
    q_lens, prefixes = prefill_lengths(PREFILL_TOKENS, seed=0)
    varlen_attn, va_params = varlen_attn_fn()
    log(f"prefill: {len(q_lens)} sequences, {sum(q_lens)} new tokens; prefixes U[512,2048] sum "
        f"{sum(prefixes)}; torch varlen_attn params: {sorted(va_params) if va_params else None}")
    for with_prefix in (False, True):
        for page in (16, 256):
            if budget.left() < 15:
                log(f"prefill page={page} prefix={with_prefix}: skipped (budget)")
                continue
            pre = prefixes if with_prefix else [0] * len(q_lens)
            pr = prefill_problem(q_lens, pre, page, seed=1)
            row = dict(section="prefill", page=page, prefix=with_prefix, tokens=pr["tokens"],
                       seqs=len(q_lens), flops=pr["flops"], triton={}, others={})
            out = torch.empty_like(pr["q"])
            for bm, bn, w, s, pack in PREFILL_CONFIGS:
                cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, pack=pack)
                key = f"m{bm}n{bn}w{w}s{s}{'p' if pack else ''}"
                try:
                    us, _ = time_calls([lambda: varlen_prefill_attention(
                        pr["q"], pr["k"], pr["v"], pr["k_cache"], pr["v_cache"], pr["cu"], pr["ctx"], pr["bt"],
                        scale, out=out, config=cfg)], target_ms=30, replays=7, graph=False)
                    row["triton"][key] = us
                except Exception as e:
                    log(f"    triton {key}: {type(e).__name__}: {str(e)[:200]}")
            d = prefill_config(DEV, DT, HEAD_DIM)
            row["triton_default_key"] = (f"m{d['block_m']}n{d['block_n']}w{d['num_warps']}s{d['num_stages']}"
                                         f"{'p' if d['pack'] else ''}")
            others = {}
            if fa is not None:
                bt0 = pr["bt"].clamp(min=0)
                others["fa4 paged"] = lambda: fa(pr["q"], pr["k_cache"], pr["v_cache"], cu_seqlens_q=pr["cu"],
                                                 seqused_k=pr["ctx"], page_table=bt0, max_seqlen_q=pr["max_q"],
                                                 softmax_scale=scale, causal=True)
            # Dense (unpaged) K/V of each whole context, packed: the best case for the libraries.
            k_dense = torch.randn(pr["total_ctx"], KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
            v_dense = torch.randn_like(k_dense)
            if fa is not None:
                others["fa4 dense"] = lambda: fa(pr["q"], k_dense, v_dense, cu_seqlens_q=pr["cu"],
                                                 cu_seqlens_k=pr["cu_k"], max_seqlen_q=pr["max_q"],
                                                 max_seqlen_k=pr["max_k"], softmax_scale=scale, causal=True)
            if varlen_attn is not None:
                if "enable_gqa" in va_params:  # torch >= 2.12: GQA, causal by window, paged tables
                    others["torch varlen dense"] = lambda: varlen_attn(
                        pr["q"], k_dense, v_dense, pr["cu"], pr["cu_k"], pr["max_q"], pr["max_k"],
                        scale=scale, window_size=(-1, 0), enable_gqa=True)
                    if "block_table" in va_params:
                        others["torch varlen paged"] = lambda: varlen_attn(
                            pr["q"], pr["k_cache"], pr["v_cache"], pr["cu"], None, pr["max_q"], pr["max_k"],
                            scale=scale, window_size=(-1, 0), enable_gqa=True, seqused_k=pr["ctx"],
                            block_table=pr["bt"].clamp(min=0))
                else:  # torch 2.11: no GQA, so K/V are expanded to 16 heads (untimed)
                    k_rep = k_dense.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    v_rep = v_dense.repeat_interleave(HEADS // KV_HEADS, dim=1)
                    kw = dict(window_size=(-1, 0)) if "window_size" in va_params else dict(is_causal=True)
                    others["torch varlen dense (kv expanded)"] = lambda: varlen_attn(
                        pr["q"], k_rep, v_rep, pr["cu"], pr["cu_k"], pr["max_q"], pr["max_k"],
                        scale=scale, **kw)
            for name, fn in others.items():
                if budget.left() < 10:
                    break
                try:
                    us, _ = time_calls([fn], target_ms=30, replays=7, graph=False)
                    row["others"][name] = us
                except Exception as e:
                    log(f"    {name}: {type(e).__name__}: {str(e)[:300]}")
            finish_prefill_row(row)
            results.append(row)
            del pr, k_dense, v_dense, others
            torch.cuda.empty_cache()


def finish_prefill_row(row):
    tf = lambda us: row["flops"] / (us * 1e-6) / 1e12  # noqa: E731
    t = row["triton"]
    if not t:
        return
    best = min(t, key=t.get)
    row["best_key"], row["best_tflops"] = best, tf(t[best])
    row["default_tflops"] = tf(t.get(row["triton_default_key"], float("nan")))
    row["others_tflops"] = {k: tf(v) for k, v in row["others"].items()}
    fa = row["others_tflops"].get("fa4 paged")
    if fa:
        row["ratio_best"] = row["best_tflops"] / fa
        row["ratio_default"] = row["default_tflops"] / fa
    log(f"prefill page={row['page']:3d} prefix={row['prefix']!s:5s} {row['tokens']} tok: default "
        f"{row['default_tflops']:.0f} TFLOP/s | best {best} {row['best_tflops']:.0f} | "
        + " | ".join(f"{k} {v:.0f}" for k, v in row["others_tflops"].items())
        + f" | ratio vs fa4 paged {row.get('ratio_best', float('nan')):.2f}")
    log("    all: " + ", ".join(f"{k}={tf(v):.0f}" for k, v in sorted(t.items(), key=lambda kv: kv[1])))


def bench_store(results):
    t = PREFILL_TOKENS
    for page in (16, 256):
        nb = t // page + 8
        k_cache = torch.empty(nb, page, KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
        v_cache = torch.empty_like(k_cache)
        qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, device=DEV, dtype=DT)
        k, v = qkv[:, HEADS:HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS:]
        slots = torch.randperm(nb * page, device=DEV)[:t]
        us, _ = time_calls([lambda: store_kvcache(k, v, k_cache, v_cache, slots)], target_ms=10)
        nbytes = 2 * 2 * t * KV_HEADS * HEAD_DIM * 2
        row = dict(section="store", page=page, tokens=t, us=us, tbs=nbytes / (us * 1e-6) / 1e12)
        log(f"store_kvcache page={page} T={t}: {us:.1f} us, {row['tbs']:.2f} TB/s (read + write)")
        results.append(row)


def summary(results, copy_tbs):
    log("\n## summary (bf16, 16 q heads / 8 kv heads / head_dim 128)")
    log(f"copy bandwidth (read + write): {copy_tbs:.2f} TB/s")
    log("| decode | page | contexts | B | ours default TB/s | ours best TB/s (config) | fa4 TB/s | best/fa4 | default/fa4 |")
    log("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["section"] == "decode" and "best_tbs" in r:
            log(f"| | {r['page']} | {r['contexts']} | {r['batch']} | {r['default_tbs']:.2f} | {r['best_tbs']:.2f} "
                f"({r['best_key']}) | {r.get('fa4_tbs', float('nan')):.2f} | {r.get('ratio_best', float('nan')):.2f} "
                f"| {r.get('ratio_default', float('nan')):.2f} |")
    log("| prefill | page | prefix | tokens | ours default TFLOP/s | ours best (config) | others TFLOP/s | best/fa4 paged |")
    log("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["section"] == "prefill" and "best_tflops" in r:
            oth = "; ".join(f"{k} {v:.0f}" for k, v in r["others_tflops"].items())
            log(f"| | {r['page']} | {r['prefix']} | {r['tokens']} | {r['default_tflops']:.0f} | "
                f"{r['best_tflops']:.0f} ({r['best_key']}) | {oth} | {r.get('ratio_best', float('nan')):.2f} |")


def profile_calls() -> int:
    """One launch each, in this order: our decode, flash-attn-4 decode (B=256, U[512,2048], page
    16), our prefill, flash-attn-4 prefill (35k tokens, no prefix, page 16); default configs. For
    `ncu -k regex:"_decode_kernel|_prefill_kernel|flash" -c 4`."""
    scale = HEAD_DIM ** -0.5
    fa = flash_attn_varlen()
    pr = decode_problem(DECODE_BATCHES[-1], *DECODE_DISTS[0][1:], 16, seed=7)
    p = pr["problems"][0]
    paged_decode_attention(p["q"], p["k"], p["v"], pr["k_cache"], pr["v_cache"], p["bt"], pr["ctx"],
                           scale, out=p["out"])
    if fa is not None:
        fa(p["q"], pr["k_cache"], pr["v_cache"], cu_seqlens_q=pr["cu"], seqused_k=pr["ctx"],
           page_table=p["bt0"], max_seqlen_q=1, softmax_scale=scale, causal=True,
           num_splits=fa4_num_splits(DEV))
    q_lens, _ = prefill_lengths(PREFILL_TOKENS, seed=0)
    pf = prefill_problem(q_lens, [0] * len(q_lens), 16, seed=1)
    varlen_prefill_attention(pf["q"], pf["k"], pf["v"], pf["k_cache"], pf["v_cache"], pf["cu"], pf["ctx"],
                             pf["bt"], scale)
    if fa is not None:
        fa(pf["q"], pf["k_cache"], pf["v_cache"], cu_seqlens_q=pf["cu"], seqused_k=pf["ctx"],
           page_table=pf["bt"].clamp(min=0), max_seqlen_q=pf["max_q"], softmax_scale=scale, causal=True)
    torch.cuda.synchronize()
    return 0


def smoke_shapes():
    global HEADS, KV_HEADS, HEAD_DIM, DT, DEV, DECODE_BATCHES, DECODE_DISTS, PREFILL_TOKENS, Q_RANGE
    global PREFIX_RANGE, COPY_BYTES, L2_BYTES, DECODE_CONFIGS, PREFILL_CONFIGS
    os.environ.setdefault("TRITON_INTERPRET", "1")
    HEADS, KV_HEADS, HEAD_DIM, DT, DEV = 4, 2, 16, torch.float32, torch.device("cpu")
    DECODE_BATCHES, DECODE_DISTS = (1, 3), (("U[5,40]", 5, 40),)
    PREFILL_TOKENS, Q_RANGE, PREFIX_RANGE, COPY_BYTES, L2_BYTES = 60, (5, 30), (3, 20), 2**20, 2**14
    DECODE_CONFIGS = [(16, 1, 1), (32, 1, 1)]
    PREFILL_CONFIGS = [(16, 16, 1, 1, True), (32, 16, 1, 1, False)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-decode", type=float, default=150.0, help="seconds; later cases are skipped")
    ap.add_argument("--budget-prefill", type=float, default=90.0)
    ap.add_argument("--profile", action="store_true",
                    help="one call of each Triton kernel on the headline shapes, for ncu")
    ap.add_argument("--sections", default="copy,store,decode,prefill")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        smoke_shapes()
    torch.set_grad_enabled(False)
    if args.profile:
        return profile_calls()
    import triton

    fa = flash_attn_varlen() if DEV.type == "cuda" else None
    env = dict(device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", torch=torch.__version__,
               triton=triton.__version__, flash_attn_4=fa is not None)
    try:
        import importlib.metadata as md
        env["flash_attn_4_version"] = md.version("flash-attn-4")
    except Exception:
        pass
    log("env:", env)
    results, copy_tbs = [], float("nan")
    sections = args.sections.split(",")
    for name in sections:
        t0 = time.time()
        try:
            if name == "copy":
                copy_tbs = copy_bandwidth()
                log(f"copy bandwidth: {copy_tbs:.2f} TB/s (read + write)")
            elif name == "store":
                bench_store(results)
            elif name == "decode":
                bench_decode(results, Budget(args.budget_decode), fa)
            elif name == "prefill":
                bench_prefill(results, Budget(args.budget_prefill), fa)
        except Exception:
            log(f"section {name} failed:\n{traceback.format_exc()}")
        log(f"[{name}: {time.time() - t0:.0f} s]")
    summary(results, copy_tbs)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(dict(env=env, copy_tbs=copy_tbs, results=results, max_splits=MAX_SPLITS), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
