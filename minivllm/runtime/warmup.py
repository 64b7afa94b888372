"""Compiling, before serving, the Triton kernel variants that serving would otherwise compile.

Triton compiles a kernel once per specialisation: per value of its constexpr arguments, per
class of its integer arguments (equal to 1, divisible by 16, neither) and per pointer alignment
(16 bytes or not: make_sampling_batch keeps its columns aligned for that). Some of those change with
the batch: the sampler's vocabulary chunk follows the number of rows, and the attention kernels
see the number of sequences and the block-table width. Each new variant costs a compile of about
a second on the first step that needs it, in the middle of serving (the throughput benchmark's
tail, where the batch shrinks, hit several). Running one small step of each class at start-up
moves those compiles there, through the forward that serving's prefill and mixed steps take
(decode steps replay graphs captured before). The steps write only into a scratch cache of their
own.

cuBLAS pays in the same way, on the host: the first LM-head GEMM at a new number of logits rows
took ~4.5 ms on the H200 against ~0.1 ms after, for one row count in eight (9, 17, 25, ...;
benchmarks/head_first_call.py, BENCHMARKS.md session 7), with no memory allocated: cuBLAS
choosing and loading a kernel for a new shape. Prefill and mixed steps, which run the head
outside any graph, meet a new row count in most steps of the prefill phase. So the head is run
once at every row count a step can have (1..max_num_seqs).
"""

from __future__ import annotations

import logging
import time

import torch

from ..functional import model
from ..functional.model import forward
from ..functional.sampling import SamplingRow, make_sampling_batch, sample
from ..state.batch import SeqChunk, make_batch
from ..state.cache import init_cache
from ..state.params import Params

log = logging.getLogger("minivllm")

# Sequences per step and blocks per block table: one of each integer class (1, 16, neither).
_CLASSES = (1, 3, 16)


def sampler_sizes(max_rows: int, vocab_size: int, device: torch.device) -> list[int]:
    """One row count per distinct tiling of the one-pass sampler kernel, up to max_rows."""
    from ..kernels.sample_kernel import chunk_size

    sizes, seen = [], set()
    for rows in range(1, max_rows + 1):
        chunk = chunk_size(rows, vocab_size, device)
        if chunk not in seen:
            seen.add(chunk)
            sizes.append(rows)
    return sizes


def warm_up_kernels(params: Params, backend, *, block_size: int, max_num_seqs: int,
                    forward_fn=forward, cuda_only: bool = True, cache_dtype=None) -> None:
    """Run the sampler at each tiling and logits dtype, prefill and decode steps over every class
    of sequence count and block-table width through forward_fn (the forward that serving's
    prefill and mixed steps take: a compiled one compiles its variants here), on a scratch
    cache, and forward_fn's head at every row count up to max_num_seqs (by default on CUDA
    only: elsewhere nothing is compiled or loaded lazily; the tests run it on CPU). cache_dtype:
    serving's (None: the params'), so that the kernels compiled here are the ones serving runs."""
    device = params.device
    if cuda_only and device.type != "cuda":
        return
    vocab = params.config.vocab_size
    widest = max(_CLASSES)
    scratch = init_cache(params, num_blocks=widest * widest + 1, block_size=block_size, dtype=cache_dtype)
    with torch.no_grad():
        # Logits in each dtype serving samples: fp32 from model.head, the activation dtype from
        # the compiled forward's model.logits_head. The kernel is compiled per dtype; unwarmed,
        # bf16's three variants compiled inside the first throughput run on a fresh H200, which
        # ran 5.78 s against 5.2 after (BENCHMARKS.md session 25).
        for rows in sampler_sizes(max_num_seqs, vocab, device):
            sb = make_sampling_batch([SamplingRow(temperature=1.0)] * rows, vocab_size=vocab,
                                     device=device)
            for dtype in dict.fromkeys((torch.float32, params.dtype)):
                sample(torch.zeros(rows, vocab, device=device, dtype=dtype), sb)
        # The truncated rows' draw (kernels.truncated_sample: one compile for every row count):
        # with top-p (Qwen3's generation config) and without (min-p), each logits dtype.
        for truncation in (dict(top_k=20, top_p=0.95), dict(min_p=0.05)):
            sb = make_sampling_batch([SamplingRow(temperature=1.0, **truncation)], vocab_size=vocab,
                                     device=device)
            for dtype in dict.fromkeys((torch.float32, params.dtype)):
                sample(torch.zeros(1, vocab, device=device, dtype=dtype), sb)
        # With LoRA slot weights, each step also with its rows in slot 0: a compiled forward's
        # LoRA layer compiles its variants here too, not inside the first adapter's request.
        lora_variants = (None,) if params.lora is None else (None, (0,))
        for num_seqs in _CLASSES:
            for width in _CLASSES:
                tables = [list(range(s * width, (s + 1) * width)) for s in range(num_seqs)]
                tokens = width * block_size
                prefill = [SeqChunk([0] * tokens, 0, t) for t in tables]
                decode = [SeqChunk([0], tokens - 1, t) for t in tables]
                for chunks in (prefill, decode):
                    for slots in lora_variants:
                        batch = make_batch(chunks, block_size=block_size, device=device,
                                           lora_slots=slots and slots * num_seqs)
                        forward_fn(params, scratch, batch, backend)
        warm_up_head(params, head_of(forward_fn), max_num_seqs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def head_of(forward_fn):
    """The head that forward_fn runs: a forward with its parts bound (functools.partial, as
    runtime.compiled.compiled_forward builds it) or the plain model.head."""
    return getattr(forward_fn, "keywords", {}).get("head", model.head)


def warm_up_head(params: Params, head_fn, max_rows: int) -> None:
    """Run head_fn at every number of logits rows from 1 to max_rows (see the module's
    docstring), over hidden states of more rows than any of them, as a prefill step's are."""
    start = time.perf_counter()
    hidden = params.config.hidden_size
    # Two tensors, as serving passes: one for both would make dynamo guard on their aliasing
    # and compile the head once more, for a call serving never makes.
    x, residual = (torch.zeros(max_rows + 1, hidden, device=params.device, dtype=params.dtype)
                   for _ in range(2))
    with torch.no_grad():
        for rows in range(1, max_rows + 1):
            head_fn(params, x, residual, torch.arange(rows, device=params.device))
    log.info("minivllm: LM head warm-up at 1..%d rows took %.1f s", max_rows,
             time.perf_counter() - start)
