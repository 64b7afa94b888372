"""The skinny GEMM at forced tile configs, in the forms the engine calls it (H200 tuning aid).

    PYTHONPATH=. python benchmarks/sweep_decode_gemm.py [--rows 1,16] [--layers o_proj,down,qkv,gate_up]
    PYTHONPATH=. python benchmarks/sweep_decode_gemm.py --rows 64,128,256   # past the skinny range

Qwen3-0.6B's decode GEMMs at a few rows. The row-parallel o_proj (x: [M, 2048]) and down with
SiLU-and-mul folded in (x: [M, 2 * 3072]) return fp32 split-K partials (partials=True), as the
engine calls them. The column-parallel qkv and gate_up, which the engine gives to cuBLAS, are
timed summed (split K costs the sum kernel), beside F.linear. Timed like bench_linear.py: a CUDA
graph of 20 calls over weight copies that exceed the L2, median of 10 replays; microseconds per
call for skinny_config's default and each forced config. Past 16 rows, where the engine runs
cuBLAS (down after a SiLU-and-mul kernel), every layer is timed beside that form, and the skinny
GEMM in M tiles of 64-128 rows. Only an engine A/B decides a default; this says which configs
are worth one.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_linear import DT, cuda_and_l2, graph_us, weight_copies
from minivllm.functional.activation import silu_and_mul
from minivllm.kernels.skinny_gemm import MAX_SKINNY_ROWS, skinny_config, skinny_linear

LAYERS = {  # N, K, glu, engine form returns partials
    "o_proj": (1024, 2048, False, True), "down": (1024, 3072, True, True),
    "qkv": (4096, 1024, False, False), "gate_up": (6144, 1024, False, False)}
CONFIGS = [dict(block_n=16), dict(block_n=32), dict(block_n=32, split=16), dict(block_n=64),
           dict(block_n=64, block_k=64), dict(block_n=64, block_k=64, split=8),
           dict(block_n=64, block_k=64, num_stages=3), dict(block_n=128, block_k=64),
           dict(block_n=64, block_k=64, split=2), dict(block_n=32, block_k=64, split=2)]
# past 16 rows (the engine's cuBLAS range), M tiles of m_pad rows
WIDE_CONFIGS = [dict(m_pad=64, block_n=64, block_k=64), dict(m_pad=128, block_n=64, block_k=64),
                dict(m_pad=64, block_n=128, block_k=64), dict(m_pad=128, block_n=128, block_k=64),
                dict(m_pad=64, block_n=64, block_k=64, split=4),
                dict(m_pad=128, block_n=64, block_k=64, split=4),
                dict(m_pad=128, block_n=128, block_k=64, split=2),
                dict(m_pad=128, block_n=64, block_k=128, num_stages=3)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", default=",".join(LAYERS))
    args = ap.parse_args()
    if (gpu := cuda_and_l2("sweep_decode_gemm.py")) is None:
        return 2
    (dev, l2), dt = gpu, DT
    gen = torch.Generator(device=dev).manual_seed(0)
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.layers.split(","):
            n, k, glu, partials = LAYERS[name]
            ws = weight_copies(n, k, l2, gen)
            copies = len(ws)
            x = torch.randn(m, 2 * k if glu else k, device=dev, dtype=dt, generator=gen)
            cells = []
            if glu and m > MAX_SKINNY_ROWS:  # the engine's form there: SiLU-and-mul, then cuBLAS
                us = graph_us(lambda i: F.linear(silu_and_mul(x), ws[i % copies]))
                cells.append(f"silu_and_mul + cuBLAS: {us:.2f}")
            elif not partials or m > MAX_SKINNY_ROWS:
                cells.append(f"cuBLAS: {graph_us(lambda i: F.linear(x, ws[i % copies])):.2f}")
            for over in [{}] + (CONFIGS if m <= MAX_SKINNY_ROWS else WIDE_CONFIGS):
                cfg = skinny_config(m, n, k, dt, dev, **over)
                tag = "m{m_pad} bn{block_n} bk{block_k} s{split} st{num_stages}".format(**cfg)
                try:
                    us = f"{graph_us(lambda i: skinny_linear(x, ws[i % copies], glu=glu, partials=partials, config=over)):.2f}"
                except Exception as e:  # e.g. more shared memory than an SM has
                    us = type(e).__name__
                cells.append(f"{'default ' if not over else ''}{tag}: {us}")
            print(f"M={m:<2} {name:7} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
