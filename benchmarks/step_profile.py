"""Where a decode step's time goes (issue 5): one runner at the Qwen3-0.6B shape with random
weights, a decode step of B sequences with contexts uniform in [512, 2048], timed piece by piece:

  execute      the runner's whole decode step as the engine calls it (host work, graph replay,
               sampling, reading the tokens back)
  fill         host time to copy the step into the graphs' static buffers
  replay       the captured forward alone (CUDA events)
  sample       the sampler alone on [B, vocab] logits (CUDA events)
  kernels      the top CUDA kernels of one eager decode step (torch.profiler)

    PYTHONPATH=. python benchmarks/step_profile.py --batch 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from minivllm.functional.model import forward
from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample
from minivllm.runtime.config import EngineConfig
from minivllm.runtime.runner import ModelRunner, StepInput
from minivllm.state.batch import DecodeChunks, SeqChunk, make_batch


def cuda_time(fn, repeats=20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    config = EngineConfig.create(f"random:{args.shape}", dtype="bfloat16", max_model_len=4096,
                                 max_num_seqs=256, num_kv_blocks=256 * 4096 // 16)
    runner = ModelRunner(config)
    rng = random.Random(0)
    bs, b = config.block_size, args.batch
    chunks, next_block = [], 0
    for _ in range(b):
        ctx = rng.randint(512, 2048)
        table = list(range(next_block, next_block + -(-(ctx + 1) // bs)))
        next_block += len(table)
        chunks.append(SeqChunk([rng.randrange(1000)], ctx, table))
    rows = [SamplingRow(temperature=0.6, seed=i, step=5) for i in range(b)]
    step = StepInput(chunks, rows)
    result = {"shape": args.shape, "batch": b, "backend": runner.backend.name,
              "device": torch.cuda.get_device_name()}

    for _ in range(3):
        runner.execute(step)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        runner.execute(step)
    result["execute_ms"] = (time.perf_counter() - t0) / 20 * 1e3

    g = runner.graphs
    decode_chunks = DecodeChunks.of(chunks)
    t0 = time.perf_counter()
    for _ in range(20):
        g.fill(decode_chunks)
    result["fill_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3
    torch.cuda.synchronize()
    result["replay_ms"] = cuda_time(lambda: g.replay(b))
    logits = g.replay(b).clone()
    sb = make_sampling_batch(rows, vocab_size=runner.vocab_size, device=runner.device)
    result["sample_ms"] = cuda_time(lambda: sample(logits, sb))
    t0 = time.perf_counter()
    for _ in range(20):
        make_sampling_batch(rows, vocab_size=runner.vocab_size, device=runner.device)
    result["make_sampling_batch_host_ms"] = (time.perf_counter() - t0) / 20 * 1e3

    kv_bytes = sum(c.num_cached + 1 for c in chunks) * 2 * 28 * 8 * 128 * 2
    result["kv_gb"] = kv_bytes / 1e9
    result["replay_floor_ms"] = (kv_bytes + 1.19e9) / 4.25e12 * 1e3

    batch = make_batch(chunks, block_size=bs, device=runner.device)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward(runner.params, runner.cache, batch, runner.backend)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    print(table)
    result["eager_kernels_top"] = table
    print(json.dumps({k: v for k, v in result.items() if k != "eager_kernels_top"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
