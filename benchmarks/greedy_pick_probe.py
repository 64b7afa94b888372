"""The greedy pick of a decode step's logits on the GPU: torch.argmax against the sampler's
Triton kernel (minivllm.kernels.sample_kernel.gumbel_argmax) at temperature 0, at each chunk.

    PYTHONPATH=. python benchmarks/greedy_pick_probe.py

Logits [B, 151936] fp32 (Qwen3's vocabulary), B in {1, 2}. Each way runs 50 times in one CUDA
graph (no launch cost from the host), timed with CUDA events, best and median of 5 replays, in
us a call. Every way's tokens are checked against torch.argmax's first. What this leaves out is
the host's cost of launching each way eagerly, which is what the engine pays (BENCHMARKS.md
session 19: there the kernel lost).
"""

from __future__ import annotations

import argparse
import sys

import torch

VOCAB = 151936


def time_in_graph(fn, calls: int = 50, replays: int = 5) -> tuple[float, float]:
    """(best, median) us a call of fn, `calls` of it captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return min(times), sorted(times)[len(times) // 2]


def main() -> int:
    # No options: --help prints what it measures instead of measuring.
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not torch.cuda.is_available():
        print("greedy_pick_probe: needs a CUDA GPU", file=sys.stderr)
        return 1
    from minivllm.kernels.sample_kernel import chunk_size, gumbel_argmax

    dev = torch.device("cuda")
    for b in (1, 2):
        logits = torch.randn(b, VOCAB, device=dev)
        temperature = torch.zeros(b, device=dev)
        seeds = torch.arange(b, device=dev, dtype=torch.int64)
        steps = torch.zeros(b, device=dev, dtype=torch.int64)
        ways = {"torch.argmax": lambda: logits.argmax(-1)}
        for chunk in (None, 2048, 4096, 8192):
            name = f"gumbel_argmax chunk {chunk or chunk_size(b, VOCAB, dev, 1024)}"
            ways[name] = lambda c=chunk: gumbel_argmax(logits, temperature, seeds, steps, chunk=c)
        want = logits.argmax(-1)
        for name, fn in ways.items():
            if not torch.equal(fn(), want):
                raise AssertionError(f"{name} picks other tokens than torch.argmax")
            best, median = time_in_graph(fn)
            print(f"rows {b}: {name}: {best:.2f} us a call (median {median:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
