"""Whether the host or the GPU bounds the single stream: one engine, `minivllm bench --latency`'s
run repeated with asynchronous scheduling on and off in turn, each reporting a decode step's
host work and its wait for the device (10th, 50th, 90th percentiles over its untimed stream).

    PYTHONPATH=. python benchmarks/latency_async_sync.py OUT.json [ROUNDS]

Without overlap (sync) a step costs the host's work plus the GPU's; with it (async) the larger
of the two, so host ~ sync step - GPU time, and an async step that still waits for the device
is GPU-bound.
"""

from __future__ import annotations

import argparse
import json
import time

from minivllm.runtime import bench
from minivllm.runtime.llm import LLM


def main(out_path: str, rounds: int) -> None:
    start = time.perf_counter()
    llm = LLM("random:qwen3-0.6b", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=bench.LATENCY_MAX_NUM_SEQS)
    print(f"engine started in {time.perf_counter() - start:.1f} s", flush=True)
    results = []
    for r in range(rounds):
        for mode in ("async", "sync"):
            llm.engine.async_scheduling = mode == "async"
            out = bench.run_latency(llm) | dict(mode=mode, round=r)
            print(f"{mode} {r}: {out['output_tok_per_s']:.1f} tok/s; us a step, p10/50/90: host "
                  f"{out['host_us_p10_50_90']}, wait {out['wait_us_p10_50_90']}", flush=True)
            results.append(out)
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the JSON file the rounds' results go to")
    parser.add_argument("rounds", type=int, nargs="?", default=3)
    args = parser.parse_args()
    main(args.out, args.rounds)
