"""Whether an engine sized from free memory stays within gpu_memory_utilization (H200 check).

    PYTHONPATH=. python benchmarks/kv_budget_check.py [--utilization 0.3] [--json PATH]

The throughput run's KV cache is capped by what its sequences can use (65,536 blocks), so it
never meets the memory budget. At a low utilization the budget binds: the cache takes what is
left after the largest step's peaks (runner.kv_budget_bytes), then the decode and prefill graphs
are captured and the nano-vllm workload runs through every graph. With the prefill graphs on,
their pool holds the forward's activations for good and the budget sets aside the forward's and
sampling's peaks side by side, and the decode graphs' pool beside them; this checks that the
device's peak use stays under utilization * total, and prints the headroom left.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch

from minivllm.runtime.bench import device_peak_bytes, run_throughput
from minivllm.runtime.llm import LLM
from minivllm.runtime.memory import GiB, memory_owners


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--utilization", type=float, default=0.3)
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--json")
    args = p.parse_args()
    logging.basicConfig(format="%(message)s")  # the runner's start-up lines: the budget's parts
    logging.getLogger("minivllm").setLevel(logging.INFO)
    device = torch.device("cuda")
    free0, total = torch.cuda.mem_get_info(device)
    llm = LLM(f"random:{args.shape}", gpu_memory_utilization=args.utilization, max_num_seqs=256)
    runner = llm.engine.runner  # one GPU: the ModelRunner itself
    result = run_throughput(llm)
    torch.cuda.synchronize(device)
    free, _ = torch.cuda.mem_get_info(device)
    peak = device_peak_bytes(device)
    limit = args.utilization * total
    out = {
        "utilization": args.utilization, "total_gib": total / GiB, "limit_gib": limit / GiB,
        "used_before_engine_gib": (total - free0) / GiB, "peak_gib": peak / GiB,
        "peak_fraction": peak / total, "used_after_run_gib": (total - free) / GiB,
        "reserved_after_run_gib": torch.cuda.memory_reserved(device) / GiB,
        "max_reserved_gib": torch.cuda.max_memory_reserved(device) / GiB,
        "headroom_gib": (limit - peak) / GiB,
        "num_kv_blocks": runner.num_blocks, "prefill_graphs": runner.use_prefill_graphs,
        "prefill_graph_env": os.environ.get("MINIVLLM_PREFILL_GRAPH"),
        "output_tok_per_s": result["output_tok_per_s"], "seconds": result["seconds"],
        "output_tokens": result["output_tokens"], "device": torch.cuda.get_device_name(device),
    }
    print(f"kv budget: utilization {args.utilization}: peak {peak / GiB:.2f} GiB of "
          f"{limit / GiB:.2f} GiB allowed ({total / GiB:.2f} total; headroom "
          f"{(limit - peak) / GiB:.2f} GiB; {(total - free) / GiB:.2f} GiB in use after the "
          f"run), {out['num_kv_blocks']} KV blocks, prefill graphs {out['prefill_graphs']}, "
          f"{result['output_tok_per_s']:.0f} tok/s", flush=True)
    print(memory_owners(device), flush=True)
    print(f"allocator peaks (GiB): reserved {out['max_reserved_gib']:.3f}, allocated "
          f"{torch.cuda.max_memory_allocated(device) / GiB:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if peak <= limit else 1


if __name__ == "__main__":
    raise SystemExit(main())
