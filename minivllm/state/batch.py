"""Batch: what one forward step computes, as a pytree of tensors.

T tokens from B sequences, packed without padding, sequence after sequence:
  input_ids      [T]      int64  token ids
  positions      [T]      int64  each token's position in its sequence
  slot_mapping   [T]      int64  cache slot its K/V is written to (-1: do not write)
  cu_seqlens_q   [B + 1]  int32  offsets of each sequence's tokens in the packed T
  context_lens   [B]      int32  tokens in the cache for the sequence once this step's are written
  block_tables   [B, M]   int32  the blocks holding each sequence's context (-1: unused)
  logits_indices [N]      int64  rows of T that get logits (in prefill, each sequence's last)
and, static, the block_size the slots and tables count in: forward refuses a cache of another
(its slots would address other tokens' K/V). Optional:
  lora_slots     [T]      int64  each token's LoRA slot in params.lora (-1: the base model), or
                                 None (no LoRA in this step: the forward is the one without it).
                                 Values in [-1, max_loras): forward cannot check values on the
                                 device; another value runs the base model at that row
                                 (make_batch checks them, given max_loras)
  input_embeds   [T, hidden]       the rows' input embeddings where embeds_mask is set (vLLM's
  embeds_mask    [T]      bool     prompt_embeds): the stem takes them in place of the embedding
                                   lookup of input_ids; both None (no such row in this step: the
                                   stem is the one without them) or both given

The new tokens of sequence b sit at positions context_lens[b] - q_len_b ... context_lens[b] - 1;
the earlier ones (a cached prefix or earlier chunks) are read from the cache through block_tables.
A decode step is the case q_len_b == 1 for every b, i.e. T == B, which is static (from shapes).
"""

from __future__ import annotations

import itertools
from collections import abc
from typing import NamedTuple, Sequence

import numpy as np
import torch

from .pytree import pytree_class, static
from .values import as_int


@pytree_class
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    logits_indices: torch.Tensor
    block_size: int = static()
    lora_slots: torch.Tensor | None = None
    input_embeds: torch.Tensor | None = None
    embeds_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token (static: read off the shapes)."""
        return self.num_tokens == self.num_seqs


class SeqChunk(NamedTuple):
    """One sequence's part of a step: `token_ids` are new, `num_cached` tokens precede them in the
    cache, `block_table` lists the sequence's blocks, `want_logits` asks for its last row's logits.
    (A NamedTuple: the engine builds one per sequence per step, at ~40% of a frozen attrs
    class's cost.)"""

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]
    want_logits: bool = True
    num_logits: int = 1


def host_to_device(host: torch.Tensor, device) -> torch.Tensor:
    """host copied to `device`: pinned and non-blocking on CUDA, since a copy from pageable
    memory makes the host wait for the work already queued (asynchronous scheduling, and a draft
    model's rounds queued behind the last step, need it not to)."""
    if device is not None and torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def slot_of(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The cache slot of a sequence's token at `position`."""
    return block_table[position // block_size] * block_size + position % block_size


def is_decode_step(chunks: Sequence[SeqChunk]) -> bool:
    """Whether every chunk brings one token and wants its logits (a DecodeChunks does)."""
    return isinstance(chunks, DecodeChunks) or \
        all(len(c.token_ids) == 1 and c.want_logits for c in chunks)


def is_verification_step(chunks: Sequence[SeqChunk]) -> bool:
    """Whether every chunk is a speculative verification chunk: a decoding sequence's last token
    and its drafts, with a logits row each (num_logits > 1)."""
    return not isinstance(chunks, DecodeChunks) and bool(chunks) and \
        all(c.num_logits > 1 for c in chunks)


class DecodeChunks(abc.Sequence):
    """A decode step's chunks held as columns: each sequence brings one new token, at
    `positions[b]` (the tokens cached before it), and wants its logits. The engine builds a
    decode step's rows as three lists, not a SeqChunk a row, and the CUDA graphs' buffers are
    filled from the columns; indexed, it gives each row's SeqChunk, so that it serves wherever
    chunks do (make_batch, a tensor-parallel rank's pickled step)."""

    __slots__ = ("input_ids", "positions", "block_tables")

    def __init__(self, input_ids: list[int], positions: list[int],
                 block_tables: list[Sequence[int]]):
        if not len(input_ids) == len(positions) == len(block_tables):
            raise ValueError(f"DecodeChunks' columns differ in length: {len(input_ids)} ids, "
                             f"{len(positions)} positions, {len(block_tables)} block tables")
        self.input_ids, self.positions, self.block_tables = input_ids, positions, block_tables

    @classmethod
    def of(cls, chunks: Sequence[SeqChunk]) -> DecodeChunks:
        """The columns of chunks that each bring one token and want logits."""
        if not is_decode_step(chunks):
            raise ValueError("a decode step's chunks each bring one token and want logits")
        return cls([c.token_ids[0] for c in chunks], [c.num_cached for c in chunks],
                   [c.block_table for c in chunks])

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return SeqChunk([self.input_ids[i]], self.positions[i], self.block_tables[i], True)

    def __reduce__(self):  # pickled as its columns (__slots__, no __dict__)
        return DecodeChunks, (self.input_ids, self.positions, self.block_tables)

    def __repr__(self):
        return f"DecodeChunks({len(self)} rows)"


def batch_arrays(chunks: Sequence[SeqChunk], *, block_size: int, max_blocks: int | None = None,
                 every_row: bool = False) -> dict[str, np.ndarray]:
    """Batch's fields as host arrays (make_batch's, before they become tensors), by field name,
    in the fields' dtypes. every_row: logits for every token (teacher forcing, losses), not only
    each chunk's last.

    Per-token fields are computed with numpy, not a Python loop over tokens: a prefill step of
    ~8,000 tokens is on the host's critical path while the GPU waits (~2 ms per step in Python,
    session 6's prefill trace)."""
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    if isinstance(chunks, DecodeChunks):
        chunks = list(chunks)  # its rows made once: they are read four times below
    width = max(max_blocks or 0, max(len(c.block_table) for c in chunks), 1)
    tables = np.full((len(chunks), width), -1, dtype=np.int32)
    lens = np.empty(len(chunks), dtype=np.int64)
    cached = np.empty(len(chunks), dtype=np.int64)
    for b, chunk in enumerate(chunks):
        n = len(chunk.token_ids)
        if n == 0:
            raise ValueError(f"sequence {b} brings no new tokens")
        total = chunk.num_cached + n
        if total > len(chunk.block_table) * block_size:
            raise ValueError(f"sequence {b} needs {total} slots but its block table holds "
                             f"{len(chunk.block_table) * block_size}")
        lens[b], cached[b] = n, chunk.num_cached
        tables[b, : len(chunk.block_table)] = chunk.block_table
    ids = np.fromiter(itertools.chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64,
                      count=int(lens.sum()))
    cu = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    row_seq = np.repeat(np.arange(len(chunks)), lens)  # [T] each token's sequence
    positions = cached[row_seq] + np.arange(cu[-1]) - cu[row_seq]
    blocks = tables[row_seq, positions // block_size].astype(np.int64)
    slots = blocks * block_size + positions % block_size
    if every_row:
        logit_rows = np.arange(cu[-1])
    elif any(c.num_logits != 1 for c in chunks):
        # The last num_logits rows of each chunk that wants logits, chunk after chunk.
        counts = np.array([c.num_logits if c.want_logits else 0 for c in chunks], dtype=np.int64)
        firsts = np.repeat(cu[1:] - counts, counts)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logit_rows = firsts + within
    else:
        logit_rows = (cu[1:] - 1)[[c.want_logits for c in chunks]]
    return dict(input_ids=ids, positions=positions, slot_mapping=slots,
                cu_seqlens_q=cu.astype(np.int32), context_lens=(cached + lens).astype(np.int32),
                block_tables=tables, logits_indices=logit_rows.astype(np.int64))


def _ids(values, what: str, upper: int | None, upper_name: str) -> None:
    """TypeError/ValueError unless `values` are integers in [0, upper)."""
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and (arr.dtype == bool or arr.dtype.kind not in "iu")):
        raise TypeError(f"{what} must be a flat sequence of integers, got {values!r:.80}")
    if not arr.size:  # an empty chunk is batch_arrays' error, with its own message
        return
    if arr.min() < 0:
        raise ValueError(f"{what} holds {int(arr.min())}, a negative id")
    if upper is not None and arr.max() >= upper:
        raise ValueError(f"{what} holds {int(arr.max())}, not below {upper_name} ({upper})")


def check_chunks(chunks: Sequence[SeqChunk], *, block_size: int, num_blocks: int | None = None,
                 vocab_size: int | None = None) -> None:
    """TypeError/ValueError naming the first malformed chunk: what make_batch would otherwise
    truncate (float ids), wrap (negative positions index from the end) or pass on for the cache
    write to trip over (a block past the cache) after some layers have written."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence):
        raise TypeError(f"chunks must be a sequence of SeqChunk, got {type(chunks).__name__}")
    for b, chunk in enumerate(chunks):
        if not isinstance(chunk, SeqChunk):
            raise TypeError(f"chunk {b} must be a SeqChunk, got {type(chunk).__name__}")
        _ids(chunk.token_ids, f"chunk {b}'s token_ids", vocab_size, "the vocabulary size")
        n = as_int(chunk.num_cached)
        if n is None or n < 0:
            raise ValueError(f"chunk {b}'s num_cached must be an integer >= 0, got "
                             f"{chunk.num_cached!r}")
        _ids(chunk.block_table, f"chunk {b}'s block_table", num_blocks, "the cache's num_blocks")
        if not isinstance(chunk.want_logits, (bool, np.bool_)):  # packing indexes rows with it
            raise TypeError(f"chunk {b}'s want_logits must be a bool, got {chunk.want_logits!r}")
        k = as_int(chunk.num_logits)
        if k is None or not 1 <= k <= max(len(chunk.token_ids), 1):
            raise ValueError(f"chunk {b}'s num_logits must be an integer in [1, its tokens], got "
                             f"{chunk.num_logits!r}")


def check_lora_slots(lora_slots: Sequence[int], num_chunks: int,
                     max_loras: int | None = None) -> None:
    """TypeError/ValueError unless lora_slots holds one integer a chunk, each -1 (the base model)
    or a slot below max_loras (params.lora.max_loras, where given). On the device a slot outside
    [0, max_loras) matches no slot's mask column: that row would silently run the base model."""
    if isinstance(lora_slots, (str, bytes)) or \
            not isinstance(lora_slots, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"lora_slots must be a sequence of ints (one a chunk), got "
                        f"{type(lora_slots).__name__}")
    if len(lora_slots) != num_chunks:
        raise ValueError(f"{len(lora_slots)} LoRA slots for {num_chunks} chunks")
    for b, slot in enumerate(lora_slots):
        s = as_int(slot)
        if s is None:
            raise TypeError(f"chunk {b}'s LoRA slot must be an int, got {slot!r}")
        if s < -1 or (max_loras is not None and s >= max_loras):
            bound = "" if max_loras is None else f" or a slot below max_loras ({max_loras})"
            raise ValueError(f"chunk {b}'s LoRA slot {s} is out of range: -1 (the base "
                             f"model){bound}")


def make_batch(chunks: Sequence[SeqChunk], *, block_size: int, device=None,
               max_blocks: int | None = None, every_row: bool = False, check: bool = True,
               num_blocks: int | None = None, vocab_size: int | None = None,
               lora_slots: Sequence[int] | None = None, max_loras: int | None = None,
               embeds: Sequence[tuple[int, torch.Tensor]] = (), hidden_size: int | None = None,
               embeds_dtype: torch.dtype | None = None) -> Batch:
    """Pack sequence chunks into a Batch (built on the host, then moved to `device`).
    every_row: logits for every token (teacher forcing, losses), not only each chunk's last.

    check: validate the chunks first (check_chunks; `num_blocks` and `vocab_size`, where given,
    bound the block ids and token ids: forward cannot check values on the device without
    waiting for it). The engine's runner passes False: its chunks come from requests checked
    when they were added, and a decode step's host time is on its critical path.

    lora_slots: one LoRA slot per chunk (-1: the base model), repeated over the chunk's tokens
    into Batch.lora_slots; None, or every chunk -1, leaves it None. With check, each is an int
    in [-1, max_loras) (max_loras: params.lora.max_loras, where given; check_lora_slots).

    embeds: (row, rows_embeds [n, hidden]) pairs: token rows row ... row + n - 1 (indices in the
    chunks' concatenated tokens) take those input embeddings (Batch.input_embeds, in
    embeds_dtype, and embeds_mask; embeds_rows). Empty: both stay None."""
    if check:
        check_chunks(chunks, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
        if lora_slots is not None:
            check_lora_slots(lora_slots, len(chunks), max_loras)
    arrays = batch_arrays(chunks, block_size=block_size, max_blocks=max_blocks,
                          every_row=every_row)
    def t(x: np.ndarray):
        return host_to_device(torch.from_numpy(np.ascontiguousarray(x)), device)

    slots = None
    if lora_slots is not None:
        if len(lora_slots) != len(chunks):
            raise ValueError(f"{len(lora_slots)} LoRA slots for {len(chunks)} chunks")
        per_chunk = np.asarray(lora_slots, dtype=np.int64)
        if (per_chunk >= 0).any():
            lens = np.diff(arrays["cu_seqlens_q"].astype(np.int64))
            slots = t(np.repeat(per_chunk, lens))
    input_embeds = mask = None
    if embeds:
        host_embeds, host_mask = embeds_rows(len(arrays["input_ids"]), embeds, hidden_size,
                                             embeds_dtype)
        input_embeds = host_to_device(host_embeds, device)
        mask = t(host_mask)
    return Batch(**{name: t(x) for name, x in arrays.items()}, block_size=block_size,
                 lora_slots=slots, input_embeds=input_embeds, embeds_mask=mask)


def embeds_rows(num_tokens: int, embeds: Sequence[tuple[int, torch.Tensor]], hidden_size: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """A step's input_embeds [T, hidden] (zeros outside the given rows) and embeds_mask [T]
    (bool) on the host, from (row, rows_embeds [n, hidden]) pairs: rows row ... row + n - 1
    take rows_embeds. ValueError for a piece of another width or past the T rows."""
    out = torch.zeros(num_tokens, hidden_size, dtype=dtype)
    mask = np.zeros(num_tokens, dtype=bool)
    for row, piece in embeds:
        n = piece.shape[0]
        if piece.ndim != 2 or piece.shape[1] != hidden_size:
            raise ValueError(f"input embeddings must be [rows, {hidden_size}], got "
                             f"{list(piece.shape)}")
        if row < 0 or row + n > num_tokens:
            raise ValueError(f"input embeddings for rows {row}..{row + n - 1} of a step of "
                             f"{num_tokens} tokens")
        out[row:row + n] = piece
        mask[row:row + n] = True
    return out, mask
