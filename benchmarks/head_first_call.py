"""What the LM head's GEMM costs the host the first time it meets a row count (H200 diagnosis).

    PYTHONPATH=. python benchmarks/head_first_call.py [--rows 1-300] [--vocab 151936 --hidden 1024]

The prefill trace of session 6 showed the head's `aten::mm` holding the CPU 5-8 ms in some
prefill and mixed steps and ~0.1 ms in others, with nothing traced inside. Those steps' logits
have a row count not seen before. This times, for each row count in turn, the host time of a
first and of a second `x @ head.T` (bf16, then the engine's fp32 cast), synchronised before and
after, and the caching allocator's device allocations (`num_device_alloc`) each made. A first
call that is slow with no allocation is cuBLAS loading or choosing a kernel for a new shape,
which a warm-up over the row counts (or padding rows to a few sizes) moves out of serving.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def parse_rows(spec: str) -> list[int]:
    rows = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        rows += list(range(int(lo), int(hi or lo) + 1))
    return rows


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1-300")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("head_first_call.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    weight = torch.randn(args.vocab, args.hidden, device=dev, dtype=torch.bfloat16)
    x_all = torch.randn(max(parse_rows(args.rows)), args.hidden, device=dev, dtype=torch.bfloat16)
    (x_all[:1] @ weight.T).float()  # cuBLAS handle and workspace, outside the figures
    records = []
    for m in parse_rows(args.rows):
        x = x_all[:m]
        allocs = torch.cuda.memory_stats(dev)["num_device_alloc"]
        first = timed(lambda: (x @ weight.T).float())
        first_allocs = torch.cuda.memory_stats(dev)["num_device_alloc"] - allocs
        second = timed(lambda: (x @ weight.T).float())
        records.append({"rows": m, "first_ms": 1e3 * first, "second_ms": 1e3 * second,
                        "first_device_allocs": first_allocs})
    slow = [r for r in records if r["first_ms"] > 1.0]
    print(f"{len(records)} row counts; {len(slow)} first calls took > 1 ms of host time")
    for r in slow:
        print(f"  rows {r['rows']:4}: first {r['first_ms']:.2f} ms ({r['first_device_allocs']} "
              f"device allocations), second {r['second_ms']:.3f} ms")
    typical = sorted(r["second_ms"] for r in records)[len(records) // 2]
    print(f"median second call {typical:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "vocab": args.vocab,
                       "hidden": args.hidden, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
