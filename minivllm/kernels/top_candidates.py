"""A row's k largest logits and their ids for small k (top-k sampling's candidates), in two
Triton passes where torch.topk took 0.66 ms for k 20 at 256 rows of 151,936 ids on the H100
(session 65's sampler_stages; reading the logits once takes ~0.03 ms).

Each value and its id travel as one int64 key, so that one bitonic top-k (tl.topk) orders both:
the value's fp32 bits mapped to an int32 that orders as the floats do, above 2^31 - 1 - id (of
two equal values the lower id ranks first). Pass one: a program per (row, chunk of CHUNK ids)
keeps its chunk's top K keys (K: k's next power of two, at least 2). Pass two: a program per
row takes the top K of its chunks' keys and writes the first k, decoded. Ids past the row's end
enter as -inf with the lowest key of all (below every real -inf id's): never among a row's k.

  logits [B, V] fp32 / bf16 / fp16, unit stride along V -> (values [B, k] fp32, largest first,
  each the logit's exact value; ids [B, k] int64)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import next_pow2, runs_ptx

# The largest k these kernels take; above, torch.topk (the merge pass holds all chunks' K keys
# of a row at once: 38 chunks x 64 keys at 151,936 ids).
MAX_K = 64
CHUNK = 4096
NUM_WARPS = 8
# Whether a GPU takes the kernels by default (kernel=None). Off: timed by sampler_stages on an
# H100 (session 66, k = 20 over 151,936 fp32 logits), they took 0.239 ms against torch.topk's
# 0.217 at 64 rows and 0.807 against 0.655 at 256 (correct there: tests/test_top_candidates.py
# passed on it). Kept for kernel=True and as a start for a faster first pass.
ON_GPU_BY_DEFAULT = False
# The key of an id past the row's end: -inf's ordered bits above an id part of 0.
_PAD_KEY = tl.constexpr(-((0x7F800000 + 1) << 32))


@triton.jit
def value_id_keys(x, ids, valid):
    """int64 keys that order as (x descending, id ascending) (x fp32, ids < 2^31 - 1); lanes
    not `valid`: _PAD_KEY, below all. Also the truncated draw's bounds kernel's."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # -0.0 made +0.0
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - ids).to(tl.int64)
    return tl.where(valid, key, _PAD_KEY)


@triton.jit
def key_values(key):
    """The fp32 values of value_id_keys' keys."""
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def key_ids(key):
    """The int64 ids of value_id_keys' keys (2^31 - 1 for _PAD_KEY)."""
    return 0x7FFFFFFF - (key & 0x7FFFFFFF)


@triton.jit
def _chunk_top_kernel(logits_ptr, keys_ptr, V, stride_row, num_chunks, CHUNK: tl.constexpr,
                      K: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    ids = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = ids < V
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + ids, mask=valid,
                other=float("-inf")).to(tl.float32)
    top = tl.topk(value_id_keys(x, ids, valid), K)
    tl.store(keys_ptr + (row.to(tl.int64) * num_chunks + chunk) * K + tl.arange(0, K), top)


@triton.jit
def _merge_top_kernel(keys_ptr, vals_ptr, ids_ptr, num_keys, k, K: tl.constexpr,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row.to(tl.int64) * num_keys + offs, mask=offs < num_keys,
                   other=_PAD_KEY)
    top = tl.topk(keys, K)
    out = row.to(tl.int64) * k + tl.arange(0, K)
    first_k = tl.arange(0, K) < k
    tl.store(vals_ptr + out, key_values(top), mask=first_k)
    tl.store(ids_ptr + out, key_ids(top), mask=first_k)


def top_candidates(logits: torch.Tensor, k: int, *, kernel: bool | None = None,
                   chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, k], ids [B, k] int64): each row's k largest logits, largest first; with the
    kernels, values in fp32 and ties by id (lowest first); from torch.topk, values in the
    logits' dtype (a cast would be one more launch a decode step for the compiled head's bf16
    logits: candidate_bounds reads any float dtype). kernel: None, the kernels on a GPU where
    ON_GPU_BY_DEFAULT (never under the interpreter, whose bitonic top-k takes ~1 s a chunk);
    torch.topk otherwise and for k above MAX_K. chunk: ids a program of the first pass (default
    CHUNK, or the row's length's next power of two if shorter)."""
    b, v = logits.shape
    if not 0 < k <= v:
        raise ValueError(f"k must be in [1, {v}] (the row's length), got {k}")
    if kernel is None:
        kernel = ON_GPU_BY_DEFAULT and runs_ptx(logits.device)
    if not kernel or k > MAX_K:
        return logits.topk(k, dim=-1)
    assert v < 2**31 - 1, "ids are int32 inside the kernel"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    top = max(2, next_pow2(k))  # tl.topk of 1 reduces to a scalar
    chunk = max(chunk or min(CHUNK, next_pow2(v)), top)
    n = triton.cdiv(v, chunk)
    keys = torch.empty(b, n * top, dtype=torch.int64, device=logits.device)
    _chunk_top_kernel[(b, n)](logits, keys, v, logits.stride(0), n, CHUNK=chunk, K=top,
                              num_warps=NUM_WARPS)
    vals = torch.empty(b, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, k, dtype=torch.int64, device=logits.device)
    _merge_top_kernel[(b,)](keys, vals, ids, n * top, k, K=top, BLOCK=max(next_pow2(n * top), top),
                            num_warps=NUM_WARPS)
    return vals, ids
