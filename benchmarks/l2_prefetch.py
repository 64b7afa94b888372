"""Would the decode GEMMs run faster from L2, and can a weight be prefetched there in time?
(H200 experiment for issue 5's single stream; no engine change rests on it yet.)

    PYTHONPATH=. python benchmarks/l2_prefetch.py [--rows 1,16,256] [--sleep-us 10]

A single-stream step reads each layer's 30 MB of weights once, at ~0.8 TB/s on average: its
GEMMs take 5-6 us each where the bytes alone would take 1-3 us, so they wait on DRAM latency,
not bandwidth. Each GEMM of Qwen3-0.6B's decode, in the engine's form (cuBLAS for qkv and
gate_up; the skinny GEMM's partials for o_proj and down at <= 16 rows, cuBLAS past that), is
timed in a CUDA graph of 20 steps, each step a GPU sleep of --sleep-us (standing in for the
kernels before the GEMM: attention, a norm) and then the GEMM:

  cold        sleep; gemm(w_i)            w_i rotates over weight copies that exceed the L2
  hot         sleep; gemm(w_0)            the same copy every time: L2-resident
  prefetched  prefetch(w_i); sleep; gemm(w_i)   cp.async.bulk.prefetch.L2 issued before the sleep

A GEMM's time is its step's minus the same step without it (sleep, or prefetch + sleep).
`prefetch issue` is what issuing the prefetch adds to a step (a kernel that returns at once: the
copy runs in the memory system, not on the SMs). If `prefetched` comes near `hot`, a fused
prefetch (issued from a kernel that already runs, such as decode attention) is worth building.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.bench_linear import DT, cuda_and_l2, graph_us, weight_copies
from minivllm.functional.activation import silu_and_mul
from minivllm.kernels.skinny_gemm import MAX_SKINNY_ROWS, skinny_linear

LAYERS = {"qkv": (4096, 1024, False), "o_proj": (1024, 2048, False),
          "gate_up": (6144, 1024, False), "down": (1024, 3072, True)}  # N, K, glu
PIECE = 4096   # bytes one thread asks for
PIECES = 32    # threads (one warp) a program: 128 KB a program


@triton.jit
def bulk_prefetch_l2(addr, size):
    """Each element asks the L2 for `size` bytes (int32; none when <= 0) at byte pointer `addr`:
    one cp.async.bulk.prefetch.L2, a fire-and-forget request to the memory system (sm_90)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2_kernel(ptr, nbytes, PIECE: tl.constexpr, PIECES: tl.constexpr):
    # Each thread issues one bulk prefetch of PIECE bytes (the last ones fewer, or none), so the
    # kernel ends without waiting for them.
    offs = tl.program_id(0).to(tl.int64) * (PIECE * PIECES) + tl.arange(0, PIECES).to(tl.int64) * PIECE
    size = tl.minimum(nbytes - offs, PIECE).to(tl.int32)
    bulk_prefetch_l2(ptr.to(tl.pointer_type(tl.int8)) + offs, size)


def prefetch_l2(t: torch.Tensor) -> None:
    """Ask for t's bytes (contiguous, 16-byte aligned, a multiple of 16 bytes) to be in L2."""
    nbytes = t.numel() * t.element_size()
    assert t.is_contiguous() and t.data_ptr() % 16 == 0 and nbytes % 16 == 0
    _prefetch_l2_kernel[(triton.cdiv(nbytes, PIECE * PIECES),)](t, nbytes, PIECE=PIECE, PIECES=PIECES,
                                                                num_warps=1)


def engine_gemm(x: torch.Tensor, w: torch.Tensor, glu: bool, skinny: bool) -> torch.Tensor:
    if skinny:
        return skinny_linear(x, w, glu=glu, partials=True)
    return F.linear(silu_and_mul(x) if glu else x, w)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--sleep-us", type=float, default=10.0)
    args = ap.parse_args()
    if (gpu := cuda_and_l2("l2_prefetch.py")) is None:
        return 2
    dev, l2 = gpu
    # torch.cuda._sleep spins for a number of cycles: calibrate it against the clock once
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    e0.record(); torch.cuda._sleep(1_000_000); e1.record(); e1.synchronize()
    cycles = int(args.sleep_us * 1e3 / (e0.elapsed_time(e1) * 1e6 / 1_000_000))

    def sleep():
        torch.cuda._sleep(cycles)

    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}, L2 {l2 / 2**20:.0f} MiB, sleep {args.sleep_us} us = {cycles} cycles; "
          "us per GEMM in a CUDA graph of 20 steps, median of 10 replays", flush=True)
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.layers.split(","):
            n, k, glu = LAYERS[name]
            skinny = name in ("o_proj", "down") and m <= MAX_SKINNY_ROWS
            ws = weight_copies(n, k, l2, gen)
            c = len(ws)
            x = torch.randn(m, 2 * k if glu else k, device=dev, dtype=DT, generator=gen)

            def step(i, *, gemm=True, pre=False, hot=False):
                w = ws[0 if hot else i % c]
                if pre:
                    prefetch_l2(w)
                sleep()
                if gemm:
                    engine_gemm(x, w, glu, skinny)

            base = graph_us(lambda i: step(i, gemm=False))
            base_pre = graph_us(lambda i: step(i, gemm=False, pre=True))
            cold = graph_us(lambda i: step(i)) - base
            hot = graph_us(lambda i: step(i, hot=True)) - base
            pre = graph_us(lambda i: step(i, pre=True)) - base_pre
            form = ("skinny" if skinny else "cuBLAS") + (" (glu)" if glu and skinny else "")
            mb = n * k * DT.itemsize / 2**20
            print(f"M={m:<3} {name:7} {form:13} {mb:5.1f} MiB x{c:<2}  cold {cold:6.2f} | hot {hot:6.2f} | "
                  f"prefetched {pre:6.2f} | prefetch issue {base_pre - base:5.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
