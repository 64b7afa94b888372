"""torch.distributed for tensor parallelism: who started the ranks (the engine itself, or
torchrun), which device each rank drives, the process groups, and the one message rank 0 sends
each step.

Two groups. The default group carries the forward's collectives (NCCL on CUDA, gloo on CPU)
under a bounded timeout (MINIVLLM_DIST_TIMEOUT seconds, default 600). A gloo "control" group
carries each step's StepInput from rank 0, pickled on the host (the GPU stream is never
involved); the workers wait on it between steps for as long as the user leaves the engine idle,
so its timeout is unbounded, but rank 0's sends on it are bounded (a worker that is stuck, not
dead, stops reading). A dead peer still ends either wait at once: gloo sees the closed socket.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ..state.config import ModelConfig
from ..state.shard import ShardSpec

# How long a worker may wait for rank 0's next step: the engine may sit idle for days.
IDLE_TIMEOUT = datetime.timedelta(days=365)
# How long rank 0 waits for the workers to take its stop message: a worker between steps takes
# it at once; one that does not is stuck, and is terminated.
STOP_TIMEOUT = datetime.timedelta(seconds=10)


def collective_timeout() -> datetime.timedelta:
    """The bound on one collective (and on start-up rendezvous)."""
    return datetime.timedelta(seconds=float(os.environ.get("MINIVLLM_DIST_TIMEOUT", "600")))


@dataclass(frozen=True)
class Launch:
    """torchrun's description of this process (its RANK, WORLD_SIZE, LOCAL_RANK, ...)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_env(environ=None) -> Launch | None:
    """This process's place in a torchrun launch; None when not started by torchrun (or an
    equivalent launcher that sets RANK and WORLD_SIZE)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError as e:
        raise ValueError(f"malformed torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK): {e}") from None
    return Launch(rank, world, local_rank, local_world)


def check_tensor_parallel(model_config: ModelConfig, tp: int, device: torch.device,
                          launch: Launch | None) -> None:
    """ValueError, at start-up, for a tensor-parallel size the model, the machine or the launcher
    cannot run."""
    if launch is not None and launch.world_size != tp:
        raise ValueError(f"tensor_parallel_size={tp}, but torchrun started WORLD_SIZE="
                         f"{launch.world_size} processes; they must be equal (torchrun "
                         f"--nproc-per-node {tp}, or nnodes x nproc-per-node = {tp} over several hosts)")
    if tp == 1:
        return
    ShardSpec(0, tp).check(model_config)  # heads, KV heads, intermediate size
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"tensor parallelism runs on cuda (NCCL) or cpu (gloo), not {device.type}")
    if device.type == "cuda":
        visible = torch.cuda.device_count()
        if launch is not None:
            need, what = launch.local_world_size, f"{launch.local_world_size} ranks on this host"
        else:
            need, what = (device.index or 0) + tp, f"tensor_parallel_size={tp} from {device}"
        if need > visible:
            raise ValueError(f"{what} need {need} GPUs, but {visible} are visible "
                             f"(CUDA_VISIBLE_DEVICES); lower tensor_parallel_size")
    if launch is None and dist.is_available() and dist.is_initialized():
        raise ValueError("torch.distributed is already initialized in this process (by another "
                         "tensor-parallel LLM? call its shutdown() first); one process runs one "
                         "tensor-parallel engine, and inside an existing group only under torchrun")


def rank_device(device: torch.device, rank_on_host: int) -> torch.device:
    """The device a rank drives: the rank_on_host-th GPU after `device`'s index (torchrun: its
    LOCAL_RANK's GPU), or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank_on_host)


# A step's pickled StepInput travels in one broadcast of this many bytes (a second one carries
# the rest of a larger step): broadcast_object_list would take two (size, then data) each step.
STEP_BUFFER_BYTES = 1 << 18


@dataclass(frozen=True)
class Groups:
    data: Any  # the default group: the forward's collectives
    control: Any  # gloo: step descriptions from rank 0
    buffer: torch.Tensor  # [STEP_BUFFER_BYTES] uint8 on the CPU: a step's bytes on the wire


def init_groups(rank: int, world_size: int, device: torch.device, store=None) -> Groups:
    """Join the default group (from `store`, else torchrun's env://) and create the control group."""
    kwargs: dict[str, Any] = dict(rank=rank, world_size=world_size, timeout=collective_timeout())
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = "env://"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Groups(data=dist.group.WORLD, control=control,
                  buffer=torch.empty(STEP_BUFFER_BYTES, dtype=torch.uint8))


def abort_groups() -> None:
    """Abort this process's NCCL communicators, so that a collective waiting on a dead peer
    fails now rather than at the timeout (gloo sees the closed socket by itself)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "nccl":
        return
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception:  # an experimental API: at worst a collective waits for its timeout
        pass


def destroy_groups(*, peers_ok: bool = True) -> None:
    """Leave the process groups. NCCL's shutdown can wait for every rank to shut down too (torch
    shuts backends down in a fixed order because ncclCommAbort once was collective), so all
    ranks call this at the same time; peers_ok=False (a rank died, or may sit in a collective):
    the communicators are aborted first, which waits for nobody."""
    if not peers_ok:
        abort_groups()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_now(code: int) -> NoReturn:
    """Leave a worker process without the interpreter's finalization. A gloo thread may still be
    dropping a finished collective's tensors, which takes the GIL, and a thread that takes the
    GIL while the interpreter finalizes aborts the process ("terminate called without an active
    exception", pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard_spec(rank: int, world_size: int, groups: Groups) -> ShardSpec:
    return ShardSpec(rank=rank, world_size=world_size, group=groups.data)


def agree_min(n: int, device: torch.device) -> int:
    """The smallest n over the ranks (on the default group)."""
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def min_max(n: int, device: torch.device) -> tuple[int, int]:
    """(min, max) of n over the ranks, in one all-reduce."""
    t = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]), -int(t[1])


def _send(tensor: torch.Tensor, groups: Groups, timeout: datetime.timedelta) -> None:
    """Rank 0's broadcast of `tensor` on the control group, failing after `timeout`. The
    group's own timeout (IDLE_TIMEOUT) bounds the workers' wait for a step; a worker that is
    stuck rather than dead (its socket open, its buffer full) must not hold rank 0's send as
    long."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    groups.control.broadcast([tensor], opts).wait()


def broadcast_step(step, groups: Groups) -> None:
    """Rank 0: send a StepInput (or None: stop) to every rank: [length: 8 bytes][pickle]. A
    step not taken within the collective timeout (the stop message: STOP_TIMEOUT) raises."""
    timeout = STOP_TIMEOUT if step is None else collective_timeout()
    data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
    fit = min(len(data), STEP_BUFFER_BYTES - 8)
    view = groups.buffer.numpy()
    view[:8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
    view[8:8 + fit] = np.frombuffer(data, dtype=np.uint8, count=fit)
    _send(groups.buffer, groups, timeout)
    if fit < len(data):
        rest = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=fit).copy())
        _send(rest, groups, timeout)


def receive_step(groups: Groups):
    """Ranks > 0: the next StepInput from rank 0 (None: stop)."""
    dist.broadcast(groups.buffer, src=0, group=groups.control)
    view = groups.buffer.numpy()
    size = int.from_bytes(view[:8].tobytes(), "little")
    fit = min(size, STEP_BUFFER_BYTES - 8)
    data = view[8:8 + fit].tobytes()
    if fit < size:
        rest = torch.empty(size - fit, dtype=torch.uint8)
        dist.broadcast(rest, src=0, group=groups.control)
        data += rest.numpy().tobytes()
    return pickle.loads(data)
