"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step (one new token for each of B sequences) is shaped only by B and the block-table
width, so it can be captured once per bucket of B and replayed with new data copied into static
input buffers. The graphs share one memory pool (each one's logits too: see unowned) and capture
the pure `forward` with its parts compiled; weights and the KV cache are captured at their
addresses, which never change, since the cache is donated and written in place.

The forward's parts are compiled by runtime.compiled (one decoder layer, the stem and the head).
The smallest bucket is 2, so that the compiled layer sees only batches of 2 or more and one
dynamic-batch compile (after a first static one) serves every bucket; a single sequence is padded
to 2 rows, which costs a dense model nothing measurable. With persistent_decode the buckets of 1
and 2 rows run every layer as one persistent kernel (kernels/decode_layer.py) instead, whose work
grows with each row, padding included, so there a single sequence has a bucket of its own. So does
a mixture-of-experts model's: its padding row routes to experts of its own, and at one sequence
that doubles the expert weights a step reads (8 of 128 experts become ~16 at Qwen3-30B-A3B's shape;
the bucket of 1 made its single stream 1.32x faster on an H100, BENCHMARKS.md session 69), for one
more compile of the layer. For the same reason a mixture of experts gets finer buckets: every size
up to 8 rows, then every 8 up to 64 (vLLM's capture sizes step by 8). At uniform routing B rows
read 1 - (1 - k/E)^B of a layer's experts: 5 rows padded to 8 would read 46% more expert bytes at
that shape, 17 padded to 32 31% more (to 24: 18%). A bucket costs a capture (~1 s at that shape)
and no compile of the layer, whose one dynamic-batch compile serves them all (at most Triton's
variants of the MoE kernels for the new sizes).

Rows past the real batch are padding: slot -1 (nothing is written), context length 1 and a block
table of zeros (block 0 exists, and the padding row's one key is its own new token), so they
read valid memory, write none, and their logits are dropped.

With LoRA (params.lora: the adapters' slot weights, written in place, so at static addresses),
every bucket is captured through the LoRA decoder layer with one more static buffer, each row's
LoRA slot (-1 for a base row and for padding: a delta of exact zeros). Such a set serves any mix
of adapters and base rows. A LoRA engine also captures a set of the base model's graphs
(adapters=False: no slots, the forward without LoRA, the persistent decode where the engine
takes it) for its steps without adapter rows, as vLLM's cudagraph_specialize_lora does: through
the LoRA layer they ran at 57% of an engine without LoRA (BENCHMARKS.md session 63).
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np
import torch

from ..functional.model import forward
from ..state.batch import Batch, DecodeChunks, slot_of
from ..state.cache import KVCache
from ..state.params import Params
from .compiled import compiled_forward
from .step_inputs import StepInputs, batch_layout

log = logging.getLogger("minivllm")

# The fields a decode step fills, in their packed order (ids first: a step that keeps the ids
# copies from positions on; block tables last: it copies only its bucket's rows of them).
STEP_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")
# With LoRA, each row's slot too, before the block tables (a step copies up to its bucket's).
LORA_STEP_FIELDS = STEP_FIELDS[:-1] + ("lora_slots",) + STEP_FIELDS[-1:]

PYTHON_SLOTS_MAX_ROWS = 32  # DecodeGraphs.fill: up to this many rows, slots are found in Python


def warm_up_and_capture(run, stream: torch.cuda.Stream, pool=None):
    """Run `run` twice (compiling what it needs, outside the graph), then capture it on `stream`
    (a side stream, as CUDA graphs need) into a graph sharing `pool`. Returns the graph and what
    the captured call returned (its static output)."""
    for _ in range(2):
        run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = run()
    return graph, out


def unowned(t: torch.Tensor) -> torch.Tensor:
    """t's elements, in a tensor that does not keep t's memory alive (vLLM's weak_ref_tensors
    does the same). A graph's static output held this way goes back to the graphs' shared pool,
    where later captures reuse it: the graphs replay one at a time on one stream, and each
    replay's output is read (in stream order) before the next replay, so any graph of the pool
    may write its output or scratch where another's output was. Held strongly, every decode
    bucket's fp32 logits stayed allocated side by side: 2,190 rows of 151,936 at the 0.6B shape
    with 256 sequences, 1.24 GiB, against one bucket's 0.15 GiB. A torch without the private
    constructor gets t itself: the same results, with each graph's output kept apart."""
    construct = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if construct is None:
        return t
    storage = construct(t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.size(), t.stride())


def decode_buckets(max_num_seqs: int, single: bool = False, fine: bool = False) -> list[int]:
    """Padded batch sizes: 2, 4, 8, then every 16 up to max_num_seqs (which is always one).
    single: 1 too (the persistent decode layers, whose work grows with every row, padding
    included: 42.7 against 31.3 us a layer at 2 rows and 1 on the H200, BENCHMARKS.md session
    15; the compiled layer, which the bucket of 1 row would make compile once more, is not
    used there; and a mixture of experts, whose padding row reads experts of its own). fine:
    every size from 2 to 8 and every 8 from 8 to 64 too (a mixture of experts: see above)."""
    small = range(2, 9) if fine else (2, 4, 8)
    sizes = [b for b in ((1,) if single else ()) + tuple(small) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    if fine:
        sizes += [b for b in range(8, 65, 8) if b < max_num_seqs]
    sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeGraphs:
    """Static input buffers and one captured decode graph per bucket.

    fill(...) copies a step's host arrays into the buffers (non-blocking, from pinned memory);
    replay(B) runs the bucket that holds B rows and returns logits [B, vocab] (a view of the
    graph's static output: read it before the next replay)."""

    def __init__(self, params: Params, cache: KVCache, backend, *, max_num_seqs: int,
                 max_blocks_per_seq: int, compile_forward: bool = True,
                 persistent_decode: bool = False, fused_mlp_rows: tuple[int, int] | None = None,
                 adapters: bool | None = None, fn=None):
        """adapters: whether the graphs take each row's LoRA slot (None: whether params hold
        LoRA slot weights; False with them: the base model's graphs of a LoRA engine). fn: the
        forward to capture, another set's .fn, whose compiled code this set then shares (None:
        compiled here unless compile_forward is False)."""
        if adapters and params.lora is None:
            raise ValueError("DecodeGraphs(adapters=True) needs params with LoRA slot weights "
                             "(params.lora)")
        self.params, self.cache, self.backend = params, cache, backend
        self.device = params.device
        self.buckets = decode_buckets(max_num_seqs,
                                      single=persistent_decode or params.config.is_moe,
                                      fine=params.config.is_moe)
        n, m = self.buckets[-1], max_blocks_per_seq
        dev = self.device
        # The per-step inputs (runtime/step_inputs.py); cu_seqlens_q and logits_indices never
        # change.
        self.lora = params.lora is not None if adapters is None else adapters
        fields = LORA_STEP_FIELDS if self.lora else STEP_FIELDS
        layout = batch_layout(n, n, m, lora=self.lora)
        self.inputs = StepInputs({k: layout[k] for k in fields}, dev)
        self.input_ids, self.positions, self.slot_mapping, self.context_lens, \
            self.block_tables = (self.inputs.views[k] for k in STEP_FIELDS)
        # [n] each row's LoRA slot (-1: the base model, and padding), or None without LoRA.
        self.lora_slots = self.inputs.views.get("lora_slots")
        self.slot_mapping.fill_(-1)
        if self.lora:
            self.lora_slots.fill_(-1)
        # Per staging, per row: (the block table its row holds, that table's length then), or
        # None for a row of zeros (fill).
        self.tables_held = [[None] * n for _ in self.inputs.staging]
        self.context_lens.fill_(1)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=dev)
        # fused_mlp_rows (lo, hi): the compiled layer's o_proj to down as one persistent kernel
        # in decode steps of lo-hi rows (kernels/decode_mlp.py; runner.FUSED_MLP_ROWS by default).
        if fn is None:
            fn = compiled_forward(fused_mlp_rows=fused_mlp_rows, device=dev) \
                if compile_forward else forward
        self.fn = fn
        # Buckets of at most MAX_ROWS rows: every layer in one persistent kernel (decode_layer.py).
        self.small_fn, self.small_rows = self.fn, 0
        if persistent_decode:
            if self.lora:  # the kernel adds no deltas: a LoRA engine's base graphs take it
                raise ValueError("persistent_decode computes no LoRA deltas")
            from ..kernels.decode_layer import MAX_ROWS, with_persistent_layers

            self.small_fn = with_persistent_layers(self.fn, params, cache)
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
        self.pool = self.stream = None  # the graphs' memory pool and capture stream (capture)

    def batch_view(self, bs: int) -> Batch:
        return Batch(input_ids=self.input_ids[:bs], positions=self.positions[:bs],
                     slot_mapping=self.slot_mapping[:bs], cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
                     context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                     logits_indices=self.logits_indices[:bs], block_size=self.cache.block_size,
                     lora_slots=None if self.lora_slots is None else self.lora_slots[:bs])

    def capture(self, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        """Warm up (compiling) and capture every bucket, largest first so that the shared pool is
        sized by it. The buffers hold padding rows throughout, so nothing is written to the cache.
        pool, stream: another DecodeGraphs' (its .pool, .stream) to capture into, whose graphs
        then replay one at a time with these (see unowned): a draft model's decode graphs share
        the target's (ModelRunner._compile_and_capture). The stream must be the pool's: the
        caching allocator hands a freed block only to the stream it was used on
        (PrefillGraph.capture)."""
        start = time.perf_counter()
        stream = stream or torch.cuda.Stream(self.device)  # one for all buckets
        self.stream = stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            for bs in reversed(self.buckets):
                graph, logits = warm_up_and_capture(lambda: self._decode(bs), stream, pool)
                pool = graph.pool()
                self.graphs[bs], self.outputs[bs] = graph, unowned(logits)
                del logits  # back to the pool for the next bucket's capture (unowned)
                if len(self.graphs) == 1:
                    first = time.perf_counter() - start
        self.pool = pool
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        log.info("minivllm: captured decode CUDA graphs for batch sizes %s in %.1f s (the first, "
                 "compile included, %.1f s)", self.buckets, time.perf_counter() - start, first)

    def recapture(self, pool=None, stream: torch.cuda.Stream | None = None) -> None:
        """Capture every bucket again, after release(), where the weights and the cache now live
        (runtime/sleep.py: they came back at new addresses): the persistent layers' table of
        those addresses is built anew; the compiled forward is the one compiled before. pool,
        stream: as for capture."""
        if self.small_rows:
            from ..kernels.decode_layer import with_persistent_layers

            self.small_fn = with_persistent_layers(self.fn, self.params, self.cache)
        self.capture(pool, stream)

    def _decode(self, bs: int) -> torch.Tensor:
        """What bucket bs's graph runs: the forward (and, when the bucket picks greedy tokens,
        the pick into greedy_tokens). Returns the logits [bs, vocab]."""
        from ..kernels.decode_head import picking_head
        from ..kernels.sample_kernel import argmax_of_tiles, greedy_argmax

        fn = self.small_fn if bs <= self.small_rows else self.fn
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

    def fill(self, chunks: DecodeChunks, *, keep_ids: bool = False,
             lora_slots: Sequence[int] | None = None) -> int:
        """Copy one decode step (B rows) into the static buffers, padding to the bucket. Returns
        the bucket size. Host work is numpy only (no tensor ops but the one copy); each row's
        slot and context length follow from its position and table. keep_ids: leave the
        device's input ids as they are (the last replay's greedy pick put them there) and copy
        the other fields only. lora_slots: each row's LoRA slot (-1: the base model), None: every
        row the base model's (graphs captured with LoRA only)."""
        b = len(chunks)
        bs = self.bucket(b)
        m = self.block_tables.shape[1]
        host = self.inputs.next_host()
        ids, pos, slot_rows, ctx, tables = (host[k] for k in STEP_FIELDS)
        if self.lora:
            host["lora_slots"][:b] = -1 if lora_slots is None else lora_slots
            host["lora_slots"][b:bs] = -1
        elif lora_slots is not None:
            raise ValueError("a step with LoRA slots, but the graphs were captured without LoRA")
        ids[:b], pos[:b] = chunks.input_ids, chunks.positions
        ids[b:bs] = pos[b:bs] = 0
        slot_rows[b:bs] = -1
        ctx[b:bs] = 1
        # A row at a time, and only where this staging holds another table than the row's or a
        # shorter one: a table only grows in place (StepInput), so most rows of a steady batch
        # are there already (one numpy assignment a row beat the vectorised scatter, seven
        # numpy calls, at every batch size measured: 168 against 350 us at 128 rows of 40-167
        # blocks on this repository's CPU; skipping a row costs a fifth of writing it).
        held = self.tables_held[self.inputs.turn]
        for row, table in enumerate(chunks.block_tables):
            was = held[row]
            if was is not None and was[0] is table and was[1] == len(table):
                continue
            tables[row, :len(table)] = table
            if was is not None and was[1] > len(table):
                tables[row, len(table):was[1]] = 0
            held[row] = (table, len(table))
        for row in range(b, bs):  # padding rows: zeros
            if held[row] is not None:
                tables[row, :held[row][1]] = 0
                held[row] = None
        # Each row's slot and context length (make_batch's), in Python for a few rows: numpy's
        # eight calls cost ~15 us on this repository's CPU, as much as Python's loop at ~40 rows.
        block_size = self.cache.block_size
        if b <= PYTHON_SLOTS_MAX_ROWS:
            slot_rows[:b] = [slot_of(table, p, block_size)
                             for table, p in zip(chunks.block_tables, chunks.positions)]
            ctx[:b] = [p + 1 for p in chunks.positions]
        else:
            positions = pos[:b]
            blocks = tables[np.arange(b), positions // block_size].astype(np.int64)
            slot_rows[:b] = blocks * block_size + positions % block_size
            ctx[:b] = positions + 1
        # Rows past bs are stale but no graph of bucket bs reads them.
        offsets = self.inputs.offsets
        start = offsets["positions"] if keep_ids else 0
        self.inputs.send(start, offsets["block_tables"] + tables.itemsize * bs * m)
        return bs

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
