"""The sampler on the GPU: the Gumbel-max kernel against the inverse-CDF path it replaces for
plain-temperature rows, on the throughput benchmark's shape.

    PYTHONPATH=. python benchmarks/bench_sampler.py [--json PATH] [--iters N]

Logits [B, 151936] (Qwen3's vocabulary) fp32 and bf16, B in {1, 64, 256}, every row temperature
0.6 with its own seed (no top-k / top-p / min-p, penalties or logprobs). Times sample(logits, sb)
with CUDA events, median over N calls after warm-up:
  inverse_cdf   sample(..., gumbel=False): softmax, float64 CDF, searchsorted (the old path)
  gumbel        sample(...): one Triton pass over the logits and a per-row reduction
  kernel        minivllm.kernels.sample_kernel.gumbel_argmax alone
Also counts the kernels each launches (torch profiler), reports the Gumbel kernel's achieved
bandwidth on the logits (bytes read / time) and the fraction of rows where it picks the token of
its torch reference. Prints a table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

VOCAB = 151936
BATCHES = (1, 64, 256)
TEMPERATURE = 0.6


def cuda_time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cuda_kernels(fn) -> list[str]:
    """The names of the CUDA kernels (and copies) one call of fn launches, in order."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def kernel_launches(fn) -> int:
    return len(cuda_kernels(fn))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampler: needs a CUDA GPU; nothing to do here.")
        return 0

    from minivllm.functional.sampling import (SamplingRow, gumbel_argmax_reference, make_sampling_batch,
                                              sample)
    from minivllm.kernels.sample_kernel import chunk_size, gumbel_argmax

    dev = torch.device("cuda")
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        for b in BATCHES:
            gen = torch.Generator(device=dev).manual_seed(b)
            logits = (torch.randn(b, VOCAB, device=dev, generator=gen) * 4).to(dtype)
            rows = [SamplingRow(temperature=TEMPERATURE, seed=i, step=7) for i in range(b)]
            sb = make_sampling_batch(rows, vocab_size=VOCAB, device=dev)
            old = lambda: sample(logits, sb, gumbel=False)  # noqa: E731
            new = lambda: sample(logits, sb)  # noqa: E731
            kern = lambda: gumbel_argmax(logits, sb.temperature, sb.seeds, sb.steps)  # noqa: E731
            row = {"dtype": str(dtype).removeprefix("torch."), "batch": b, "vocab": VOCAB,
                   "chunk": chunk_size(b, VOCAB, dev),
                   "inverse_cdf_ms": cuda_time_ms(old, args.iters),
                   "gumbel_ms": cuda_time_ms(new, args.iters),
                   "kernel_ms": cuda_time_ms(kern, args.iters),
                   "inverse_cdf_launches": kernel_launches(old),
                   "gumbel_launches": kernel_launches(new)}
            row["speedup"] = row["inverse_cdf_ms"] / row["gumbel_ms"]
            row["kernel_gb_s"] = logits.numel() * logits.element_size() / (row["kernel_ms"] * 1e-3) / 1e9
            # The kernel against its torch reference on the GPU: the same tokens (up to near-ties
            # within an ulp, where CUDA's logs and fused multiply-adds round differently).
            ref = gumbel_argmax_reference(logits, sb.temperature, sb.seeds, sb.steps)
            row["agree_with_reference"] = (kern() == ref).float().mean().item()
            results.append(row)

    head = (f"{'dtype':>8} {'B':>4} {'chunk':>6} {'inv-CDF ms':>11} {'gumbel ms':>10} {'kernel ms':>10}"
            f" {'speedup':>8} {'GB/s':>7} {'launches old/new':>17} {'agree':>6}")
    print(f"sampler on {torch.cuda.get_device_name()}, V={VOCAB}, T={TEMPERATURE}")
    print(head)
    for r in results:
        print(f"{r['dtype']:>8} {r['batch']:>4} {r['chunk']:>6} {r['inverse_cdf_ms']:>11.4f}"
              f" {r['gumbel_ms']:>10.4f} {r['kernel_ms']:>10.4f} {r['speedup']:>7.1f}x {r['kernel_gb_s']:>7.0f}"
              f" {r['inverse_cdf_launches']:>8}/{r['gumbel_launches']:<8}"
              f" {r['agree_with_reference']:>6.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
