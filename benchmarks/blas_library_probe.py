"""The decode GEMMs of 17-256 rows (cuBLAS's, where the skinny GEMM stops) under each BLAS library
torch can route `mm` to (torch.backends.cuda.preferred_blas_library; TORCH_BLAS_PREFER_CUBLASLT=1
sets it for a whole run): torch's default choice (what the engine runs), cuBLAS and cuBLASLt,
whose heuristics may choose other tiles and splits for these shapes.

Each GEMM runs as the engine runs it: in a CUDA graph, its weight cold in L2 (each of the graph's
20 calls reads another copy of it, 20 copies being larger than the L2), x: [rows, K] bf16.
Prints µs a call for each shape, row count and library.

    python benchmarks/blas_library_probe.py [--shape qwen3-0.6b] [--rows 32,64,128,256]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minivllm.state import SHAPES  # noqa: E402

CALLS = 20


def layer_gemms(shape: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of one decoder layer's four GEMMs (weight [N, K])."""
    h, d = shape["hidden_size"], shape["head_dim"]
    q, kv, i = shape["num_heads"] * d, shape["num_kv_heads"] * d, shape["intermediate_size"]
    return {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "gate_up": (2 * i, h), "down": (h, i)}


def time_in_graph(rows: int, n: int, k: int, device) -> float:
    """µs a call of x @ w.T, the weight cold, replayed in a CUDA graph."""
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(CALLS)]
    out = [None] * CALLS
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for w in weights[:2]:  # warm-up: cuBLAS's handle and heuristics outside the capture
            torch.mm(x, w.t())
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for j, w in enumerate(weights):
            out[j] = torch.mm(x, w.t())
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="32,64,128,256")
    args = ap.parse_args()
    device = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    gemms = layer_gemms(SHAPES[args.shape])
    libraries = ("default", "cublas", "cublaslt")
    results = {}
    for lib in libraries:
        torch.backends.cuda.preferred_blas_library(lib)
        for name, (n, k) in gemms.items():
            for m in rows:
                results[lib, name, m] = time_in_graph(m, n, k, device)
    torch.backends.cuda.preferred_blas_library("default")
    print(f"{args.shape}, bf16, µs a call in a CUDA graph (weight cold), {torch.cuda.get_device_name(device)}")
    print("| GEMM (N x K) | rows | " + " | ".join(libraries) + " | Lt / default |")
    print("|---|---|" + "---|" * (len(libraries) + 1))
    for name, (n, k) in gemms.items():
        for m in rows:
            t = [results[lib, name, m] for lib in libraries]
            print(f"| {name} ({n} x {k}) | {m} | " + " | ".join(f"{v:.2f}" for v in t)
                  + f" | {t[-1] / t[0]:.2f} |")
    for lib in libraries:
        for m in rows:
            total = sum(results[lib, name, m] for name in gemms)
            print(f"{lib}: four GEMMs at {m} rows: {total:.1f} µs")


if __name__ == "__main__":
    main()
