"""One Qwen3 decoder layer at a decode step of 1-2 rows as one persistent kernel (work in
progress, branch layer-kernel; the engine does not call it yet).

The single stream runs a layer as 8 kernels of 2-6 us of launch, ramp-up and tail each for at
most 13 MB (~36 us a layer on the H200, BENCHMARKS.md sessions 7-8). Here one program an SM stays
resident and runs the layer's phases with a grid barrier between them:

  0  x + residual, its RMSNorm (each program norms the whole row itself), this program's qkv rows
  1  attention: (row, KV head, split) units: q/k RMSNorm + RoPE, K/V stored, split partials
     (decode_attention's _decode_unit)
  2  the splits merged per (row, head) (decode_attention's _merge_unit)
  3  this program's o_proj rows
  4  y + residual, its RMSNorm, gate and up for this program's intermediate columns, SiLU * up
  5  this program's down rows

Session 15's probe (benchmarks/layer_kernel_probe.py) measured a grid barrier at ~1 us, and the
layer's four GEMVs in one such launch at 17.5 us against ~22 for the engine's four kernels and
their gaps. This kernel (benchmarks/decode_layer_probe.py, H200): 31.3 us a layer at one row and
a 600-token context, against ~36 for the engine's compiled layer in its traces; it does not yet
load the next phase's weights before each barrier, as the probe's fastest form does. Values are
rounded to the activation dtype wherever functional.layer.decoder_layer rounds them.

On the CPU, Triton's interpreter runs programs one after another, so a spin barrier could never
return: there the kernel is launched once per phase (the same phase code; the launch boundary is
the barrier). On a GPU the whole grid must be resident at once: one program an SM, nothing else
running beside it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..state.batch import Batch
from ..state.config import FP8_DTYPES, ModelConfig
from ..state.params import LayerParams
from .decode_attention import LOG2E, MAX_SPLITS, _decode_unit, _merge_unit
from .launch import cuda_capability, dot_precision, next_pow2, num_sms, runs_ptx

MAX_ROWS = 2  # the single stream's decode bucket
PHASES = 6
BLOCK_K = 256  # GEMV columns a load
SPLIT_TOKENS = 64  # attention: tokens a split, about (the single stream's contexts are ~600)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid arrives before any leaves (all programs must be resident).
    The counter only grows: barrier k of a launch waits for base + k * programs arrivals."""
    tl.debug_barrier()  # this program's threads are done with the phase
    tl.atomic_add(counter_ptr, 1, sem="release")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _added(x_ptr, res_ptr, offs, mask, HAS_RES: tl.constexpr):
    """x (+ residual, rounded to x's dtype as the reference's add is) at offs of one row."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
             ).to(x.dtype)
    return x


@triton.jit
def _row_rms(x_ptr, res_ptr, K: tl.constexpr, eps, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    """1 / RMS of one row of K values (x + residual); every program computes it for itself."""
    offs = tl.arange(0, BLOCK)
    xf = _added(x_ptr, res_ptr, offs, offs < K, HAS_RES).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / K + eps)


@triton.jit
def _input_chunk(x_ptr, res_ptr, nw_ptr, rms, k0, K: tl.constexpr, BK: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """Columns [k0, k0 + BK) of one GEMV input row, fp32: x as stored or, NORM, RMSNorm(x +
    residual) * weight, rounded where functional.norm.rms_norm rounds."""
    offs = k0 + tl.arange(0, BK)
    mask = offs < K
    x = _added(x_ptr, res_ptr, offs, mask, HAS_RES and NORM)
    if NORM:
        n = (x.to(tl.float32) * rms).to(x.dtype)
        x = (tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32) * n.to(tl.float32)
             ).to(x.dtype)
    return x.to(tl.float32)


@triton.jit
def _gemv(w_ptr, row0, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr, x_ptr, res_ptr, nw_ptr,
          rms0, rms1, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
          HAS_RES: tl.constexpr):
    """Rows [row0, row0 + R) of W: [N, K] (row-major) times each input row ([M, K], M <= 2):
    (acc0, acc1), [BN] fp32 each; rows past R or N are zero."""
    offs_n = tl.arange(0, BN)
    rows = row0 + offs_n
    rmask = (offs_n < R) & (rows < N)
    acc0 = tl.zeros([BN], tl.float32)
    acc1 = tl.zeros([BN], tl.float32)
    for k0 in tl.static_range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :],
                    mask=rmask[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        x0 = _input_chunk(x_ptr, res_ptr, nw_ptr, rms0, k0, K, BK, NORM, HAS_RES)
        acc0 += tl.sum(w * x0[None, :], 1)
        if M > 1:
            x1 = _input_chunk(x_ptr + K, res_ptr + K, nw_ptr, rms1, k0, K, BK, NORM, HAS_RES)
            acc1 += tl.sum(w * x1[None, :], 1)
    return acc0, acc1


@triton.jit
def _store_row_block(y_ptr, row0, R: tl.constexpr, N: tl.constexpr, acc0, acc1,
                     M: tl.constexpr, BN: tl.constexpr):
    """acc0 / acc1 into rows [row0, row0 + R) of y's row 0 / 1 (y: [M, N])."""
    offs_n = tl.arange(0, BN)
    cols = row0 + offs_n
    mask = (offs_n < R) & (cols < N)
    tl.store(y_ptr + cols, acc0.to(y_ptr.dtype.element_ty), mask=mask)
    if M > 1:
        tl.store(y_ptr + N + cols, acc1.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_sum(out_ptr, x_ptr, res_ptr, col0, R: tl.constexpr, H: tl.constexpr,
               M: tl.constexpr, BR: tl.constexpr, HAS_RES: tl.constexpr):
    """Columns [col0, col0 + R) of x + residual: the residual stream after this add."""
    offs = col0 + tl.arange(0, BR)
    mask = (tl.arange(0, BR) < R) & (offs < H)
    tl.store(out_ptr + offs, _added(x_ptr, res_ptr, offs, mask, HAS_RES), mask=mask)
    if M > 1:
        tl.store(out_ptr + H + offs, _added(x_ptr + H, res_ptr + H, offs, mask, HAS_RES),
                 mask=mask)


@triton.jit
def _silu_mul(g, u, dt: tl.constexpr):
    """silu(gate) * up from fp32 sums, each rounded to dt where the reference's tensors are."""
    g = g.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt)
    return (s.to(tl.float32) * u.to(dt).to(tl.float32)).to(dt)


@triton.jit
def _decode_layer_kernel(
        counter_ptr, x_ptr, res_ptr, res1_ptr, res2_ptr, qkv_ptr, part_out_ptr, part_lse_ptr,
        attn_ptr, y_ptr, act_ptr, out_ptr,
        in_norm_ptr, w_qkv_ptr, q_norm_ptr, k_norm_ptr, w_o_ptr, post_norm_ptr, w_gu_ptr,
        w_down_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr, cos_ptr, sin_ptr,
        eps, scale_log2, stride_bt, stride_rope,
        M: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr,
        R_QKV: tl.constexpr, BN_QKV: tl.constexpr, R_H: tl.constexpr, BN_H: tl.constexpr,
        R_I: tl.constexpr, BN_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, HAS_RES: tl.constexpr,
        PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, FP8_CACHE: tl.constexpr,
        PTX_WIDEN: tl.constexpr, PHASE: tl.constexpr):
    """PHASE -1: every phase, a grid barrier after each; 0-5: that phase only. R_*: rows (or
    columns) a program of qkv's output, the hidden size, the intermediate size; BN_*: those
    padded to a power of two. BLOCK_*: the hidden size, head_dim, the query heads of a KV head
    (at least 16, for tl.dot) and the splits, padded to powers of two."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    eps = tl.cast(eps, tl.float32)
    scale_log2 = tl.cast(scale_log2, tl.float32)
    dt = x_ptr.dtype.element_ty
    QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ATT: tl.constexpr = HEADS * HEAD_DIM
    GROUP: tl.constexpr = HEADS // KV_HEADS
    base = 0
    if PHASE == -1:
        base = tl.atomic_add(counter_ptr, 0) // programs * programs  # see _grid_barrier

    if (PHASE == -1) or (PHASE == 0):  # the residual stream, its norm, qkv
        _store_sum(res1_ptr, x_ptr, res_ptr, pid * R_H, R_H, H, M, BN_H, HAS_RES)
        rms0 = _row_rms(x_ptr, res_ptr, H, eps, BLOCK_H, HAS_RES)
        rms1 = rms0
        if M > 1:
            rms1 = _row_rms(x_ptr + H, res_ptr + H, H, eps, BLOCK_H, HAS_RES)
        acc0, acc1 = _gemv(w_qkv_ptr, pid * R_QKV, R_QKV, QKV, H, x_ptr, res_ptr, in_norm_ptr,
                           rms0, rms1, M, BN_QKV, BK, True, HAS_RES)
        _store_row_block(qkv_ptr, pid * R_QKV, R_QKV, QKV, acc0, acc1, M, BN_QKV)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + programs)

    if (PHASE == -1) or (PHASE == 1):  # attention, split partials
        for unit in range(pid, M * KV_HEADS * SPLITS, programs):
            split = unit % SPLITS
            kvh = (unit // SPLITS) % KV_HEADS
            b = unit // (SPLITS * KV_HEADS)
            _decode_unit(b, kvh, split, qkv_ptr, qkv_ptr + ATT, qkv_ptr + ATT + KV_HEADS * HEAD_DIM,
                         k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr, q_norm_ptr,
                         k_norm_ptr, cos_ptr, sin_ptr, eps, attn_ptr, part_out_ptr, part_lse_ptr,
                         scale_log2, SPLITS, QKV, HEAD_DIM, QKV, HEAD_DIM, QKV, HEAD_DIM,
                         stride_bt, stride_rope, ATT, HEAD_DIM, KV_HEADS, GROUP, HEAD_DIM,
                         BLOCK_G, BLOCK_D, PAGE, BLOCK_N, True, True, True, PRECISION, F16_DOTS,
                         FP8_CACHE, PTX_WIDEN, False)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 2 * programs)

    if (PHASE == -1) or (PHASE == 2):  # the splits merged
        for unit in range(pid, M * HEADS, programs):
            _merge_unit(unit // HEADS, unit % HEADS, part_out_ptr, part_lse_ptr, attn_ptr, ATT,
                        HEAD_DIM, SPLITS, HEADS, HEAD_DIM, BLOCK_S, BLOCK_D)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 3 * programs)

    if (PHASE == -1) or (PHASE == 3):  # o_proj
        acc0, acc1 = _gemv(w_o_ptr, pid * R_H, R_H, H, ATT, attn_ptr, attn_ptr, attn_ptr, 1.0,
                           1.0, M, BN_H, BK, False, False)
        _store_row_block(y_ptr, pid * R_H, R_H, H, acc0, acc1, M, BN_H)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 4 * programs)

    if (PHASE == -1) or (PHASE == 4):  # the residual stream again, its norm, gate * up
        _store_sum(res2_ptr, y_ptr, res1_ptr, pid * R_H, R_H, H, M, BN_H, True)
        rms0 = _row_rms(y_ptr, res1_ptr, H, eps, BLOCK_H, True)
        rms1 = rms0
        if M > 1:
            rms1 = _row_rms(y_ptr + H, res1_ptr + H, H, eps, BLOCK_H, True)
        g0, g1 = _gemv(w_gu_ptr, pid * R_I, R_I, INTER, H, y_ptr, res1_ptr, post_norm_ptr, rms0,
                       rms1, M, BN_I, BK, True, True)
        u0, u1 = _gemv(w_gu_ptr + INTER * H, pid * R_I, R_I, INTER, H, y_ptr, res1_ptr,
                       post_norm_ptr, rms0, rms1, M, BN_I, BK, True, True)
        _store_row_block(act_ptr, pid * R_I, R_I, INTER, _silu_mul(g0, u0, dt),
                         _silu_mul(g1, u1, dt), M, BN_I)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 5 * programs)

    if (PHASE == -1) or (PHASE == 5):  # down
        acc0, acc1 = _gemv(w_down_ptr, pid * R_H, R_H, H, INTER, act_ptr, act_ptr, act_ptr, 1.0,
                           1.0, M, BN_H, BK, False, False)
        _store_row_block(out_ptr, pid * R_H, R_H, H, acc0, acc1, M, BN_H)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 6 * programs)


def decode_layer(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: Batch, *, config: ModelConfig, programs: int | None = None,
                 phase_by_phase: bool | None = None, num_warps: int = 8,
                 block_k: int = BLOCK_K
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.layer.decoder_layer for a decode batch of M <= MAX_ROWS rows on one GPU, as
    one persistent launch (phase_by_phase: one launch per phase; the default under the CPU
    interpreter). Returns (down's output [M, hidden], the residual stream [M, hidden]) and
    writes this step's K/V into the caches, as decoder_layer does. x must be [M, hidden]
    (summed, not split-K partials)."""
    m, hidden = x.shape
    if not batch.is_decode or m > MAX_ROWS or m != batch.context_lens.shape[0]:
        raise ValueError(f"decode_layer takes a decode batch of at most {MAX_ROWS} rows, got "
                         f"{m} rows (decode: {batch.is_decode})")
    if x.dim() != 2 or hidden != config.hidden_size:
        raise ValueError(f"x must be [rows, {config.hidden_size}], got {tuple(x.shape)}")
    dev, dt = x.device, x.dtype
    d, heads, kv_heads, inter = config.head_dim, config.num_heads, config.num_kv_heads, \
        config.intermediate_size
    qkv_size = (heads + 2 * kv_heads) * d
    programs = programs or num_sms(dev)
    if phase_by_phase is None:
        phase_by_phase = not runs_ptx(dev)
    max_context = batch.block_tables.shape[1] * k_cache.shape[1]
    splits = max(1, min(MAX_SPLITS, -(-max_context // SPLIT_TOKENS), programs // (m * kv_heads)))
    empty = lambda *shape, dtype=dt: torch.empty(*shape, device=dev, dtype=dtype)  # noqa: E731
    res1, res2, y, out = empty(m, hidden), empty(m, hidden), empty(m, hidden), empty(m, hidden)
    qkv, attn, act = empty(m, qkv_size), empty(m, heads * d), empty(m, inter)
    part_out = empty(m, heads, splits, d, dtype=torch.float32)
    part_lse = empty(m, heads, splits, dtype=torch.float32)
    counter = torch.zeros(1, device=dev, dtype=torch.int32)
    fp8 = k_cache.dtype in FP8_DTYPES
    f16_dots = fp8 and dt.itemsize == 2
    rows = dict(R_QKV=-(-qkv_size // programs), R_H=-(-hidden // programs),
                R_I=-(-inter // programs))
    rows |= {f"BN_{k[2:]}": next_pow2(v) for k, v in list(rows.items())}
    consts = dict(
        M=m, H=hidden, INTER=inter, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, SPLITS=splits,
        PAGE=k_cache.shape[1], BLOCK_N=64 if runs_ptx(dev) else 16,
        BK=min(block_k, next_pow2(max(hidden, inter))), **rows, BLOCK_H=next_pow2(hidden),
        BLOCK_D=next_pow2(d), BLOCK_G=max(16, next_pow2(heads // kv_heads)),
        BLOCK_S=max(2, next_pow2(splits)),
        HAS_RES=residual is not None,
        PRECISION=dot_precision(torch.float16 if f16_dots else dt), F16_DOTS=f16_dots,
        FP8_CACHE=fp8, PTX_WIDEN=int(fp8 and f16_dots and cuda_capability(dev) >= (8, 9)))
    args = (counter, x, residual if residual is not None else x, res1, res2, qkv, part_out,
            part_lse, attn, y, act, out, lp.input_norm, lp.qkv, lp.q_norm, lp.k_norm, lp.o_proj,
            lp.post_norm, lp.gate_up, lp.down, k_cache, v_cache, batch.block_tables,
            batch.context_lens, batch.slot_mapping, cos, sin, float(config.rms_norm_eps),
            d ** -0.5 * LOG2E, batch.block_tables.stride(0), cos.stride(0))
    for phase in range(PHASES) if phase_by_phase else (-1,):
        _decode_layer_kernel[(programs,)](*args, **consts, PHASE=phase, num_warps=num_warps)
    return out, res2


def persistent_decoder_layer(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                             cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, batch: Batch, *, config: ModelConfig, shard,
                             backend) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.decoder_layer's signature: decode_layer for a decode batch of at most MAX_ROWS
    rows on one rank, decoder_layer itself for anything else (prefill, larger batches)."""
    from ..functional.layer import decoder_layer
    from ..functional.linear import sum_partials

    if batch.is_decode and batch.num_seqs <= MAX_ROWS and shard.world_size == 1:
        x = sum_partials(x, x.dtype if residual is None else residual.dtype)
        return decode_layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, config=config)
    return decoder_layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, config=config,
                         shard=shard, backend=backend)
