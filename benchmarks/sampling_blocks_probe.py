"""What the heaviest sampling's blocks reserve in torch's caching allocator, from an emptied
cache, against its allocated peak, for each order of the logits dtypes serving samples (CUDA):
the KV budget sets the reserved figure aside (runner._cuda_kv_budget), so the cheaper order is
memory for the cache.

    python3 benchmarks/sampling_blocks_probe.py [--rows 256] [--vocab 151936]
"""

from __future__ import annotations

import argparse
import itertools

import torch

from minivllm.functional.sampling import make_sampling_batch, sample
from minivllm.runtime.memory import GiB
from minivllm.runtime.runner import heaviest_row


def heaviest(rows: int, vocab: int, dtype: torch.dtype, device: torch.device) -> None:
    row = heaviest_row(max_logprobs=20)  # the engine's default max_logprobs
    with torch.no_grad():
        sample(torch.zeros(rows, vocab, device=device, dtype=dtype),
               make_sampling_batch([row] * rows, vocab_size=vocab, device=device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    device = torch.device("cuda")
    heaviest(8, 1000, torch.float32, device)  # context, kernels' first load
    for order in [(torch.float32,), (torch.bfloat16,), *itertools.permutations(
            (torch.float32, torch.bfloat16))]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
        for dtype in order:
            heaviest(args.rows, args.vocab, dtype, device)
        torch.cuda.synchronize()
        names = ", ".join(str(d).removeprefix("torch.") for d in order)
        grown = torch.cuda.memory_reserved() - reserved
        peak = torch.cuda.max_memory_allocated() - allocated
        print(f"sampling blocks, {names}: reserved {grown / GiB:.3f} GiB, allocated peak "
              f"{peak / GiB:.3f}", flush=True)


if __name__ == "__main__":
    main()
