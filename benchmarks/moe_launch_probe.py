"""How fast can kernels/fused_moe.py's kernels be? Their launch choices, by step size.

    PYTHONPATH=. python benchmarks/moe_launch_probe.py [--tokens 1,2,4,...]
        [--gemm-tokens 1,2,8,32] [--route-tokens 1,8,...] [--budget-s S] [--json PATH]

Session 68 traced the Qwen3-30B-A3B shape's single stream on an H200. The align kernel (one
program that lays the step's (token, expert) pairs out by expert) took 13.4 us a layer: 48
launches a step, ~0.64 ms of a 4.8 ms step, for 16 pairs. Its pair chunk (BLOCK_P,
align_block_for in the module) and its warps were never chosen on a GPU, and neither were the
expert GEMMs' tiles (gemm_config: "guesses from skinny_gemm's reasoning").

This times the align kernel at each step size of --tokens for every chunk of 16-128 pairs and
1-8 warps, and checks that every choice lays the pairs out as the default does. Then it times
each expert GEMM (gate/up with SiLU, down with the routing weights) at each step size of
--gemm-tokens over a grid of tiles, warps and stages, each output checked against the default
launch's, with the bytes of the experts read and their rate. Every call is timed in a CUDA graph
of calls (launch overhead out, as in the engine's graphs); the GEMMs' calls rotate over 4 layers'
experts (4.8 GB), so their weights come from HBM. --budget-s stops the GEMM grid where it has
got to.

Session 69 (H100, benchmarks/results/2026-12-07_s69_c2_moe_launch_align.txt, ..._c3_*): the
align kernel took 10.1 us at 1 token and 112 us at 64 in its default launch, most of it in its
third pass (each slot's run searched over every expert); no launch choice took back more than
14%, so the kernel itself was rewritten (its padding stored where it lies; from
ALIGN_COUNT_FROM chunks of pairs a count kernel and a program a chunk, whose time does not grow
with the step as one program's does; --tokens now goes to 256). The GEMMs' defaults
were within a few percent of the grid's best at 1-32 tokens but for 512-byte rows at block_n 16,
since then 256 as at the other widths.

Session 72 (H100, benchmarks/results/2026-12-07_s72_c2_*): the rewritten kernel's chunk of 64
pairs was 1-5 us a call behind the best launch at 1-64 tokens; align_block_for now picks 16 pairs
to 64 tokens and 32 above (the default column below is its choice at each size).

Session 73 (H100, benchmarks/results/2026-12-07_s73_c3_*): routing (kernels/moe_route.py) at
1-256 tokens, against `route` compiled: one warp a token beat two and four at every size (4.8
against 6.0-6.9 us at 1 token; compiled torch 8.5); the router's skinny split of 8 or 16 was
~0.2 us under the skinny GEMM's own 32 (in that call's keys "default"), so moe_route takes 8.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch
from triton.runtime.errors import OutOfResources

from benchmarks.bench_linear import graph_us
from minivllm.kernels import fused_moe
from minivllm.state.config import config_for_shape

CHUNKS = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8)
GEMM_GRID = [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
             itertools.product((16, 32, 64), (64, 128, 256), (2, 4, 8), (3, 4))]
LAYERS = 4  # layers' experts the GEMM calls rotate over: 4 x 1.2 GB, many times the L2


def probe_align(tokens: list[int], num_experts: int, top_k: int, dev, gen) -> list[dict]:
    """µs of an align call per launch choice (None where its layout differs from the default's)
    at each step size: each pair chunk and warps, counted in a kernel of a program a chunk
    (key "CxW") and by the one program (key "CxW one", where the default counts in a kernel)."""
    one = 10**9  # count_from no step reaches: the one program counts
    print(f"align: µs a call (CUDA graph of 20); default chunk align_block_for's, 4 warps, "
          f"counted by a kernel from {fused_moe.ALIGN_COUNT_FROM} chunks", flush=True)
    results = []
    for t in tokens:
        # route's experts: a view of [T, experts]'s top-k indices (strided, int64)
        experts = torch.randn(t, num_experts, device=dev, generator=gen).topk(top_k).indices
        block_m = fused_moe.block_m_for(t * top_k, num_experts, dev)
        default = (fused_moe.align_block_for(t * top_k, num_experts), 4)
        want = fused_moe.align(experts, num_experts, block_m)
        row = {"tokens": t, "pairs": t * top_k, "block_m": block_m, "chunk": default[0],
               "us": {}}
        for chunk, warps, count_from in itertools.product(CHUNKS, WARPS,
                                                          (fused_moe.ALIGN_COUNT_FROM, one)):
            counted = -(-t * top_k // chunk) >= fused_moe.ALIGN_COUNT_FROM
            if count_from == one and not counted:
                continue  # the one program already
            got = fused_moe.align(experts, num_experts, block_m, block_p=chunk, num_warps=warps,
                                  count_from=count_from)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            us = graph_us(lambda i, c=chunk, w=warps, f=count_from: fused_moe.align(
                experts, num_experts, block_m, block_p=c, num_warps=w, count_from=f))
            key = f"{chunk}x{warps}" + (" one" if count_from == one else "")
            row["us"][key] = us if same else None
        base = row["us"][f"{default[0]}x{default[1]}"]
        ok = {k: v for k, v in row["us"].items() if v is not None}
        best = min(ok, key=ok.get)
        wrong = sorted(set(row["us"]) - set(ok))
        print(f"{t:>4} tokens ({t * top_k} pairs, block_m {block_m}, chunk {default[0]}): "
              f"default {base:.2f} us, "
              f"best {best} {ok[best]:.2f} us" + (f"; DIFFERENT LAYOUT: {wrong}" if wrong else ""),
              flush=True)
        print("      " + "  ".join(f"{k} {v:.2f}" for k, v in ok.items()), flush=True)
        results.append(row)
    return results


def probe_gemms(tokens: list[int], config, dev, gen, deadline: float) -> list[dict]:
    """Each expert GEMM's µs per launch choice of GEMM_GRID at each step size (None where the
    output strays from the default launch's)."""
    dt = torch.bfloat16
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    layers = [(torch.randn(num_experts, 2 * inter, hidden, device=dev, dtype=dt, generator=gen)
               * 0.02,
               torch.randn(num_experts, hidden, inter, device=dev, dtype=dt, generator=gen) * 0.02)
              for _ in range(LAYERS)]
    expert_mb = {"gate_up": 2 * inter * hidden * 2 / 1e6, "down": hidden * inter * 2 / 1e6}
    print(f"expert GEMMs: µs a call (CUDA graph of {LAYERS * 5} calls over {LAYERS} layers)",
          flush=True)
    results = []
    for t in tokens:
        h = torch.randn(t, hidden, device=dev, dtype=dt, generator=gen)
        scores = torch.randn(t, num_experts, device=dev, generator=gen)
        top = scores.softmax(-1).topk(top_k)
        weights, experts = top.values, top.indices
        pairs = t * top_k
        block_m = fused_moe.block_m_for(pairs, num_experts, dev)
        # the default's layout: align's, or at one token a tile a pair (takes_pair_tiles)
        layout = None if fused_moe.takes_pair_tiles(t) else \
            fused_moe.align(experts, num_experts, block_m)
        distinct = len(torch.unique(experts))
        act = torch.empty((pairs, inter), dtype=dt, device=dev)
        y = torch.empty((pairs, hidden), dtype=torch.float32, device=dev)

        def gate_up(i, cfg):
            fused_moe._gemm(h, layers[i % LAYERS][0], act, None, experts, layout, n=inter,
                            k=hidden, a_div=top_k, glu=True, block_m=block_m, config=cfg)
            return act

        def down(i, cfg):
            fused_moe._gemm(act, layers[i % LAYERS][1], y, weights, experts, layout, n=hidden,
                            k=inter, a_div=1, glu=False, block_m=block_m, config=cfg)
            return y

        for name, fn in (("gate_up", gate_up), ("down", down)):
            want = fn(0, None).float().clone()
            scale = want.abs().max().item() or 1.0
            row = {"tokens": t, "gemm": name, "experts": distinct,
                   "MB": distinct * expert_mb[name], "default_us": graph_us(lambda i: fn(i, None),
                                                                            calls=LAYERS * 5),
                   "us": {}}
            for cfg in GEMM_GRID:
                if time.monotonic() > deadline:
                    break
                key = "n{block_n}k{block_k}w{num_warps}s{num_stages}".format(**cfg)
                try:
                    err = (fn(0, cfg).float() - want).abs().max().item() / scale
                except OutOfResources:  # its tiles and stages need more shared memory than
                    # an SM has (session 69: block_n 64, block_k 256, 4 stages)
                    row["us"][key] = "no room"
                    continue
                row["us"][key] = (graph_us(lambda i, c=cfg: fn(i, c), calls=LAYERS * 5)
                                  if err < 1e-2 else None)
            ok = {k: v for k, v in row["us"].items() if isinstance(v, float)}
            wrong = sorted(k for k, v in row["us"].items() if v is None)
            best = min(ok, key=ok.get) if ok else None
            rate = row["MB"] / row["default_us"]  # MB a us is TB/s
            print(f"{t:>4} tokens {name:>7}: {distinct} experts, {row['MB']:.1f} MB; default "
                  f"{row['default_us']:.2f} us ({rate:.2f} TB/s)"
                  + (f", best {best} {ok[best]:.2f} us ({row['MB'] / ok[best]:.2f} TB/s)"
                     if best else "")
                  + (f"; {len(ok)} of {len(GEMM_GRID)} timed" if len(row["us"]) < len(GEMM_GRID)
                     else "") + (f"; OUTPUT DIFFERS: {wrong}" if wrong else ""), flush=True)
            fastest = sorted(ok.items(), key=lambda kv: kv[1])[:5]
            print("      " + "  ".join(f"{k} {v:.2f}" for k, v in fastest), flush=True)
            results.append(row)
    return results


def probe_route(tokens: list[int], config, dev, gen) -> list[dict]:
    """µs of a step's routing (kernels/moe_route.py: the router's product, by the skinny GEMM up
    to 16 rows, and the routing kernel) per launch choice at each step size, each checked to
    pick the default's experts, against route (torch) compiled as the engine compiles it."""
    from minivllm.functional.moe import route
    from minivllm.kernels import moe_route
    from minivllm.kernels.skinny_gemm import MAX_SKINNY_ROWS

    hidden, e, k = config.hidden_size, config.num_experts, config.num_experts_per_tok
    router = torch.randn(e, hidden, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02
    compiled = torch.compile(lambda h: route(h, router, k, True), fullgraph=True)
    print(f"routing: µs a call (CUDA graph of 20); keys: the router's skinny split (default "
          f"{moe_route.ROUTER_SPLIT}; 'linear': F.linear, past {MAX_SKINNY_ROWS} rows) x warps",
          flush=True)
    results = []
    for t in tokens:
        h = torch.randn(t, hidden, device=dev, generator=gen, dtype=torch.bfloat16)
        skinny = t <= MAX_SKINNY_ROWS
        want = moe_route.fused_route(h, router, k, True, skinny=skinny)[1]
        row = {"tokens": t, "skinny": skinny, "torch_compiled": graph_us(lambda i: compiled(h)),
               "us": {}}
        for split, warps in itertools.product((8, 16, 32) if skinny else (0,), (1, 2, 4)):
            cfg = {"split": split} if split else None  # the default: moe_route.ROUTER_SPLIT
            fn = lambda i, c=cfg, w=warps: moe_route.fused_route(  # noqa: E731
                h, router, k, True, skinny=skinny, skinny_config=c, num_warps=w)
            same = torch.equal(fn(0)[1], want)
            row["us"][f"{split or 'linear'}x{warps}"] = graph_us(fn) if same else None
        print(f"{t:>4} tokens: torch compiled {row['torch_compiled']:.2f} us; " + "  ".join(
            f"{key} {us:.2f}" if us is not None else f"{key} DIFFERENT"
            for key, us in row["us"].items()), flush=True)
        results.append(row)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--gemm-tokens", default="1,2,8,32")
    ap.add_argument("--route-tokens", default="1,8,16,64,256")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_launch_probe.py: needs a CUDA GPU; nothing to do here.")
        return 2
    deadline = time.monotonic() + args.budget_s
    dev = torch.device("cuda")
    config = config_for_shape("qwen3-30b-a3b")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}; {config.num_experts} experts, "
          f"top-{config.num_experts_per_tok}", flush=True)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    route = probe_route(ints(args.route_tokens), config, dev, gen)
    align = probe_align(ints(args.tokens), config.num_experts, config.num_experts_per_tok, dev,
                        gen)
    gemms = probe_gemms(ints(args.gemm_tokens), config, dev, gen, deadline)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev),
                       "align_default": ["align_block_for", 4, fused_moe.ALIGN_COUNT_FROM],
                       "route": route,
                       "align": align,
                       "gemms": gemms}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
