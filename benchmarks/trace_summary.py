"""Where a traced step's GPU time goes: kernels grouped by name, per step, from the Chrome trace
that `minivllm bench --trace F` writes (torch.profiler; .json or .json.gz).

    python benchmarks/trace_summary.py trace.json.gz [--steps 8] [--top 25]

Prints the GPU's busy time, the kernel count and the gaps between kernels per step, then each
kernel group's launches and time per step. Inductor's kernels are grouped by kind
(inductor_poi/per/red: pointwise, persistent reduction, reduction), since their names spell out
the fused ops. Then the host's side: the engine's named ranges (runner.trace_range) and the CUDA
runtime calls, each with its calls and time per host step and its longest call, so that a call
that blocks the host on the device (a synchronize, a page-locked allocation) stands out."""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re


def load_events(path: str) -> list[dict]:
    """Every event of the trace (a .json or .json.gz Chrome trace)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def load_kernels(path: str, events: list[dict] | None = None) -> list[dict]:
    """The trace's GPU kernels, in start order."""
    events = load_events(path) if events is None else events
    return sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])


HOST_CATEGORIES = ("user_annotation", "cuda_runtime", "cuda_driver")


def host_summary(events: list[dict]) -> tuple[int, list[tuple[str, float, float, float]]]:
    """(host steps, [(name, calls a step, us a step, longest call's us)] by time) over the
    engine's named ranges and the CUDA runtime and driver calls. Host steps are the profiler's
    ProfilerStep#N ranges on the host (the trace holds each a second time as a
    gpu_user_annotation), which are left out of the rows."""
    steps = sum(1 for e in events if e.get("cat") == "user_annotation"
                and e.get("name", "").startswith("ProfilerStep#"))
    if not steps:
        raise ValueError("the trace holds no ProfilerStep ranges (was it taken by bench --trace?)")
    groups = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_CATEGORIES and "dur" in e and \
                not e["name"].startswith("ProfilerStep#"):
            groups[e["name"][:70]].append(e["dur"])
    rows = [(name, len(d) / steps, sum(d) / steps, max(d)) for name, d in groups.items()]
    return steps, sorted(rows, key=lambda r: -r[2])


def kernel_group(name: str) -> str:
    name = re.sub(r"triton_(poi|per|red)_fused_.*", r"inductor_\1", name)
    name = re.sub(r"_\d+$", "", name)
    return name[:70]


def summarize(kernels: list[dict], steps: int) -> dict:
    """Totals per step (times in us). Gaps are the idle time between consecutive kernels, those
    under 50 us only (longer ones are the host between steps, not launch latency)."""
    if not kernels:
        raise ValueError("the trace holds no GPU kernels (was it taken on a GPU?)")
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in kernels:
        g = groups[kernel_group(e["name"])]
        g[0] += 1
        g[1] += e["dur"]
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:])]
    gaps = [g for g in gaps if 0 <= g < 50]
    return {
        "kernels_per_step": len(kernels) / steps,
        "busy_us_per_step": sum(e["dur"] for e in kernels) / steps,
        "short_gaps_us_per_step": sum(gaps) / steps,
        "groups": sorted(((name, n / steps, t / steps) for name, (n, t) in groups.items()),
                         key=lambda g: -g[2]),
    }


# Every step samples once: the Gumbel kernel's second pass, or for an all-greedy batch torch's
# arg-max reduction. Each runs once a step and nowhere else.
STEP_MARKERS = ("_final_argmax_kernel", "ArgMaxOps")


def steps_in(kernels: list[dict], markers: tuple[str, ...] = STEP_MARKERS) -> int | None:
    """How many steps' kernels the trace holds, counted by the sampler's once-a-step kernel (None
    without one). Not the profiler's step count: with asynchronous scheduling the 8 traced host
    steps hold the GPU work of ~9 (BENCHMARKS.md, session 7)."""
    return sum(1 for e in kernels if any(m in e["name"] for m in markers)) or None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps the trace holds (default: the sampler's launches, else 8)")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    events = load_events(args.trace)
    kernels = load_kernels(args.trace, events)
    steps = args.steps or steps_in(kernels) or 8
    s = summarize(kernels, steps)
    print(f"per step ({steps} steps): {s['kernels_per_step']:.0f} kernels, GPU busy "
          f"{s['busy_us_per_step']:.0f} us, gaps under 50 us {s['short_gaps_us_per_step']:.0f} us")
    print(f"{'launches':>9} {'us':>9} {'us each':>8}  kernel")
    for name, n, t in s["groups"][: args.top]:
        print(f"{n:9.1f} {t:9.1f} {t / n:8.2f}  {name}")
    host_steps, rows = host_summary(events)
    print(f"host, per step ({host_steps} steps): named ranges and CUDA runtime calls")
    print(f"{'calls':>9} {'us':>9} {'longest':>8}  range or call")
    for name, n, t, longest in rows[: args.top]:
        print(f"{n:9.1f} {t:9.1f} {longest:8.1f}  {name}")


if __name__ == "__main__":
    main()
