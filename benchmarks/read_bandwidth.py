"""How fast the GPU's memory can be read, not copied: the ceiling a KV-reading kernel works under.

    PYTHONPATH=. python benchmarks/read_bandwidth.py [--gib 4] [--json PATH]

The throughput floor in BENCHMARKS.md divides the workload's bytes by the device-to-device copy
rate (~4.25 TB/s on the H200, bytes read + written). Decode attention only reads; if reads alone
go faster than a copy, the floor is pessimistic and the attention kernel (~4.0 TB/s in the
engine's form at 256 sequences) has room the copy rate does not show. Timed here, each in a CUDA
graph over a buffer far larger than the L2, median of replays:

  copy      torch's device-to-device copy (bytes read + written), the floor's ceiling (eager,
            runtime.bench.copy_bandwidth)
  sum       torch.sum of a bf16 buffer to one fp32 value (a read with a tiny write)
  stream    kernels.memory_read's kernel, which only reads: P programs, each striding over the
            buffer in tiles and keeping a running sum (P, warps and tiles swept); `minivllm
            bench` times the fastest launch found here for its floor at the read rate
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.bench_linear import cuda_and_l2, graph_us
from minivllm.kernels.memory_read import stream_read
from minivllm.runtime.bench import copy_bandwidth


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if (gpu := cuda_and_l2("read_bandwidth.py")) is None:
        return 2
    dev = gpu[0]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    n = int(args.gib * 2**30) // 2 // 65536 * 65536
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    nbytes = src.numel() * src.element_size()
    results = {}

    def report(name, seconds, moved):
        results[name] = dict(seconds=seconds, tb_per_s=moved / seconds / 1e12)
        print(f"{name}: {moved / seconds / 1e12:.3f} TB/s ({seconds * 1e3:.3f} ms)", flush=True)

    # the copy as `bench` times it, outside a graph: captured, torch's device-to-device copy
    # became a memcpy node that ran at ~2.7 TB/s on the H200
    report("copy (read + write)", 2 * nbytes / copy_bandwidth(dev, nbytes), 2 * nbytes)
    total = graph_us(lambda i: torch.sum(src, dtype=torch.float32), 5, 7) / 1e6
    report("torch.sum (read)", total, nbytes)
    want = src.float().sum().item()
    for waves in (1, 2, 4, 8, 16):
        for warps, block, stages in ((4, 2048, 1), (4, 4096, 1), (8, 4096, 1), (8, 8192, 1),
                                     (4, 4096, 3), (8, 8192, 3)):
            out = torch.zeros(waves * sms, device=dev, dtype=torch.float32)
            seconds = graph_us(lambda i: stream_read(src, out, block, warps, stages), 5, 7) / 1e6
            got = out.sum().item()
            if abs(got - want) > 1e-3 * abs(want) + 1.0:
                print(f"stream read wrong: {got} against {want}", file=sys.stderr)
                return 1
            report(f"stream read, {waves * sms} programs, {warps} warps, {block} elements a "
                   f"load, {stages} stages", seconds, nbytes)
    best = max((v["tb_per_s"], k) for k, v in results.items() if k.startswith("stream"))
    print(f"best read: {best[0]:.3f} TB/s ({best[1]}); copy "
          f"{results['copy (read + write)']['tb_per_s']:.3f} TB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), gib=args.gib, results=results),
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
