"""A kernel that only reads memory: the ceiling of a kernel that streams the KV cache.

`minivllm bench` divides the workload's bytes by a device-to-device copy's rate (bytes read +
written) for its memory-traffic floor. Decode attention only reads, and on the H200 a read runs
~10% faster than a copy: 4.66 against 4.24 TB/s (benchmarks/read_bandwidth.py, BENCHMARKS.md
session 24). So bench also times this kernel (runtime.bench.read_bandwidth) for the floor at the
read rate, the tighter one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The fastest launch of benchmarks/read_bandwidth.py's sweep on the H200: 16 programs an SM of
# 8 warps, each load 8,192 bf16 elements (16 KB); 4.66 TB/s, and 4.63-4.65 from 4 programs an SM.
READ_PROGRAMS_PER_SM = 16
READ_BLOCK = 8192
READ_WARPS = 8


@triton.jit
def _stream_read_kernel(src, out, n_tiles, BLOCK: tl.constexpr):
    """Program p sums tiles p, p + P, p + 2P, ... of src (BLOCK elements each) into out[p]."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    offsets = tl.arange(0, BLOCK)
    for tile in range(pid, n_tiles, programs):
        acc += tl.load(src + tl.cast(tile, tl.int64) * BLOCK + offsets).to(tl.float32)
    tl.store(out + pid, tl.sum(acc, axis=0))


def stream_read(src: torch.Tensor, out: torch.Tensor, block: int = READ_BLOCK,
                warps: int = READ_WARPS, stages: int = 1) -> None:
    """out[p] = the sum of program p's tiles of src (1-D, a multiple of `block` elements): all of
    src is read once, by out.numel() programs. The sum is there so that no load is dead code."""
    if src.dim() != 1 or src.numel() % block:
        raise ValueError(f"src must be 1-D with a multiple of {block} elements, "
                         f"got {tuple(src.shape)}")
    _stream_read_kernel[(out.numel(),)](src, out, src.numel() // block, BLOCK=block,
                                        num_warps=warps, num_stages=stages)

