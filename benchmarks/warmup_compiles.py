"""How many graphs start-up's kernel warm-up compiles, and how long it takes.

Runs warm_up_kernels through compiled_forward() on a tiny random model, on the CPU by default
(Inductor's C++ backend), with Inductor's caches off unless --caches, and prints the graphs and
seconds as JSON. Each part compiles static first, then with the step's sizes dynamic, then again
for each size a step first meets at 1: 13 graphs on the CPU, 21 on the H200, where the skinny
GEMM's dispatch at up to 16 rows splits them further (BENCHMARKS.md, sessions 21-22, with why
compiling dynamic from the first call was dropped).

    python benchmarks/warmup_compiles.py [--device cuda] [--caches]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--caches", action="store_true", help="leave Inductor's caches on")
    args = ap.parse_args()
    if not args.caches:
        os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

    import torch
    from torch._dynamo.utils import counters

    import minivllm
    from minivllm.kernels import select_backend
    from minivllm.runtime.compiled import compiled_forward
    from minivllm.runtime.warmup import warm_up_kernels
    from minivllm.state import ModelConfig

    if args.device == "cpu":
        config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                             num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    else:  # the GPU's attention kernels take head_dim 64 or 128 (tl.dot needs K >= 16)
        config = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                             dtype=torch.bfloat16)
    params = minivllm.random_params(config, seed=0, device=args.device)
    fn = compiled_forward()
    start = time.perf_counter()
    block_size = 4 if args.device == "cpu" else 16
    warm_up_kernels(params, select_backend(args.device), block_size=block_size, max_num_seqs=8,
                    forward_fn=fn, cuda_only=False)
    print(json.dumps({"device": args.device,
                      "graphs": counters["stats"]["unique_graphs"],
                      "seconds": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
