"""The skinny GEMM at forced tile configs, in the forms the engine calls it (H200 tuning aid).

    PYTHONPATH=. python benchmarks/sweep_decode_gemm.py [--rows 1,16] [--layers o_proj,down,qkv,gate_up]

Qwen3-0.6B's decode GEMMs at a few rows. The row-parallel o_proj (x: [M, 2048]) and down with
SiLU-and-mul folded in (x: [M, 2 * 3072]) return fp32 split-K partials (partials=True), as the
engine calls them. The column-parallel qkv and gate_up, which the engine gives to cuBLAS, are
timed summed (split K costs the sum kernel), beside F.linear. Timed like bench_linear.py: a CUDA
graph of 20 calls over weight copies that exceed the L2, median of 10 replays; microseconds per
call for skinny_config's default and each forced config. Only an engine A/B decides a default;
this says which configs are worth one.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_linear import DT, graph_us, weight_copies
from minivllm.kernels.skinny_gemm import skinny_config, skinny_linear

LAYERS = {  # N, K, glu, engine form returns partials
    "o_proj": (1024, 2048, False, True), "down": (1024, 3072, True, True),
    "qkv": (4096, 1024, False, False), "gate_up": (6144, 1024, False, False)}
CONFIGS = [dict(block_n=16), dict(block_n=32), dict(block_n=32, split=16), dict(block_n=64),
           dict(block_n=64, block_k=64), dict(block_n=64, block_k=64, split=8),
           dict(block_n=64, block_k=64, num_stages=3), dict(block_n=128, block_k=64),
           dict(block_n=64, block_k=64, split=2), dict(block_n=32, block_k=64, split=2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_decode_gemm.py needs a CUDA GPU (it times CUDA graphs)", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), DT
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)
    gen = torch.Generator(device=dev).manual_seed(0)
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.layers.split(","):
            n, k, glu, partials = LAYERS[name]
            ws = weight_copies(n, k, l2, gen)
            copies = len(ws)
            x = torch.randn(m, 2 * k if glu else k, device=dev, dtype=dt, generator=gen)
            cells = []
            if not partials:
                cells.append(f"cuBLAS: {graph_us(lambda i: F.linear(x, ws[i % copies])):.2f}")
            for over in [{}] + CONFIGS:
                cfg = skinny_config(m, n, k, dt, dev, **over)
                us = graph_us(lambda i: skinny_linear(x, ws[i % copies], glu=glu,
                                                      partials=partials, config=over))
                tag = "bn{block_n} bk{block_k} s{split} st{num_stages}".format(**cfg)
                cells.append(f"{'default ' if not over else ''}{tag}: {us:.2f}")
            print(f"M={m:<2} {name:7} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
