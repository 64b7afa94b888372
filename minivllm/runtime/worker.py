"""What every tensor-parallel rank runs: join the groups, load its shard into a ModelRunner whose
KV cache size all ranks agree on, and (ranks > 0) execute the steps rank 0 broadcasts until it
sends None.

Imports nothing from transformers, so that a spawned rank starts in the time it takes to import
torch.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from typing import NoReturn

import torch

from .config import EngineConfig
from .distributed import (Groups, Launch, agree_min, collective_timeout, destroy_groups,
                          exit_now, init_groups, min_max, rank_device, receive_step, shard_spec)
from .runner import LoadWeights, ModelRunner, SetLoRA, Sleep, WakeUp


class ShardRunner(ModelRunner):
    """A ModelRunner whose KV cache has the same number of blocks on every rank (the smallest any
    rank can hold), since the engine's block tables index the cache of all of them."""

    def _num_blocks(self) -> int:
        return agree_min(super()._num_blocks(), self.params.device)


def start_rank(config: EngineConfig, rank: int, world_size: int, store=None
               ) -> tuple[ModelRunner, Groups]:
    """Join the process groups and build this rank's runner. Every rank calls it at the same
    time: loading, sizing the cache and any warm-up run collectives."""
    groups = init_groups(rank, world_size, config.device, store)
    runner = ShardRunner(config, shard=shard_spec(rank, world_size, groups))
    low, high = min_max(runner.num_blocks, runner.device)
    if low != high:  # ModelRunner sized its cache without ShardRunner._num_blocks
        raise RuntimeError(f"tensor-parallel ranks disagree on the KV cache size ({low} to {high} "
                           f"blocks)")
    return runner, groups


def serve(runner: ModelRunner, groups: Groups) -> None:
    """Run every step rank 0 sends, until it sends None. Each rank runs exactly the StepInput
    rank 0 runs, so that all take the same path (eager or CUDA graph) through the same
    collectives; the sampled tokens are rank 0's to use. A SetLoRA between steps writes this
    rank's slice of an adapter into its slot, where rank 0 wrote its own; a LoadWeights copies
    this rank's slices of new weights into its params; a Sleep or WakeUp frees or takes back
    this rank's memory (runtime/sleep.py)."""
    while (step := receive_step(groups)) is not None:
        if isinstance(step, SetLoRA):
            runner.set_lora(step.slot, step.adapter)
            continue
        if isinstance(step, LoadWeights):
            runner.load_weights(step.weights)
            continue
        if isinstance(step, Sleep):
            runner.sleep(step.level)
            continue
        if isinstance(step, WakeUp):
            runner.wake_up(step.tags)
            continue
        # Queued, not waited for: rank 0 paces the steps, and the collectives keep the ranks
        # in step. This rank's sampled tokens stay on its device, fed back like rank 0's.
        runner.launch(step)
    runner.release_graphs()  # before the groups go (rank 0 does the same)


def config_for_rank(config: EngineConfig, rank_on_host: int) -> EngineConfig:
    return dataclasses.replace(config, device=rank_device(config.device, rank_on_host))


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when the engine's process is gone (killed with no chance to stop us)."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="minivllm-parent-watch", daemon=True).start()


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def spawned_worker(rank: int, world_size: int, port: int, config: EngineConfig,
                   parent_pid: int) -> None:
    """Entry point of a worker that the engine spawned (rank >= 1 on the engine's host)."""
    # Ctrl-C in a terminal reaches every process of the group; rank 0 decides what to do and
    # stops the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    if config.device.type == "cpu":
        torch.set_num_threads(_threads_per_rank(world_size))
    code = 0
    try:
        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=collective_timeout())
        store.set(ready_key(rank), "1")
        runner, groups = start_rank(config, rank, world_size, store)
        serve(runner, groups)
    except BaseException:
        code = 1
        if os.getppid() == parent_pid:  # the engine is alive: this is news to it
            print(f"minivllm: tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
    finally:
        destroy_groups(peers_ok=code == 0)
    exit_now(code)


def torchrun_worker(config: EngineConfig, launch: Launch) -> NoReturn:
    """A rank > 0 that torchrun started: serve rank 0's engine until it stops, then leave the
    process (exit code 0, or 1 after an error, whose traceback is printed)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        runner, groups = start_rank(config_for_rank(config, launch.local_rank), launch.rank,
                                    launch.world_size)
        serve(runner, groups)
    except BaseException:
        code = 1
        print(f"minivllm: tensor-parallel rank {launch.rank} failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
    finally:
        destroy_groups(peers_ok=code == 0)
    exit_now(code)


def ready_key(rank: int) -> str:
    return f"minivllm/ready/{rank}"
