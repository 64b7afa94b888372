"""The skinny GEMM where K is split, as the engine calls it, at forced tile configs (H200 aid).

    PYTHONPATH=. python benchmarks/sweep_split_gemm.py [--rows 1,16]

Qwen3-0.6B's row-parallel layers at decode: o_proj (x: [M, 2048]) and down with SiLU-and-mul
folded in (x: [M, 2 * 3072]), both returning fp32 split-K partials (partials=True), timed like
bench_linear.py (a CUDA graph of 20 calls over weight copies that exceed the L2, median of 10
replays). Prints microseconds per call for skinny_config's default and each forced config.
Only an engine A/B decides a default; this says which configs are worth one.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.bench_linear import graph_us
from minivllm.kernels.skinny_gemm import skinny_config, skinny_linear

LAYERS = {"o_proj": (1024, 2048, False), "down": (1024, 3072, True)}  # N, K, glu
CONFIGS = [dict(block_n=16), dict(block_n=32), dict(block_n=32, split=16), dict(block_n=64),
           dict(block_n=64, block_k=64), dict(block_n=64, block_k=64, split=8),
           dict(block_n=64, block_k=64, num_stages=3), dict(block_n=128, block_k=64)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("sweep_split_gemm.py needs a CUDA GPU (it times CUDA graphs)", file=sys.stderr)
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)
    gen = torch.Generator(device=dev).manual_seed(0)
    for m in (int(r) for r in args.rows.split(",")):
        for name, (n, k, glu) in LAYERS.items():
            copies = max(1, min(20, math.ceil(2 * l2 / (n * k * dt.itemsize))))
            ws = [torch.randn(n, k, device=dev, dtype=dt, generator=gen) * k**-0.5
                  for _ in range(copies)]
            x = torch.randn(m, 2 * k if glu else k, device=dev, dtype=dt, generator=gen)
            cells = []
            for over in [{}] + CONFIGS:
                cfg = skinny_config(m, n, k, dt, dev, **over)
                us = graph_us(lambda i: skinny_linear(x, ws[i % copies], glu=glu, partials=True,
                                                      config=over))
                tag = "bn{block_n} bk{block_k} s{split} st{num_stages}".format(**cfg)
                cells.append(f"{'default ' if not over else ''}{tag}: {us:.2f}")
            print(f"M={m:<2} {name:6} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
