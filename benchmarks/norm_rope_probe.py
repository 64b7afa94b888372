"""A prefill step's q/k norm + RoPE and K/V store: kernels.norm_rope_store against the compiled
torch form it replaced (functional.layer.qk_norm_rope under torch.compile, then store_kvcache),
at a prefill step's token counts, Qwen3-0.6B's heads (H200 check).

    PYTHONPATH=. python benchmarks/norm_rope_probe.py [--tokens 8192,2048,512]

Both read q, k, v as views of one qkv projection, as the layer does, and must agree (q and k to
rounding, v's cache rows exactly).
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
        same = (torch.allclose(q1.float(), q2.float(), rtol=1e-2, atol=1e-2)
                and torch.allclose(k1.float(), k2.float(), rtol=1e-2, atol=1e-2)
                and torch.equal(caches[1], caches[3]))
        print(f"tokens {t:5}: compiled torch form + store {before:7.1f} us, norm_rope_store "
              f"{after:7.1f} us ({before / after:.2f}x); agree: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
