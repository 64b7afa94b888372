"""The one-kernel decode head (kernels/decode_head.py) at Qwen3-0.6B's head, its default (two
programs an SM, each taking several vocabulary tiles and computing each row's RMS once) against
other program counts, one a tile (2,374) among them, beside cuBLAS's GEMV of the same weight
(F.linear, no norm: the byte rate to reach). H200 tuning aid: an engine A/B decides a default.

    PYTHONPATH=. python benchmarks/sweep_decode_head.py [--rows 1,2] [--programs 132,264,...]

Timed as bench_linear.py times: a CUDA graph of calls (the 311 MB weight exceeds the L2, so
every call reads it from HBM), median of the replays; microseconds a call and the weight's
bytes over that time.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from benchmarks.bench_linear import cuda_and_l2, graph_us
from minivllm.kernels.decode_head import BLOCK_N, decode_head

VOCAB, HIDDEN = 151936, 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2")
    ap.add_argument("--programs", default="132,264,396,528,792,1188,2374",
                    help="program counts to time beside the default (two an SM)")
    args = ap.parse_args()
    if (gpu := cuda_and_l2("sweep_decode_head.py")) is None:
        return 2
    dev, _ = gpu
    gen = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    weight = torch.randn(VOCAB, HIDDEN, device=dev, dtype=dt, generator=gen) * HIDDEN**-0.5
    norm = 1 + 0.1 * torch.randn(HIDDEN, device=dev, dtype=dt, generator=gen)
    tiles = -(-VOCAB // BLOCK_N)
    gbytes = weight.numel() * weight.element_size() / 1e9
    for m in (int(r) for r in args.rows.split(",")):
        x, residual = (torch.randn(m, HIDDEN, device=dev, dtype=dt, generator=gen)
                       for _ in range(2))
        cells = [f"cuBLAS GEMV {graph_us(lambda i: F.linear(x, weight)):.1f}"]
        want = decode_head(x, residual, norm, weight, vocab_size=VOCAB, eps=1e-6)
        for programs in [None] + [int(p) for p in args.programs.split(",")]:
            if programs is not None and not 1 <= programs <= tiles:
                continue
            got = decode_head(x, residual, norm, weight, vocab_size=VOCAB, eps=1e-6,
                              programs=programs)
            same = all(torch.equal(a, b) for a, b in zip(got, want))
            us = graph_us(lambda i: decode_head(x, residual, norm, weight, vocab_size=VOCAB,
                                                eps=1e-6, programs=programs))
            name = f"{programs} programs" if programs else "default"
            cells.append(f"{name} {us:.1f} ({gbytes / us * 1e3:.2f} TB/s)"
                         + ("" if same else " OUTPUT DIFFERS"))
        print(f"M={m}  " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
