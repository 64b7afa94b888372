"""Where a sampling step's time goes on the device, feature by feature and stage by stage.

    PYTHONPATH=. python benchmarks/sampler_stages.py [--rows 64,256] [--vocab 151936]
        [--iters 20] [--json PATH]

Session 63 (BENCHMARKS.md) timed the engine at 256 sequences on an H100: plain sampling 45,500
tok/s, top-k 50 with top-p 0.9 26,300 (after the candidates replaced the sort of the
vocabulary; 21,700 before), min-p 36,300, penalties 33,900 (before their sparse form), and at 64
sequences allowed_token_ids 0.75 of plain. This times, on logits [B, V] drawn at random (--dtype),
each setting's whole sample() and its stages:
  settings   plain (temperature 0.6), top_k20_top_p095 (Qwen3's generation config), top_p095,
             min_p005, penalties (presence, frequency and repetition, ~560 output and ~560
             prompt ids a row), allowed_ids (1,000 ids a row)
  sample          sample(logits, sb), as the engine calls it (the batch made before): since
                  session 64 a truncated row's draw is the Gumbel kernel over the ids truncation
                  keeps (kernels.truncated_sample), its truncated logits never written
  make_batch      make_sampling_batch, host and copies (penalties and allowed ids send ids)
  penalties       apply_penalties (settings with ids or penalties)
  sample_sort     top-k / top-p with the candidates off (sb.top_k_bound 0): the sort
  inverse_cdf     sample(gumbel=False): the truncated logits written out, their softmax and
                  inverse CDF (session 63's draw for truncated rows)
  truncate        truncated_logits (temperature, min-p, top-k / top-p), written out
  topk            torch.topk of the candidates alone
  candidates      kernels.top_candidates' Triton passes for the same (cut_bounds takes them on a
                  GPU where top_candidates.ON_GPU_BY_DEFAULT)
  bounds          truncation.cut_bounds: the candidates, the ties' count, the numbers a row
                  (kernels.truncated_sample.candidate_bounds)
  cut_kernel      kernels.truncated_sample.cut_gumbel_argmax alone (the bounds made before)
On a CUDA GPU with CUDA events (median of --iters after warm-up); elsewhere with the host's
clock (a smoke run: tests/test_sampler_stages.py). Prints a line a setting; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import attrs
import numpy as np
import torch

from minivllm.functional.sampling import (SamplingRow, apply_penalties, cut_bounds,
                                          make_sampling_batch, sample, truncated_logits,
                                          truncated_rows)
from minivllm.kernels.top_candidates import top_candidates

SETTINGS = {"plain": {},
            "top_k20_top_p095": dict(top_k=20, top_p=0.95),
            "top_p095": dict(top_p=0.95),
            "min_p005": dict(min_p=0.05),
            "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
            "allowed_ids": "allowed_ids"}
TRUNCATING = ("top_k20_top_p095", "top_p095", "min_p005")


def rows_for(name: str, b: int, vocab: int) -> list[SamplingRow]:
    """b rows of the setting `name`, each seeded apart (ids drawn with seed 0)."""
    kw = SETTINGS[name]
    rng = np.random.default_rng(0)
    if kw == "allowed_ids":
        allowed = np.arange(min(vocab, 1000), dtype=np.int64)  # as the engine's rows hold them
        return [SamplingRow(temperature=0.6, seed=i, allowed_ids=allowed) for i in range(b)]
    if "presence_penalty" in kw:
        return [SamplingRow(temperature=0.6, seed=i, **kw,
                            output_ids=rng.integers(0, vocab, 560),
                            prompt_ids=rng.integers(0, vocab, 560)) for i in range(b)]
    return [SamplingRow(temperature=0.6, seed=i, **kw) for i in range(b)]


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


def stages(logits: torch.Tensor, rows: list[SamplingRow], name: str) -> dict:
    """stage -> a call of that stage on these logits and rows (none writes `logits`)."""
    vocab, device = logits.shape[-1], logits.device
    sb = make_sampling_batch(rows, vocab_size=vocab, device=device)
    found = {"sample": lambda: sample(logits, sb),
             "make_batch": lambda: make_sampling_batch(rows, vocab_size=vocab, device=device)}
    if name in ("penalties", "allowed_ids"):
        found["penalties"] = lambda: apply_penalties(logits, sb)
    if name not in TRUNCATING:
        return found
    found |= {
        "sample_sort": lambda: sample(logits, attrs.evolve(sb, top_k_bound=0)),
        "inverse_cdf": lambda: sample(logits, sb, gumbel=False),
        "truncate": lambda: truncated_logits(logits.float(), sb),
    }
    if sb.top_k_bound:
        found["topk"] = lambda: logits.topk(sb.top_k_bound, dim=-1)
        found["candidates"] = lambda: top_candidates(logits, sb.top_k_bound, kernel=True)
    if device.type == "cuda" and (sb.top_k_bound or not (sb.do_top_k or sb.do_top_p)):
        from minivllm.kernels.truncated_sample import cut_gumbel_argmax

        cut_rows = truncated_rows(sb, vocab)
        found["bounds"] = lambda: cut_bounds(logits, sb, cut_rows)
        bounds = cut_bounds(logits, sb, cut_rows)
        found["cut_kernel"] = lambda: cut_gumbel_argmax(logits, sb.temperature, sb.seeds,
                                                        sb.steps, *bounds)
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the logits' (the engine samples fp32 from model.head, the activation "
                         "dtype from the compiled forward's head)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results = []
    for b in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator(device=device).manual_seed(b)
        logits = (torch.randn(b, args.vocab, device=device, generator=gen) * 4).to(
            getattr(torch, args.dtype))
        for name in SETTINGS:
            rows = rows_for(name, b, args.vocab)
            line = {"rows": b, "vocab": args.vocab, "setting": name, "device": str(device),
                    "dtype": args.dtype}
            for stage, fn in stages(logits, rows, name).items():
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
