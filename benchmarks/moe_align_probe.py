"""How fast can kernels/fused_moe.py's align kernel be? Its launch choices, by step size.

    PYTHONPATH=. python benchmarks/moe_align_probe.py [--tokens 1,2,4,...] [--json PATH]

Session 68 traced the Qwen3-30B-A3B shape's single stream on an H200: the align kernel (one
program that lays the step's (token, expert) pairs out by expert) took 13.4 us a layer, 48
launches a step, ~0.64 ms of a 4.8 ms step, for 8 or 16 pairs. Its pair chunk (BLOCK_P, ALIGN_BLOCK
in the module) and its warps were never chosen on a GPU. This times it at each step size for
every chunk of 16-128 pairs and 1-8 warps, each in a CUDA graph of calls (launch overhead out, as
in the engine's graphs), checks that every choice lays the pairs out as the default does, and
prints the microseconds of each against the default's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from benchmarks.bench_linear import graph_us
from minivllm.kernels import fused_moe
from minivllm.kernels.launch import next_pow2
from minivllm.state.config import config_for_shape

CHUNKS = (16, 32, 64, 128)
WARPS = (1, 2, 4, 8)


def align_with(experts: torch.Tensor, num_experts: int, block_m: int, chunk: int, warps: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_moe.align with the pair chunk and warps given (the module's launch otherwise)."""
    p = experts.numel()
    tiles = fused_moe.max_tiles(p, num_experts, block_m)
    dev = experts.device
    sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    num_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    fused_moe._align_kernel[(1,)](
        experts, sorted_ids, tile_expert, num_tiles, p, num_experts, tiles * block_m,
        experts.stride(0), experts.stride(1), TOP_K=experts.shape[1], BLOCK_M=block_m,
        E_PAD=max(2, next_pow2(num_experts)), BLOCK_P=chunk, num_warps=warps)
    return sorted_ids, tile_expert, num_tiles


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_align_probe.py: needs a CUDA GPU; nothing to do here.")
        return 2
    dev = torch.device("cuda")
    config = config_for_shape("qwen3-30b-a3b")
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    gen = torch.Generator(device=dev).manual_seed(0)
    default = (fused_moe.ALIGN_BLOCK, 4)
    print(f"{torch.cuda.get_device_name(dev)}; µs an align call (CUDA graph of 20), "
          f"{num_experts} experts, top-{top_k}; default chunk {default[0]}, {default[1]} warps",
          flush=True)
    results = []
    for t in (int(x) for x in args.tokens.split(",")):
        # route's experts: a view of [T, experts]'s top-k indices (strided, int64)
        experts = torch.randn(t, num_experts, device=dev, generator=gen).topk(top_k).indices
        block_m = fused_moe.block_m_for(t * top_k, num_experts, dev)
        want = align_with(experts, num_experts, block_m, *default)
        row = {"tokens": t, "pairs": t * top_k, "block_m": block_m, "us": {}}
        for chunk, warps in itertools.product(CHUNKS, WARPS):
            got = align_with(experts, num_experts, block_m, chunk, warps)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            us = graph_us(lambda i, c=chunk, w=warps: align_with(experts, num_experts, block_m,
                                                                  c, w))
            row["us"][f"{chunk}x{warps}"] = us if same else None
        base = row["us"][f"{default[0]}x{default[1]}"]
        ok = {k: v for k, v in row["us"].items() if v is not None}
        best = min(ok, key=ok.get)
        wrong = sorted(set(row["us"]) - set(ok))
        print(f"{t:>4} tokens ({t * top_k} pairs, block_m {block_m}): default {base:.2f} us, "
              f"best {best} {ok[best]:.2f} us" + (f"; DIFFERENT LAYOUT: {wrong}" if wrong else ""),
              flush=True)
        print("      " + "  ".join(f"{k} {v:.2f}" for k, v in ok.items()), flush=True)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "default": list(default),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
