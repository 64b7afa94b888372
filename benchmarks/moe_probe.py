"""Where do the two MoE expert paths cross? One Qwen3-30B-A3B sparse layer's MLP, by token count.

    PYTHONPATH=. python benchmarks/moe_probe.py [--tokens 1,2,4,...] [--json PATH]

Session 54 (BENCHMARKS.md) ran the engine at that shape with MINIVLLM_MOE_KERNEL=triton and
without: the Triton kernels (kernels/fused_moe.py) were 13% faster on a single stream and 12%
slower on the throughput run, whose steps hold up to 256 tokens. This times functional.moe's
moe_mlp (routing included) both ways at each token count, in a CUDA graph of calls over layer
copies whose experts exceed the L2 many times (as a forward reads them), and reports each call's
microseconds, the bytes of the distinct experts it must read, and their rate. With --kernels
the kernels one call launches and their device time (torch.profiler) at a few token counts.

--compiled times moe_mlp under torch.compile(fullgraph=True), as the engine's layers run it: the
eager call's routing is 11 small aten kernels (softmax, a radix sort, the normalization, copies;
session 72's H100 list at 1 token: 22 of the Triton path's 66 us, the expert GEMMs 32),
which Inductor fuses, so only the compiled list says what routing costs the engine (its router
GEMM included: cuBLAS, 5.0 us eagerly for 0.5 MB). Each token count compiles anew (static
shapes): give it a few, e.g. --tokens 1,8,64,256.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from benchmarks.bench_linear import graph_us
from minivllm.functional.moe import moe_mlp
from minivllm.state.config import ModelConfig, config_for_shape
from minivllm.state.shard import ShardSpec

LAYERS = 4  # 4 x 1.2 GB of experts


def moe_config() -> ModelConfig:
    return config_for_shape("qwen3-30b-a3b")


def kernel_times(fn) -> list[tuple[str, float]]:
    """(name, µs) of each CUDA kernel one call of fn launches, in order."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,48,64,96,128,160,192,256")
    ap.add_argument("--kernels", default="1,32,256", help="token counts to list kernels at")
    ap.add_argument("--compiled", action="store_true",
                    help="moe_mlp under torch.compile(fullgraph=True), as the engine runs it")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("moe_probe.py: needs a CUDA GPU; nothing to do here.")
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    config, shard = moe_config(), ShardSpec()
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    experts_n, top_k = config.num_experts, config.num_experts_per_tok
    layers = [(torch.randn(experts_n, hidden, device=dev, dtype=dt, generator=gen) * 0.02,
               torch.randn(experts_n, 2 * inter, hidden, device=dev, dtype=dt, generator=gen) * 0.02,
               torch.randn(experts_n, hidden, inter, device=dev, dtype=dt, generator=gen) * 0.02)
              for _ in range(LAYERS)]
    expert_bytes = 3 * hidden * inter * 2
    mlp = moe_mlp
    if args.compiled:  # a compile per (token count, path): more than dynamo's default 8
        torch._dynamo.config.recompile_limit = 64
        mlp = torch.compile(moe_mlp, fullgraph=True, dynamic=False)
    print(f"{torch.cuda.get_device_name(dev)}; µs a layer's moe_mlp"
          f"{' (compiled)' if args.compiled else ''}, CUDA graphs of "
          f"{LAYERS * 5} calls over {LAYERS} layers", flush=True)
    print(f"{'tokens':>6} {'experts':>7} {'MB':>7} {'grouped':>8} {'triton':>8} "
          f"{'GB/s g':>7} {'GB/s t':>7} {'max err':>8}", flush=True)
    results = []
    with torch.no_grad():
        for t in (int(x) for x in args.tokens.split(",")):
            h = torch.randn(t, hidden, device=dev, dtype=dt, generator=gen)
            row = {"tokens": t}
            outs = {}
            for kernel in ("grouped", "triton"):
                def call(i, kernel=kernel):
                    r, gu, dn = layers[i % LAYERS]
                    return mlp(h, r, gu, dn, config, shard, kernel=kernel)
                outs[kernel] = call(0).float()
                row[kernel] = graph_us(call, calls=LAYERS * 5)
            experts = sum(len(torch.unique(torch.topk(h.float() @ r.float().t(), top_k).indices))
                          for r, _, _ in layers) / LAYERS
            mb = experts * expert_bytes / 1e6
            row |= {"experts": experts, "MB": mb,
                    "max_err": (outs["grouped"] - outs["triton"]).abs().max().item()}
            print(f"{t:>6} {experts:>7.1f} {mb:>7.1f} {row['grouped']:>8.1f} {row['triton']:>8.1f} "
                  f"{mb / row['grouped'] * 1e3:>7.0f} "
                  f"{mb / row['triton'] * 1e3:>7.0f} {row['max_err']:>8.2e}", flush=True)
            results.append(row)
            if str(t) in args.kernels.split(","):
                for kernel in ("grouped", "triton"):
                    r, gu, dn = layers[0]
                    ks = kernel_times(lambda: mlp(h, r, gu, dn, config, shard, kernel=kernel))
                    print(f"  {kernel} at {t} tokens: {len(ks)} kernels, "
                          f"{sum(us for _, us in ks):.1f} µs", flush=True)
                    for name, us in ks:
                        print(f"    {us:8.1f}  {name[:110]}", flush=True)
                    row[f"{kernel}_kernels"] = ks
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "compiled": args.compiled,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
