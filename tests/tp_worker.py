"""Worker side of the tensor-parallel tests, kept free of transformers so that spawned ranks
start quickly."""

import os
import socket

import torch
import torch.distributed as dist

import minivllm
from minivllm.runtime.distributed import exit_now
from minivllm.state import SeqChunk, ShardSpec, make_batch

PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55], [90, 34, 2, 2, 18, 76, 43, 21, 9, 10]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, rank: int, world_size: int):
    shard = ShardSpec(rank=rank, world_size=world_size, group=dist.group.WORLD if world_size > 1 else None)
    params = minivllm.load(path, shard=shard)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    cache = minivllm.init_cache(params, num_blocks=8 * len(PROMPTS), block_size=4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4, every_row=True)
    logits, _ = minivllm.forward(params, cache, batch)
    # the forward the engine's graphs run: stem, layers and head each traced whole (fullgraph),
    # collectives included
    from minivllm.runtime.compiled import compiled_forward

    cache = minivllm.init_cache(params, num_blocks=8 * len(PROMPTS), block_size=4)
    compiled_logits, _ = compiled_forward("aot_eager")(params, cache, batch)
    cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
    tokens, _ = minivllm.generate(params, cache, PROMPTS, max_new_tokens=20)
    return logits, compiled_logits, tokens


def _kv_blocks(path: str, rank: int, world_size: int) -> int:
    """The KV cache size of the engine's runner when each rank may hold a different number of
    blocks (rank r: 10 * (r + 1) blocks' worth of memory): all must take the smallest."""
    from minivllm.runtime.config import EngineConfig
    from minivllm.runtime.memory import kv_block_bytes
    from minivllm.runtime.worker import ShardRunner

    shard = ShardSpec(rank=rank, world_size=world_size, group=dist.group.WORLD)
    block = kv_block_bytes(minivllm.load(path, shard=shard), 16, torch.float32)
    os.environ["MINIVLLM_CPU_KV_CACHE_SPACE"] = str(10 * (rank + 1) * block / (1 << 30))
    config = EngineConfig.create(path, max_num_seqs=4, max_model_len=512, device="cpu",
                                 attention_backend="reference")
    return ShardRunner(config, shard=shard).num_blocks


def _steps_over_the_wire(rank: int) -> bool:
    """The engine's StepInputs from rank 0, as received: a small one (one broadcast), one larger
    than the step buffer (two), and the stop message."""
    from minivllm.runtime.distributed import STEP_BUFFER_BYTES, Groups, broadcast_step, receive_step
    from minivllm.runtime.runner import StepInput

    groups = Groups(data=dist.group.WORLD, control=dist.group.WORLD,
                    buffer=torch.empty(STEP_BUFFER_BYTES, dtype=torch.uint8))
    sent = [StepInput([SeqChunk(list(range(n)), 0, [0, 1])], []) for n in (3, 100_000)] + [None]
    if rank == 0:
        for step in sent:
            broadcast_step(step, groups)
        return True
    return [receive_step(groups) for _ in sent] == sent


def _worker(rank: int, world_size: int, port: int, root: str, cases: list[str]):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.set_num_threads(1)
        torch.save(_steps_over_the_wire(rank), os.path.join(root, f"wire.rank{rank}.pt"))
        for case in cases:
            logits, compiled_logits, tokens = _run(os.path.join(root, case), rank, world_size)
            torch.save({"logits": logits, "compiled_logits": compiled_logits, "tokens": tokens,
                        "kv_blocks": _kv_blocks(
                os.path.join(root, case), rank, world_size)}, os.path.join(root, f"{case}.rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    exit_now(0)  # past the interpreter's finalization, where gloo threads can abort the process
