"""kernels/decode_layer.py's persistent decoder layer at the single stream's step, timed.

    PYTHONPATH=. python benchmarks/decode_layer_probe.py [--rows 1] [--context 600]
        [--stack-only --block-k auto,1024,4096] [--timeline]
        [--loads off,default,gate_up_early,arrive_first+gate_up_early]

Qwen3-0.6B's layer shape, random bf16 weights, a bf16 cache with `--context` tokens a row, page
16. The persistent layer (one launch, grid barriers) against functional.decoder_layer on the
triton backend (eager kernels: not the engine's compiled layer, whose single-stream layer the
traces put at ~36 us), each in a CUDA graph of 20 layers over weight copies that exceed the L2;
then every layer of the model (as many as exceed the L2) in one launch, per layer. Outputs are
compared with each other first.
"""

from __future__ import annotations

import argparse
import sys

import torch

import minivllm
from benchmarks.bench_linear import cuda_and_l2, graph_us
from minivllm.functional.rope import rope_cos_sin
from minivllm.kernels import select_backend
from minivllm.kernels.decode_layer import LOADS_OFF, PHASES, decode_stack, layer_table
from minivllm.state import SeqChunk, make_batch
from minivllm.state.shard import ShardSpec
from minivllm.state.config import config_for_shape


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--stack-only", action="store_true",
                    help="only the whole stack, at each --block-k and --loads (8 warps)")
    ap.add_argument("--block-k", default="auto",
                    help="GEMV columns a load for the stack's runs, comma-separated; auto: "
                         "decode_stack's own choice (chunk_columns)")
    ap.add_argument("--loads", default="default",
                    help="where the stack's runs load each phase's weights, comma-separated: "
                         + ", ".join(LOADS) + " (decode_stack's flags)")
    ap.add_argument("--timeline", action="store_true",
                    help="as --stack-only, each run followed by its in-kernel timeline: where a "
                         "layer's time goes, phase by phase, from %%globaltimer stamps at each "
                         "grid barrier")
    args = ap.parse_args()
    if (gpu := cuda_and_l2("decode_layer_probe.py")) is None:
        return 2
    dev, l2 = gpu
    layer_bytes = 31_457_280  # qkv, o_proj, gate_up, down of the 0.6B shape in bf16
    config = config_for_shape("qwen3-0.6b", num_layers=max(2, -(-2 * l2 // layer_bytes)))
    layers = minivllm.random_params(config, seed=0, device=dev).layers
    page = 16
    blocks = -(-args.context // page)
    chunks = [SeqChunk([7], args.context - 1, list(range(r * blocks, (r + 1) * blocks)))
              for r in range(args.rows)]
    batch = make_batch(chunks, block_size=page, device=dev)
    shape = (args.rows * blocks + 1, page, config.num_kv_heads, config.head_dim)
    k_cache = torch.randn(shape, device=dev, dtype=config.dtype)
    v_cache = torch.randn(shape, device=dev, dtype=config.dtype)
    x = torch.randn(args.rows, config.hidden_size, device=dev, dtype=config.dtype)
    res = torch.randn_like(x)
    cos, sin = rope_cos_sin(config, batch.positions)
    backend = select_backend(dev, "triton")

    def functional(i):
        return minivllm.functional.decoder_layer(
            layers[i % len(layers)], x, res, cos, sin, k_cache, v_cache, batch, config=config,
            shard=ShardSpec(), backend=backend)

    want = functional(0)
    tables = [layer_table([lp], [k_cache], [v_cache]) for lp in layers]
    block_ks = [None if b == "auto" else int(b) for b in args.block_k.split(",")]
    runs = [(block_k, loads) for block_k in block_ks for loads in args.loads.split(",")]
    for block_k, loads in runs:
        got = decode_stack(tables[0], x, res, cos, sin, k_cache, batch, config=config,
                           dtype=config.dtype, block_k=block_k, **LOADS[loads])
        for name, a, b in (("output", got[0], want[0]), ("residual", got[1], want[1])):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            print(f"{block_k or 'auto'}-column loads, {loads}, {name}: relative difference "
                  f"{err:.2e}", flush=True)
    table = layer_table(layers, [k_cache] * len(layers), [v_cache] * len(layers))
    if args.timeline or args.stack_only:
        programs = torch.cuda.get_device_properties(dev).multi_processor_count
        for block_k, loads in runs:
            def stack(i, timeline=None):
                return decode_stack(table, x, res, cos, sin, k_cache, batch, config=config,
                                    dtype=config.dtype, programs=programs, block_k=block_k,
                                    timeline=timeline, **LOADS[loads])
            us = graph_us(stack) / len(layers)
            print(f"persistent stack of {len(layers)} layers, one launch, {block_k or 'auto'}"
                  f"-column loads, {loads}: {us:.2f} us a layer ({args.rows} row(s), context "
                  f"{args.context})", flush=True)
            if args.timeline:
                stamps = torch.zeros(1 + len(layers) * 2 * PHASES, programs, dtype=torch.int64,
                                     device=dev)
                for _ in range(2):  # the second run's stamps
                    stack(0, stamps)
                torch.cuda.synchronize()
                for line in timeline_report(stamps.cpu()):
                    print(line, flush=True)
        return 0
    print(f"functional layer, eager kernels: {graph_us(functional):.2f} us a layer "
          f"({args.rows} row(s), context {args.context})", flush=True)
    for block_k, warps in ((256, 8), (1024, 8), (256, 4), (1024, 4)):
        us = graph_us(lambda i: decode_stack(
            tables[i % len(layers)], x, res, cos, sin, k_cache, batch, config=config,
            dtype=config.dtype, block_k=block_k, num_warps=warps))
        print(f"persistent layer, one launch, {block_k}-column loads, {warps} warps: {us:.2f} us "
              f"a layer ({args.rows} row(s), context {args.context})", flush=True)
    # every layer in one launch (each layer's K/V into the same cache: timing only)
    for warps, prefetch in ((8, True), (8, False), (16, True)):
        us = graph_us(lambda i: decode_stack(table, x, res, cos, sin, k_cache, batch,
                                             config=config, dtype=config.dtype, num_warps=warps,
                                             prefetch_next=prefetch))
        print(f"persistent stack of {len(layers)} layers, one launch, {warps} warps, next "
              f"layer's qkv {'prefetched' if prefetch else 'not prefetched'}: "
              f"{us / len(layers):.2f} us a layer ({args.rows} row(s), context {args.context})",
              flush=True)
    print_phase_times(lambda i: decode_stack(
        tables[i % len(layers)], x, res, cos, sin, k_cache, batch, config=config,
        dtype=config.dtype, phase_by_phase=True), len(layers), args)
    return 0


# decode_stack's load placements by name: "off", "default", "default+<flag>" / "default-<flag>"
# (the defaults with that flag on / off), or flags joined by "+" (each on, the others off)
LOADS = {"off": LOADS_OFF, "default": {}, "default-kv_early": dict(kv_early=False),
         "default+kv_early": dict(kv_early=True)} | {
    "+".join(flags): LOADS_OFF | dict.fromkeys(flags, True) for flags in (
        ("gate_up_early",), ("prefetch_next",), ("arrive_first",),
        ("kv_early",), ("arrive_first", "gate_up_early"), ("arrive_first", "prefetch_next"))}
PHASE_NAMES = ("norm + qkv", "attention", "merge", "o_proj", "norm + gate/up", "down")


def timeline_phases(stamps: torch.Tensor) -> dict[str, tuple[float, float, float]]:
    """decode_stack's timeline ([1 + layers * 2 * PHASES, programs] ns: start, then each
    barrier's arrivals and departures) by phase, averaged over the layers after the first
    (whose qkv phase holds the launch's ramp-up), in us: (span: the previous barrier's departure
    to its own, median program; work: departure to arrival, median program; work of the slowest
    program). The span less the slowest work is the barrier: from the last arrival to the
    median departure."""
    phases = len(PHASE_NAMES)
    layers = (stamps.shape[0] - 1) // (2 * phases)
    arrive = stamps[1::2].reshape(layers, phases, -1).double()
    leave = stamps[2::2].reshape(layers, phases, -1).double()
    before = torch.cat([stamps[:1].double(), leave.reshape(layers * phases, -1)[:-1]]
                       ).reshape(layers, phases, -1)  # each phase's start, program by program
    span = (leave - before).median(dim=2).values / 1e3  # [layers, phases]
    work = (arrive - before) / 1e3
    keep = slice(1, None) if layers > 1 else slice(None)
    per_layer = (span, work.median(dim=2).values, work.max(dim=2).values)
    return {name: tuple(t[keep, p].mean().item() for t in per_layer)
            for p, name in enumerate(PHASE_NAMES)}


def timeline_report(stamps: torch.Tensor) -> list[str]:
    """timeline_phases as lines, then a layer's span and the clock's smallest step seen."""
    lines = [f"  {'phase':<16}{'span':>8}{'work, median':>14}{'work, slowest':>15}"
             f"{'barrier':>9}  (us)"]
    phases = timeline_phases(stamps)
    for name, (span, mid, slowest) in phases.items():
        lines.append(f"  {name:<16}{span:>8.2f}{mid:>14.2f}{slowest:>15.2f}{span - slowest:>9.2f}")
    steps = stamps.flatten().unique().diff()
    step = steps[steps > 0].min().item() if (steps > 0).any() else 0
    lines.append(f"  a layer: {sum(p[0] for p in phases.values()):.2f} us; the clock's "
                 f"smallest step seen: {step} ns")
    return lines


def print_phase_times(fn, calls: int, args, reps: int = 5) -> None:
    """Each phase of the layer as a launch of its own (phase_by_phase), its kernel time from the
    profiler, by phase: where the single launch's time goes, ramp-up of each phase's first
    weight loads included (the single launch requests those before the barrier ahead)."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(calls):  # compiled outside the profile
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(reps * calls):
            fn(i)
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if "_decode_stack_kernel" in e.name and
                      e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if len(kernels) != reps * calls * PHASES:
        print(f"phase times: expected {reps * calls * PHASES} kernels, the profile has "
              f"{len(kernels)}", flush=True)
        return
    per_phase = [sorted(k.time_range.elapsed_us() for k in kernels[p::PHASES])
                 for p in range(PHASES)]
    medians = [t[len(t) // 2] for t in per_phase]
    each = ", ".join(f"{n} {m:.2f}" for n, m in zip(PHASE_NAMES, medians))
    print(f"phases one launch each, profiler kernel time, median us ({args.rows} row(s), context "
          f"{args.context}): {each}; sum {sum(medians):.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
