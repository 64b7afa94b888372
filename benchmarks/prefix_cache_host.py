"""Host time of the block allocator alone on the throughput workload's shape: nano-vllm's 256
prompts (ids U[0, 10000), lengths U[100, 1024], seed 0) admitted with prefix matching and
registered, then 1,000 decode steps of a token each (a block registered every 16 steps a
sequence), then freed. Best of --reps, ms per phase; the garbage collector on, as in the engine.

usage: python benchmarks/prefix_cache_host.py [--tree DIR] [--reps N]
  --tree: import minivllm from DIR (another commit unpacked there), for an A/B in turns
"""
import argparse
import random
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--tree", default=".")
parser.add_argument("--reps", type=int, default=12)
args = parser.parse_args()
sys.path.insert(0, args.tree)

from minivllm.runtime.block_manager import BlockManager  # noqa: E402
from minivllm.runtime.sampling_params import SamplingParams  # noqa: E402
from minivllm.runtime.sequence import Sequence  # noqa: E402

random.seed(0)
prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
best = {"admit": float("inf"), "decode": float("inf"), "free": float("inf")}
for _ in range(args.reps):
    bm = BlockManager(40000, 16)
    seqs = [Sequence(i, str(i), 0, p, SamplingParams(), 0) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for seq in seqs:
        hits = bm.match_prefix(seq)
        bm.allocate(seq, seq.num_tokens, hits)
        bm.register_full_blocks(seq, seq.num_tokens)
    t1 = time.perf_counter()
    for step in range(1000):
        for seq in seqs:
            seq.token_ids.append(step)
            bm.allocate(seq, seq.num_tokens)
            bm.register_full_blocks(seq, seq.num_tokens)
    t2 = time.perf_counter()
    for seq in seqs:
        bm.free_blocks(seq)
    t3 = time.perf_counter()
    for phase, t in (("admit", t1 - t0), ("decode", t2 - t1), ("free", t3 - t2)):
        best[phase] = min(best[phase], t)
print(args.tree, "  ".join(f"{phase} {t * 1e3:.1f} ms" for phase, t in best.items()))
