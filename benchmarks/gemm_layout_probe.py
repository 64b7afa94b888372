"""Do the decode GEMMs at 144-256 rows run faster with the weights stored [in, out]?

    PYTHONPATH=. python benchmarks/gemm_layout_probe.py [--rows 144,192,256] [--json PATH]

At 256 sequences a decode layer's four cuBLAS GEMMs take ~28 us where their FLOPs would take ~11
and their weights' reads ~7 (BENCHMARKS.md session 44), and cuBLAS chose a smaller tile for qkv
(`..._64x32_...`, 7.7 us) than for gate_up (`..._96x128_...`, 7.6 us for 1.5x the work). The
engine stores each weight as [out, in] (x @ W.T, cuBLAS's "TN" form); stored [in, out]
(x @ W, "NN") cuBLAS picks from another family of kernels. Each GEMM of the Qwen3-0.6B
shape is timed both ways in a CUDA graph of 20 calls over weight copies that exceed twice the L2
(as a forward reads them), o_proj also as the engine's compiled layer runs it (addmm onto the
residual, beta = 1), and the kernel cuBLAS ran is named (torch.profiler).

On the H200 (BENCHMARKS.md session 44) cuBLAS picked the same tiles either way, mirrored, and
the four GEMMs summed within 1.6% of each other at 96-256 rows: the layout is not a lever.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_linear import DT, cuda_and_l2, graph_us, rel_err, weight_copies
from benchmarks.bench_sampler import cuda_kernels

LAYERS = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
          "down": (1024, 3072)}  # (N, K)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="144,192,256")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if (gpu := cuda_and_l2("gemm_layout_probe.py")) is None:
        return 2
    dev, l2 = gpu
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name(dev)}; µs a call, CUDA graphs of 20 calls, weights cold",
          flush=True)
    results, layer_sums = [], {}
    for name, (n, k) in LAYERS.items():
        ws = weight_copies(n, k, l2, gen)  # [N, K], as the engine stores them
        wts = [w.t().contiguous() for w in ws]  # [K, N]
        c = len(ws)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=DT, generator=gen)
            res = torch.randn(m, n, device=dev, dtype=DT, generator=gen)
            ref = x.float() @ ws[0].float().t()
            forms = {"out_in (engine)": lambda i: F.linear(x, ws[i % c]),
                     "in_out": lambda i: x @ wts[i % c]}
            if name == "o_proj":
                forms["out_in, addmm"] = lambda i: torch.addmm(res, x, ws[i % c].t())
                forms["in_out, addmm"] = lambda i: torch.addmm(res, x, wts[i % c])
            for form, fn in forms.items():
                out = fn(0)
                want = ref + res.float() if "addmm" in form else ref
                err = rel_err(out, want)
                us = graph_us(fn)
                kern = ", ".join(n[:60] for n in cuda_kernels(lambda: fn(0))) or "?"
                results.append(dict(layer=name, rows=m, form=form, us=us, rel_err=err,
                                    kernels=kern))
                if "addmm" not in form:
                    layer_sums[(m, form)] = layer_sums.get((m, form), 0.0) + us
                print(f"{name:8} M={m:<4} {form:16} {us:7.2f} us  err {err:.1e}  {kern}",
                      flush=True)
        del ws, wts
        torch.cuda.empty_cache()
    print("the four GEMMs (o_proj without the add), µs:")
    for (m, form), us in sorted(layer_sums.items()):
        print(f"  M={m:<4} {form:16} {us:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(dev), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
