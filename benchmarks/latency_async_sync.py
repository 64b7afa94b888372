"""Whether the host or the GPU bounds the single stream: one engine, `minivllm bench --latency`'s
run repeated with asynchronous scheduling on and off in turn, each with a decode step split into
the host's own work and its wait for the device (10th, 50th, 90th percentiles over one more
256-token stream).

    PYTHONPATH=. python benchmarks/latency_async_sync.py OUT.json [ROUNDS]

Without overlap (sync) a step costs the host's work plus the GPU's; with it (async) the larger
of the two, so host ~ sync step - GPU time, and an async step that still waits for the device
is GPU-bound.
"""

from __future__ import annotations

import json
import sys
import time

from minivllm.runtime import bench
from minivllm.runtime.llm import LLM
from minivllm.runtime.sampling_params import SamplingParams


def percentiles(values, ps=(0.1, 0.5, 0.9)) -> list[float]:
    values = sorted(values)
    return [values[int(p * (len(values) - 1))] for p in ps]


def main(out_path: str, rounds: int) -> None:
    start = time.perf_counter()
    llm = LLM("random:qwen3-0.6b", dtype="bfloat16", max_model_len=4096,
              max_num_seqs=bench.LATENCY_MAX_NUM_SEQS)
    print(f"engine started in {time.perf_counter() - start:.1f} s", flush=True)
    results = []
    for r in range(rounds):
        for mode in ("async", "sync"):
            llm.engine.async_scheduling = mode == "async"
            out = bench.run_latency(llm)
            log: list = []
            unwrap = bench.host_and_wait(llm.engine, log)
            try:
                llm.generate([{"prompt_token_ids": list(range(5, 517))}],
                             SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)
            finally:
                unwrap()
            decode = log[2:]  # the prefill and the first decode step left out
            out.update(mode=mode, round=r,
                       host_p10_50_90=percentiles([1e6 * (s - w) for s, w in decode]),
                       wait_p10_50_90=percentiles([1e6 * w for _, w in decode]),
                       step_p10_50_90=percentiles([1e6 * s for s, _ in decode]))
            print(f"{mode} {r}: {out['output_tok_per_s']:.1f} tok/s; us a step, p10/50/90: host "
                  f"{out['host_p10_50_90']}, wait {out['wait_p10_50_90']}, step "
                  f"{out['step_p10_50_90']}", flush=True)
            results.append(out)
            with open(out_path, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
