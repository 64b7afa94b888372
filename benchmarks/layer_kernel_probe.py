"""Is a persistent kernel per layer the single stream's way to 1,250 tok/s? Two measurements.

    PYTHONPATH=. python benchmarks/layer_kernel_probe.py

The single stream runs ~36 us a decoder layer as 8 kernels, each ~2-6 us of launch, ramp-up and
tail for at most 13 MB (BENCHMARKS.md, sessions 7-8); 1,250 tok/s needs ~26 us. A kernel that
stays resident (one program an SM) and runs the layer's phases with a grid-wide barrier between
them pays the ramp-up once. What that costs, at one row, Qwen3-0.6B's shapes:

1. A grid barrier alone: R barriers in one launch, us a barrier.
2. The layer's four GEMVs (qkv, o_proj, gate_up, down; 31.5 MB of bf16 weights) in one
   persistent launch with a barrier after each (and without, to price the barriers), against
   the same four as F.linear (cuBLAS) in a CUDA graph. Two forms: BLOCK_N-row tiles dealt
   round-robin (_layer_gemvs_kernel), and one row block a program whose next phase's first
   weight chunk (or whole row block) is loaded before the barrier that precedes it
   (_layer_prefetch_kernel): a layer's weights never depend on the previous phase, only its
   input vector does. Weights rotate over copies that exceed the L2, as in bench_linear.py.
   Each GEMV is checked against an fp32 matmul.

GPU only: Triton's CPU interpreter runs programs one after another, so a spin barrier would never
return there. A measurement, not the engine: the phases' inputs are fixed vectors, not each
other's outputs.
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from benchmarks.bench_linear import CALLS, DT, cuda_and_l2, graph_us, rel_err, weight_copies
from minivllm.kernels.decode_layer import _grid_barrier

LAYER = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def _barriers_kernel(counter_ptr, rounds):
    programs = tl.num_programs(0)
    base = tl.atomic_add(counter_ptr, 0) // programs * programs  # see _grid_barrier
    for r in range(rounds):
        _grid_barrier(counter_ptr, base + (r + 1) * programs)


@triton.jit
def _gemv_phase(w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """y = W @ x, W: [N, K] row-major, x: [K] (K a multiple of BLOCK_K); BLOCK_N-row tiles dealt
    round-robin to programs."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in range(pid, N // BLOCK_N, programs):
        rows = tile * BLOCK_N + offs_n
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in tl.static_range(0, K, BLOCK_K):
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + k0 + offs_k[None, :])
            x = tl.load(x_ptr + k0 + offs_k)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty))


@triton.jit
def _layer_gemvs_kernel(counter_ptr, w0, x0, y0, w1, x1, y1, w2, x2, y2, w3, x3, y3,
                        N0: tl.constexpr, K0: tl.constexpr, BN0: tl.constexpr,
                        N1: tl.constexpr, K1: tl.constexpr, BN1: tl.constexpr,
                        N2: tl.constexpr, K2: tl.constexpr, BN2: tl.constexpr,
                        N3: tl.constexpr, K3: tl.constexpr, BN3: tl.constexpr,
                        BLOCK_K: tl.constexpr, BARRIERS: tl.constexpr):
    programs = tl.num_programs(0)
    base = tl.atomic_add(counter_ptr, 0) // programs * programs
    _gemv_phase(w0, x0, y0, N0, K0, BN0, BLOCK_K)
    if BARRIERS:
        _grid_barrier(counter_ptr, base + programs)
    _gemv_phase(w1, x1, y1, N1, K1, BN1, BLOCK_K)
    if BARRIERS:
        _grid_barrier(counter_ptr, base + 2 * programs)
    _gemv_phase(w2, x2, y2, N2, K2, BN2, BLOCK_K)
    if BARRIERS:
        _grid_barrier(counter_ptr, base + 3 * programs)
    _gemv_phase(w3, x3, y3, N3, K3, BN3, BLOCK_K)
    if BARRIERS:
        _grid_barrier(counter_ptr, base + 4 * programs)


@triton.jit
def _rows_load(w_ptr, k0, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """This program's R rows of W (one tile, BN >= R), columns [k0, k0 + BLOCK_K), masked past K
    (BLOCK_K is a power of two; a whole 3,072-column row is one 4,096-wide load)."""
    offs = tl.arange(0, BN)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    rows = tl.program_id(0) * R + offs
    mask = ((offs < R) & (rows < N))[:, None]
    if K % BLOCK_K != 0:
        mask = mask & (offs_k < K)[None, :]
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _rows_gemv(w_first, w_ptr, x_ptr, y_ptr, N: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
               BN: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[rows] = W[rows] @ x for this program's rows, the first BLOCK_K columns already loaded."""
    offs_k = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_k, mask=offs_k < K, other=0.0)
    acc = tl.sum(w_first.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    for k0 in tl.static_range(BLOCK_K, K, BLOCK_K):
        w = _rows_load(w_ptr, k0, N, K, R, BN, BLOCK_K)
        x = tl.load(x_ptr + k0 + offs_k, mask=k0 + offs_k < K, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    offs = tl.arange(0, BN)
    rows = tl.program_id(0) * R + offs
    tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=(offs < R) & (rows < N))


@triton.jit
def _layer_prefetch_kernel(counter_ptr, w0, x0, y0, w1, x1, y1, w2, x2, y2, w3, x3, y3,
                           N0: tl.constexpr, K0: tl.constexpr, R0: tl.constexpr, BN0: tl.constexpr,
                           N1: tl.constexpr, K1: tl.constexpr, R1: tl.constexpr, BN1: tl.constexpr,
                           N2: tl.constexpr, K2: tl.constexpr, R2: tl.constexpr, BN2: tl.constexpr,
                           N3: tl.constexpr, K3: tl.constexpr, R3: tl.constexpr, BN3: tl.constexpr,
                           BK0: tl.constexpr, BK1: tl.constexpr, BK2: tl.constexpr,
                           BK3: tl.constexpr):
    """One row block of each GEMV a program; the next phase's first BKj weight columns are
    loaded before the barrier that precedes it (weights never depend on the previous phase).
    BKj >= Kj: the whole row block is requested a phase ahead."""
    programs = tl.num_programs(0)
    base = tl.atomic_add(counter_ptr, 0) // programs * programs
    w = _rows_load(w0, 0, N0, K0, R0, BN0, BK0)
    _rows_gemv(w, w0, x0, y0, N0, K0, R0, BN0, BK0)
    w = _rows_load(w1, 0, N1, K1, R1, BN1, BK1)
    _grid_barrier(counter_ptr, base + programs)
    _rows_gemv(w, w1, x1, y1, N1, K1, R1, BN1, BK1)
    w = _rows_load(w2, 0, N2, K2, R2, BN2, BK2)
    _grid_barrier(counter_ptr, base + 2 * programs)
    _rows_gemv(w, w2, x2, y2, N2, K2, R2, BN2, BK2)
    w = _rows_load(w3, 0, N3, K3, R3, BN3, BK3)
    _grid_barrier(counter_ptr, base + 3 * programs)
    _rows_gemv(w, w3, x3, y3, N3, K3, R3, BN3, BK3)
    _grid_barrier(counter_ptr, base + 4 * programs)


def block_n_for(n: int, programs: int) -> int:
    """Rows per tile: the largest power of two (<= 64) that still gives every program a tile."""
    bn = 64
    while bn > 1 and n // bn < programs:
        bn //= 2
    return bn


def layer_args(weights, xs, ys, i: int) -> list:
    """The four phases' (weight copy i, x, y), in LAYER's order."""
    copies = min(len(w) for w in weights.values())
    return [t for name in LAYER for t in (weights[name][i % copies], xs[name], ys[name])]


def max_error(weights, xs, ys) -> float:
    """Against an fp32 matmul of the last call's weight copies (the ones y holds)."""
    copies = min(len(w) for w in weights.values())
    return max(rel_err(ys[name], weights[name][(CALLS - 1) % copies].float() @ xs[name].float())
               for name in LAYER)


def main() -> int:
    # No options: --help prints what it measures instead of measuring.
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if (gpu := cuda_and_l2("layer_kernel_probe.py")) is None:
        return 2
    dev, l2 = gpu
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)

    for rounds in (1, 16):
        us = graph_us(lambda i: _barriers_kernel[(sms,)](counter, rounds, num_warps=4))
        print(f"grid barrier, {sms} programs: {rounds} a launch: {us:.2f} us a launch, "
              f"{us / rounds:.2f} us a barrier", flush=True)

    weights = {name: weight_copies(n, k, l2 // 2, gen) for name, (n, k) in LAYER.items()}
    xs = {name: torch.randn(k, device=dev, dtype=DT, generator=gen)
          for name, (_, k) in LAYER.items()}
    ys = {name: torch.empty(n, device=dev, dtype=DT) for name, (n, _) in LAYER.items()}
    layer_bytes = sum(n * k * DT.itemsize for n, k in LAYER.values())

    def report(what: str, us: float, err: float | None = None):
        print(f"{what}: {us:.2f} us a layer, {layer_bytes / us / 1e6:.2f} TB/s"
              + (f", max rel err {err:.1e}" if err is not None else ""), flush=True)

    def cublas(i):
        args = layer_args(weights, xs, ys, i)
        for j in range(len(LAYER)):
            w, x, y = args[3 * j:3 * j + 3]
            torch.nn.functional.linear(x[None], w, out=y[None])

    report("cuBLAS, four GEMMs at one row", graph_us(cublas))

    tiles = {f"BN{j}": block_n_for(n, sms) for j, (n, _) in enumerate(LAYER.values())}
    shapes = {f"{c}{j}": v for j, (n, k) in enumerate(LAYER.values())
              for c, v in (("N", n), ("K", k))}
    for block_k, warps in ((256, 4), (512, 4), (512, 8), (1024, 8)):
        for barriers in (True, False):
            us = graph_us(lambda i: _layer_gemvs_kernel[(sms,)](
                counter, *layer_args(weights, xs, ys, i), **shapes, **tiles, BLOCK_K=block_k,
                BARRIERS=barriers, num_warps=warps))
            report(f"persistent, {sms} programs, BLOCK_K {block_k}, {warps} warps, tiles "
                   + "/".join(str(b) for b in tiles.values())
                   + f", {'a barrier after each GEMV' if barriers else 'no barriers'}",
                   us, max_error(weights, xs, ys))

    blocks = {}  # one block of ceil(N / programs) rows a program, a power-of-two tile holding it
    for j, (n, _) in enumerate(LAYER.values()):
        blocks |= {f"R{j}": -(-n // sms), f"BN{j}": triton.next_power_of_2(-(-n // sms))}
    whole = {f"BK{j}": triton.next_power_of_2(k) for j, (_, k) in enumerate(LAYER.values())}
    for block_k, warps in ((256, 8), (1024, 8), ("whole", 8), ("whole", 16)):
        chunks = whole if block_k == "whole" else {f"BK{j}": block_k for j in range(len(LAYER))}
        us = graph_us(lambda i: _layer_prefetch_kernel[(sms,)](
            counter, *layer_args(weights, xs, ys, i), **shapes, **blocks, **chunks,
            num_warps=warps))
        report("persistent, one row block a program, next weights loaded before each barrier, "
               f"{'whole rows' if block_k == 'whole' else f'BLOCK_K {block_k}'}, {warps} warps",
               us, max_error(weights, xs, ys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
