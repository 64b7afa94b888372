"""Worker side of test_awq.py's tensor-parallel test, free of transformers (and of the engine) so
that the spawned ranks start quickly: the eager forward's logits and a greedy generate."""

import os

import torch
import torch.distributed as dist

import minivllm
from minivllm.runtime.distributed import exit_now
from minivllm.state import SeqChunk, ShardSpec, make_batch

PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55], [90, 34, 2, 2, 18, 76, 43, 21, 9, 10]]


def run(path: str, rank: int, world_size: int, new_tokens: int = 8):
    """(logits of every prompt position, greedy tokens) of the checkpoint at `path`, as rank
    `rank` of `world_size` (the default process group when more than one)."""
    shard = ShardSpec(rank=rank, world_size=world_size,
                      group=dist.group.WORLD if world_size > 1 else None)
    params = minivllm.load(path, shard=shard)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4,
                       every_row=True)
    with torch.no_grad():
        cache = minivllm.init_cache(params, num_blocks=8 * len(PROMPTS), block_size=4)
        logits, _ = minivllm.forward(params, cache, batch)
        cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
        tokens, _ = minivllm.generate(params, cache, PROMPTS, max_new_tokens=new_tokens)
    return logits, tokens


def worker(rank: int, world_size: int, port: int, root: str, cases: list[str]):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        for case in cases:
            logits, tokens = run(os.path.join(root, case), rank, world_size)
            torch.save({"logits": logits, "tokens": tokens},
                       os.path.join(root, f"{case}.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_now(0)  # past the interpreter's finalization, where gloo threads can abort the process
