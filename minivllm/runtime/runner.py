"""The model runner: owns the weights and the KV cache on one device, and turns a scheduled step
into a Batch, runs the forward, and samples.

Its input (`StepInput`) and output (`StepResult`) are plain, picklable data with no reference to
the engine's sequences, so that a tensor-parallel executor can broadcast a StepInput to one
runner per rank (each loading its own shard) and take rank 0's StepResult: that is the seam
issue 6 plugs into. CUDA graphs and torch.compile for decode (issue 5) belong in `execute`;
`enforce_eager` is kept here for them.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import operator
import os
import time
from dataclasses import dataclass

import attrs
import numpy as np
import torch
from torch.profiler import record_function

from ..functional.model import final_hidden, forward, logits_head, prompt_logprobs
from ..functional.model import stem as model_stem
from ..functional.sampling import (MAX_TOP_K_BOUND, SampleOutput, SamplingBatch, SamplingRow,
                                  make_sampling_batch, needs_vocab_rows, plain_greedy, sample,
                                  with_pending_ids, with_steps)
from ..kernels import select_backend
from ..state.batch import (DecodeChunks, SeqChunk, host_to_device, is_decode_step,
                           is_verification_step, make_batch)
from ..state.cache import init_cache
from ..state.config import ceil_div
from ..state.load import copy_hf_weights_, load
from ..state.params import Params, has_quantized, random_params
from ..state.shard import ShardSpec
from .config import EngineConfig, is_random_model, random_quantization
from .compiled import compiled_forward
from .graphs import DecodeGraphs
from .guide import pack_ids
from .memory import (CAPTURE_CODE_BYTES, CUDA_SEGMENT_GRANULE, GiB, bytes_outside_allocator,
                     cpu_kv_budget_bytes, device_bytes_in_use, kv_block_bytes,
                     kv_blocks_within, kv_blocks_within_caches, kv_budget_bytes,
                     memory_owners, profile_lengths, startup_memory_report)
from .prefill_graph import PrefillGraph, prefill_graph_sizes, verify_graph_shapes
from .sleep import Offloaded, check_level, free, owned, restore, stage
from .warmup import warm_up_kernels

log = logging.getLogger("minivllm")


def trace_range(name: str):
    """A named range in a torch.profiler trace (minivllm bench --trace), or, when no profiler
    runs, a no-op: record_function costs ~5 us even then, and a step opens about ten."""
    if torch.autograd._profiler_enabled():
        return record_function(name)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class StepInput:
    """One forward step: the sequences' chunks (in batch order) and, for each chunk that wants
    logits (in the same order), its sampling row.

    fed_back: (i, r) pairs for tokens that the previous step is still sampling (asynchronous
    scheduling): input token i of this step (its index in the chunks' concatenated token_ids,
    where it stands as a placeholder) is row r of the previous step's sampled tokens, taken from
    the device.

    drafts, drafted: a draft model's tokens still on the device (ModelRunner.propose's [n, k]
    ids), and (i, j) pairs: input token i of this step (a placeholder) is element j of
    drafts.view(-1). The step is built and launched while the draft's rounds run; the drafts
    reach the host with the step's sampled tokens (StepResult.drafts).

    pending_ids: (row, column, r) triples for penalised rows whose sequence's last token the
    previous step is still sampling: the row's output ids (its known ones) take row r of that
    step's sampled tokens at `column` (their count), on the device.

    steps: each row's step (tokens its sequence has generated), in place of the rows' own when
    given: the engine reuses a sequence's row from step to step and sends only this column.

    scored: prompt tokens to score (prompt_logprobs), or None: see PromptScores.

    pooled: rows of the step (indices in the chunks' concatenated tokens) whose final-normed
    hidden states to return (embeddings: runtime/pooling.py), in order; their chunks want no
    logits.

    A runner is done with a StepInput when launch() / execute() return (the tensor-parallel
    executor pickles it before): the engine passes the sequences' live block tables, which
    it changes only after that, and only by appending (a sequence whose blocks are freed gets
    a new list). The decode graphs rely on it: a row whose table is the same list at the same
    length as when they last copied it is not copied again (DecodeGraphs.fill)."""

    chunks: list[SeqChunk]
    rows: list[SamplingRow]
    fed_back: tuple[tuple[int, int], ...] = ()
    steps: tuple[int, ...] | None = None
    scored: "PromptScores | None" = None
    pooled: tuple[int, ...] = ()
    # Each chunk's LoRA slot (-1: the base model), or None: no chunk uses an adapter.
    lora_slots: tuple[int, ...] | None = None
    # Prompt embeddings (vLLM's prompt_embeds): (row, embeds [n, hidden]) pairs, rows row ...
    # row + n - 1 of the step (indices in the chunks' concatenated tokens) taking those input
    # embeddings in place of their ids' (host tensors in the model's dtype). Such a step runs
    # through _run, never a CUDA graph (whose static buffers hold ids only).
    embeds: tuple[tuple[int, torch.Tensor], ...] = ()
    drafts: torch.Tensor | None = None
    drafted: tuple[tuple[int, int], ...] = ()
    pending_ids: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, eq=False)
class SetLoRA:
    """What the tensor-parallel executor sends its workers, between StepInputs, for each LoRA
    slot the engine (re)writes: every rank writes its own slice of `adapter` (a
    state.lora.LoRAAdapter, read and checked once, by rank 0; None: a zero delta) into slot
    `slot`, in the order of the steps around it, as rank 0 does."""

    slot: int
    adapter: object


@dataclass(frozen=True, eq=False)
class LoadWeights:
    """What the tensor-parallel executor sends its workers for LLM.load_weights, between
    StepInputs: the checked (Hugging Face name, whole tensor on the host) pairs
    (state.load.check_hf_weights, run once, by rank 0), of which every rank copies its own
    slice into its params, as rank 0 does."""

    weights: list


@dataclass(frozen=True)
class Sleep:
    """What the tensor-parallel executor sends its workers for LLM.sleep: every rank frees its
    own shard's memory (ModelRunner.sleep), as rank 0 does."""

    level: int


@dataclass(frozen=True)
class WakeUp:
    """What the tensor-parallel executor sends its workers for LLM.wake_up: every rank takes
    back the memory of `tags` (ModelRunner.wake_up) and, once all are awake, captures its graphs
    again, as rank 0 does (the captures run collectives: every rank must)."""

    tags: tuple[str, ...]


@dataclass(frozen=True)
class PromptScores:
    """Known next tokens to score in a step (vLLM's prompt_logprobs): input row rows[i] of the
    step (its index in the chunks' concatenated tokens) is followed by token targets[i]; each
    gets its logprob and rank, and the top `n` of its row."""

    rows: tuple[int, ...]
    targets: tuple[int, ...]
    n: int


@functools.lru_cache(maxsize=8)
def same_rows(n: int) -> tuple[tuple[int, int], ...]:
    """fed_back when each of n rows takes its own row's token (a steady decode batch): compared
    as one tuple, in C."""
    return tuple((i, i) for i in range(n))


@dataclass(frozen=True)
class TokenLogprobs:
    """The sampled token's logprob and rank, and the top-N (ids, logprobs), for one row."""

    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(frozen=True)
class StepResult:
    token_ids: list[int]  # one per sampling row
    logprobs: list[TokenLogprobs] | None = None  # per row, when any row asked for logprobs
    scores: list[TokenLogprobs] | None = None  # per PromptScores row, when the step had any
    pooled: torch.Tensor | None = None  # [len(StepInput.pooled), hidden] fp32 on the host
    drafts: list[list[int]] | None = None  # StepInput.drafts' rows, when the step had them


def _logprob_rows(lps, ranks, top_ids, top_lps, counts) -> list[TokenLogprobs]:
    """TokenLogprobs of each row from host lists, the top cut to the row's count."""
    return [TokenLogprobs(lp, rank, ids[:n], tops[:n])
            for lp, rank, ids, tops, n in zip(lps, ranks, top_ids, top_lps, counts)]


class PendingStep:
    """A launched step: its sampled tokens (and logprobs) are on their way to the host, in pinned
    memory, behind an event; result() waits for them. On CPU they are copied at once."""

    def __init__(self, rows: list[SamplingRow], out: SampleOutput | None, device: torch.device,
                 scores: tuple | None = None, scored: PromptScores | None = None,
                 pooled: torch.Tensor | None = None, drafts: torch.Tensor | None = None):
        self.rows = rows
        self.scored = scored
        self.pooled = pooled is not None
        self.drafts = drafts is not None
        self.event = None
        self.host = None
        if out is None and scores is None and pooled is None:
            return
        self.num_sampled = 0 if out is None else 1 if out.logprobs is None else 5
        tensors = [] if out is None else [out.token_ids]
        if out is not None and out.logprobs is not None:
            tensors += [out.logprobs, out.ranks, out.top_ids, out.top_logprobs]
        tensors += list(scores or ())
        if drafts is not None:  # next to last
            tensors.append(drafts)
        if pooled is not None:  # last
            tensors.append(pooled)
        if device.type == "cuda":
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for h, t in zip(self.host, tensors):
                h.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            # Copies: the tokens may be a view of a graph's static buffer, which the next step
            # rewrites before this one is read.
            self.host = [t.clone() for t in tensors]

    def result(self) -> StepResult:
        if self.host is None:
            return StepResult(token_ids=[])
        with trace_range("read_tokens"):
            if self.event is not None:
                self.event.synchronize()
            token_ids = self.host[0].tolist() if self.num_sampled else []
        host, pooled = (self.host[:-1], self.host[-1]) if self.pooled else (self.host, None)
        host, drafts = (host[:-1], host[-1].tolist()) if self.drafts else (host, None)
        scores = None
        if self.scored is not None:
            columns = (t.tolist() for t in host[self.num_sampled:])
            scores = _logprob_rows(*columns, [self.scored.n] * len(self.scored.rows))
        if self.num_sampled <= 1:
            return StepResult(token_ids=token_ids, scores=scores, pooled=pooled, drafts=drafts)
        columns = (t.tolist() for t in host[1:self.num_sampled])
        logprobs = _logprob_rows(*columns, [row.logprobs or 0 for row in self.rows])
        return StepResult(token_ids=token_ids, logprobs=logprobs, scores=scores, pooled=pooled,
                          drafts=drafts)


def sample_in_slices(logits: torch.Tensor, batches: list[SamplingBatch] | None, size: int
                     ) -> SampleOutput:
    """sample() over logits' rows [B, vocab], `size` rows at a time, batches[i] the i-th slice's
    (of one num_logprobs: their top-N columns are joined). A row's draw reads its own row only
    (its seed and step), so this is sample() over all the rows at once, at the memory of `size`
    rows. batches None: every row is plain greedy (plain_greedy), whose token sample() takes as
    the arg-max of the logits as they are: that, with no sampling batch built."""
    if batches is None:
        return SampleOutput(token_ids=logits.argmax(dim=-1))
    if len(batches) == 1:
        return sample(logits, batches[0])
    outs = [sample(logits[i * size:(i + 1) * size], sb) for i, sb in enumerate(batches)]
    return SampleOutput(*(None if parts[0] is None else torch.cat(parts)
                          for parts in zip(*(attrs.astuple(o, recurse=False) for o in outs))))


def _no_head(params, x, residual, rows):
    """forward's head for a draft model's mirrored step (ModelRunner._mirror): no logits."""
    return None


def decode_columns(chunks) -> DecodeChunks:
    """A decode step's chunks as DecodeChunks (what DecodeGraphs.fill takes), as they are if so
    already."""
    return chunks if isinstance(chunks, DecodeChunks) else DecodeChunks.of(chunks)


def replay_draft_round(graphs: DecodeGraphs, chunks: DecodeChunks,
                       ids: torch.Tensor) -> torch.Tensor:
    """One round of ModelRunner.propose replayed from the draft's decode graphs: the greedy next
    token [rows] of each of chunks' rows, whose input ids are `ids` [rows] on the device (copied
    device to device, with no host sync; chunks' own ids are not read). The padding rows up to
    the bucket keep the ids they held (tokens written before, or the buffer's zeros): valid ids,
    whose logits are dropped. A bucket that picks the greedy tokens in its graph (the persistent
    decode's) gives them (a view of graphs.greedy_tokens, valid until the next replay)."""
    rows = len(chunks)
    graphs.fill(chunks, keep_ids=True)
    graphs.input_ids[:rows].copy_(ids)
    logits = graphs.replay(rows)
    if graphs.picks_greedy(rows):
        return graphs.greedy_tokens[:rows]
    return logits.argmax(dim=-1)


@contextlib.contextmanager
def _logged_time(what: str):
    """Log how long a start-up phase took (start-up time is part of what users wait for)."""
    start = time.perf_counter()
    yield
    log.info("minivllm: %s took %.1f s", what, time.perf_counter() - start)


# Decode graphs of these rows run each layer's o_proj to down as one persistent kernel
# (kernels/decode_mlp.py) unless MINIVLLM_FUSED_MLP says otherwise: on the H200 at the 0.6B shape
# it took 21.3 against 26.3 us a layer at 128 rows and 18.3 against 25.5 at 64, lost at 256 (30.3
# against 29.2), and the throughput run went 26,123 / 26,083 against 25,790 / 25,662 tok/s
# without it (BENCHMARKS.md session 34). 1-2 rows are the persistent decode's buckets. Only where
# measured (fused_mlp_measured); elsewhere the flag asks for it.
FUSED_MLP_ROWS = (3, 128)
FUSED_MLP_MAX_HIDDEN = 1024


def fused_mlp_measured(hidden_size: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether FUSED_MLP_ROWS is the default: the shape, dtype and GPU it was measured at
    (bf16, hidden size up to FUSED_MLP_MAX_HIDDEN, a Hopper GPU: its tiles' pipelines take up
    to 192 KB of shared memory, more than an A100's SM has)."""
    from ..kernels.launch import cuda_capability

    return hidden_size <= FUSED_MLP_MAX_HIDDEN and dtype == torch.bfloat16 and \
        cuda_capability(device)[0] == 9


def captures_decode_graphs(device: torch.device, enforce_eager: bool, runner: str) -> bool:
    """Whether a runner captures decode CUDA graphs (and may capture prefill graphs, and sets
    aside their pool in the KV budget): on a CUDA device, not under enforce_eager, for a
    generating engine. A pooling engine (runner "pooling") never decodes: every request of it
    ends with its prompt (its pooled step goes through the forward, never a graph), so the
    capture would cost start-up time and hold memory the KV cache could have."""
    return device.type == "cuda" and not enforce_eager and runner != "pooling"


def fused_mlp_rows(flag: str | None, measured: bool = True) -> tuple[int, int] | None:
    """MINIVLLM_FUSED_MLP's value as (LO, HI) rows of the decode graphs that run each layer's
    o_proj to down as one kernel (kernels/decode_mlp.py): "LO-HI"; "0", "off" or empty: none;
    unset (None): FUSED_MLP_ROWS where `measured` (fused_mlp_measured), else none."""
    if flag is None:
        return FUSED_MLP_ROWS if measured else None
    if flag.strip().lower() in ("", "0", "off"):
        return None
    from ..kernels.decode_mlp import MAX_ROWS, MIN_ROWS

    lo, sep, hi = flag.partition("-")
    if not (sep and lo.strip().isdigit() and hi.strip().isdigit()) or \
            not MIN_ROWS <= int(lo) <= int(hi) <= MAX_ROWS:
        raise ValueError(f"MINIVLLM_FUSED_MLP must be LO-HI rows within {MIN_ROWS}-{MAX_ROWS} "
                         f"(e.g. 3-128) or 0 / off, got {flag!r}")
    return int(lo), int(hi)


def heaviest_row(max_logprobs: int, vocab_size: int) -> SamplingRow:
    """The heaviest sampling row serving can ask for, every stage on: the penalties (the
    logits' fp32 copy; their ids sorted and counted), banned ids, allowed ids (a [rows, vocab]
    mask), a structured output's packed mask (unpacked to [rows, vocab]), a logit bias, the
    sort of the vocabulary for top-k / top-p (a top-k past MAX_TOP_K_BOUND, or none where the
    vocabulary has no such: a smaller one truncates on candidates, which take less), min-p and
    the most logprobs. The KV budget sets aside what max_num_seqs of them take."""
    top_k = MAX_TOP_K_BOUND + 1 if vocab_size > MAX_TOP_K_BOUND + 1 else 0
    return SamplingRow(temperature=1.0, top_p=0.9, top_k=top_k, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.5, repetition_penalty=1.1, output_ids=(0,),
                       prompt_ids=(0,), banned_ids=(0,), logit_bias=((0, 1.0),),
                       allowed_ids=(0, 1), allowed_bits=pack_ids(np.arange(2), vocab_size),
                       logprobs=max_logprobs)


class ModelRunner:
    def __init__(self, config: EngineConfig, *, shard: ShardSpec | None = None,
                 params: Params | None = None):
        self.config = config
        self.block_size = config.block_size
        with _logged_time("weights"):
            if params is None and is_random_model(config.model):
                params = random_params(config.model_config, seed=config.seed, dtype=config.dtype,
                                       device=config.device, shard=shard,
                                       quantization=random_quantization(config.model))
            self.params = params if params is not None else load(
                config.model, dtype=config.dtype, device=config.device, shard=shard,
                config=config.model_config)
        if config.enable_lora:
            # The adapters' slot weights, zeros (no adapter) until the engine writes a slot
            # (set_lora); allocated before the KV cache is sized from what is left.
            from ..state.lora import init_lora

            self.params = attrs.evolve(self.params, lora=init_lora(
                self.params.config, max_loras=config.max_loras,
                max_rank=config.max_lora_rank, dtype=self.params.dtype,
                device=self.params.device, shard=self.params.shard))
        if config.enable_sleep_mode:
            self.params = owned(self.params)  # memory-mapped weights cannot be freed
        self.asleep: dict = {}  # tag -> sleep.Offloaded, while it sleeps (runtime/sleep.py)
        self.model_config = self.params.config
        self.vocab_size = self.model_config.vocab_size
        self.device = self.params.device
        self.backend = select_backend(self.device, config.attention_backend, config.cache_dtype,
                                      self.model_config.head_dim)
        self.enforce_eager = config.enforce_eager
        self.last_sampling = None  # (rows, SamplingBatch) of the last step that sampled
        self.prefill_forward = forward  # see _compile_and_capture
        self.small_decode_forward, self.small_decode_rows = None, 0  # ditto (persistent_decode)
        self.use_prefill_graphs = self._wants_prefill_graphs(config)
        # Draft-model speculative decoding (runtime/spec_decode.py): the draft's weights, in
        # the target's dtype on its device, loaded before the KV cache is sized from what is
        # left; its own cache, of the target's blocks, is indexed by the same tables and slots.
        self.draft_params = self.draft_cache = self.draft_backend = None
        # The draft's forward for mirrored steps (_mirror: no logits), compiled where the
        # target's is (_compile_and_capture).
        self.draft_forward = functools.partial(forward, head=_no_head)
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            with _logged_time("draft model weights"):
                if is_random_model(spec.model):
                    # the engine's seed: a draft of the target's shape has the target's weights
                    self.draft_params = random_params(spec.draft_config, seed=config.seed,
                                                      dtype=config.dtype, device=config.device)
                else:
                    self.draft_params = load(spec.model, dtype=config.dtype,
                                             device=config.device, config=spec.draft_config)
                if config.enable_sleep_mode:  # sleeps with the target's (sleep)
                    self.draft_params = owned(self.draft_params)
            self.draft_backend = select_backend(self.device, config.attention_backend,
                                                config.cache_dtype,
                                                self.draft_params.config.head_dim)
        with _logged_time("KV cache sizing"):
            self.num_blocks = self._num_blocks()
        self.cache = init_cache(self.params, num_blocks=self.num_blocks, block_size=self.block_size,
                                dtype=config.cache_dtype)
        if self.draft_params is not None:
            self.draft_cache = init_cache(self.draft_params, num_blocks=self.num_blocks,
                                          block_size=self.block_size, dtype=config.cache_dtype)
        # Decode graphs: the target's (with LoRA, the base model's), a LoRA engine's for steps
        # with adapter rows, the draft model's.
        self.graphs = self.lora_graphs = self.draft_graphs = None
        self.prefill_graphs = []  # largest first (_capture_prefill_graphs)
        self.lora_prefill_graphs = []  # the same, with LoRA slots: for steps with adapter rows
        self.verify_graphs = []  # speculation's verification steps', smallest first (ditto)
        self.verify_mirrors = {}  # a verification graph -> the draft's over its inputs (ditto)
        self.mirrored = True  # whether the last launched step was mirrored (launch, catch_up)
        self.last_tokens = None  # [rows] the last launched step's sampled ids, on the device
        # The decode graphs whose input ids hold last_tokens already (their greedy pick), or None.
        self.ids_in_graph = None
        marks, outside = [], []  # per phase: device bytes in use; of them, outside the allocator

        def mark(phase: str) -> None:
            marks.append((phase, device_bytes_in_use(self.device)))
            if self.device.type == "cuda":
                outside.append((phase, bytes_outside_allocator(self.device)))

        mark("KV cache")
        try:
            self._compile_and_capture(config)
            mark("decode graphs")
            with _logged_time("kernel warm-up"):
                warm_up_kernels(self.params, self.backend, block_size=self.block_size,
                                cache_dtype=config.cache_dtype,
                                max_num_seqs=config.max_num_seqs, forward_fn=self.prefill_forward)
                if self.draft_params is not None:
                    # Through the mirror's own forward, whose head (_no_head) computes nothing:
                    # the draft's logits come from its decode graphs (propose; eagerly only where
                    # the whole engine is eager), so its LM head needs no warm-up at the row
                    # counts of prompt steps.
                    warm_up_kernels(self.draft_params, self.draft_backend,
                                    block_size=self.block_size, cache_dtype=config.cache_dtype,
                                    max_num_seqs=config.max_num_seqs,
                                    forward_fn=self.draft_forward)
            mark("kernel warm-up")
            if self.device.type == "cuda":
                # The warm-up's freed blocks, kept by the caching allocator, are not the KV
                # budget's to hold (0.34 GiB of the device's peak at utilization 0.3 on the H200,
                # session 29).
                torch.cuda.empty_cache()
                mark("empty_cache")
            self._capture_prefill_graphs(config)
            mark("prefill graphs")
            if self.device.type == "cuda" and config.num_kv_blocks is None:
                # Leave the allocator's cache holding blocks for the largest sampling, which the
                # budget set aside: serving's smaller samplings split them. Emptied, the cache
                # grew block by block as steps sampled more rows, past the budget (0.25 GiB
                # over on the H200 at 256 rows of 151,936, session 30). From an emptied cache,
                # as the budget measured what they reserve.
                torch.cuda.empty_cache()
                self._sampling_blocks()
                torch.cuda.synchronize(self.device)
                mark("sampling blocks")
        except BaseException:
            self.release_graphs()  # as a failed start unwinds: see release_graphs
            raise
        # What start-up built (compiled graphs, their sympy expressions, captured graphs) lives
        # as long as the process; frozen, the cyclic GC no longer rescans it in the pauses it
        # takes mid-serving.
        gc.collect()
        gc.freeze()
        if self.device.type == "cuda":
            message, over = startup_memory_report(marks, torch.cuda.mem_get_info(self.device)[1],
                                                  config.gpu_memory_utilization)
            # A cache of num_kv_blocks given by the user is theirs to fit.
            (log.warning if over and config.num_kv_blocks is None else log.info)(message)
            log.info(memory_owners(self.device))
            log.info("minivllm: GiB outside the allocator after each phase: %s",
                     ", ".join(f"{name} {b / GiB:.3f}" for name, b in outside))

    def set_lora(self, slot: int, adapter) -> None:
        """Write `adapter` (a state.lora.LoRAAdapter, or None: a zero delta) into LoRA slot
        `slot`, in place (this rank's slice of it: state.lora.write_slot), queued in stream order
        after the steps already launched, whose rows the engine never lets use a slot it
        rewrites."""
        from ..state.lora import write_slot

        write_slot(self.params.lora, slot, adapter, self.model_config, self.params.shard)

    def load_weights(self, checked: list) -> None:
        """Copy checked (Hugging Face name, tensor) pairs (state.load.check_hf_weights) into
        this rank's params, in place, queued in stream order after the steps already launched:
        the compiled forward, the CUDA graphs and the persistent decode's layer table read the
        same tensors, so they run the new weights without a recapture. A copy that fails after
        the checks (nothing a check foresaw) is a RuntimeError saying the weights may be mixed."""
        try:
            copy_hf_weights_(self.params, checked)
        except Exception as e:
            raise RuntimeError(f"load_weights failed while copying the checked weights "
                               f"({type(e).__name__}: {e}): the model may now hold some of the "
                               f"new weights and the old rest; load the whole set again") from e

    def sleep(self, level: int) -> None:
        """Free the weights' memory (level 1: copied to the host first; 2: discarded) and the KV
        cache's, keeping every tensor object (runtime/sleep.py), and release the CUDA graphs,
        which read those addresses. A draft model's weights and cache are freed with the
        target's, staged as one pytree with them (_sleep_trees); level 2 with a draft model is
        a ValueError before anything is staged (sleep.check_level).

        All or nothing, as far as it can be: the weights' host copy is made before anything is
        freed (no host memory for it frees nothing), the cache (discarded at either level) is
        freed before the weights, and the graphs are released after both. A failure on the way
        puts back what was freed (_undo_sleep: the weights' bytes from their host copy, the
        cache's as zeros, whose prefix cache the engine forgets) and raises, the runner awake.
        Level 2's discard of the weights, last, is the one step that cannot be undone: a failure
        once it has freed any leaves the runner asleep, as a level-2 sleep does, and raises."""
        check_level(level, draft_model=self.draft_params is not None)
        params, caches = self._sleep_trees()
        weights = stage(params, keep=level == 1)
        cache = stage(caches, keep=False)
        released = False
        try:
            free(cache)
            if level == 1:
                free(weights)
            released = True
            self._drop_captures()
            if level == 2:
                free(weights)
        except BaseException:
            if level == 2 and weights.freed:
                self._fall_asleep(weights, cache)
            else:
                self._undo_sleep(weights, cache, released)
            raise
        self._fall_asleep(weights, cache)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks back to the device, for the trainer

    def _sleep_trees(self) -> tuple[tuple, tuple]:
        """What "weights" and "kv_cache" free: the target's params and a draft model's, the
        target's cache and the draft's (None without a draft: no leaves). One pytree a tag, so
        that one stage, free and restore cover both models: a failure in the draft's part gives
        back the target's too, and a wake_up of a tag brings back both models' memory."""
        return (self.params, self.draft_params), (self.cache, self.draft_cache)

    def _fall_asleep(self, weights: Offloaded, cache: Offloaded) -> None:
        """Record the weights and the cache asleep (for wake_up), the graphs released."""
        self.last_tokens, self.ids_in_graph = None, None
        self.asleep = {"weights": weights, "kv_cache": cache}

    def _undo_sleep(self, weights: Offloaded, cache: Offloaded, released: bool) -> None:
        """After a sleep failed before level 2's discard: give back what it freed (restore:
        only the storages it emptied) and, where any came back (at a new address) or the graphs
        were being released, capture the graphs again, as wake_up does (they are released for
        good if that fails: eager steps read no baked address). Memory that cannot be taken
        back leaves the runner asleep, for a wake_up to try again."""
        moved = weights.freed or cache.freed
        try:
            restore(weights)
            restore(cache)
        except BaseException:
            self._fall_asleep(weights, cache)
            raise
        if not (moved or released):
            return  # nothing freed, nothing released: the graphs stand
        self._drop_captures()
        self.last_tokens, self.ids_in_graph = None, None
        try:
            self._capture_again()
        except BaseException:
            self.release_graphs()
            raise

    def wake_up(self, tags: tuple[str, ...]) -> None:
        """Take back the memory of `tags` ("weights": their bytes from the host, or zeros after
        level 2; "kv_cache": zeros), a draft model's with the target's. Once nothing sleeps,
        capture what baked the old addresses again (the graphs, the draft's among them, the
        persistent decode's layer tables), with no compile. A tag is
        forgotten only once restored: a restore that fails (the device's memory still taken, say)
        keeps it, and its host copy, for a wake_up to try again, which skips the tags restored."""
        for tag in tags:
            off = self.asleep.get(tag)
            if off is not None:  # None: restored by a wake_up that failed at another tag
                restore(off)
                del self.asleep[tag]
        if not self.asleep:
            self._capture_again()

    def _drop_captures(self) -> None:
        """Release the CUDA graphs' captures (and their pool), keeping their objects, compiled
        functions and static buffers for _capture_again."""
        for graphs in self._decode_graph_sets():
            graphs.release()
        for graph in self._captured_steps():
            graph.release()

    def _decode_graph_sets(self) -> list[DecodeGraphs]:
        """The decode graphs, in the order they are captured into one pool (the first sizes it):
        a LoRA engine's graphs with adapters (the larger step), the target's, the draft's."""
        return [g for g in (self.lora_graphs, self.graphs, self.draft_graphs) if g is not None]

    def _capture_decode_graphs(self, again: bool = False) -> None:
        """Capture (again: recapture, after sleep) every set of decode graphs, all into the first
        one's pool on its stream: their replays take turns on that stream (graphs.unowned), so
        the pool holds the largest of their steps' peaks, not their sum."""
        pool = stream = None
        for graphs in self._decode_graph_sets():
            (graphs.recapture if again else graphs.capture)(pool, stream)
            pool, stream = graphs.pool, graphs.stream

    def _captured_steps(self) -> list[PrefillGraph]:
        """The prefill graphs (a LoRA engine's with slots first: the larger steps), then the
        verification graphs, each followed by its draft mirror, in the order they are captured
        into one pool (largest first: the first sizes it)."""
        steps = self.lora_prefill_graphs + self.prefill_graphs
        for graph in reversed(self.verify_graphs):
            steps += [graph] + ([self.verify_mirrors[graph]] if graph in self.verify_mirrors
                                else [])
        return steps

    def _capture_again(self) -> None:
        """After the weights and cache storages came back at new addresses: the decode graphs
        (and their persistent layer table), the eager persistent decode's table and the prefill
        graphs, captured anew as at start-up, through the functions compiled then."""
        self._capture_decode_graphs(again=True)
        if self.small_decode_forward is not None:
            from ..kernels.decode_layer import with_persistent_layers

            self.small_decode_forward = with_persistent_layers(self.prefill_forward, self.params,
                                                               self.cache)
        pool, stream = None, None
        for graph in self._captured_steps():  # one pool and stream, in order, as at start-up
            stream = stream or torch.cuda.Stream(self.device)
            pool = graph.capture(pool, stream)

    def _compile_and_capture(self, config: EngineConfig) -> None:
        graphs = captures_decode_graphs(self.device, self.enforce_eager, config.runner)
        compile_forward = os.environ.get("MINIVLLM_COMPILE", "1") != "0"
        # Where the forward is compiled: where decode graphs are captured, and a pooling
        # engine's on the same device, which captures none.
        compiles = self.device.type == "cuda" and not self.enforce_eager and compile_forward
        flag = os.environ.get("MINIVLLM_FUSED_MLP")
        fused = fused_mlp_rows(flag, measured=fused_mlp_measured(
            self.model_config.hidden_size, self.params.embed.dtype, self.device))
        if fused and self.model_config.is_moe:  # the kernel computes the dense MLP
            if flag is not None:
                log.warning("minivllm: MINIVLLM_FUSED_MLP runs the dense MLP; this model's "
                            "sparse layers are mixtures of experts: ignored")
            fused = None
        if fused and has_quantized(self.params):  # the kernel multiplies 16-bit dense weights
            if flag is not None:
                log.warning("minivllm: MINIVLLM_FUSED_MLP multiplies 16-bit dense weights; this "
                            "model's are quantized (AWQ 4-bit or block fp8): ignored")
            fused = None
        if fused and not (graphs and compile_forward):
            if flag is not None:
                log.warning("minivllm: MINIVLLM_FUSED_MLP applies to the compiled decode graphs "
                            "only (a generating engine on a CUDA GPU, not enforce_eager, "
                            "MINIVLLM_COMPILE not 0): ignored")
            fused = None
        if graphs:
            max_blocks = ceil_div(config.max_model_len, self.block_size)
            # With LoRA, the base model's graphs (no slots, the forward without deltas: the
            # persistent decode and the fused MLP where the engine takes them) serve the steps
            # without adapter rows; the LoRA graphs, through the same compiled forward, the rest.
            self.graphs = DecodeGraphs(
                self.params, self.cache, self.backend, max_num_seqs=config.max_num_seqs,
                max_blocks_per_seq=max_blocks, compile_forward=compile_forward,
                persistent_decode=config.persistent_decode, fused_mlp_rows=fused,
                adapters=False)
            if config.enable_lora:
                self.lora_graphs = DecodeGraphs(
                    self.params, self.cache, self.backend, max_num_seqs=config.max_num_seqs,
                    max_blocks_per_seq=max_blocks, adapters=True, fn=self.graphs.fn)
            if self.draft_params is not None:
                # propose's rounds replay these, in the target's pool (_capture_decode_graphs),
                # so that they take no memory of their own (the pool holds the larger of the two
                # decode steps' peaks: _cuda_kv_budget). The persistent decode where the draft's
                # shape takes it (EngineConfig.draft_persistent_decode), whose graphs also pick
                # the greedy tokens a round drafts (replay_draft_round).
                self.draft_graphs = DecodeGraphs(
                    self.draft_params, self.draft_cache, self.draft_backend,
                    max_num_seqs=config.max_num_seqs, max_blocks_per_seq=max_blocks,
                    compile_forward=compile_forward,
                    persistent_decode=config.draft_persistent_decode)
            self._capture_decode_graphs()
        # Prefill and mixed steps run through the same compiled decoder layer (its prefill
        # variants are compiled by the warm-up): on the H200 the throughput benchmark ran 22,637
        # tok/s so against 16,911 with eager prefill (BENCHMARKS.md). MINIVLLM_COMPILE_PREFILL=0:
        # eager.
        compile_prefill = os.environ.get("MINIVLLM_COMPILE_PREFILL", "1") != "0"
        if self.graphs is not None and self.graphs.fn is not forward and compile_prefill:
            self.prefill_forward = self.graphs.fn
        elif self.graphs is None and compiles and compile_prefill:
            # No decode graphs to share theirs (a pooling engine): its prompts, all it runs,
            # still go through a compiled forward, as a generating engine's do.
            self.prefill_forward = compiled_forward(device=self.device)
        if self.draft_graphs is not None and self.prefill_forward is not forward:
            # The draft's steps mirrored from the target's through the draft's own compiled
            # forward (compiled_forward's code copies: no dynamo caches shared with the target's).
            self.draft_forward = functools.partial(self.draft_graphs.fn, head=_no_head)
        # Eager decode steps of at most MAX_ROWS rows (no CUDA graphs: enforce_eager, a CPU
        # under the interpreter) take the persistent layer too.
        if config.persistent_decode:
            from ..kernels.decode_layer import MAX_ROWS, with_persistent_layers

            self.small_decode_forward = with_persistent_layers(self.prefill_forward, self.params,
                                                               self.cache)
            self.small_decode_rows = MAX_ROWS

    def _wants_prefill_graphs(self, config: EngineConfig) -> bool:
        """Whether steps with prompt tokens replay CUDA graphs (runtime/prefill_graph.py): by
        default wherever they can (one CUDA GPU, the triton backend, not under enforce_eager),
        MINIVLLM_PREFILL_GRAPH=0 never. Session 28 measured them on the H200: time to first token
        3-4 ms against 14-21, throughput +3% on average (BENCHMARKS.md)."""
        flag = os.environ.get("MINIVLLM_PREFILL_GRAPH")
        if flag == "0":
            return False
        applies = captures_decode_graphs(self.device, self.enforce_eager, config.runner) and \
            getattr(self.backend, "name", None) == "triton" and \
            self.params.shard.world_size == 1 and \
            config.max_num_batched_tokens > config.max_num_seqs
        if not applies and flag == "1":
            log.warning("minivllm: MINIVLLM_PREFILL_GRAPH=1 needs one CUDA GPU with decode graphs, "
                        "the triton backend and more batched tokens than sequences: not used")
        return applies

    def _capture_prefill_graphs(self, config: EngineConfig) -> None:
        """Steps with prompt tokens replay the smallest CUDA graph of prefill_graph_sizes whose
        shape they fill at least half (_wants_prefill_graphs says where). Under speculation,
        verification steps replay the smallest of verify_graph_shapes they fit, and a draft
        model's mirror of such a step the draft's graph over the same inputs. A LoRA engine's
        steps with adapter rows replay graphs of the same sizes with each token's slot. All in
        one pool (the graphs replay one at a time on one stream, each output read before the
        next)."""
        if not self.use_prefill_graphs or self.graphs is None:
            return
        self.prefill_graphs = self._make_prefill_graphs(adapters=False)
        if config.enable_lora:
            self.lora_prefill_graphs = self._make_prefill_graphs(adapters=True)
        self.verify_graphs, self.verify_mirrors = self._make_verify_graphs()
        # One stream for the pool's captures (PrefillGraph.capture says why).
        pool, stream = None, torch.cuda.Stream(self.device)
        for graph in self._captured_steps():
            pool = graph.capture(pool, stream)

    def _make_prefill_graphs(self, adapters: bool) -> list[PrefillGraph]:
        """A prefill graph of each of prefill_graph_sizes, largest first, not yet captured."""
        config = self.config
        return [PrefillGraph(self.params, self.cache, self.backend, self.prefill_forward,
                             num_tokens=tokens, max_num_seqs=config.max_num_seqs,
                             max_blocks_per_seq=ceil_div(config.max_model_len, self.block_size),
                             block_size=self.block_size, adapters=adapters)
                for tokens in prefill_graph_sizes(config.max_num_batched_tokens,
                                                  config.max_num_seqs)]

    def _verify_shapes(self) -> list[tuple[int, int]]:
        """verify_graph_shapes under speculation (none without)."""
        config = self.config
        if config.speculative is None:
            return []
        return verify_graph_shapes(config.speculative.num_speculative_tokens,
                                   config.max_num_seqs, config.max_num_batched_tokens)

    def _make_verify_graphs(self) -> tuple[list[PrefillGraph], dict]:
        """The verification graphs, smallest first, and a draft model's mirror of each (a graph
        of the draft's forward over the same inputs), not yet captured."""
        shape = dict(min_tokens=1, block_size=self.block_size,
                     max_blocks_per_seq=ceil_div(self.config.max_model_len, self.block_size))
        graphs, mirrors = [], {}
        for tokens, seqs in self._verify_shapes():
            graph = PrefillGraph(self.params, self.cache, self.backend, self.prefill_forward,
                                 num_tokens=tokens, max_num_seqs=seqs, num_logits=tokens, **shape)
            graphs.append(graph)
            if self.draft_params is not None:
                mirrors[graph] = PrefillGraph(
                    self.draft_params, self.draft_cache, self.draft_backend, self.draft_forward,
                    num_tokens=tokens, max_num_seqs=seqs, num_logits=tokens, inputs=graph.inputs,
                    **shape)
        return graphs, mirrors

    def release_graphs(self) -> None:
        """Drop the CUDA graphs (the runner then runs every step eagerly): a tensor-parallel
        rank must do so before it leaves its process group (DecodeGraphs.release)."""
        for graphs in self._decode_graph_sets():
            graphs.release()
        self.graphs = self.lora_graphs = self.draft_graphs = None
        for graph in self._captured_steps():
            graph.release()
        self.prefill_graphs, self.lora_prefill_graphs = [], []
        self.verify_graphs, self.verify_mirrors = [], {}

    # -- sizing the KV cache ---------------------------------------------------------------------

    def _num_blocks(self) -> int:
        config = self.config
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_block_bytes(self.params, self.block_size, self.config.cache_dtype)
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = cpu_kv_budget_bytes()
        # Enough for every sequence at full length, within the memory budget.
        wanted = config.max_num_seqs * ceil_div(config.max_model_len, self.block_size)
        granule = CUDA_SEGMENT_GRANULE if self.device.type == "cuda" else 1
        if self.draft_params is None:
            within = kv_blocks_within(budget, per_block, 2 * self.params.config.num_layers,
                                      granule)
        else:
            # A draft model's cache has as many blocks: a block's bytes are both caches'.
            draft_block = kv_block_bytes(self.draft_params, self.block_size,
                                         self.config.cache_dtype)
            within = kv_blocks_within_caches(
                budget, [(per_block, 2 * self.params.config.num_layers),
                         (draft_block, 2 * self.draft_params.config.num_layers)], granule)
            per_block += draft_block
        num = min(wanted, within)
        if num < 1:
            rounding = f", each of its tensors rounded up to {granule} bytes" if granule > 1 else ""
            raise ValueError(f"no memory left for the KV cache (a block needs {per_block} bytes"
                             f"{rounding}; the budget is {budget}); lower "
                             f"max_num_batched_tokens or raise gpu_memory_utilization")
        log.info("minivllm KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s)", num,
                 self.block_size, num * self.block_size, num * per_block / GiB,
                 str(self.config.cache_dtype).removeprefix("torch."))
        return num

    def _cuda_kv_budget(self) -> int:
        """Free memory * gpu_memory_utilization, less what the largest step needs, measured by
        running one: a forward over max_num_batched_tokens tokens in max_num_seqs sequences,
        then sampling max_num_seqs rows with every stage on, from logits in each dtype serving
        samples (the sort for top-k/top-p and the logprobs are the big ones). With prefill
        graphs the forward's share is held for good by their pool while sampling allocates
        beside it, so both are set aside rather than the larger. The decode graphs' pool, held
        for good too, is set aside as a decode step's peak at max_num_seqs rows. A draft model's
        weights are in use already. Its decode graphs are captured into the target's pool (their
        replays and the target's take turns on one stream: graphs.unowned), which then holds the
        larger of the two decode steps' peaks, and load executables and compiled kernels of
        their own (CAPTURE_CODE_BYTES more). Its other forwards' peaks (mirrored prompt and
        verification steps) are not measured: they run after the target's, which is larger for
        a smaller draft. Under speculation, the prefill graphs' pool also holds the verification
        graphs' (a logits row a token): the forward's share is the larger of the two peaks."""
        config = self.config
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        tokens = min(config.max_num_batched_tokens, config.max_num_seqs * config.max_model_len)
        lengths = profile_lengths(tokens, config.max_num_seqs, config.max_model_len)
        blocks = sum(ceil_div(n, self.block_size) for n in lengths)
        scratch = init_cache(self.params, num_blocks=blocks, block_size=self.block_size,
                             dtype=config.cache_dtype)
        chunks, next_block = [], 0
        for n in lengths:
            table = list(range(next_block, next_block + ceil_div(n, self.block_size)))
            next_block += len(table)
            chunks.append(SeqChunk([0] * n, 0, table))
        # With LoRA, every row through slot 0: the step's peak with the deltas.
        slots = (0,) * len(chunks) if config.enable_lora else None
        forward_peak = self._peak_bytes(
            lambda: self._run(scratch, StepInput(chunks, [], lora_slots=slots)))
        verify = self._largest_verify_step(blocks)
        if verify:  # held by the same pool as the prefill graphs' (_capture_prefill_graphs)
            forward_peak = max(forward_peak, self._peak_bytes(
                lambda: self._run(scratch, StepInput(verify, []))))
        # The decode graphs' pool keeps about a decode step's peak at the largest bucket for good
        # (their logits share it: graphs.unowned).
        decode_graphs_peak = 0
        if captures_decode_graphs(self.device, self.enforce_eager, config.runner):
            rows = [SeqChunk([0], 0, [0])] * config.max_num_seqs  # scratch's block 0 for all
            slots = (0,) * len(rows) if config.enable_lora else None  # the graphs' LoRA layer
            decode_graphs_peak = self._peak_bytes(
                lambda: self._run(scratch, StepInput(rows, [], lora_slots=slots)))
            if self.draft_params is not None:  # its decode graphs share the pool: see above
                decode_graphs_peak = max(decode_graphs_peak, self._draft_decode_peak(rows)) + \
                    CAPTURE_CODE_BYTES
            # A LoRA engine's base graphs share it too; their step is the same without deltas.
            decode_graphs_peak += CAPTURE_CODE_BYTES * (2 if config.enable_lora else 1)
        # Start-up leaves the blocks of every dtype's heaviest sampling in the allocator's cache,
        # and they reserve more than sampling's allocated peak (1.97 GiB against 1.59 at 256
        # rows of 151,936 on the H200, session 31): a freed block too small for a later request
        # stays, and the allocator cuts a new one beside it.
        sampling_peak, sampling_blocks = self._sampling_footprint()
        del scratch
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        in_use = total - free  # weights, the CUDA context, other processes
        log.info("minivllm: KV budget: %.2f GiB in use (%.3f outside the allocator), forward "
                 "peak %.2f GiB, sampling %.2f GiB reserved (allocated peak %.2f), decode graphs "
                 "%.2f GiB", in_use / GiB, bytes_outside_allocator(self.device) / GiB,
                 forward_peak / GiB, sampling_blocks / GiB, sampling_peak / GiB,
                 decode_graphs_peak / GiB)
        return kv_budget_bytes(total, config.gpu_memory_utilization, in_use, forward_peak,
                               max(sampling_peak, sampling_blocks), decode_graphs_peak,
                               graphs_hold_forward=self.use_prefill_graphs)

    def _largest_verify_step(self, blocks: int) -> list[SeqChunk]:
        """The chunks of the largest verification graph's step, in a scratch cache of `blocks`
        blocks (every sequence on the same ones), or none where no verification graph will be
        captured. Its logits (a row a token) may outweigh the prefill graphs' peak."""
        shapes = self._verify_shapes()
        if not shapes or not self.use_prefill_graphs or not captures_decode_graphs(
                self.device, self.enforce_eager, self.config.runner):
            return []
        tokens, seqs = shapes[-1]
        per_seq = tokens // seqs
        table = list(range(min(blocks, ceil_div(per_seq, self.block_size))))
        per_seq = min(per_seq, len(table) * self.block_size)
        return [SeqChunk([0] * per_seq, 0, table, num_logits=per_seq)] * seqs

    def _draft_decode_peak(self, rows: list[SeqChunk]) -> int:
        """The bytes the draft's eager forward allocates at its peak over the decode step `rows`
        (each in block 0 of a scratch cache of its own)."""
        scratch = init_cache(self.draft_params, num_blocks=1, block_size=self.block_size,
                             dtype=self.config.cache_dtype)
        batch = make_batch(rows, block_size=self.block_size, device=self.device, check=False)
        with torch.no_grad():
            return self._peak_bytes(
                lambda: forward(self.draft_params, scratch, batch, self.draft_backend))

    def _sampled_dtypes(self) -> tuple[torch.dtype, ...]:
        """The logits dtypes serving samples: fp32 from model.head, the activation dtype from the
        compiled forward's head. Each leaves blocks of other sizes in the allocator's cache, and
        fp32 first reserves the least (1.97 GiB against 2.05 with bf16 first, at 256 rows of
        151,936 on the H200: benchmarks/sampling_blocks_probe.py, session 31)."""
        return tuple(dict.fromkeys((torch.float32, self.params.dtype)))

    def _sampling_blocks(self) -> None:
        """The heaviest sampling from logits of each dtype serving samples, in turn: the blocks
        start-up leaves in the allocator's cache for serving's samplings to split."""
        for dtype in self._sampled_dtypes():
            self._heaviest_sampling(dtype)

    def _heaviest_sampling(self, dtype: torch.dtype) -> SampleOutput:
        """Sample max_num_seqs rows of `dtype` logits with every stage on (heaviest_row)."""
        rows = [heaviest_row(self.config.max_logprobs, self.vocab_size)] * \
            self.config.max_num_seqs
        with torch.no_grad():
            return sample(torch.zeros(len(rows), self.vocab_size, device=self.device, dtype=dtype),
                          make_sampling_batch(rows, vocab_size=self.vocab_size,
                                              device=self.device,
                                              logprobs_mode=self.config.logprobs_mode))

    def _sampling_footprint(self) -> tuple[int, int]:
        """_sampling_blocks from an emptied cache, as start-up runs it: (bytes allocated at its
        peak, bytes the caching allocator reserved anew)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        self._sampling_blocks()
        torch.cuda.synchronize(self.device)
        return (torch.cuda.max_memory_allocated(self.device) - allocated,
                torch.cuda.memory_reserved(self.device) - reserved)

    def _peak_bytes(self, run) -> int:
        """The bytes `run()` allocates at its peak beyond what was allocated before it."""
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        run()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - before

    # -- one step --------------------------------------------------------------------------------

    def _feed_back(self, input_ids: torch.Tensor, step: StepInput) -> None:
        """Write the tokens still on the device into this step's input ids: the previous step's
        sampled tokens (fed_back) and a draft model's drafts (drafted); device to device, in
        stream order: no wait for the work that computes them."""
        if step.drafted:  # (input index, index into the drafts)
            self._scatter(input_ids, step.drafted, step.drafts.view(-1))
        if not step.fed_back:
            return
        if self.last_tokens is None:
            raise ValueError("a step feeds back tokens but no step was launched before it")
        n = len(step.fed_back)
        if step.fed_back == same_rows(n):
            # Row k's token is input k (a decode step whose batch did not change): one copy.
            input_ids[:n].copy_(self.last_tokens[:n])
            return
        self._scatter(input_ids, step.fed_back, self.last_tokens)  # (input index, row)

    def _scatter(self, input_ids: torch.Tensor, pairs: tuple[tuple[int, int], ...],
                 source: torch.Tensor) -> None:
        """input_ids[i] = source[j] for each (i, j) of pairs, on the device in stream order."""
        index = host_to_device(torch.tensor(pairs, dtype=torch.int64).T, self.device)  # [2, n]
        input_ids[index[0]] = source[index[1]]

    def _run(self, cache, step: StepInput):
        """The step through the forward (compiled or eager): (SampleOutput or None, the prompt
        scores' tensors or None, the pooled rows' hidden states or None, the cache)."""
        batch = make_batch(step.chunks, block_size=self.block_size, device=self.device,
                           check=False, lora_slots=step.lora_slots, embeds=step.embeds,
                           hidden_size=self.model_config.hidden_size,
                           embeds_dtype=self.params.embed.dtype)
        # Built before the forward is queued, for the same reason as in _run_decode_graph.
        sbs = self._sampling_batches(step)
        self._feed_back(batch.input_ids, step)
        fn = self.prefill_forward
        if self.small_decode_forward is not None and batch.is_decode and \
                batch.num_seqs <= self.small_decode_rows and not step.embeds and \
                step.lora_slots is None:  # the persistent kernel adds no LoRA deltas
            fn = self.small_decode_forward
        if step.embeds:
            # The eager stem (an embedding lookup and a where: two kernels): compiled, a step
            # with embeddings (a Batch of another pytree structure) would recompile it, and
            # such steps are prompt chunks, rare next to decode steps. Layers and head are the
            # compiled ones, as for any step.
            fn = functools.partial(fn, stem=model_stem)
        scores = pooled = None
        with torch.no_grad():
            if step.scored is not None or step.pooled:
                fn = functools.partial(fn, head=self._extra_head(step))
            logits, cache = fn(self.params, cache, batch, self.backend)
            if step.scored is not None or step.pooled:
                logits, scores, pooled = logits
            out = sample_in_slices(logits, sbs, self.config.max_num_seqs) if step.rows else None
        return out, scores, pooled, cache

    def _extra_head(self, step: StepInput):
        """forward's head for a step with prompt tokens to score or rows to pool: the sampled
        rows' logits, the scores (model.prompt_logprobs) or None, and the pooled rows' final-normed
        hidden states in fp32 (model.final_hidden) or None, all eager (such steps are rare in
        generation, and an embedding step is a prefill: no graph, and no compiled head that a new
        number of rows would recompile). Scores come max_num_seqs rows at a time: the logits
        start-up sized the sampler's memory for (_sampling_blocks)."""
        scored, chunk = step.scored, self.config.max_num_seqs
        if scored is not None:
            rows = torch.tensor(scored.rows, dtype=torch.int64).to(self.device)
            targets = torch.tensor(scored.targets, dtype=torch.int64).to(self.device)
        pooled = torch.tensor(step.pooled, dtype=torch.int64).to(self.device) if step.pooled \
            else None

        def extra_head(params, x, residual, logits_rows):
            return (logits_head(params, x, residual, logits_rows),
                    None if scored is None else
                    prompt_logprobs(params, x, residual, rows, targets, scored.n, chunk=chunk),
                    None if pooled is None else final_hidden(params, x, residual, pooled).float())
        return extra_head

    def _run_decode_graph(self, step: StepInput, ids_in_graph: DecodeGraphs | None = None):
        """A decode step (one new token for every sequence) replayed from its CUDA graph: the
        LoRA graphs' where a row names an adapter, else the target's. ids_in_graph: the graphs
        whose greedy pick the last launched step took, which is then in their input ids."""
        b = len(step.chunks)
        graphs = self.graphs if step.lora_slots is None else self.lora_graphs
        # All rows plain greedy, in a graph that picks their arg-max itself: no sampling batch,
        # nothing launched after the replay (the tokens are a view of the graph's static buffer,
        # read in stream order before the next replay rewrites it).
        plain = all(map(plain_greedy, step.rows))
        greedy = plain and graphs.picks_greedy(b)
        with trace_range("prepare_decode"):
            chunks = decode_columns(step.chunks)
            # The sampling batch's copies go first: queued behind the replay, copies from pageable
            # memory would make the host wait for the whole forward before sampling could start.
            # Plain greedy rows need none (their arg-max, in the graph or after it).
            sb = None if plain else self._sampling_batch(step)
            # After a step that took the graph's pick, the pick is in the input ids already:
            # when every row's token comes back to its own row, they need no copy.
            keep_ids = ids_in_graph is graphs and step.fed_back == same_rows(b)
            graphs.fill(chunks, keep_ids=keep_ids, lora_slots=step.lora_slots)
            if not keep_ids:
                self._feed_back(graphs.input_ids, step)
        with trace_range("replay"):
            logits = graphs.replay(b)
        if greedy:
            self.ids_in_graph = graphs
            return SampleOutput(token_ids=graphs.greedy_tokens[:b])
        with trace_range("sample"):
            return sample_in_slices(logits, None if plain else [sb], b)

    def _sampling_batch(self, step: StepInput) -> SamplingBatch:
        """The step's sampling batch. When its rows are the very objects of the last batch's, in
        order (the engine reuses a sequence's row while only its step changes: most decode steps
        of a steady batch), that batch with its steps sent anew (with_steps)."""
        rows, last = step.rows, self.last_sampling
        if step.steps is not None and last is not None and len(last[0]) == len(rows) and \
                all(map(operator.is_, last[0], rows)):
            sb = with_steps(last[1], step.steps, self.device)
        else:
            sb = make_sampling_batch(rows, vocab_size=self.vocab_size, device=self.device,
                                     steps=step.steps, logprobs_mode=self.config.logprobs_mode)
            if step.pending_ids:
                # Asynchronous scheduling built the penalised rows while their sequences' last
                # tokens were still being sampled: taken from the device, in stream order.
                if self.last_tokens is None:
                    raise ValueError("a step takes pending ids but no step was launched before it")
                sb = with_pending_ids(sb, step.pending_ids, self.last_tokens, self.vocab_size,
                                      self.device)
        self.last_sampling = (rows, sb)
        return sb

    def _sampling_batches(self, step: StepInput) -> list[SamplingBatch] | None:
        """What sample_in_slices takes for the step's rows: None where there are none, or where
        every row is plain greedy (their arg-max: a greedy speculative step's verification rows,
        k + 1 a sequence, are new rows every step, whose batch would be built and sent each time
        for the arg-max alone).
        Else the step's sampling batch; for a step of more rows than max_num_seqs (a speculative
        step's, a row per logits row: up to (k + 1) * max_num_seqs) whose sampling allocates
        temporaries of the logits' size (needs_vocab_rows: penalties, top-k/p, logprobs), one
        batch per max_num_seqs rows, sampled in turn (sample_in_slices): start-up set aside
        sampling's memory at max_num_seqs rows (_sampling_footprint), which all the rows at once
        would outgrow. Greedy and plain temperature rows are sampled at once: slices would only
        add launches and host work (at max_num_seqs 2, bench's single stream, three a step)."""
        if not step.rows or all(map(plain_greedy, step.rows)):
            return None
        size = self.config.max_num_seqs
        if len(step.rows) <= size:
            return [self._sampling_batch(step)]
        if step.pending_ids:  # (speculative steps, the only ones this wide, are synchronous)
            raise ValueError("a step of more rows than max_num_seqs has no pending ids")
        whole = make_sampling_batch(step.rows, vocab_size=self.vocab_size, device=self.device,
                                    steps=step.steps, logprobs_mode=self.config.logprobs_mode)
        if not needs_vocab_rows(whole):
            return [whole]
        batches = [make_sampling_batch(
            step.rows[i:i + size], vocab_size=self.vocab_size, device=self.device,
            steps=None if step.steps is None else step.steps[i:i + size],
            logprobs_mode=self.config.logprobs_mode) for i in range(0, len(step.rows), size)]
        widest = max(sb.num_logprobs for sb in batches)  # every slice's top-N as wide: joined
        return [attrs.evolve(sb, num_logprobs=widest) for sb in batches]

    def _prefill_graph_for(self, step: StepInput) -> PrefillGraph | None:
        """The smallest verification graph the step fits, else the smallest prefill graph (None:
        run it through the compiled forward). A step with LoRA rows: the smallest prefill graph
        with slots it fits."""
        graphs = reversed(self.lora_prefill_graphs) if step.lora_slots is not None else \
            itertools.chain(self.verify_graphs, reversed(self.prefill_graphs))
        for graph in graphs:
            if graph.fits(step.chunks):
                return graph
        return None

    def _run_prefill_graph(self, graph: PrefillGraph, step: StepInput):
        """A step with prompt tokens replayed from a prefill graph, padded to its shape."""
        with trace_range("prepare_prefill"):
            # Before the replay, as in _run_decode_graph: the sampling batch's copies.
            sbs = self._sampling_batches(step)
            n = graph.fill(step.chunks, lora_slots=step.lora_slots)
            self._feed_back(graph.batch.input_ids, step)
        with trace_range("replay"):
            logits = graph.replay(n)
        return sample_in_slices(logits, sbs, self.config.max_num_seqs) if step.rows else None

    def _graph_step(self, step: StepInput) -> bool:
        chunks = step.chunks
        return (self.graphs is not None and len(chunks) == len(step.rows)  # all want logits
                and step.scored is None and not step.embeds
                and self.graphs.bucket(len(chunks)) is not None
                and is_decode_step(chunks))

    def launch(self, step: StepInput) -> PendingStep:
        """Queue the step's forward and sampling on the device and return without waiting."""
        ids_in_graph, self.ids_in_graph = self.ids_in_graph, None
        scores = pooled = graph = None
        if self._graph_step(step):
            with torch.no_grad():
                out = self._run_decode_graph(step, ids_in_graph)
        elif step.scored is None and not step.pooled and not step.embeds and \
                (graph := self._prefill_graph_for(step)) is not None:
            with torch.no_grad():
                out = self._run_prefill_graph(graph, step)
        else:
            out, scores, pooled, self.cache = self._run(self.cache, step)
        pending = PendingStep(step.rows, out, self.device, scores, step.scored, pooled,
                              step.drafts)
        if self.draft_params is not None:
            # A step of verification chunks only is not mirrored: propose's rounds wrote the
            # draft K/V of each chunk's tokens but its last draft, which catch_up writes where
            # every draft was accepted (elsewhere its slot lies past the sequence's length).
            self.mirrored = not is_verification_step(step.chunks)
            if self.mirrored:
                # Queued after the tokens' copy and its event: the host reads the tokens,
                # records them and schedules the next step while the mirror runs; the next
                # step's draft rounds follow it in stream order.
                self._mirror(step, self.verify_mirrors.get(graph))
        self.last_tokens = out.token_ids if out is not None else None
        return pending

    # -- draft-model speculative decoding (runtime/spec_decode.py) --------------------------------

    def _mirror(self, step: StepInput, graph: PrefillGraph | None = None) -> None:
        """Run the step's tokens through the draft too, without its logits, writing their draft
        K/V into the same slots as the target's: the draft cache then holds, at every slot, K/V
        of the token the target's holds. A decode step replays the draft's decode graphs where
        it has them (their logits left unread; the target's, in the same pool, are read by the
        step's sampling, queued before); a step the target replayed from a verification graph
        replays `graph`, the draft's over the same filled inputs; any other step runs
        draft_forward."""
        if step.fed_back or step.embeds or step.lora_slots is not None:
            # EngineConfig refuses what would bring these (asynchronous scheduling is off
            # under speculation; prompt embeddings and LoRA are refused with a draft model).
            raise ValueError("a draft model's step takes no fed-back tokens, prompt embeddings "
                             "or LoRA slots")
        with torch.no_grad():
            if graph is not None:
                graph.replay(0)
                return
            if self.draft_graphs is not None and is_decode_step(step.chunks):
                self.draft_graphs.fill(decode_columns(step.chunks))
                self.draft_graphs.replay(len(step.chunks))
                return
            batch = make_batch(step.chunks, block_size=self.block_size, device=self.device,
                               check=False)
            self._feed_back(batch.input_ids, step)  # the drafts (no fed-back tokens here)
            _, self.draft_cache = self.draft_forward(self.draft_params, self.draft_cache, batch,
                                                     self.draft_backend)

    def _draft_round(self, chunks: DecodeChunks, ids: torch.Tensor) -> torch.Tensor:
        """One decode round of the draft over chunks' rows, their input ids `ids` [rows] on the
        device (chunks' own ids are not read): their K/V written into the draft cache, their
        greedy next tokens returned. Replayed from the draft's decode graphs where it has them
        (replay_draft_round), else through its eager forward."""
        if self.draft_graphs is not None:
            return replay_draft_round(self.draft_graphs, chunks, ids)
        batch = make_batch(chunks, block_size=self.block_size, device=self.device, check=False)
        batch.input_ids.copy_(ids)
        logits, self.draft_cache = forward(self.draft_params, self.draft_cache, batch,
                                           self.draft_backend)
        return logits.argmax(dim=-1)

    def catch_up(self, tokens: list[int], positions: list[int], block_tables: list) -> None:
        """After a verification step that was not mirrored (launch): the draft K/V of each
        sequence b whose every draft was accepted, for its last draft tokens[b] at positions[b],
        which propose's rounds did not write (the round that drafted it took the draft before
        it). One draft round, its tokens unread; nothing where the step was mirrored."""
        if self.mirrored or not tokens:
            return
        chunks = DecodeChunks([0] * len(tokens), positions, block_tables)
        with torch.no_grad():
            # without blocking: queued behind the verification step (host_to_device)
            self._draft_round(chunks, host_to_device(torch.tensor(tokens, dtype=torch.int64),
                                                     self.device))

    def propose(self, tokens: list[int], positions: list[int], block_tables: list,
                counts: list[int]) -> torch.Tensor:
        """Greedy drafts of the draft model: for each decoding sequence b, whose last token
        tokens[b] sits at positions[b] (in no cache yet) and whose block table holds slots up to
        positions[b] + counts[b], counts[b] tokens d1, d2, ...: [tokens[b]]@p -> d1, [d1]@p+1 ->
        d2, and so on, each round one decode batch of the sequences still drafting (their draft
        K/V written at p ... p + counts[b] - 1), each a _draft_round. Queued without waiting:
        returns drafts [n, max(counts)] on the device (row b's first counts[b] are b's), which
        the verification step reads in stream order (StepInput.drafts) and brings back to the
        host with its sampled tokens."""
        n = len(tokens)
        if not n:
            return torch.empty((0, 0), dtype=torch.int64, device=self.device)
        order = sorted(range(n), key=lambda b: -counts[b])  # those still drafting: a prefix
        most = counts[order[0]]
        drafts = torch.empty((n, most), dtype=torch.int64, device=self.device)
        # without blocking: the rounds queue behind the last step's work (host_to_device)
        current = host_to_device(torch.tensor([tokens[b] for b in order], dtype=torch.int64),
                                 self.device)
        with torch.no_grad():
            for r in range(most):
                rows = [b for b in order if counts[b] > r]
                chunks = DecodeChunks([0] * len(rows), [positions[b] + r for b in rows],
                                      [block_tables[b] for b in rows])
                current = self._draft_round(chunks, current[:len(rows)])
                drafts[:len(rows), r] = current
        if order == list(range(n)):  # counts non-increasing already: rows in b's order
            return drafts
        place = [0] * n  # b's row in the order drafted
        for row, b in enumerate(order):
            place[b] = row
        return drafts[host_to_device(torch.tensor(place, dtype=torch.int64), self.device)]

    def execute(self, step: StepInput) -> StepResult:
        """Compute the step's tokens into the cache and sample one token per row."""
        return self.launch(step).result()
