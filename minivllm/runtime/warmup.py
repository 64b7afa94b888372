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
"""

from __future__ import annotations

import torch

from ..functional.model import forward
from ..functional.sampling import SamplingRow, make_sampling_batch, sample
from ..state.batch import SeqChunk, make_batch
from ..state.cache import init_cache
from ..state.params import Params

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
                    forward_fn=forward, cuda_only: bool = True) -> None:
    """Run the sampler at each tiling, and prefill and decode steps over every class of sequence
    count and block-table width through forward_fn (the forward that serving's prefill and mixed
    steps take: a compiled one compiles its variants here), on a scratch cache (by default on
    CUDA only: elsewhere nothing is compiled; the tests run it on CPU)."""
    device = params.device
    if cuda_only and device.type != "cuda":
        return
    vocab = params.config.vocab_size
    widest = max(_CLASSES)
    scratch = init_cache(params, num_blocks=widest * widest + 1, block_size=block_size)
    with torch.no_grad():
        for rows in sampler_sizes(max_num_seqs, vocab, device):
            logits = torch.zeros(rows, vocab, device=device)
            sample(logits, make_sampling_batch([SamplingRow(temperature=1.0)] * rows,
                                               vocab_size=vocab, device=device))
        for num_seqs in _CLASSES:
            for width in _CLASSES:
                tables = [list(range(s * width, (s + 1) * width)) for s in range(num_seqs)]
                tokens = width * block_size
                prefill = [SeqChunk([0] * tokens, 0, t) for t in tables]
                decode = [SeqChunk([0], tokens - 1, t) for t in tables]
                for chunks in (prefill, decode):
                    batch = make_batch(chunks, block_size=block_size, device=device)
                    forward_fn(params, scratch, batch, backend)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
