"""How far the compiled forward's numbers are from eager's, on this machine.

    PYTHONPATH=. python benchmarks/compiled_vs_eager.py [--device cpu] [--dtype bfloat16]

One mixed step (four prompts of 8-30 tokens) of a small random Qwen3 model through
minivllm.forward, eagerly and through runtime.compiled.compiled_forward, each on its own fresh
cache: the share of the logits and of each layer's K cache entries that differ, and the largest
logit difference. Eager rounds every 16-bit op's result; Inductor's fused kernels keep them in
fp32 unless told to round as eager does (compile_part's emulate_precision_casts; BENCHMARKS.md
session 45 has this script's figures before and after).
"""

from __future__ import annotations

import argparse
import json

import torch

import minivllm
from minivllm.kernels import select_backend
from minivllm.runtime.compiled import compiled_forward
from minivllm.state import ModelConfig, SeqChunk, make_batch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    config = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=64, dtype=dtype)
    params = minivllm.random_params(config, seed=0, std=0.2, device=args.device)
    backend = select_backend(args.device)
    gen = torch.Generator().manual_seed(0)
    chunks = [SeqChunk(torch.randint(0, 512, (n,), generator=gen).tolist(), 0,
                       list(range(8 * i, 8 * i + 8))) for i, n in enumerate((30, 17, 25, 8))]
    batch = make_batch(chunks, block_size=4, device=args.device)
    caches = [minivllm.init_cache(params, num_blocks=64, block_size=4) for _ in range(2)]
    want, caches[0] = minivllm.forward(params, caches[0], batch, backend)
    got, caches[1] = compiled_forward()(params, caches[1], batch, backend)
    print(json.dumps({
        "device": args.device, "dtype": args.dtype,
        "logits_differing": round((got != want).float().mean().item(), 4),
        "logits_max_difference": (got.float() - want.float()).abs().max().item(),
        "k_cache_differing_by_layer": [round((a != b).float().mean().item(), 4)
                                       for a, b in zip(caches[0].k, caches[1].k)]}))


if __name__ == "__main__":
    main()
