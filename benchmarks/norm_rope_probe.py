"""A prefill step's q/k norm + RoPE and K/V store: kernels.norm_rope_store against the compiled
torch form it replaced (functional.layer.qk_norm_rope under torch.compile, then store_kvcache),
at a prefill step's token counts, Qwen3-0.6B's heads (H200 check).

    PYTHONPATH=. python benchmarks/norm_rope_probe.py [--tokens 8192,2048,512]

Both read q, k, v as views of one qkv projection, as the layer does. Agreement is counted in
bf16 units in the last place (ulps) against the eager torch form (whose roundings the kernel
copies) and against the compiled one (Inductor keeps some intermediates in fp32); the cache's
V rows must be equal and its K rows the kernel's k (exit 1 where they are not). Session 26: 77% of
q and k equal the eager form's, 19% one ulp apart (one product of the rotation fused into its sum,
since prevented: 99.999% equal in session 27); 53% equal the compiled form's (~50% since).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_linear import cuda_and_l2, graph_us
from minivllm.functional.layer import qk_norm_rope
from minivllm.kernels.norm_rope_store import norm_rope_store
from minivllm.kernels.store_kv import store_kvcache

HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def ulps(ref: torch.Tensor, x: torch.Tensor) -> str:
    """How far x is from ref in ref's units in the last place (at |ref| >= 1/64: the rows are
    O(1), and near 0 a cancellation's ulp says nothing): the largest, and the share of elements
    0, 1 and more than 1 apart."""
    ulp = torch.finfo(ref.dtype).eps * torch.exp2(torch.floor(torch.log2(
        ref.float().abs().clamp_min(1 / 64))))
    apart = ((x.float() - ref.float()).abs() / ulp).round()
    share = [f"{(c * 100):.3f}%" for c in ((apart == 0).float().mean().item(),
                                            (apart == 1).float().mean().item(),
                                            (apart > 1).float().mean().item())]
    return f"max {apart.max().item():.0f} ulp, 0/1/>1 ulp apart: {'/'.join(share)}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="8192,2048,512")
    args = ap.parse_args()
    found = cuda_and_l2("norm_rope_probe.py")
    if found is None:
        return 2
    dev, _ = found
    dt = torch.bfloat16
    torch_form = torch.compile(qk_norm_rope, fullgraph=True)
    wrong = 0
    for t in map(int, args.tokens.split(",")):
        gen = torch.Generator(dev).manual_seed(t)
        qkv = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, device=dev, dtype=dt, generator=gen)
        q, k, v = qkv.split([HEADS, KV_HEADS, KV_HEADS], dim=1)
        qw, kw = 1 + 0.1 * torch.randn(2, HEAD_DIM, device=dev, dtype=dt, generator=gen)
        angles = torch.rand(t, HEAD_DIM, device=dev, generator=gen) * 6.3
        norm_rope = (qw, kw, angles.cos(), angles.sin(), 1e-6)
        blocks = -(-t // PAGE) + 1
        slots = torch.randperm(blocks * PAGE, device=dev, generator=gen)[:t]
        caches = [torch.zeros(blocks, PAGE, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
                  for _ in range(4)]

        def torch_step(i):
            qn, kn = torch_form(q, k, *norm_rope)
            store_kvcache(kn, v, caches[0], caches[1], slots)
            return qn, kn

        def kernel_step(i):
            return norm_rope_store(q, k, v, caches[2], caches[3], slots, norm_rope)

        with torch.no_grad():
            before = graph_us(torch_step, calls=4, replays=20)
            after = graph_us(kernel_step, calls=4, replays=20)
            (q1, k1), (q2, k2) = torch_step(0), kernel_step(0)
            q0, k0 = qk_norm_rope(q, k, *norm_rope)
        stored = torch.equal(caches[1], caches[3]) and torch.equal(
            caches[2].view(-1, KV_HEADS, HEAD_DIM)[slots], k2)
        print(f"tokens {t:5}: compiled torch form + store {before:7.1f} us, norm_rope_store "
              f"{after:7.1f} us ({before / after:.2f}x); cache rows right: {stored}")
        wrong += not stored
        for name, (qr, kr) in (("eager", (q0, k0)), ("compiled", (q1, k1))):
            print(f"   against the {name} torch form: q {ulps(qr, q2)}; k {ulps(kr, k2)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
