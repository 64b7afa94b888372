"""Gumbel-max sampling and greedy arg-max in one pass over the logits.

For each row b the token is argmax_v x[b, v] with
    x = logits + T * g    (T > 0: a Gumbel-max draw from softmax(logits / T))
    x = logits            (T = 0: greedy)
where g[b, v] is Gumbel noise, a pure function of (seeds[b], steps[b], v). The math, and the
noise, are those of the torch reference (minivllm.functional.sampling.gumbel_argmax_reference):
the same 32-bit hashes bit for bit; the float noise agrees to rounding of the logs (a token can
differ only where two candidates are within an ulp).

  logits: [B, V] fp32 / bf16 / fp16, unit stride along V (read in its dtype, computed in fp32)
  temperature: [B] fp32, seeds / steps: [B] int64 -> token ids [B] int64

Two kernels: one program per (row, vocab chunk) writes its chunk's (max, first index of the max);
a one-program-per-row kernel picks the first index of the row's max over the chunks. The max is
exact, so the chunking (chosen from the shape and the GPU) never changes a token: a row's token
does not depend on the batch. Ties go to the lowest id, as torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..functional.sampling import MAX_TEMPERATURE as _MAX_TEMPERATURE
from .launch import interpreting, next_pow2, num_sms, runs_ptx

BLOCK = 1024       # ids per inner step of a program
# Temperatures above this are clamped to it, as the torch sampler clamps them (T * noise must
# stay finite in fp32; functional.sampling says why).
MAX_TEMPERATURE = tl.constexpr(_MAX_TEMPERATURE)
MAX_CHUNK = 8192   # ids per program, at most
NUM_WARPS = 4


@triton.jit
def _hash32(x):
    """lowbias32 (C. Wellons) on uint32, as functional.sampling._hash32 on int64."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _counter_key(seed, step):
    """int64 seed and step -> the row's uint32 key, as functional.sampling.counter_key."""
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = _hash32((step & 0xFFFFFFFF).to(tl.uint32) ^ 0x9E3779B9)
    h = _hash32(h ^ hi)
    h = _hash32(h ^ lo)
    return _hash32(h ^ 0x85EBCA6B)


@triton.jit
def _counter_bits(key, v):
    """The row key and ids v (int32) -> uint32 hashes, as functional.sampling.counter_bits."""
    return _hash32(key ^ (v.to(tl.uint32) * 0x9E3779B9))


@triton.jit
def _log(x, FAST_LOG: tl.constexpr):
    """Natural log. FAST_LOG: the GPU's lg2.approx (absolute error ~1e-7 in log2, a few
    instructions) times ln 2, where tl.log is libdevice's accurate log (~50 instructions): two
    logs an element made the sampler compute-bound at 256 rows (BENCHMARKS.md, session 7)."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def _gumbel(bits, FAST_LOG: tl.constexpr = False):
    """uint32 hashes -> fp32 Gumbel noise, as functional.sampling.gumbel_from_bits: g = -log(E)
    with E = -log(1 - s) exponential, s uniform. Near E = 0 (the large g that win the arg-max)
    E ~ s keeps s's full 32-bit relative precision through the series, where 1 - s in fp32
    would round to 24 bits."""
    s = bits.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10  # 2^-32, 2^-33
    s = tl.minimum(s, 0.99999994)  # bits near 2^32 round s up to 1.0
    series = s * (1.0 + s * (0.5 + s * (0.3333333432674408 + s * (0.25 + s * (0.20000000298023224
                                                                            + s * 0.1666666716337204)))))
    e = tl.where(s < 0.0625, series, -_log(1.0 - s, FAST_LOG))
    return -_log(e, FAST_LOG)


@triton.jit
def _keep_better(s, v, best, best_id):
    """Per-lane running (max, first id of it) of scores s at ids v: lanes see increasing ids,
    so a strict > keeps the first; the lanes are reduced once at the end (_store_chunk_best)."""
    better = s > best
    return tl.where(better, s, best), tl.where(better, v, best_id)


@triton.jit
def _store_chunk_best(best, best_id, val_ptr, idx_ptr, slot):
    """A chunk's max over its lanes and the first id holding it, at `slot`. An all -inf chunk
    (banned ids) still names an in-range id, its first, as torch.argmax would."""
    m = tl.max(best, axis=0)
    tl.store(val_ptr + slot, m)
    tl.store(idx_ptr + slot, tl.min(tl.where(best == m, best_id, 2147483647), axis=0))


@triton.jit
def _partial_argmax_kernel(logits_ptr, temp_ptr, seeds_ptr, steps_ptr, val_ptr, idx_ptr,
                           V, stride_row, num_chunks,
                           CHUNK: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
                           GREEDY: tl.constexpr = False):
    """GREEDY: every row's plain arg-max; temp_ptr, seeds_ptr and steps_ptr are not read."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    if not GREEDY:
        t = tl.minimum(tl.load(temp_ptr + row), MAX_TEMPERATURE)
        key = _counter_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    base = logits_ptr + row.to(tl.int64) * stride_row
    start = chunk * CHUNK
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = start + offs
    for off in range(start, start + CHUNK, BLOCK):
        v = off + offs
        mask = v < V
        x = tl.load(base + v, mask=mask, other=float("-inf")).to(tl.float32)
        if not GREEDY:
            g = _gumbel(_counter_bits(key, v), FAST_LOG)
            x = tl.where(t > 0, x + t * g, x)
        best, best_id = _keep_better(x, v, best, best_id)
    _store_chunk_best(best, best_id, val_ptr, idx_ptr, row * num_chunks + chunk)


@triton.jit
def _final_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, BLOCK_S: tl.constexpr,
                         out2_ptr=None, HAS_OUT2: tl.constexpr = False):
    """HAS_OUT2: the ids are stored at out2_ptr too."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < num_chunks
    vals = tl.load(val_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    ids = tl.load(idx_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    m = tl.max(vals, axis=0)
    # Chunks are in id order and each holds its own first max: the lowest id among the maxima.
    first = tl.min(tl.where((vals == m) & mask, ids, 2147483647), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))
    if HAS_OUT2:
        tl.store(out2_ptr + row, first.to(tl.int64))


def chunk_size(rows: int, vocab: int, device: torch.device, block: int = BLOCK) -> int:
    """Ids per program: MAX_CHUNK when rows alone give the GPU a few waves of programs, smaller
    (down to one block) for few rows. Depends on shapes and the device only."""
    chunk = MAX_CHUNK
    while chunk > block and rows * triton.cdiv(vocab, chunk) < 4 * num_sms(device):
        chunk //= 2
    return max(chunk, block)


def fast_log_default(device: torch.device) -> bool:
    """The approximate log (an inline PTX instruction) on a CUDA GPU; the interpreter runs no PTX."""
    return runs_ptx(device)


def _check_fast_log(fast_log: bool | None, device: torch.device) -> bool:
    if fast_log is None:
        return fast_log_default(device)
    if fast_log and not fast_log_default(device):
        raise ValueError(f"fast_log needs a CUDA GPU (it is a PTX instruction); the logits are on {device}"
                         + (" under TRITON_INTERPRET" if interpreting() else ""))
    return bool(fast_log)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, *, block: int = BLOCK, chunk: int | None = None,
                  fast_log: bool | None = None) -> torch.Tensor:
    """logits [B, V], temperature [B] fp32 (0: greedy; clamped to MAX_TEMPERATURE), seeds / steps
    [B] int64 -> ids [B] int64. As in greedy_argmax, a NaN never wins, where the torch reference
    (sampling.gumbel_argmax_reference, torch.argmax) picks it: the model's logits hold none.
    `block` / `chunk` (a multiple of block) override the tiling, for tests; `fast_log` (default:
    on a CUDA GPU) computes the noise's logs with the GPU's approximate log2."""
    b, v = logits.shape
    assert v < 2**31, "ids are int32 inside the kernel"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = chunk or chunk_size(b, v, logits.device, block)
    fast_log = _check_fast_log(fast_log, logits.device)
    assert chunk % block == 0, (chunk, block)
    n = triton.cdiv(v, chunk)
    vals = torch.empty(b, n, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, n, dtype=torch.int32, device=logits.device)
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    _partial_argmax_kernel[(b, n)](logits, temperature, seeds, steps, vals, ids, v, logits.stride(0), n,
                                   CHUNK=chunk, BLOCK=block, FAST_LOG=fast_log, num_warps=NUM_WARPS)
    _final_argmax_kernel[(b,)](vals, ids, out, n, BLOCK_S=next_pow2(n), num_warps=1)
    return out


def _check_outs(b: int, device: torch.device, out, copy_to) -> None:
    for name, t in (("out", out), ("copy_to", copy_to)):
        if t is not None and (t.shape != (b,) or t.dtype != torch.int64 or t.device != device
                              or t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous int64 [{b}] on {device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")


def greedy_argmax(logits: torch.Tensor, *, out: torch.Tensor | None = None,
                  copy_to: torch.Tensor | None = None, block: int = BLOCK,
                  chunk: int | None = None) -> torch.Tensor:
    """logits [B, V] -> each row's arg-max, ids [B] int64 (into `out` when given, and into
    `copy_to` too, a second [B] int64 destination: a decode graph's next input ids): the
    kernels above without the noise, so no per-row parameters. Ties go to the lowest id, as
    torch.argmax; unlike it, a NaN never wins (rows of the model's logits hold none). In a CUDA
    graph it took 4.0 us at one row of Qwen3's vocabulary, against torch.argmax's 8.4
    (benchmarks/greedy_pick_probe.py, BENCHMARKS.md session 19)."""
    b, v = logits.shape
    assert v < 2**31, "ids are int32 inside the kernel"
    _check_outs(b, logits.device, out, copy_to)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunk = chunk or chunk_size(b, v, logits.device, block)
    assert chunk % block == 0, (chunk, block)
    n = triton.cdiv(v, chunk)
    vals = torch.empty(b, n, dtype=torch.float32, device=logits.device)
    ids = torch.empty(b, n, dtype=torch.int32, device=logits.device)
    _partial_argmax_kernel[(b, n)](logits, logits, logits, logits, vals, ids, v, logits.stride(0),
                                   n, CHUNK=chunk, BLOCK=block, FAST_LOG=False, GREEDY=True,
                                   num_warps=NUM_WARPS)
    return argmax_of_tiles(vals, ids, out=out, copy_to=copy_to)


def argmax_of_tiles(tile_max: torch.Tensor, tile_argmax: torch.Tensor, *,
                    out: torch.Tensor | None = None, copy_to: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """tile_max [B, n] fp32, tile_argmax [B, n] int32: each vocabulary tile's max and the first
    id of it, tiles in id order -> each row's first id of its max, [B] int64 (into `out` and
    `copy_to` as in greedy_argmax). The second half of greedy_argmax, and of a pick whose first
    half another kernel did (kernels.decode_head)."""
    b, n = tile_max.shape
    _check_outs(b, tile_max.device, out, copy_to)
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=tile_max.device)
    block = next_pow2(n)
    _final_argmax_kernel[(b,)](tile_max, tile_argmax, out, n, BLOCK_S=block, out2_ptr=copy_to,
                               HAS_OUT2=copy_to is not None, num_warps=1 if block <= 256 else 4)
    return out


@triton.jit
def _noise_kernel(seeds_ptr, steps_ptr, bits_ptr, noise_ptr, V, BLOCK: tl.constexpr,
                  FAST_LOG: tl.constexpr):
    row = tl.program_id(0)
    key = _counter_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    for off in range(0, V, BLOCK):
        v = off + tl.arange(0, BLOCK)
        bits = _counter_bits(key, v)
        tl.store(bits_ptr + row * V + v, bits.to(tl.int64), mask=v < V)
        tl.store(noise_ptr + row * V + v, _gumbel(bits, FAST_LOG), mask=v < V)


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int,
                 fast_log: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's hashes [B, V] int64 (in [0, 2^32)) and noise [B, V] fp32, written out: only
    for testing them against the torch reference (`fast_log` as in gumbel_argmax)."""
    b = seeds.shape[0]
    bits = torch.empty(b, vocab, dtype=torch.int64, device=seeds.device)
    noise = torch.empty(b, vocab, dtype=torch.float32, device=seeds.device)
    fast_log = _check_fast_log(fast_log, seeds.device)
    _noise_kernel[(b,)](seeds, steps, bits, noise, vocab, BLOCK=256, FAST_LOG=fast_log)
    return bits, noise
