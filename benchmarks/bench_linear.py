"""Decode-shaped linear layers on the GPU: F.linear (cuBLAS) against skinny_linear (Triton).

    PYTHONPATH=. python benchmarks/bench_linear.py [--json PATH] [--models 0.6b,8b] [--tp 1,2]
                                                   [--rows 1,2,4,8,16] [--sweep]

x: [M, K] @ weight: [N, K].T in bf16 for M in --rows, over Qwen3-0.6B's and Qwen3-8B's layer
shapes (qkv, o_proj, gate_up, down, lm_head; --models also takes 1.7b, 4b and 30b-a3b, whose
dense linears and router are listed) and their tensor-parallel-2 slices (column-parallel
qkv/gate_up/lm_head halve N, row-parallel o_proj/down halve K, the router whole). Each op is
captured in a CUDA graph of CALLS calls and the graph replayed REPLAYS times; the median replay /
CALLS is the time per call, launch overhead excluded as in the engine's decode graphs. The calls
rotate over enough copies of the weight to exceed twice the L2, so weights come from HBM as they
do in a model's forward.
TB/s = weight bytes / time. Both results are checked against an fp32 matmul (bf16 tolerance).
--sweep also times a few forced tile configs of skinny_linear at the rows of --sweep-rows (2 and 16
by default; tuning aid), --sweep-split configs that split K as well.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys

import torch
import torch.nn.functional as F

from minivllm.kernels.skinny_gemm import skinny_config, skinny_linear

SHAPES = {  # model: {layer: (N, K)}
    "0.6b": {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
             "down": (1024, 3072), "lm_head": (151936, 1024)},
    "1.7b": {"qkv": (4096, 2048), "o_proj": (2048, 2048), "gate_up": (12288, 2048),
             "down": (2048, 6144), "lm_head": (151936, 2048)},
    "4b": {"qkv": (6144, 2560), "o_proj": (2560, 4096), "gate_up": (19456, 2560),
           "down": (2560, 9728), "lm_head": (151936, 2560)},
    "8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096),
           "down": (4096, 12288), "lm_head": (151936, 4096)},
    # Qwen3-30B-A3B's dense linears (its MLPs are experts: kernels/fused_moe.py); the router is
    # the MoE layer's product of 128 columns (kernels/moe_route.py takes it to the skinny GEMM)
    "30b-a3b": {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
                "lm_head": (151936, 2048)},
}
ROW_PARALLEL = ("o_proj", "down")  # split on K under tensor parallelism; the others on N
REPLICATED = ("router",)  # whole on every rank
LAYER = ("qkv", "o_proj", "gate_up", "down")  # one decoder layer's GEMMs, summed in the summary
CALLS, REPLAYS = 20, 10
DT = torch.bfloat16
TOL = 1e-2  # max |out - ref| / max |ref|: bf16 output rounding is 2^-9 relative
SWEEP = [dict(block_n=bn, block_k=bk, num_stages=st)
         for bn, bk, st in itertools.product((16, 32, 64), (128, 256), (3, 4))]
# --sweep-split: K split too (the skinny GEMM's default splits only where N alone gives fewer
# than two programs an SM; at K >= 4096 each unsplit program streams 128+ KB of one tile column)
SWEEP_SPLIT = [dict(block_n=bn, block_k=bk, split=sp, num_stages=4)
               for bn, bk, sp in itertools.product((16, 32, 64), (64, 128), (2, 4, 8))]


def log(*a):
    print(*a, flush=True)


def graph_us(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Median microseconds per call of fn(i), i = 0..calls-1, replayed from one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (Triton compiles) outside the capture
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    us = replay_us(g, replays)
    del g
    return us / calls


def replay_us(graph: torch.cuda.CUDAGraph, replays: int = REPLAYS) -> float:
    """Median microseconds of one replay of a captured graph (after one untimed replay)."""
    graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    return statistics.median(times) * 1e3


def cuda_and_l2(script: str) -> tuple[torch.device, int] | None:
    """The CUDA device and its L2 size in bytes; None (after saying so) without a GPU."""
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU (it times CUDA graphs)", file=sys.stderr)
        return None
    dev = torch.device("cuda")
    return dev, getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)


def weight_copies(n: int, k: int, l2: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Copies of a random [n, k] weight (at most CALLS) that together exceed twice the L2, so
    that calls rotating over them read from HBM, as a model's forward does."""
    copies = max(1, min(CALLS, math.ceil(2 * l2 / (n * k * DT.itemsize))))
    return [torch.randn(n, k, device=gen.device, dtype=DT, generator=gen) * k**-0.5
            for _ in range(copies)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def shapes(models, tps):
    for model in models:
        for tp in tps:
            for layer, (n, k) in SHAPES[model].items():
                if layer in ROW_PARALLEL:
                    k //= tp
                elif layer not in REPLICATED:
                    n //= tp
                yield model, tp, layer, n, k


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--models", default="0.6b,8b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--sweep", action="store_true", help="also time forced tile configs")
    ap.add_argument("--sweep-split", action="store_true", help="sweep split-K configs as well")
    ap.add_argument("--sweep-rows", default="2,16", help="the rows --sweep times")
    ap.add_argument("--layers", default=None, help="only these layers (comma-separated)")
    args = ap.parse_args()
    if (gpu := cuda_and_l2("bench_linear.py")) is None:
        return 2
    dev, l2 = gpu
    props = torch.cuda.get_device_properties(dev)
    rows = [int(r) for r in args.rows.split(",")]
    models, tps = args.models.split(","), [int(t) for t in args.tp.split(",")]
    sweep_rows = {int(r) for r in args.sweep_rows.split(",")}
    sweep = SWEEP + (SWEEP_SPLIT if args.sweep_split else [])
    only = set(args.layers.split(",")) if args.layers else None
    log(f"{props.name}, {props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MB, {DT}, "
        f"{CALLS} calls per graph, median of {REPLAYS} replays")
    gen = torch.Generator(device=dev).manual_seed(0)
    results, failures = [], []
    hdr = (f"{'model':>5} {'tp':>2} {'layer':>8} {'N':>6} {'K':>6} {'M':>3} | {'cuBLAS us':>9} "
           f"{'TB/s':>5} | {'skinny us':>9} {'TB/s':>5} | {'speedup':>7} | config")
    log(hdr)
    log("-" * len(hdr))
    for model, tp, layer, n, k in shapes(models, tps):
        if only is not None and layer not in only:
            continue
        nbytes = n * k * DT.itemsize
        ws = weight_copies(n, k, l2, gen)
        copies = len(ws)
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=DT, generator=gen)
            ref = x.float() @ ws[0].float().T
            errs = {"cublas": rel_err(F.linear(x, ws[0]), ref), "skinny": rel_err(skinny_linear(x, ws[0]), ref)}
            for name, e in errs.items():
                if not e <= TOL:
                    failures.append(f"{name} {model} tp{tp} {layer} M={m}: rel err {e:.3g}")
            t_cublas = graph_us(lambda i: F.linear(x, ws[i % copies]))
            t_skinny = graph_us(lambda i: skinny_linear(x, ws[i % copies]))
            cfg = skinny_config(m, n, k, DT, dev)
            row = dict(model=model, tp=tp, layer=layer, n=n, k=k, m=m, cublas_us=t_cublas,
                       skinny_us=t_skinny, cublas_tbs=nbytes / t_cublas / 1e6,
                       skinny_tbs=nbytes / t_skinny / 1e6, rel_err=errs, config=cfg)
            if args.sweep and m in sweep_rows:
                row["sweep"] = []
                for over in sweep:
                    c = skinny_config(m, n, k, DT, dev, **over)
                    us = graph_us(lambda i: skinny_linear(x, ws[i % copies], config=over))
                    row["sweep"].append(dict(config=c, us=us, tbs=nbytes / us / 1e6))
                best = min(row["sweep"], key=lambda r: r["us"])
                row["sweep_best"] = best
            results.append(row)
            cstr = "bn{block_n} bk{block_k} s{split} w{num_warps} st{num_stages}".format(**cfg)
            if "sweep_best" in row:
                b = row["sweep_best"]
                cstr += " | best {:.1f} us: bn{block_n} bk{block_k} s{split} st{num_stages}".format(
                    b["us"], **b["config"])
            log(f"{model:>5} {tp:>2} {layer:>8} {n:>6} {k:>6} {m:>3} | {t_cublas:>9.1f} "
                f"{row['cublas_tbs']:>5.2f} | {t_skinny:>9.1f} {row['skinny_tbs']:>5.2f} | "
                f"{t_cublas / t_skinny:>6.2f}x | {cstr}")
        del ws
        torch.cuda.empty_cache()

    log("\nOne decoder layer's GEMMs (" + " + ".join(LAYER) + "), us: cuBLAS / skinny / best of each "
        "(the sweep's best included where swept)")
    summary = []
    for model, tp in itertools.product(models, tps):
        for m in rows:
            sel = [r for r in results if (r["model"], r["tp"], r["m"]) == (model, tp, m) and r["layer"] in LAYER]
            if len(sel) != len(LAYER):
                continue
            c, s = sum(r["cublas_us"] for r in sel), sum(r["skinny_us"] for r in sel)
            b = sum(min(r["cublas_us"], r["skinny_us"], r.get("sweep_best", {}).get("us", 1e9))
                    for r in sel)
            summary.append(dict(model=model, tp=tp, m=m, cublas_us=c, skinny_us=s, best_us=b))
            log(f"  {model:>5} tp{tp} M={m:>2}: {c:7.1f} / {s:7.1f} / {b:7.1f}")
    for f in failures:
        log("MISMATCH", f)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=props.name, sms=props.multi_processor_count, dtype=str(DT), calls=CALLS,
                           replays=REPLAYS, results=results, layer_summary=summary, failures=failures),
                      fh, indent=1)
        log(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
