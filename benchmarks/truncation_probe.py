"""Where a truncated sampling step's time goes: top-k / top-p / min-p rows, stage by stage.

    PYTHONPATH=. python benchmarks/truncation_probe.py [--rows 64,256] [--vocab 151936]
        [--iters 20] [--json PATH]

Session 63 (BENCHMARKS.md) timed the engine at 256 sequences: plain sampling 45,500 tok/s,
top-k 50 with top-p 0.9 26,300 (after the candidates replaced the sort of the vocabulary;
21,700 before), min-p 36,300. This times, on fp32 logits [B, V] drawn at random, each batch's
whole sample() and its stages, per row setting (Qwen3's top-k 20 / top-p 0.95, top-p 0.95
alone, min-p 0.05):
  sample          sample(logits, sb), as the engine calls it
  sample_sort     the same with the candidates off (sb.top_k_bound 0): the sort of the vocabulary
  truncate        truncated_logits (temperature, min-p, top-k / top-p)
  topk            torch.topk of the candidates alone
  softmax         truncated_probs' softmax of the truncated logits
  inverse_cdf     sample_from_probs of those probabilities
  gumbel_kernel   the lever not yet taken: the Gumbel kernel over the truncated logits (their
                  temperature already divided), one pass in place of softmax and inverse_cdf
On a CUDA GPU with CUDA events (median of --iters after warm-up); elsewhere with the host's
clock (a smoke run: tests/test_truncation_probe.py). Prints a table; --json writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attrs
import torch

from minivllm.functional.sampling import (SamplingRow, make_sampling_batch, sample,
                                          sample_from_probs, truncated_logits,
                                          uniform_from_counter)

SETTINGS = {"top_k20_top_p095": dict(top_k=20, top_p=0.95),
            "top_p095": dict(top_p=0.95),
            "min_p005": dict(min_p=0.05)}


def timed_ms(fn, iters: int, device: torch.device) -> float:
    """The median of `iters` calls of fn after two warm-up calls, in ms."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def stages(logits: torch.Tensor, sb) -> dict:
    """name -> a call of that stage on these logits and this batch (none writes `logits`)."""
    from minivllm.functional.sampling import _gumbel_pass

    cut = truncated_logits(logits.clone(), sb)
    probs = torch.softmax(cut, dim=-1)
    uniforms = uniform_from_counter(sb.seeds, sb.steps)
    unit = attrs.evolve(sb, temperature=torch.ones_like(sb.temperature))
    kernel = logits.is_cuda
    found = {
        "sample": lambda: sample(logits, sb),
        "sample_sort": lambda: sample(logits, attrs.evolve(sb, top_k_bound=0)),
        "truncate": lambda: truncated_logits(logits.clone(), sb),
        "softmax": lambda: torch.softmax(cut, dim=-1),
        "inverse_cdf": lambda: sample_from_probs(probs, uniforms),
        "gumbel_kernel": lambda: _gumbel_pass(cut, unit, kernel),
    }
    if sb.top_k_bound:
        found["topk"] = lambda: logits.topk(sb.top_k_bound, dim=-1)
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for b in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator(device=device).manual_seed(b)
        logits = torch.randn(b, args.vocab, device=device, generator=gen) * 4
        for name, kw in SETTINGS.items():
            rows = [SamplingRow(temperature=0.6, seed=i, **kw) for i in range(b)]
            sb = make_sampling_batch(rows, vocab_size=args.vocab, device=device)
            line = {"rows": b, "vocab": args.vocab, "setting": name, "device": str(device)}
            for stage, fn in stages(logits, sb).items():
                line[f"{stage}_ms"] = timed_ms(fn, args.iters, device)
            results.append(line)
            print(f"{b:>4} rows {name:<18} " + ", ".join(
                f"{k.removesuffix('_ms')} {v:.3f}" for k, v in line.items() if k.endswith("_ms")),
                flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
