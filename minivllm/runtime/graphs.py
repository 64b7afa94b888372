"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step (one new token for each of B sequences) is shaped only by B and the block-table
width, so it can be captured once per bucket of B and replayed with new data copied into static
input buffers. The graphs share one memory pool and capture the pure `forward` with its parts
compiled; weights and the KV cache are captured at their addresses, which never change,
since the cache is donated and written in place.

What is compiled is one decoder layer (and the stem and head around the layers), not the whole
forward: the 28 layers of a Qwen3 model are the same function on same-shaped weights, so one
small graph serves them all, and inside a CUDA graph the Python loop around it costs nothing.
Compiling the whole forward gave the same fused kernels but took minutes on a fresh machine (a
28-layer graph, compiled twice: once static, once with a dynamic batch), which is why it is not
done. The smallest bucket is 2, so that the compiled layer sees only batches of 2 or more and one
dynamic-batch compile (after a first static one) serves every bucket; a single sequence is
padded to 2 rows, which costs nothing measurable. With persistent_decode the buckets of 1 and 2
rows run every layer as one persistent kernel (kernels/decode_layer.py) instead, whose work grows
with each row, padding included, so there a single sequence has a bucket of its own.

Rows past the real batch are padding: slot -1 (nothing is written), context length 1 and a block
table of zeros (block 0 exists, and the padding row's one key is its own new token), so they
read valid memory, write none, and their logits are dropped.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import types

import torch
import torch.fx.experimental._config

from ..functional import model
from ..functional.layer import decoder_layer
from ..functional.model import forward
from ..state.batch import Batch
from ..state.cache import KVCache
from ..state.params import Params

log = logging.getLogger("minivllm")


def decode_buckets(max_num_seqs: int, single: bool = False) -> list[int]:
    """Padded batch sizes: 2, 4, 8, then every 16 up to max_num_seqs (which is always one).
    single: 1 too (the persistent decode layers, whose work grows with every row, padding
    included: 42.7 against 31.3 us a layer at 2 rows and 1 on the H200, BENCHMARKS.md session
    15; the compiled layer, which the bucket of 1 row would make compile once more, is not
    used there)."""
    sizes = [b for b in ((1,) if single else ()) + (2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


def compiled_forward(compile_backend="inductor"):
    """forward with its three parts (stem, decoder layer, head) compiled, each fullgraph (no
    graph breaks), for one engine. Compiling the stem and the head too turns their ~20 eager
    kernels per step (embedding, RoPE tables, final add + norm, the logits' cast) into a few.

    torch.compile keeps its compiled graphs and its record of which input sizes have varied per
    code object. With one code object shared by every engine of a process, a second engine of
    another shape (a TP=2 engine after a TP=1 one, a test session) saw its weight sizes "vary",
    so dynamo compiled them as symbolic sizes: slower code, and on the H200 an Inductor crash
    (KeyError in Scheduler.compute_ancestors, pytorch/pytorch#189271, when a Triton kernel's
    output is reshaped by symbolic head counts). So each call compiles its own copies
    (_own_copy): an engine's first compile is static, its second makes only the step's sizes
    dynamic."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # Inductor's default mode: max-autotune (timing Triton GEMM templates against cuBLAS) did not
    # finish its start-up within 90 s on the H200, several templates asking for more shared
    # memory than an SM has (BENCHMARKS.md, session 8).

    def compiled(fn):
        return torch.compile(_own_copy(fn), fullgraph=True, backend=compile_backend)

    return functools.partial(forward, layer=compiled(decoder_layer), stem=compiled(model.stem),
                             head=compiled(model.head))


def start_up_form(fn):
    """fn (a compiled_forward) for start-up's calls (capture, warm-up): each compiled part marks
    the step's sizes (tokens, sequences, block-table width, logits rows) dynamic before it runs,
    and compiles them size-obliviously (torch.fx.experimental._config.backed_size_oblivious), so
    that its first compile is already the dynamic one and a size of 1 does not specialise it.
    Without it each part compiles static first, then dynamic, then once more for each size that
    a step first meets at 1 (one sequence, one block-table column, one logits row): 13 graphs
    in the warm-up's steps on the CPU (Inductor) where this form compiles 4, and 17 against 6
    over the buckets' captures and the warm-up (tests/test_decode_graphs.py). Serving calls fn
    itself: the graphs compiled here serve it, and marking costs ~30 us a tensor on the host."""
    if not isinstance(fn, functools.partial):  # the eager forward: nothing is compiled
        return fn
    parts = fn.keywords

    def stem(params, batch):
        _mark_batch(batch)
        with _size_oblivious():
            return parts["stem"](params, batch)

    def layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, **kwargs):
        # x: [T, hidden], or down's unsummed partials [split, T, hidden]
        _mark(x, x.dim() - 2)
        for t in (residual, cos, sin):
            _mark(t, 0)
        _mark_batch(batch)
        with _size_oblivious():
            return parts["layer"](lp, x, residual, cos, sin, k_cache, v_cache, batch, **kwargs)

    def head(params, x, residual, rows):
        _mark(x, x.dim() - 2)
        _mark(residual, 0)
        _mark(rows, 0)
        with _size_oblivious():
            return parts["head"](params, x, residual, rows)

    return functools.partial(forward, layer=layer, stem=stem, head=head)


def _mark(t: torch.Tensor, dim: int) -> None:
    torch._dynamo.maybe_mark_dynamic(t, dim)


def _mark_batch(batch: Batch) -> None:
    for t in (batch.input_ids, batch.positions, batch.slot_mapping, batch.cu_seqlens_q,
              batch.context_lens, batch.block_tables, batch.logits_indices):
        _mark(t, 0)
    _mark(batch.block_tables, 1)


def _size_oblivious():
    return torch.fx.experimental._config.patch(backed_size_oblivious=True)


_copies = itertools.count(1)


def _own_copy(fn):
    """fn under a name of its own: dynamo keys a function's size history by file, line and name
    (torch._dynamo.pgo.CodeId), and its compiled graphs by code object; both are new here."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_copies)}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__doc__ = fn.__kwdefaults__, fn.__doc__
    return copy


class DecodeGraphs:
    """Static input buffers and one captured decode graph per bucket.

    fill(...) copies a step's host arrays into the buffers (non-blocking, from pinned memory);
    replay(B) runs the bucket that holds B rows and returns logits [B, vocab] (a view of the
    graph's static output: read it before the next replay)."""

    def __init__(self, params: Params, cache: KVCache, backend, *, max_num_seqs: int,
                 max_blocks_per_seq: int, compile_forward: bool = True,
                 persistent_decode: bool = False, dynamic_start: bool = False):
        self.params, self.cache, self.backend = params, cache, backend
        self.device = params.device
        self.buckets = decode_buckets(max_num_seqs, single=persistent_decode)
        n, m = self.buckets[-1], max_blocks_per_seq
        dev = self.device
        # Every per-step input in one buffer, so that a step's host data goes over in one copy
        # (five copies and their launch gaps cost ~5 us of the single stream's ~800 us step).
        # Each field starts 16-byte aligned (Triton and Inductor specialise on it): n rounded
        # up to 4 rows (n4), ids, positions and slots int64 [n] at bytes 0, 8 n4 and 16 n4,
        # context lengths int32 [n] at 24 n4, block tables int32 [n, m] at 28 n4.
        n4 = n + -n % 4
        self.ids_end, self.tables_at = 8 * n4, 28 * n4
        packed = torch.zeros(self.tables_at + 4 * n * m, dtype=torch.uint8, device=dev)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, \
            self.block_tables = self._views(packed, n, m)
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(1)
        self.packed = packed
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        # Host staging of the same layout, pinned so that the copy to the device does not block
        # the host. Two, used in turn: with asynchronous scheduling the host fills step N+1
        # while step N's copy may still be queued; an event per staging says when its copy is
        # done.
        pin = dev.type == "cuda"
        self.staging = [torch.zeros(packed.shape, dtype=torch.uint8, pin_memory=pin)
                        for _ in range(2)]
        # Their fields as numpy arrays, made once: a step's fill is then numpy work only.
        self.staging_fields = [tuple(t.numpy() for t in self._views(host, n, m))
                               for host in self.staging]
        self.staged = [None, None]  # the event after each staging's copy
        self.turn = 0
        self.fn = compiled_forward() if compile_forward else forward
        # What capture runs (see start_up_form): the same compiled parts.
        self.capture_fn = start_up_form(self.fn) if dynamic_start else self.fn
        # Buckets of at most MAX_ROWS rows: every layer in one persistent kernel (decode_layer.py).
        self.small_fn, self.small_rows = self.capture_fn, 0
        if persistent_decode:
            from ..kernels.decode_layer import MAX_ROWS, with_persistent_layers

            self.small_fn = with_persistent_layers(self.capture_fn, params, cache)
            self.small_rows = MAX_ROWS
        # The persistent buckets' graphs also pick each row's arg-max into this static buffer
        # (sample_kernel.greedy_argmax, 4 us at one row against an eager torch.argmax's 8 and
        # its launch), which a step whose rows are all plain greedy takes as its tokens: it
        # then builds no sampling batch and launches nothing after the replay. The pick is
        # also written into the input ids, where a next step that feeds every row's token back
        # to the same row finds it (fill(keep_ids=True) then leaves them be: no copy from the
        # previous step's tokens). Rows of one rank only (a tensor-parallel rank's logits are
        # gathered elsewhere).
        self.greedy_rows = self.small_rows if params.shard.world_size == 1 else 0
        # Where it takes the model (kernels.decode_head.head_fits), the head is one kernel that
        # also does the pick's first half: the final norm, the LM head, the logits' cast and
        # the pick's partial arg-max in one launch instead of four.
        from ..kernels.decode_head import head_fits

        self.head_picks = head_fits(params)
        self.greedy_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def batch_view(self, bs: int) -> Batch:
        return Batch(input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                     slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
                     context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                     logits_indices=self.logits_indices[:bs])

    def capture(self) -> None:
        """Warm up (compiling) and capture every bucket, largest first so that the shared pool is
        sized by it. The buffers hold padding rows throughout, so nothing is written to the cache."""
        pool = None
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for bs in reversed(self.buckets):
                for _ in range(2):
                    self._decode(bs)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._decode(bs)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, logits
                if len(self.graphs) == 1:
                    first = time.perf_counter() - start
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("minivllm: captured decode CUDA graphs for batch sizes %s in %.1f s (the first, "
                 "compile included, %.1f s)", self.buckets, time.perf_counter() - start, first)

    def _decode(self, bs: int) -> torch.Tensor:
        """What bucket bs's graph runs: the forward (and, when the bucket picks greedy tokens,
        the pick into greedy_tokens). Returns the logits [bs, vocab]."""
        from ..kernels.decode_head import picking_head
        from ..kernels.sample_kernel import argmax_of_tiles, greedy_argmax

        fn = self.small_fn if bs <= self.small_rows else self.capture_fn
        batch = self.batch_view(bs)
        picks = dict(out=self.greedy_tokens[:bs], copy_to=self.input_ids[:bs])
        if bs <= self.greedy_rows and self.head_picks:
            (logits, tile_max, tile_argmax), _ = fn(self.params, self.cache, batch, self.backend,
                                                    head=picking_head)
            argmax_of_tiles(tile_max, tile_argmax, **picks)
            return logits
        logits, _ = fn(self.params, self.cache, batch, self.backend)
        if bs <= self.greedy_rows:
            greedy_argmax(logits, **picks)
        return logits

    def picks_greedy(self, b: int) -> bool:
        """Whether the graph that runs b rows also leaves their arg-max in greedy_tokens[:b]."""
        bs = self.bucket(b)
        return bs is not None and bs <= self.greedy_rows

    def bucket(self, b: int) -> int | None:
        for size in self.buckets:
            if size >= b:
                return size
        return None

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int],
             context_lens: list[int], block_tables: list[list[int]], *,
             keep_ids: bool = False) -> int:
        """Copy one decode step (B rows) into the static buffers, padding to the bucket. Returns
        the bucket size. Host work is numpy only (no tensor ops but the one copy). keep_ids:
        leave the device's input ids as they are (the last replay's greedy pick put them
        there) and copy the other fields only."""
        b = len(input_ids)
        bs = self.bucket(b)
        m = self.block_tables.shape[1]
        self.turn ^= 1
        if self.staged[self.turn] is not None:
            self.staged[self.turn].synchronize()
        ids, pos, slot_rows, ctx, tables = self.staging_fields[self.turn]
        ids[:b], pos[:b], slot_rows[:b], ctx[:b] = input_ids, positions, slots, context_lens
        ids[b:bs] = pos[b:bs] = 0
        slot_rows[b:bs] = -1
        ctx[b:bs] = 1
        tables[:bs] = 0
        # A row at a time: one numpy assignment a row beat the vectorised scatter (seven numpy
        # calls) at every batch size measured, 1.1 against 7.9 us at 1 row, 168 against 350 at
        # 128 rows of 40-167 blocks (this repository's CPU).
        for row, table in enumerate(block_tables):
            tables[row, :len(table)] = table
        # Rows past bs are stale but no graph of bucket bs reads them.
        start, end = (self.ids_end if keep_ids else 0), self.tables_at + 4 * bs * m
        self.packed[start:end].copy_(self.staging[self.turn][start:end], non_blocking=True)
        if self.device.type == "cuda":
            self.staged[self.turn] = torch.cuda.Event()
            self.staged[self.turn].record()
        return bs

    @staticmethod
    def _views(buffer: torch.Tensor, n: int, m: int) -> tuple[torch.Tensor, ...]:
        """The per-step inputs in `buffer` (uint8, the packed layout): input ids, positions,
        slots ([n] int64 each), context lengths ([n] int32), block tables ([n, m] int32)."""
        n4 = n + -n % 4
        i64 = buffer[: 24 * n4].view(torch.int64)
        ctx = buffer[24 * n4: 24 * n4 + 4 * n].view(torch.int32)
        tables = buffer[28 * n4: 28 * n4 + 4 * n * m].view(torch.int32).view(n, m)
        return i64[:n], i64[n4: n4 + n], i64[2 * n4: 2 * n4 + n], ctx, tables

    def release(self) -> None:
        """Drop every captured graph. A graph that captured NCCL collectives holds on to the
        communicator, and destroying the process group while such a graph lives never returns
        (pytorch/pytorch#115388; seen here at TP=2 on two H200s), so every rank calls this first.
        No synchronize: CUDA frees a graph that is still running when it completes, and a wait
        here could hang on a collective whose peer is gone."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def replay(self, b: int) -> torch.Tensor:
        bs = self.bucket(b)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
