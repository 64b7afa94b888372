"""Executors: what the engine calls to run one step (`execute(StepInput) -> StepResult`, or
`launch(StepInput)` whose `.result()` is that StepResult, for asynchronous scheduling), and what
it reads from the model (`model_config`, `num_blocks`).

At tensor_parallel_size 1 the executor is a ModelRunner itself. Above 1 it is a TPExecutor in the
engine's process, which is rank 0: it broadcasts each StepInput over torch.distributed, runs its
own shard, and returns its own StepResult (the LM head gathers the logits to every rank, and
every rank samples the same rows with the same seeds; rank 0's tokens are the ones used, and
each rank feeds its own copy of them back to its next step).

The other ranks are either spawned by the engine on this host (`TPExecutor.spawn`: daemon
processes, watched by a thread, stopped at shutdown, garbage collection, exit, SIGTERM or after
a failure), or started by torchrun on one or more hosts (`TPExecutor.torchrun`), where ranks
> 0 serve rank 0 inside `make_executor` and then leave the process.
"""

from __future__ import annotations

import atexit
import dataclasses
import multiprocessing.connection
import os
import signal
import threading
import time
import weakref

import torch

from .config import EngineConfig
from .distributed import (Groups, Launch, abort_groups, broadcast_step, collective_timeout,
                          destroy_groups, torchrun_env)
from .runner import (LoadWeights, ModelRunner, SetLoRA, Sleep, StepInput, StepResult,
                     WakeUp)
from .signals import deferred_sigint, exit_on_sigterm
from .worker import config_for_rank, ready_key, spawned_worker, start_rank, torchrun_worker

# Seconds a worker has to leave after the stop message before it is terminated.
STOP_GRACE_S = 10.0
# Seconds to wait, after a collective failed, for the worker that caused it to be seen dead.
DEATH_GRACE_S = 2.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process died; the engine has stopped the others."""


class TPPendingStep:
    """Rank 0's launched step; result() waits for it under the executor's failure handling."""

    def __init__(self, executor: "TPExecutor", pending):
        self.executor, self.pending = executor, pending

    def result(self) -> StepResult:
        return self.executor._guarded(self.pending.result)


def make_executor(config: EngineConfig):
    """The executor for `config`: a ModelRunner at tensor_parallel_size 1, else a TPExecutor
    whose workers this process spawns, or, under torchrun, this rank's part (ranks > 0 serve
    rank 0 here and then exit the process)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config)
    launch = torchrun_env()
    if launch is None:
        return TPExecutor.spawn(config)
    if launch.rank == 0:
        return TPExecutor.torchrun(config, launch)
    torchrun_worker(config, launch)  # does not return


def _describe_exit(rank: int, proc) -> str:
    code = proc.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    elif code is not None:
        how = f"exited with code {code}"
    else:  # another thread reaped it first
        how = "died"
    return (f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}; the engine has stopped "
            f"its other workers and cannot run more steps (create a new LLM)")


class SpawnedWorkers:
    """Ranks 1..N-1 as daemon processes on this host, and a thread that notices when one dies.

    The thread alone reaps them until stop() (two threads reaping one process race, and the
    loser sees no exit code). On CUDA it also aborts the NCCL communicators, since NCCL does not
    notice a dead peer and rank 0 would wait in a collective until the timeout; gloo sees the
    closed socket and fails the collective itself."""

    def __init__(self, procs: list, *, nccl: bool):
        self.procs = procs  # procs[i] is rank i + 1
        self.nccl = nccl
        self.failure: str | None = None  # the first death, described
        self._died = threading.Event()
        self._wake_r, self._wake_w = multiprocessing.Pipe(duplex=False)  # stop() wakes the watcher
        self._watcher = threading.Thread(target=self._watch, name="minivllm-tp-watch", daemon=True)

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self._watcher.start()

    def _watch(self) -> None:
        alive = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        while alive:
            ready = multiprocessing.connection.wait([*alive, self._wake_r])
            if self._wake_r in ready:
                return
            for sentinel in ready:
                rank = alive.pop(sentinel)
                self.procs[rank - 1].join()  # its sentinel closed: it has exited; reap it
                if self.failure is None:
                    self.failure = _describe_exit(rank, self.procs[rank - 1])
                    self._died.set()
                    if self.nccl:
                        abort_groups()

    def wait_dead(self, timeout: float) -> str | None:
        """Wait up to `timeout` s for a worker to be seen dead; its description, or None."""
        self._died.wait(timeout)
        return self.failure

    def wait_ready(self, store, timeout: float) -> None:
        """Until every worker has imported its code and joined the store (a worker that dies
        on the way is reported at once, not after the rendezvous timeout)."""
        keys = [ready_key(rank) for rank in range(1, len(self.procs) + 1)]
        deadline = time.monotonic() + timeout
        while not store.check(keys):
            if self.failure is not None:
                raise WorkerDiedError(f"{self.failure} while the engine was starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel workers did not start within {timeout:.0f} s "
                                   f"(MINIVLLM_DIST_TIMEOUT)")
            self._died.wait(0.02)

    def stop_watching(self) -> None:
        """From now on a worker that exits is leaving, not dying."""
        if self._watcher.is_alive():
            self._wake_w.send(None)
            self._watcher.join()

    def stop(self, grace: float) -> None:
        """Join every worker, within `grace` s, then terminate and, failing that, kill."""
        self.stop_watching()
        deadline = time.monotonic() + grace
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        for p in self.procs:
            if p.pid is not None:
                p.join(2.0)
                if p.is_alive():
                    p.kill()
                    p.join()


def _lost_peer(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer went away (gloo raises a plain
    RuntimeError, NCCL a DistError) rather than rank 0's own error, which is reported as is
    even when a worker died of the same cause (a bad checkpoint, no memory for the cache)."""
    import torch.distributed as dist

    return type(e) is RuntimeError or isinstance(e, dist.DistError)


class _Closer:
    """Stops the group once: the stop message to the workers (when they are in step with rank 0),
    then their processes, then this process's groups. Holds no reference to the executor, so
    that it can run from the executor's finalizer."""

    def __init__(self, groups: Groups, workers: SpawnedWorkers | None, runner: ModelRunner):
        self.groups, self.workers = groups, workers
        self.runner: ModelRunner | None = runner  # rank 0's: its graphs go before its groups
        self.in_step = True  # False after a failure: the workers may sit in a collective
        self.reason: str | None = None  # why the executor stopped
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        self.done = True
        atexit.unregister(self)
        if self.workers is not None:
            self.workers.stop_watching()
        if self.in_step:
            try:
                broadcast_step(None, self.groups)
            except Exception:  # a worker is gone, or stuck: stop() below ends it without grace
                self.in_step = False
        # Seen on two H200s: rank 0 never returned from destroy_process_group. Two causes are
        # known, both met here. A live CUDA graph that captured NCCL collectives makes the
        # group's destruction hang (pytorch/pytorch#115388), so the graphs go first, on every
        # rank; and NCCL's shutdown on one rank can wait for the others', so rank 0 leaves its
        # groups while the workers leave theirs, before it waits for their processes. After a
        # failure a collective may sit waiting on a dead peer: abort first, so that releasing
        # the graphs and leaving the groups wait for nobody.
        if not self.in_step:
            abort_groups()
        try:
            self.runner.release_graphs()
        except Exception:  # a failed device: the groups must go regardless
            pass
        self.runner = None
        destroy_groups()
        if self.workers is not None:
            self.workers.stop(STOP_GRACE_S if self.in_step else 0.0)
        if self.reason is None:
            self.reason = "it has been shut down"


def _sendable(step: StepInput) -> StepInput:
    """step as the workers get it: its prompt embeddings (slices of each prompt's, which pickle
    their prompt's whole storage) copied to their own rows, so that a step sends its chunks'
    rows only, not every chunk the whole prompt."""
    if not step.embeds:
        return step
    return dataclasses.replace(step, embeds=tuple((row, rows.clone())
                                                  for row, rows in step.embeds))


class TPExecutor:
    """Rank 0 of a tensor-parallel group (see the module docstring)."""

    def __init__(self, runner: ModelRunner, groups: Groups, workers: SpawnedWorkers | None,
                 store=None):
        self.runner = runner  # rank 0's shard
        self.groups = groups
        self.workers = workers
        self._store = store  # the spawned group's rendezvous: kept alive with the group
        self.world_size = runner.params.shard.world_size
        self.model_config = runner.model_config
        self.num_blocks = runner.num_blocks
        self._closer = _Closer(groups, workers, runner)
        atexit.register(self._closer)
        self._finalizer = weakref.finalize(self, self._closer)
        self._finalizer.atexit = False  # atexit calls the closer itself
        exit_on_sigterm()

    # Read-only views of rank 0's runner (its device, backend, params and cache are its shard's).
    _RANK0 = frozenset({"config", "device", "backend", "params", "cache", "graphs", "vocab_size",
                        "block_size", "enforce_eager"})

    def __getattr__(self, name):
        if name in TPExecutor._RANK0:
            return getattr(self.runner, name)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    # -- start-up --------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, config: EngineConfig) -> "TPExecutor":
        """Spawn ranks 1..N-1 on this host and become rank 0."""
        import torch.distributed as dist

        world = config.tensor_parallel_size
        timeout = collective_timeout()
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timeout)
        ctx = torch.multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=spawned_worker, name=f"minivllm-tp-rank{rank}", daemon=True,
                             args=(rank, world, store.port, config_for_rank(config, rank), os.getpid()))
                 for rank in range(1, world)]
        workers = SpawnedWorkers(procs, nccl=config.device.type == "cuda")
        try:
            workers.start()
            workers.wait_ready(store, timeout.total_seconds())
            runner, groups = start_rank(config_for_rank(config, 0), 0, world, store)
        except BaseException as e:
            found = workers.wait_dead(DEATH_GRACE_S) if _lost_peer(e) else None
            destroy_groups(peers_ok=False)
            workers.stop(0.0)
            if found is not None:
                raise WorkerDiedError(f"{found} while the engine was starting") from e
            raise
        return cls(runner, groups, workers, store)

    @classmethod
    def torchrun(cls, config: EngineConfig, launch: Launch) -> "TPExecutor":
        """Rank 0 of a torchrun launch: the other ranks are torchrun's to start and stop."""
        runner, groups = start_rank(config_for_rank(config, launch.local_rank), 0, launch.world_size)
        return cls(runner, groups, None)

    # -- steps -----------------------------------------------------------------------------------

    def execute(self, step: StepInput) -> StepResult:
        """Run the step on every rank; rank 0's sampled tokens."""
        return self.launch(step).result()

    def launch(self, step: StepInput) -> "TPPendingStep":
        """Send the step to every rank and queue rank 0's part, without waiting for it (the
        engine's asynchronous scheduling). Every rank samples the same tokens from the same
        gathered logits, so each can feed them back to its own next step."""
        if self._closer.reason is not None:
            raise RuntimeError(f"tensor-parallel engine is stopped: {self._closer.reason}")
        if self.workers is not None and (found := self.workers.failure):
            self._abandon(found)
            raise WorkerDiedError(found)

        def send():
            broadcast_step(_sendable(step), self.groups)
            return self.runner.launch(step)

        return TPPendingStep(self, self._guarded(send))

    def set_lora(self, slot: int, adapter) -> None:
        """Write `adapter` (None: a zero delta) into LoRA slot `slot` on every rank, each its
        own slice (ModelRunner.set_lora): the workers get it between the steps around it, as
        rank 0 writes it."""
        self._to_every_rank(SetLoRA(slot, adapter), lambda: self.runner.set_lora(slot, adapter))

    def load_weights(self, checked: list) -> None:
        """Copy checked (Hugging Face name, tensor) pairs into every rank's params, each rank its
        own slice (ModelRunner.load_weights). The whole tensors travel to the workers pickled
        over the control channel, through the host: simple, and slow for a large model (vLLM
        broadcasts them over NCCL)."""
        host = [(name, t.detach().to("cpu")) for name, t in checked]
        self._to_every_rank(LoadWeights(host), lambda: self.runner.load_weights(checked))

    def sleep(self, level: int) -> None:
        """Free every rank's weights and KV cache memory, each rank its own shard's
        (ModelRunner.sleep)."""
        self._to_every_rank(Sleep(level), lambda: self.runner.sleep(level))

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Take back every rank's memory of `tags` (ModelRunner.wake_up); the ranks capture
        their graphs again together, their collectives matched."""
        self._to_every_rank(WakeUp(tuple(tags)), lambda: self.runner.wake_up(tags))

    @property
    def asleep(self) -> dict:
        """The sleep mode's tags rank 0 holds asleep (ModelRunner.asleep): the engine's view
        after a wake_up failed, which stops the executor (any failure does)."""
        return self.runner.asleep

    def _to_every_rank(self, message, own) -> None:
        """Send `message` to the workers, between steps, and run rank 0's part, `own()`."""
        if self._closer.reason is not None:
            raise RuntimeError(f"tensor-parallel engine is stopped: {self._closer.reason}")

        def send():
            broadcast_step(message, self.groups)
            own()

        self._guarded(send)

    def _guarded(self, fn):
        """fn() with the engine's failure handling: a lost worker is a WorkerDiedError, any
        failure stops the engine."""
        with deferred_sigint():
            try:
                out = fn()
            except BaseException as e:
                found = None
                if self.workers is not None and _lost_peer(e):
                    found = self.workers.wait_dead(DEATH_GRACE_S)
                self._abandon(found or f"a step failed on rank 0 ({type(e).__name__}: {e})")
                if found is not None:
                    raise WorkerDiedError(found) from e
                raise
            # On CUDA an aborted communicator lets the step return garbage instead of raising.
            if self.workers is not None and self.workers.failure is not None:
                self._abandon(self.workers.failure)
                raise WorkerDiedError(self.workers.failure)
        return out

    def _abandon(self, reason: str) -> None:
        self._closer.in_step = False
        self._closer.reason = reason
        self._finalizer()

    def shutdown(self) -> None:
        """Stop the workers (they finish the step in flight, if any, and leave) and leave the
        process groups. Idempotent; also run at exit and when the executor is collected."""
        self._finalizer()
