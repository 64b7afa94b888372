"""The decode attention kernel at the throughput run's batch, in the form the engine calls it
(H200 tuning aid).

    PYTHONPATH=. python benchmarks/sweep_decode_attention.py [--batch 256] [--contexts 200-1124,700-1624]
    PYTHONPATH=. python benchmarks/sweep_decode_attention.py --batch 2 --contexts 512-768 --splits 16,32,64
        # the single stream's step (one sequence padded to 2 rows; the latency run's contexts)
    PYTHONPATH=. python benchmarks/sweep_decode_attention.py --kv-cache-dtype fp8  # an fp8 cache
    PYTHONPATH=. python benchmarks/sweep_decode_attention.py --order both --default-only
        # the default config with the rows in random order and sorted longest context first
    ncu --clock-control none -k regex:_decode_kernel -s 1 -c 1 --section WarpStateStats ... \
        python benchmarks/sweep_decode_attention.py --profile --contexts 200-1124 [--kv-cache-dtype fp8]
        # the engine's default call twice (the first compiles), for a profiler to take the second

At 256 sequences the engine's decode kernel (q/k RMSNorm and RoPE, the new K/V stored, page 16)
is ~80% of a step's GPU time (BENCHMARKS.md, session 7). bench_attention.py's B=256 case
(contexts U[512, 2048], no norm or store) reads K/V at the copy rate; the engine's contexts are
shorter at first, and its kernel does more. This times the kernel over the contexts the
throughput workload has at steps ~100 and ~600 (prompts U[100, 1024] plus the tokens decoded so
far) with and without the fused norm/RoPE/store, at a few tile configs and both grid orders
(heads_fastest: a sequence's KV heads launched side by side, so they read neighbouring 256-byte
pieces of the same cache rows together). The rows are in the engine's order: random for a
16-bit cache, longest context first for an fp8 one (the scheduler's order there; a launch's
programs start roughly in row order, so it decides what fills the tail). Timed as
bench_attention.py times (CUDA graphs over problems that exceed the L2); TB/s = K/V bytes read /
time. Only an engine A/B decides a default.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_attention import (DEV, DT, HEAD_DIM, HEADS, KV_HEADS, copy_bandwidth,
                                        decode_problem, time_calls)
from benchmarks.compile_decode_kernel import parse_configs
from minivllm.kernels.decode_attention import decode_config, decode_splits, paged_decode_attention
from minivllm.state import parse_kv_cache_dtype
from minivllm.state.config import FP8_DTYPES

CONFIGS = [{}, dict(heads_fastest=True), dict(block_n=64, num_warps=4, num_stages=3),
           dict(block_n=64, num_warps=4, num_stages=3, heads_fastest=True),
           dict(block_n=128, num_warps=8, num_stages=3), dict(block_n=128, num_warps=4, num_stages=2),
           dict(block_n=128, num_warps=4, num_stages=4),
           # short tiles: at a single stream's few sequences a split's range is rounded up to
           # whole tiles, so 128-token tiles leave most of the 16 splits of a ~600-token context
           # empty (5 of 16 work, one 64 KB tile each)
           dict(block_n=64, num_warps=4, num_stages=2), dict(block_n=32, num_warps=4, num_stages=2),
           dict(block_n=32, num_warps=2, num_stages=2), dict(block_n=16, num_warps=1, num_stages=2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--contexts", default="200-1124,700-1624")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16) or fp8")
    ap.add_argument("--splits", default="", help="split counts to time, comma-separated "
                    "(default: the engine's, from decode_splits)")
    ap.add_argument("--order", choices=("engine", "given", "longest-first", "both"), default="engine",
                    help="the batch's rows in random context order (given), sorted longest first, "
                    "or both; engine (default): as the engine orders them, longest first for an "
                    "fp8 cache, else given")
    ap.add_argument("--default-only", action="store_true",
                    help="only the engine's default config (engine form and plain)")
    ap.add_argument("--configs", type=parse_configs, default=None,
                    help="the default and these tile configs only, e.g. n32w2s3,n64w2s2 (BLOCK_N, "
                    "warps, stages)")
    ap.add_argument("--profile", action="store_true",
                    help="no timing: the engine-form default twice per context range, for ncu")
    args = ap.parse_args()
    if any("maxnreg" in c for c in args.configs or []):
        ap.error("--configs: a register cap (r<MAXNREG>) is for compile_decode_kernel.py only")
    if not torch.cuda.is_available():
        print("sweep_decode_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"copy bandwidth {copy_bandwidth():.2f} TB/s", flush=True)
    b, scale = args.batch, HEAD_DIM ** -0.5
    g = torch.Generator(device=DEV).manual_seed(0)
    weights = [torch.randn(HEAD_DIM, generator=g, device=DEV, dtype=DT) for _ in range(2)]
    cos = torch.randn(b, HEAD_DIM, generator=g, device=DEV, dtype=DT)
    sin = torch.randn(b, HEAD_DIM, generator=g, device=DEV, dtype=DT)
    cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, DT)
    only = [{}] + (args.configs or []) if args.default_only or args.configs else None
    orders = {"both": ["given", "longest-first"],
              "engine": ["longest-first" if cache_dtype in FP8_DTYPES else "given"]}.get(
        args.order, [args.order])
    for spec, order in [(s, o) for s in args.contexts.split(",") for o in orders]:
        lo, hi = (int(x) for x in spec.split("-"))
        pr = decode_problem(b, lo, hi, args.page, seed=lo, cache_dtype=cache_dtype,
                            longest_first=order == "longest-first")
        pr["order"] = order
        # the engine's block tables: max_model_len 4096
        engine_splits = decode_splits(b, KV_HEADS, 4096, DEV, cache_dtype=cache_dtype)
        for splits in [int(x) for x in args.splits.split(",")] if args.splits else [engine_splits]:
            if args.profile:
                profile_one(pr, b, splits, weights, cos, sin, scale)
                continue
            sweep_one(pr, b, lo, hi, args.page, splits, weights, cos, sin, scale, only)
        del pr
        torch.cuda.empty_cache()
    return 0


# An fp8 cache: deeper prefetch (session 13's hypothesis, refuted in session 14). Triton
# pipelines the block-table load a stage ahead of the K/V loads, so up to num_stages 4 a program
# holds one tile ahead; offline sm_90 (benchmarks/compile_decode_kernel.py): n128 s5 two tiles
# ahead, 105 KB (two programs an SM); n64 s5 two, 54.5 KB (four); n64 s7 three, 71 KB (three);
# n32 s7 three, 37 KB (five). None beat n128 s3 in random order, the default before session 14.
FP8_PREFETCH_CONFIGS = [dict(block_n=128, num_warps=4, num_stages=3),  # the default before
                        dict(block_n=128, num_warps=4, num_stages=5),  # (n128 s2 is in CONFIGS)
                        dict(block_n=64, num_warps=4, num_stages=5),
                        dict(block_n=64, num_warps=4, num_stages=7),
                        dict(block_n=32, num_warps=4, num_stages=7)]


def profile_one(pr, b, splits, weights, cos, sin, scale):
    """The engine's call (default config, fused norm/RoPE/store) on the first problem, twice
    (each new token's K/V stored in its own slot, which no program reads: p["slots"])."""
    p = pr["problems"][0]
    for _ in range(2):
        paged_decode_attention(p["q"], p["k"], p["v"], pr["k_cache"], pr["v_cache"], p["bt"],
                               pr["ctx"], scale, out=p["out"], num_splits=splits,
                               slot_mapping=p["slots"], norm_rope=(weights[0], weights[1], cos, sin, 1e-6))
    torch.cuda.synchronize()
    print(f"profiled B={b} splits {splits} {pr['k_cache'].dtype}: {pr['bytes'] / 1e6:.0f} MB read a call "
          f"({len(pr['problems'])} problems)", flush=True)


def sweep_one(pr, b, lo, hi, page, splits, weights, cos, sin, scale, only=None):
    """Every config (or only those given; {} is the default) at one split count over one set of
    problems; one printed block."""
    cells = []
    configs = CONFIGS + [dict(c, peel=False) for c in CONFIGS[:1] + CONFIGS[7:8]]  # masks on every tile
    if pr["k_cache"].dtype in FP8_DTYPES:  # an fp8 cache: its default fp16 dots, bf16 ones,
        # and the other ways of widening its tiles (ptx_widen: 0 Triton's cast, 1 PTX for V only)
        configs = configs + [dict(c, f16_dots=False) for c in CONFIGS[:2]] + [
            dict(c, ptx_widen=w) for c in CONFIGS[:1] + CONFIGS[2:3] + CONFIGS[7:8] for w in (0, 1)
        ] + FP8_PREFETCH_CONFIGS
    if only is not None:
        configs = only
    default = decode_config(DEV, DT, HEAD_DIM, splits, 4096, b, pr["k_cache"].dtype)
    resolved = []  # each config once: an fp8 cache's default n32w2s2 is also a row of CONFIGS
    for c in (default | over for over in configs):
        if c not in resolved:
            resolved.append(c)
    norm_rope = (weights[0], weights[1], cos, sin, 1e-6)
    for fused in (True, False):
        for cfg in resolved:
            # the engine's form: q/k normed and rotated, each new token's K/V stored in its own
            # slot (p["slots"])
            calls = [lambda p=p: paged_decode_attention(
                p["q"], p["k"], p["v"], pr["k_cache"], pr["v_cache"], p["bt"], pr["ctx"],
                scale, out=p["out"], num_splits=splits, config=cfg,
                **(dict(slot_mapping=p["slots"], norm_rope=norm_rope) if fused else {}))
                for p in pr["problems"]]
            us, _ = time_calls(calls)
            tag = ("engine form " if fused else "plain ") + "n{block_n}w{num_warps}s{num_stages}".format(
                **cfg) + (" heads-fastest" if cfg.get("heads_fastest") else "") + (
                " bf16-dots" if cfg.get("f16_dots") is False else "") + (
                f" ptx-widen {cfg['ptx_widen']}" if "ptx_widen" in cfg else "") + (
                " no-peel" if cfg.get("peel") is False else "")
            cells.append(f"{tag}: {us:.1f} us {pr['bytes'] / us / 1e6:.2f} TB/s")
    print(f"B={b} contexts U[{lo},{hi}] ({pr['order']} order) page {page} splits {splits} "
          f"({HEADS} heads, {str(pr['k_cache'].dtype).removeprefix('torch.')} cache):\n  "
          + "\n  ".join(cells), flush=True)


if __name__ == "__main__":
    sys.exit(main())
