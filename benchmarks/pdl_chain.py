"""A decode step's GEMM chain at a few rows: cuBLAS against the skinny GEMM, with and without
programmatic dependent launch (minivllm/kernels/pdl.py).

    PYTHONPATH=. python benchmarks/pdl_chain.py [--rows 1,8] [--layers 28] [--json PATH]

Each layer of the Qwen3-0.6B shape runs qkv -> o_proj (on q's columns) -> gate_up -> down (with
SiLU-and-mul), each GEMM feeding the next as in a decoder layer, the attention and norms left
out. The whole chain of --layers layers is one CUDA graph (weights 28 x 31.5 MB, far beyond
L2, so they stream from HBM as in the model); the median replay / layers is the time a layer's
four GEMMs take back to back, launch gaps included, which is what the engine's decode graphs
pay. Every variant's output is checked against the cuBLAS chain's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F

from minivllm.kernels.skinny_gemm import skinny_linear

HIDDEN, Q, QKV, INTER = 1024, 2048, 4096, 3072
DT = torch.bfloat16


def log(*a):
    print(*a, flush=True)


def make_layers(n: int, dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)

    def w(out, inp):
        return torch.randn(out, inp, device=dev, dtype=DT, generator=g) * inp ** -0.5

    return [dict(qkv=w(QKV, HIDDEN), o=w(HIDDEN, Q), gate_up=w(2 * INTER, HIDDEN),
                 down=w(HIDDEN, INTER)) for _ in range(n)]


def chain_cublas(layers, x):
    for lw in layers:
        q = F.linear(x, lw["qkv"])[:, :Q]
        h = F.linear(q, lw["o"])
        gu = F.linear(h, lw["gate_up"])
        x = F.linear(F.silu(gu[:, :INTER]) * gu[:, INTER:], lw["down"])
    return x


def chain_skinny(layers, x, pdl=0, config=None, qkv_cublas=False):
    """qkv_cublas: qkv and gate_up by cuBLAS, as the engine runs them today."""
    def column(x, w):
        return F.linear(x, w) if qkv_cublas else skinny_linear(x, w, pdl=pdl, config=config)

    for lw in layers:
        q = column(x, lw["qkv"])[:, :Q]
        h = skinny_linear(q, lw["o"], pdl=pdl, config=config)
        gu = column(h, lw["gate_up"])
        x = skinny_linear(gu, lw["down"], glu=True, pdl=pdl, config=config)
    return x


def graph_ms(fn, replays: int = 30) -> tuple[float, torch.Tensor]:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1))
    out = out.clone()
    del g
    return statistics.median(times), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("pdl_chain.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    layers = make_layers(args.layers, dev)
    def skinny(**kw):
        return lambda L, x: chain_skinny(L, x, **kw)

    variants = {
        "cublas": chain_cublas,
        "engine_today": skinny(qkv_cublas=True),  # cuBLAS qkv/gate_up, skinny o_proj/down
        "skinny": skinny(),
        "skinny_pdl_wait": skinny(pdl=1),
        "skinny_pdl_prefetch": skinny(pdl=2),
    }
    for w in (1, 2):
        variants[f"skinny_w{w}"] = skinny(config=dict(num_warps=w))
        variants[f"skinny_w{w}_pdl_prefetch"] = skinny(pdl=2, config=dict(num_warps=w))
    for st in (2, 3):
        variants[f"skinny_w2_s{st}"] = skinny(config=dict(num_warps=2, num_stages=st))
    for bk in (128, 512):
        variants[f"skinny_w2_k{bk}"] = skinny(config=dict(num_warps=2, block_k=bk))
    variants["engine_today_w2"] = skinny(qkv_cublas=True, config=dict(num_warps=2))
    variants["skinny_w2_bn32"] = skinny(config=dict(num_warps=2, block_n=32))
    # as the engine runs them: traced by torch.compile (Inductor launches user Triton kernels)
    variants["compiled_skinny_w2"] = torch.compile(skinny(config=dict(num_warps=2)), fullgraph=True)
    results = []
    rows = [int(r) for r in args.rows.split(",")]
    for m in rows:
        x = torch.randn(m, HIDDEN, device=dev, dtype=DT)
        ref = chain_cublas(layers[:1], x).float()  # one layer: deeper, random layers shrink to 0
        for name, fn in variants.items():
            if m != rows[0] and not any(t in name for t in ("cublas", "engine", "w2_pdl", "skinny_w2")):
                continue
            try:
                err = ((fn(layers[:1], x).float() - ref).abs().max() / ref.abs().max()).item()
                ms, _ = graph_ms(lambda: fn(layers, x))
            except Exception as e:  # one variant failing to compile must not hide the others
                log(f"M={m} {name}: {type(e).__name__}: {str(e)[:400]}")
                continue
            us = ms * 1e3 / args.layers
            results.append(dict(m=m, variant=name, us_per_layer=us, rel_err_vs_cublas=err))
            log(f"M={m:>2} {name:<26} {us:7.2f} us/layer (4 GEMMs)  rel err vs cuBLAS {err:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           layers=args.layers, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
