"""Prefill and mixed steps replayed from CUDA graphs (on by default where the runner can use them;
MINIVLLM_PREFILL_GRAPH=0: off). On the H200 (session 28) the throughput run's 18 steps with
prompt tokens took 0.336 s so against 0.36-0.54 s launched region by region, and time to first
token fell to 3-4 ms from 14-21.

A step with prompt tokens runs the compiled forward region by region (the stem, 28 layers, the
head: ~320 kernels at the 0.6B shape), and the host's Python between those launches became the
longer side once norm_rope_store shortened the GPU's part: in the throughput run the steps with
prompt tokens never waited for the device (0.03-0.08 ms a step against 4-7 ms before that
kernel; BENCHMARKS.md session 27), so each took what the host took to launch it, 15-30 ms. A
graph launches them all at the cost of one copy and one replay.

A graph is captured for one shape: T tokens and S sequences (max_num_seqs). The runner keeps one
for T = max_num_batched_tokens (which the scheduler fills in every step while prompts wait) and
for each halving of it down to 512 tokens (prefill_graph_sizes), so that a lone prompt (time to
first token) takes one too; the graphs share one memory pool, logits included. A smaller step
is padded:
  - sequences past the real ones bring no tokens (their cu_seqlens entries repeat the last, and
    the prefill kernel's programs for them exit at once); context length 0, block table 0;
  - tokens past the real ones belong to no sequence: slot -1 (nothing is written to the cache),
    id 0, position 0. Attention leaves their rows unwritten, and every other op of the layer is
    row by row, so what they hold reaches no real row; their logits are not asked for.
  - logits rows past the real ones read row 0 and are dropped.
Padding tokens cost GPU time like real ones, so only steps of at least half of T take the graph.

Speculative decoding's verification steps (runtime/spec_decode.py: each drafting sequence's last
token and its k drafts as one chunk, with logits at all k + 1 rows) take graphs of the same kind
at other shapes (verify_graph_shapes): S sequences (1, 2, 4, ... up to max_num_seqs) of k + 1
tokens each, within max_num_batched_tokens, with a logits row for every token, the smallest that
fits. Through the compiled
forward region by region such a step cost the host 15-20 ms at the 0.6B shape against ~0.7 ms on
the device (BENCHMARKS.md, session 58). A draft model's mirror of the step (ModelRunner._mirror)
replays a graph of the draft's forward captured over the same input buffers.

A LoRA engine keeps a second set of these graphs, captured through the LoRA decoder layer with
one more static input, each token's LoRA slot (-1 for base rows and padding: a delta of exact
zeros), for its steps with adapter rows; steps without them take the base model's graphs.
"""

from __future__ import annotations

import logging
import time
from typing import Sequence

import numpy as np
import torch

from ..state.batch import Batch, SeqChunk, batch_arrays
from .graphs import unowned, warm_up_and_capture
from .step_inputs import StepInputs, batch_layout

log = logging.getLogger("minivllm")

SMALLEST_GRAPH = 512  # tokens: below it a step's launches are few enough not to matter


def prefill_graph_sizes(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """The token counts of the prefill graphs, largest first: max_num_batched_tokens and each
    halving of it down to SMALLEST_GRAPH, each above max_num_seqs (Batch.is_decode reads T == B
    off the shapes: a padded step must not look like a decode step)."""
    sizes, t = [], max_num_batched_tokens
    while t > max_num_seqs and (not sizes or t >= SMALLEST_GRAPH):
        sizes.append(t)
        t //= 2
    return sizes


def verify_graph_shapes(num_speculative_tokens: int, max_num_seqs: int,
                        max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """The (tokens, sequences) of the verification graphs, smallest first: 1, 2, 4, ... sequences
    (and max_num_seqs) of num_speculative_tokens + 1 tokens each, up to max_num_batched_tokens
    (no step is larger). All of them, unlike vLLM's 512-token default bound on its graphs: a
    step without one costs the host 15-20 ms at any size (BENCHMARKS.md, session 58), more than
    the device's time for 256 sequences (~7 ms at the 0.6B shape, estimated from a decode step's
    attention and the GEMMs' rate; unmeasured); the largest's logits ([1280, vocab] at 256 sequences
    and k = 4: 0.36 GiB at Qwen3's vocabulary in bf16) are in the KV budget's measured peak."""
    per_seq = num_speculative_tokens + 1
    seqs = [b for b in (1 << i for i in range(max_num_seqs.bit_length())) if b < max_num_seqs]
    seqs.append(max_num_seqs)
    return [(b * per_seq, b) for b in seqs if b * per_seq <= max_num_batched_tokens]


def logits_rows(chunks: Sequence[SeqChunk]) -> int:
    """How many logits rows a step asks for (batch_arrays' logits_indices)."""
    return sum(c.num_logits for c in chunks if c.want_logits)


class PrefillGraph:
    """Static input buffers (runtime/step_inputs.py) and the graph of one padded step.
    fits(chunks) says whether a step can take it, fill(chunks) copies the step in, replay(n) runs
    it and returns its first n logits rows (a view of the graph's output: read it before the next
    replay).

    num_logits: logits rows (max_num_seqs if None); min_tokens: the fewest tokens a step must
    bring to take the graph (half of num_tokens if None). inputs: another graph's StepInputs, whose
    fill this graph's replay then reads (a draft model's mirror of a verification graph); such a
    graph is never filled itself. adapters: the graph takes each token's LoRA slot (params must
    hold LoRA slot weights)."""

    def __init__(self, params, cache, backend, forward_fn, *, num_tokens: int, max_num_seqs: int,
                 max_blocks_per_seq: int, block_size: int, num_logits: int | None = None,
                 min_tokens: int | None = None, inputs: StepInputs | None = None,
                 adapters: bool = False):
        if num_tokens <= max_num_seqs:
            # Batch.is_decode reads T == B off the shapes: a padded step must not look like one.
            raise ValueError(f"a prefill graph needs more tokens than sequences, got "
                             f"{num_tokens} tokens for {max_num_seqs} sequences")
        if adapters and (params.lora is None or inputs is not None):
            raise ValueError("a prefill graph with adapters needs params with LoRA slot weights "
                             "(params.lora) and inputs of its own")
        self.params, self.cache, self.backend, self.fn = params, cache, backend, forward_fn
        self.adapters = adapters
        self.num_tokens, self.num_seqs = num_tokens, max_num_seqs
        self.num_logits = max_num_seqs if num_logits is None else num_logits
        self.min_tokens = num_tokens // 2 if min_tokens is None else min_tokens
        self.max_blocks, self.block_size = max_blocks_per_seq, block_size
        self.device = params.device
        self.inputs = inputs if inputs is not None else StepInputs(
            batch_layout(num_tokens, max_num_seqs, max_blocks_per_seq, num_logits=num_logits,
                         lora=adapters), self.device)
        self.batch = Batch(**self.inputs.views, block_size=block_size)
        self.graph = None
        self.logits = None

    def fits(self, chunks: Sequence[SeqChunk]) -> bool:
        """Whether the step fits the graph's shape: sequences, tokens, block tables and logits
        rows (a speculative step's chunks have several: runtime/spec_decode.py)."""
        tokens = sum(len(c.token_ids) for c in chunks)
        return (0 < len(chunks) <= self.num_seqs and self.min_tokens <= tokens <= self.num_tokens
                and all(len(c.block_table) <= self.max_blocks for c in chunks)
                and logits_rows(chunks) <= self.num_logits)

    def fill(self, chunks: Sequence[SeqChunk], lora_slots: Sequence[int] | None = None) -> int:
        """Copy one step into the static buffers, padded (see the module's docstring). Returns
        how many logits rows are real. No chunks: padding only (what capture runs). lora_slots:
        each chunk's LoRA slot (-1: the base model), for a graph with adapters (None: all -1)."""
        if lora_slots is not None and not self.adapters:
            raise ValueError("a step with LoRA slots, but the prefill graph was captured without "
                             "adapters")
        if lora_slots is not None and len(lora_slots) != len(chunks):
            raise ValueError(f"{len(lora_slots)} LoRA slots for {len(chunks)} chunks")
        if chunks and not self.fits(chunks):
            raise ValueError(f"a step of {len(chunks)} sequences, "
                             f"{sum(len(c.token_ids) for c in chunks)} tokens and "
                             f"{logits_rows(chunks)} logits rows does not fit the prefill graph "
                             f"({self.num_seqs} sequences, {self.min_tokens}-{self.num_tokens} "
                             f"tokens, {self.num_logits} logits rows)")
        host = self.inputs.next_host()
        if chunks:
            real = batch_arrays(chunks, block_size=self.block_size, max_blocks=self.max_blocks)
        else:
            real = dict(input_ids=[], positions=[], slot_mapping=[], cu_seqlens_q=[0],
                        context_lens=[], block_tables=np.zeros((0, self.max_blocks), np.int32),
                        logits_indices=[])
        t, b, n = len(real["input_ids"]), len(real["context_lens"]), len(real["logits_indices"])
        for name in ("input_ids", "positions", "slot_mapping"):
            host[name][:t] = real[name]
        host["input_ids"][t:] = host["positions"][t:] = 0
        host["slot_mapping"][t:] = -1
        host["cu_seqlens_q"][: b + 1] = real["cu_seqlens_q"]
        host["cu_seqlens_q"][b + 1:] = t
        host["context_lens"][:b] = real["context_lens"]
        host["context_lens"][b:] = 0
        # batch_arrays marks unused table entries -1; the kernels read only entries that hold
        # context, but 0 (a block that exists) keeps any stray read in bounds.
        host["block_tables"][:b] = np.maximum(real["block_tables"], 0)
        host["block_tables"][b:] = 0
        host["logits_indices"][:n] = real["logits_indices"]
        host["logits_indices"][n:] = 0
        if self.adapters:
            host["lora_slots"][t:] = -1
            host["lora_slots"][:t] = -1 if lora_slots is None else np.repeat(
                np.asarray(lora_slots, dtype=np.int64), [len(c.token_ids) for c in chunks])
        self.inputs.send()
        return n

    def capture(self, pool=None, stream: torch.cuda.Stream | None = None):
        """Warm up (compiling what the shape needs) and capture, with the buffers holding
        padding only, so that nothing is written to the cache. pool: a graph memory pool to share
        (the graphs replay one at a time); returns this graph's. stream: the side stream to
        capture on, the same for every graph of the pool: the caching allocator hands a freed
        block only to the stream it was used on, so on a stream of its own a capture finds none
        of the pool's free memory (each prefill graph had its own until session 29)."""
        start = time.perf_counter()
        self.fill([])
        stream = stream or torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.no_grad():
            graph, (logits, _) = warm_up_and_capture(
                lambda: self.fn(self.params, self.cache, self.batch, self.backend), stream, pool)
        # The logits go back to the pool for the next capture (graphs.unowned): five graphs'
        # [max_num_seqs, vocab] fp32 logits held side by side were 0.72 GiB at the 0.6B shape.
        self.logits = None if logits is None else unowned(logits)  # None: a headless mirror
        del logits
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph = graph
        log.info("minivllm: captured the prefill CUDA graph of %d tokens, %d sequences, %d logits "
                 "rows%s in %.1f s", self.num_tokens, self.num_seqs, self.num_logits,
                 "" if self.logits is not None else " (no head)", time.perf_counter() - start)
        return graph.pool()

    def replay(self, n: int) -> torch.Tensor | None:
        self.graph.replay()
        return None if self.logits is None else self.logits[:n]

    def release(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.graph = self.logits = None
