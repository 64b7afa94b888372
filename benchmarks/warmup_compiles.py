"""How many graphs start-up's kernel warm-up compiles, and how long it takes, static-first
(serving's form) against runtime.compiled.start_up_form (MINIVLLM_DYNAMIC_START=1).

Runs warm_up_kernels through compiled_forward() on a tiny random model, on the CPU by default
(Inductor's C++ backend: counts carry over to the GPU, seconds do not), with Inductor's caches
off unless --caches, and prints each form's graphs and seconds as JSON.

    python benchmarks/warmup_compiles.py [--dynamic-start] [--device cuda] [--caches]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dynamic-start", action="store_true", help="through start_up_form")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--caches", action="store_true", help="leave Inductor's caches on")
    args = ap.parse_args()
    if not args.caches:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

    import torch
    from torch._dynamo.utils import counters

    import minivllm
    from minivllm.kernels import select_backend
    from minivllm.runtime.compiled import compiled_forward, start_up_form
    from minivllm.runtime.warmup import warm_up_kernels
    from minivllm.state import ModelConfig

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0, device=args.device)
    fn = compiled_forward()
    if args.dynamic_start:
        fn = start_up_form(fn)
    start = time.perf_counter()
    warm_up_kernels(params, select_backend(args.device), block_size=4, max_num_seqs=8,
                    forward_fn=fn, cuda_only=False)
    print(json.dumps({"dynamic_start": args.dynamic_start, "device": args.device,
                      "graphs": counters["stats"]["unique_graphs"],
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
