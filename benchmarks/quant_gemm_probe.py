"""Why is the AWQ engine's single stream so slow? The quantized decode GEMMs at the Qwen3-8B shape.

    PYTHONPATH=. python benchmarks/quant_gemm_probe.py [--rows 1,2,16] [--dtype float16]
        [--json PATH]

Session 62 (BENCHMARKS.md) ran `bench --shape qwen3-8b --latency` on an H100: dense bf16 158
tok/s, block-fp8 224, AWQ 14 (72 ms a step, the device's). This times one call of each of the
layer's four linears (qkv, o, gate_up, down) at a few row counts, in a CUDA graph of calls over
weight copies that exceed the L2 together: cuBLAS on the dense weight; kernels/fp8_gemm.py at
its tiles and at 64 and 128 columns; kernels/awq_gemm.py at its own tiles and at others (the
128-column tiles and K splits that its decode rule picks or not, 256 columns, 8 warps, 2 or 3
stages); in bf16 or fp16 (--dtype; fp16 is the dtype of Qwen's AWQ checkpoints). Session 62's
first run of it compared the AWQ kernel then (each int loaded once for each of its eight
columns) with the kernel that loads each int once, now awq_gemm.py's: 8-17x faster. Session 63's
timed three cheaper dequantizations of a nibble (one conversion a weight, or none, or the scale
applied after tl.dot): all within 8% of the kernel's, so the unpacking's arithmetic is not what
bounds it (BENCHMARKS.md); they were removed.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.bench_linear import graph_us
from minivllm.kernels.awq_gemm import awq_config, awq_linear
from minivllm.kernels.fp8_gemm import fp8_linear
from minivllm.state.params import random_quantized_linear

COPIES = 4  # weight copies a graph cycles through: 4 x gate_up's 50 MB of 4-bit weights
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def variants(dense, fp8, awq, split_128: int):
    """name -> fn(x, i) over the i-th weight copy; split_128: the K split the tile rule gives
    128-column tiles at this shape and row count."""
    def awq_with(**config):
        return lambda x, i: awq_linear(x, awq[i], config=config)
    return {
        "dense": lambda x, i: torch.nn.functional.linear(x, dense[i]),
        "fp8": lambda x, i: fp8_linear(x, fp8[i]),
        # the shared tile rule gives qkv, o_proj and down 32-column tiles, as it gave AWQ's
        "fp8_n64": lambda x, i: fp8_linear(x, fp8[i], config={"block_n": 64}),
        "fp8_n128": lambda x, i: fp8_linear(x, fp8[i], config={"block_n": 128}),
        "awq": awq_with(),
        "awq_n64": awq_with(block_n=64),
        "awq_n128": awq_with(block_n=128),
        "awq_n128_split2x": awq_with(block_n=128, split=2 * split_128),
        "awq_n256": awq_with(block_n=256),
        "awq_warps8": awq_with(num_warps=8),
        "awq_stages2": awq_with(num_stages=2),
        "awq_stages3": awq_with(num_stages=3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,16")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("quant_gemm_probe.py: needs a CUDA GPU; nothing to do here.")
        return 2
    dev, dt = torch.device("cuda"), getattr(torch, args.dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in SHAPES.items():
        dense = [torch.randn(n, k, device=dev, dtype=dt, generator=gen) * 0.02
                 for _ in range(COPIES)]
        fp8 = [random_quantized_linear("fp8", n, k, gen, dev) for _ in range(COPIES)]
        awq = [random_quantized_linear("awq", n, k, gen, dev) for _ in range(COPIES)]
        print(f"{name} [{n}, {k}], {args.dtype}")
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=dt, generator=gen)
            line = []
            split_128 = awq_config(m, n, k, awq[0].group_size, dt, dev, block_n=128)["split"]
            for vname, fn in variants(dense, fp8, awq, split_128).items():
                try:
                    us = graph_us(lambda i, fn=fn, x=x: fn(x, i % COPIES), calls=COPIES * 4)
                except Exception as e:  # a variant that does not compile: say so, go on
                    print(f"  {vname} at {m} rows failed: {type(e).__name__}: {e}"[:300])
                    continue
                results.append({"shape": name, "n": n, "k": k, "rows": m, "variant": vname,
                                "dtype": args.dtype, "us": us})
                line.append(f"{vname} {us:.1f}")
            print(f"  {m} rows (us): " + ", ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
