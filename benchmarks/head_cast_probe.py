"""The decode step's head and sampler with the logits cast to fp32 (model.head) against without
(model.logits_head), each compiled as runtime.compiled compiles it, at the throughput run's row
counts (H200 check).

    PYTHONPATH=. python benchmarks/head_cast_probe.py [--rows 256,128,64] [--shape qwen3-0.6b]

Each variant is the head then sample() at temperature 0.6 (the throughput run's Gumbel pass),
replayed from one CUDA graph; the two must pick the same tokens (the sampler widens bf16 logits
exactly as the cast does).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.bench_linear import cuda_and_l2, graph_us
from minivllm.functional import model
from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample
from minivllm.runtime.compiled import _own_copy
from minivllm.state.config import SHAPES, config_for_shape
from minivllm.state.params import random_params


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="256,128,64")
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    args = ap.parse_args()
    found = cuda_and_l2("head_cast_probe.py")
    if found is None:
        return 2
    dev, _ = found
    torch._dynamo.config.recompile_limit = 64
    params = random_params(config_for_shape(args.shape), dtype=torch.bfloat16, device=dev)
    hidden, vocab = params.config.hidden_size, params.config.vocab_size
    variants = {"cast": torch.compile(_own_copy(model.head), fullgraph=True),
                "no_cast": torch.compile(_own_copy(model.logits_head), fullgraph=True)}
    for rows in map(int, args.rows.split(",")):
        gen = torch.Generator(dev).manual_seed(rows)
        x, residual = (torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16, generator=gen)
                       for _ in range(2))
        index = torch.arange(rows, device=dev)
        sb = make_sampling_batch([SamplingRow(temperature=0.6, seed=i) for i in range(rows)],
                                 vocab_size=vocab, device=dev)
        times, tokens = {}, {}
        with torch.no_grad():
            for name, head in variants.items():
                times[name] = graph_us(lambda i, head=head: sample(head(params, x, residual, index),
                                                                  sb), calls=4, replays=20)
                tokens[name] = sample(head(params, x, residual, index), sb).token_ids
        same = torch.equal(tokens["cast"], tokens["no_cast"])
        print(f"rows {rows:4}: head + sample {times['cast']:7.1f} us with the cast, "
              f"{times['no_cast']:7.1f} without ({times['cast'] - times['no_cast']:+.1f} us); "
              f"same tokens: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
