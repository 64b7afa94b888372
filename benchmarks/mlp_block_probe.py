"""Is one persistent kernel for a layer's second half the lever at 32-256 rows? (issue 5)

    PYTHONPATH=. python benchmarks/mlp_block_probe.py [--rows 32,64,128,256] [--sweep] [--json F]

At a bf16 decode step of 256 sequences on the H200 (BENCHMARKS.md session 33's trace) a layer
spends ~26 us after attention in six kernels: o_proj (cuBLAS's residual copy and its addmm),
Inductor's add + RMSNorm, gate_up, Inductor's SiLU * up and down; each pays launch, ramp-up and
tail. kernels/decode_mlp.py runs the same as one persistent launch of tensor-core tiles with
three grid barriers. Here, for each row count, in CUDA graphs (CALLS calls a graph, weights rotating
over copies that exceed twice the L2, as a forward reads them):

  engine     functional.layer's o_proj (row_linear) and mlp_block, torch.compile'd, as the
             engine's decode graphs run them
  fused      decode_mlp, one cooperative launch (its default tiles, then --sweep's)
  by phase   decode_mlp as four launches (what the barriers cost against kernel boundaries),
             and each phase alone (where a loss to the engine sits)

us a call and each output's error against the engine's (max |a - b| / max |b|, bf16). The lever
is worth wiring into the engine if fused beats engine by several us at 64-256 rows: each us a
layer is 28 us a step, ~1,000 steps a throughput run. GPU only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from benchmarks.bench_linear import DT, cuda_and_l2, graph_us, rel_err
from minivllm.functional.layer import mlp_block
from minivllm.functional.linear import row_linear, sum_partials
from minivllm.kernels.decode_mlp import decode_mlp, default_config, splits
from minivllm.kernels.launch import next_pow2
from minivllm.state.params import LayerParams
from minivllm.state.shard import ShardSpec

HIDDEN, ATT, INTER, EPS = 1024, 2048, 3072, 1e-6  # Qwen3-0.6B
CALLS = 20
SHARD = ShardSpec()  # one rank; built here, as dynamo cannot trace the attrs class's __init__
TOL = 3e-2  # two GEMMs and a norm apart, each rounding to bf16 in its own order


def sweep_configs(rows: int, programs: int = 132) -> list[dict]:
    """Tilings to try at `rows` (16, and unsplit forms of those that split): a row tile of up
    to 64 rows and one of up to 128, narrow and wide column tiles (a phase has H / BN or
    INTER / BN column blocks for ~132 programs: at 256 rows in 64-row tiles, gate/up's 128
    columns make 96 tiles, one wave, where 32 make 384, ~2.9 waves), 4 and 8 warps; o_proj's
    and down's split-K as decode_mlp.splits sets it for them."""
    fit = max(16, next_pow2(rows))
    out = []
    for block_m in sorted({min(fit, 64), min(fit, 128)}):
        for bn_o, bn_gu, bn_d in ((16, 32, 16), (32, 32, 32), (32, 64, 32), (32, 128, 32)):
            for warps in (4, 8):
                cfg = dict(block_m=block_m, bn_o=bn_o, bn_gu=bn_gu, bn_d=bn_d, block_k=64,
                           num_warps=warps, num_stages=3)
                cfg |= splits(cfg, rows, HIDDEN, ATT, INTER, programs)
                out.append(cfg)
                if warps == 8 and (cfg["split_o"] > 1 or cfg["split_d"] > 1):
                    out.append(cfg | dict(split_o=1, split_d=1))
    return out


def deep_configs(rows: int, programs: int = 132) -> list[dict]:
    """--deep: the pipeline's depth and width at the tilings session 34's sweep found best at
    128-256 rows. Its phases alone ran each tile's K loop at ~27 KB a us an SM (gate/up 22 us
    at 256 rows against cuBLAS's 7.6): latency-bound with 3 stages of one program an SM. So:
    3, 4 or 6 stages, 64 or 128 columns a K step, and one or two programs an SM (`programs`;
    a cooperative grid that cannot be resident is refused and skipped; those whose shared
    memory cannot be are left out)."""
    fit = max(16, next_pow2(rows))
    out = []
    for block_m, bn_o, bn_gu, bn_d, warps in ((min(fit, 128), 32, 64, 32, 8),
                                              (min(fit, 128), 32, 32, 32, 8),
                                              (min(fit, 64), 32, 64, 32, 4)):
        for block_k in (64, 128):
            for stages in (3, 4, 6):
                for grid in (programs, 2 * programs):
                    # gate/up's pipeline buffers, the kernel's largest, within an SM's 227 KB
                    smem = stages * (block_m + 2 * bn_gu) * block_k * 2 * grid // programs
                    if smem > 224 * 1024:
                        continue
                    cfg = dict(block_m=block_m, bn_o=bn_o, bn_gu=bn_gu, bn_d=bn_d,
                               block_k=block_k, num_warps=warps, num_stages=stages)
                    out.append(cfg | splits(cfg, rows, HIDDEN, ATT, INTER, grid)
                               | dict(programs=grid))
    return out


def layer_weights(copies: int, dev: torch.device, gen: torch.Generator) -> list[LayerParams]:
    def rand(*shape, scale):
        return torch.randn(*shape, device=dev, dtype=DT, generator=gen) * scale

    return [LayerParams(input_norm=None, qkv=None, q_norm=None, k_norm=None,
                        o_proj=rand(HIDDEN, ATT, scale=ATT ** -0.5),
                        post_norm=1.0 + rand(HIDDEN, scale=0.1),
                        gate_up=rand(2 * INTER, HIDDEN, scale=HIDDEN ** -0.5),
                        down=rand(HIDDEN, INTER, scale=INTER ** -0.5)) for _ in range(copies)]


def engine_form(lp: LayerParams, attn: torch.Tensor, residual: torch.Tensor):
    """The engine's layer after attention: row_linear (o_proj) and mlp_block, on one rank (at up
    to 16 rows down's output is its unsummed fp32 partials, as in the engine)."""
    return mlp_block(lp, row_linear(attn, lp.o_proj, SHARD, unsummed_ok=True), residual, SHARD,
                     EPS)


def weights(lp: LayerParams) -> tuple[torch.Tensor, ...]:
    return lp.o_proj, lp.post_norm, lp.gate_up, lp.down


def fused_form(lp: LayerParams, attn, residual, counter, config=None, phase_by_phase=None,
               phases=None):
    """decode_mlp as the engine calls it: a split down's partials left for the next layer.
    config's `programs`, if any, is the grid (decode_mlp's argument, not a tile key)."""
    config = dict(config or {})
    programs = config.pop("programs", None)
    return decode_mlp(attn, residual, *weights(lp), EPS, counter=counter, config=config,
                      phase_by_phase=phase_by_phase, phases=phases, unsummed_ok=True,
                      programs=programs)


PHASE_NAMES = ("o_proj, split-K partials", "their sum + residual, RMSNorm", "gate/up + SiLU * up",
               "down")


def phase_time(fn) -> float:
    """us a call of fn in a CUDA graph (graph_us), NaN if it failed."""
    try:
        return graph_us(fn)
    except Exception as e:
        print(f"  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="256,128,64,32", help="largest first: they matter most")
    ap.add_argument("--sweep", action="store_true", help="also time sweep_configs' tilings")
    ap.add_argument("--deep", action="store_true",
                    help="also time deep_configs' pipelines, and the best one's phases alone")
    ap.add_argument("--json", help="write the results here (after each row count)")
    args = ap.parse_args()
    if (gpu := cuda_and_l2("mlp_block_probe.py")) is None:
        return 2
    dev, l2 = gpu
    torch.set_grad_enabled(False)  # as the engine's steps run
    gen = torch.Generator(device=dev).manual_seed(0)
    layer_bytes = (HIDDEN * ATT + 3 * INTER * HIDDEN) * DT.itemsize
    layers = layer_weights(max(1, min(CALLS, math.ceil(2 * l2 / layer_bytes))), dev, gen)
    counter = torch.zeros(1, device=dev, dtype=torch.int64)
    compiled = torch.compile(engine_form, fullgraph=True, dynamic=False)
    results = []

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(dev), results=results), f,
                          indent=1)

    print(f"{torch.cuda.get_device_name(dev)}; {len(layers)} weight copies of "
          f"{layer_bytes / 2**20:.1f} MiB; us a call (CUDA graphs of {CALLS} calls)", flush=True)
    for rows in [int(r) for r in args.rows.split(",")]:
        attn = torch.randn(rows, ATT, device=dev, dtype=DT, generator=gen)
        residual = torch.randn(rows, HIDDEN, device=dev, dtype=DT, generator=gen)
        ref = [sum_partials(t, DT).float() for t in compiled(layers[0], attn, residual)]

        def timed(name, fn, config=None):
            """us a call of fn, None if it failed (a tiling that does not compile or launch is
            reported and skipped) or gave wrong values."""
            try:
                errs = [rel_err(sum_partials(got, DT), want) for got, want in zip(fn(0), ref)]
                us = graph_us(fn)
            except Exception as e:
                print(f"  {name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                return None
            ok = max(errs) < TOL
            print(f"  {name}: {us:7.2f} us, errors {errs[0]:.1e} / {errs[1]:.1e}"
                  f"{'' if ok else '  WRONG'}", flush=True)
            results.append(dict(rows=rows, form=name, us=us, errors=errs, ok=ok, config=config))
            return us if ok else None

        print(f"rows {rows}:", flush=True)
        engine_us = timed("engine", lambda i: compiled(layers[i % len(layers)], attn, residual))
        default = default_config(rows, dev, HIDDEN, ATT, INTER)
        fused_us = timed("fused", lambda i: fused_form(layers[i % len(layers)], attn, residual,
                                                        counter), default)
        timed("by phase", lambda i: fused_form(layers[i % len(layers)], attn, residual, counter,
                                               phase_by_phase=True), default)
        # each phase alone with the default tiles (its own launch; against the trace's
        # kernels: o_proj + its residual copy, the add + RMSNorm, gate_up + SiLU * up, down).
        # A split down hands the next layer fp32 partials to read (~1 MB at 64 rows against
        # 128 KB of bf16), which neither form's time here includes.
        def phases_alone(config):
            phase_us = []
            for k, what in enumerate(PHASE_NAMES):
                us = phase_time(lambda i, k=k: fused_form(layers[i % len(layers)], attn,
                                                          residual, counter, config,
                                                          phase_by_phase=True, phases=(k,)))
                phase_us.append(us)
                print(f"  phase {k} alone ({what}): {us:7.2f} us", flush=True)
            results.append(dict(rows=rows, form="phases alone", us=phase_us, config=config))

        phases_alone(default)
        best = (fused_us, default)
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        configs = (sweep_configs(rows, sms) if args.sweep else []) + \
            (deep_configs(rows, sms) if args.deep else [])
        if configs:
            for cfg in configs:
                name = "fused " + " ".join(f"{k}={v}" for k, v in cfg.items())
                us = timed(name, lambda i, cfg=cfg: fused_form(layers[i % len(layers)], attn,
                                                               residual, counter, cfg), cfg)
                if us is not None and (best[0] is None or us < best[0]):
                    best = (us, cfg)
            if args.deep and best[1] is not default:
                print(f"  the best's phases alone ({best[1]}):", flush=True)
                phases_alone(best[1])
        if engine_us is not None and best[0] is not None:
            print(f"  best fused {best[0]:.2f} us against the engine's {engine_us:.2f}: "
                  f"{28 * (engine_us - best[0]):+.0f} us a 28-layer step saved ({best[1]})",
                  flush=True)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
