"""Qwen3's decoder layers at a decode step of 1-2 rows as one persistent kernel (the engine's
decode steps of 1-2 sequences on one GPU, persistent_decode; on by default there).

The single stream runs a layer as 8 kernels of 2-6 us of launch, ramp-up and tail each for at
most 13 MB (~36 us a layer on the H200, BENCHMARKS.md sessions 7-8). Here one program an SM stays
resident and runs each layer's phases with a grid barrier between them, every layer of the model
in one launch (_decode_stack_kernel; layer l's weight and cache addresses from a table,
layer_table):

  0  x + residual, its RMSNorm (each program norms the whole row itself), this program's qkv rows
  1  attention: (row, KV head, split) units: q/k RMSNorm + RoPE, K/V stored, split partials
     (decode_attention's _decode_unit)
  2  the splits merged per (row, head) (decode_attention's _merge_unit)
  3  this program's o_proj rows
  4  y + residual, its RMSNorm, gate and up for this program's intermediate columns, SiLU * up
  5  this program's down rows

Each GEMV's weights are loaded before the barrier ahead of its phase, after the program arrives
there (arrive_first), so that the loads' issue overlaps the wait; gate/up's already during the
merge, where the DRAM idles (gate_up_early), and the next layer's qkv during down
(prefetch_next); at one row each program also loads its first attention tile's cached K/V
between the barrier's arrival and departure (kv_early). At the 0.6B shape every GEMV's row
block is one load (chunk_columns). Layer 0 reads the stem's x and residual where they are, and
the barrier counter only grows, so a step copies and zeroes nothing before the launch. On the
H200 (BENCHMARKS.md sessions 16-19, benchmarks/decode_layer_probe.py) the stack runs 24.4-24.5
us a layer at one row and a 600-token context (25.2 without kv_early, 28.0-28.2 with every
placement off), 33.0 at two rows (38.0), and the engine's single stream 1,278-1,299 tok/s
(session 20, between decode_stem's stem and decode_head's head, with the graph's greedy pick)
against 905-910 with the compiled layers. Inside the single launch (decode_stack's timeline:
%globaltimer at every barrier) a layer's 24.5 us span as: qkv 3.1, attention 5.4, merge 5.2
(16 programs merge, the slowest 3.5 us), o_proj 2.2, gate/up 5.6, down 3.0. From the last
arrival to the median departure a barrier takes 0.7 us, or 1.0-2.0 where the programs issue
loads after arriving (the departure follows the issue: gate/up's 12.6 MB after the merge, the
next qkv's 8.4 MB after down).
Measured slower and left out: L2 prefetches of the later phases' weights (+5.4 us a layer) or
of the next layer's cache rows (+2.4), the last split merging its heads in place of the merge
phase (+2.1), barriers that poll with acquire loads or per-program flags (1.50 and 1.38 us a
barrier against the atomic counter's 1.07), down's weights loaded during o_proj (+6.4), o_proj's
and gate/up's at the barrier before the merge (+0.7), and o_proj run in the merge phase by head
with one barrier a layer fewer (+1.8); sessions 17-19 (the last two on branches s19-both and
merge-by-head).
Values are rounded to the activation dtype wherever functional.layer.decoder_layer rounds them.

On the CPU, Triton's interpreter runs programs one after another, so a spin barrier among several
programs could never return: there the kernel is launched once per layer and phase (the same
phase code; the launch boundary is the barrier), or as one launch of one program, whose barriers
pass (the tests run both). On a GPU the whole grid must be resident at once (one program an SM):
it is a cooperative launch, which the driver refuses rather than start a grid that cannot be.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
import triton
import triton.language as tl

from ..functional.layer import decoder_layer
from ..state.batch import Batch
from ..state.cache import KVCache
from ..state.config import FP8_DTYPES, ModelConfig
from ..state.params import LayerParams, Params
from .decode_attention import LOG2E, MAX_SPLITS, _decode_unit, _first_tile, _merge_unit
from .launch import cuda_capability, dot_block, dot_precision, next_pow2, num_sms, runs_ptx

MAX_ROWS = 2  # the single stream's decode bucket
PHASES = 6
LAYER_PHASES = tl.constexpr(PHASES)  # the same, for the kernels
TABLE_COLUMNS = tl.constexpr(10)  # layer_table: 8 weights, then the K and V caches
# A GEMV load's weights (64 KB of bf16, 64 registers a thread at 8 warps), its columns as many
# as that allows: at Qwen3-0.6B's shape o_proj (8 rows x 2048) and down (8 x 4096) then take
# their row block in one load, 28.4-28.5 against 29.5 us a layer (BENCHMARKS.md session 17);
# qkv and gate/up (32 rows x 1024) already did. Until session 74 a load was at least 1,024
# columns wide whatever its rows: at Qwen3-1.7B's gate/up (64 rows) twice this (HELD_WEIGHTS).
CHUNK_WEIGHTS = 32768
MIN_COLUMNS = 128  # 256 bytes a row of 16-bit weights
# o_proj's, gate's and up's first loads are held together from the merge phase on
# (gate_up_early): at most this many weights, Qwen3-0.6B's 8 x 2048 + 2 x 32 x 1024, whose stack
# compiles for sm_90 without spills at one row. At Qwen3-1.7B's width the loads of the earlier
# rule (16 x 2048 + 2 x 64 x 1024) spilled 1,776 bytes a thread; with load_columns' 44 (Qwen3-4B
# 4,348 -> 112; Qwen3-8B 5,652 -> 1,578, its 4,096-wide rows then unrolled in 32 loads of 128:
# BENCHMARKS.md session 74, benchmarks/stack_spills.py). Qwen3-1.7B's single stream with the stack
# on an H100: 368 tok/s against 214 with the earlier rule, still under the compiled layers' 496
# (session 75): ~71 us a layer for its 101 MB of weights (~1.4 TB/s of the H100's ~3.0), where the
# compiled layers take ~44 (~2.3): at this width the GEMVs' reading rate, not launches, decides.
HELD_WEIGHTS = 81920
SPLIT_TOKENS = 64  # attention: tokens a split, about (the single stream's contexts are ~600)
# decode_stack's weight-load placement flags, every one off (its defaults turn three on)
LOADS_OFF = dict(prefetch_next=False, gate_up_early=False, arrive_first=False, kv_early=False)


@triton.jit
def _globaltimer():
    """The GPU's nanosecond clock, common to every SM (PTX %globaltimer; not in the interpreter)."""
    # one input, unused: older Tritons need an argument to shape the result by
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.program_id(0)],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _grid_arrive(counter_ptr, stamp_ptr, TIMELINE: tl.constexpr):
    """This program's arrival at a grid barrier (its threads done with the phase; the counter
    only grows). TIMELINE: the time stored at stamp_ptr."""
    tl.debug_barrier()
    if TIMELINE:
        tl.store(stamp_ptr, _globaltimer())
    tl.atomic_add(counter_ptr, 1, sem="release")


@triton.jit
def _grid_wait(counter_ptr, target, stamp_ptr, programs, TIMELINE: tl.constexpr):
    """Until target arrivals (barrier k of a launch: base + k * programs; every program must be
    resident). TIMELINE: the time it left stored at stamp_ptr + programs."""
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire")
    tl.debug_barrier()
    if TIMELINE:
        tl.store(stamp_ptr + programs, _globaltimer())


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program of the grid arrives before any leaves."""
    _grid_arrive(counter_ptr, counter_ptr, False)
    _grid_wait(counter_ptr, target, counter_ptr, 0, False)


@triton.jit
def _arrive_if(ARRIVE: tl.constexpr, counter_ptr, stamp_ptr, TIMELINE: tl.constexpr):
    if ARRIVE:
        _grid_arrive(counter_ptr, stamp_ptr, TIMELINE)


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
def _weight_chunk(w_ptr, row0, k0, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr):
    """Rows [row0, row0 + R) and columns [k0, k0 + BK) of W: [N, K] (row-major), zeros past
    R, N or K. A phase's first chunk is loaded before the barrier ahead of it: weights never
    depend on the previous phase, so the barrier's wait overlaps their arrival."""
    offs_n = tl.arange(0, BN)
    rows = row0 + offs_n
    offs_k = k0 + tl.arange(0, BK)
    mask = ((offs_n < R) & (rows < N))[:, None] & (offs_k < K)[None, :]
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv(w_first, w_ptr, row0, R: tl.constexpr, N: tl.constexpr, K: tl.constexpr, x_ptr,
          res_ptr, nw_ptr, rms0, rms1, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
          NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """Rows [row0, row0 + R) of W: [N, K] times each input row ([M, K], M <= 2): (acc0, acc1),
    [BN] fp32 each; rows past R or N are zero. w_first: the first BK columns, already loaded."""
    w = w_first.to(tl.float32)
    acc0 = tl.sum(w * _input_chunk(x_ptr, res_ptr, nw_ptr, rms0, 0, K, BK, NORM, HAS_RES)[None, :],
                  1)
    acc1 = tl.zeros([BN], tl.float32)
    if M > 1:
        acc1 += tl.sum(w * _input_chunk(x_ptr + K, res_ptr + K, nw_ptr, rms1, 0, K, BK, NORM,
                                        HAS_RES)[None, :], 1)
    for k0 in tl.static_range(BK, K, BK):
        w = _weight_chunk(w_ptr, row0, k0, R, N, K, BN, BK).to(tl.float32)
        acc0 += tl.sum(w * _input_chunk(x_ptr, res_ptr, nw_ptr, rms0, k0, K, BK, NORM,
                                        HAS_RES)[None, :], 1)
        if M > 1:
            acc1 += tl.sum(w * _input_chunk(x_ptr + K, res_ptr + K, nw_ptr, rms1, k0, K, BK,
                                            NORM, HAS_RES)[None, :], 1)
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
def _project_rows(w_first, w_ptr, x_ptr, y_ptr, row0, R: tl.constexpr, N: tl.constexpr,
                  K: tl.constexpr, M: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows [row0, row0 + R) of y = x @ W.T, no norm on x (o_proj, down): _gemv, then
    _store_row_block. w_first: W's first BK columns of those rows, already loaded."""
    acc0, acc1 = _gemv(w_first, w_ptr, row0, R, N, K, x_ptr, x_ptr, x_ptr, 1.0, 1.0, M, BN, BK,
                       False, False)
    _store_row_block(y_ptr, row0, R, N, acc0, acc1, M, BN)


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
def _gate_up_rows(w_gate_ptr, w_up_ptr, pid, H: tl.constexpr, INTER: tl.constexpr,
                  R_I: tl.constexpr, BN_I: tl.constexpr, BK_H: tl.constexpr):
    """Program pid's first gate and up weight chunks (its R_I intermediate rows of each)."""
    return (_weight_chunk(w_gate_ptr, pid * R_I, 0, R_I, INTER, H, BN_I, BK_H),
            _weight_chunk(w_up_ptr, pid * R_I, 0, R_I, INTER, H, BN_I, BK_H))


@triton.jit
def _unit_coords(unit, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr):
    """Attention unit `unit`'s (row, KV head, split): the splits of a KV head side by side."""
    return unit // (SPLITS * KV_HEADS), (unit // SPLITS) % KV_HEADS, unit % SPLITS


@triton.jit
def _attention_unit(unit, qkv_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr,
                    q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, eps, attn_ptr, part_out_ptr,
                    part_lse_ptr, scale_log2, stride_bt, stride_rope, HEADS: tl.constexpr,
                    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_G: tl.constexpr, PRECISION: tl.constexpr, F16_DOTS: tl.constexpr,
                    FP8_CACHE: tl.constexpr, PTX_WIDEN: tl.constexpr, kt0, vt0,
                    EARLY_TILE: tl.constexpr):
    """decode_attention's _decode_unit for attention unit `unit` over the [M, QKV] qkv rows
    (q/k normed and rotated, the new K/V stored, the split's partials written)."""
    QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ATT: tl.constexpr = HEADS * HEAD_DIM
    b, kvh, split = _unit_coords(unit, KV_HEADS, SPLITS)
    _decode_unit(b, kvh, split, qkv_ptr, qkv_ptr + ATT, qkv_ptr + ATT + KV_HEADS * HEAD_DIM,
                 k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr, q_norm_ptr, k_norm_ptr,
                 cos_ptr, sin_ptr, eps, attn_ptr, part_out_ptr, part_lse_ptr, scale_log2, SPLITS,
                 QKV, HEAD_DIM, QKV, HEAD_DIM, QKV, HEAD_DIM, stride_bt, stride_rope, ATT,
                 HEAD_DIM, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM, BLOCK_G, BLOCK_D, PAGE, BLOCK_N,
                 True, True, True, PRECISION, F16_DOTS, FP8_CACHE, PTX_WIDEN, False, kt0, vt0,
                 EARLY_TILE)


@triton.jit
def _layer_phases(
        pid, programs, base, w_qkv_first, next_qkv_ptr, counter_ptr, stamp_ptr, x_ptr, res_ptr,
        res1_ptr, res2_ptr, qkv_ptr, part_out_ptr, part_lse_ptr, attn_ptr, y_ptr, act_ptr, out_ptr,
        in_norm_ptr, w_qkv_ptr, q_norm_ptr, k_norm_ptr, w_o_ptr, post_norm_ptr, w_gu_ptr,
        w_down_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr, cos_ptr, sin_ptr,
        eps, scale_log2, stride_bt, stride_rope,
        M: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BK_H: tl.constexpr, BK_ATT: tl.constexpr,
        BK_I: tl.constexpr,
        R_QKV: tl.constexpr, BN_QKV: tl.constexpr, R_H: tl.constexpr, BN_H: tl.constexpr,
        R_I: tl.constexpr, BN_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, HAS_RES: tl.constexpr,
        PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, FP8_CACHE: tl.constexpr,
        PTX_WIDEN: tl.constexpr, PREFETCH_NEXT: tl.constexpr, GATE_UP_EARLY: tl.constexpr,
        ARRIVE_FIRST: tl.constexpr, KV_EARLY: tl.constexpr,
        TIMELINE: tl.constexpr, PHASE: tl.constexpr):
    """One layer, as program pid of `programs`. PHASE -1: every phase, the k-th grid barrier
    after it waiting for base + k * programs arrivals; 0-5: that phase only. PREFETCH_NEXT (with
    PHASE -1): w_qkv_first is this layer's first qkv weight chunk, loaded by the caller, and the
    next layer's (at next_qkv_ptr) is loaded before the last barrier and returned; otherwise a
    zero tile is returned. TIMELINE (PHASE -1): the k-th barrier's (k = 0..5) arrival and
    departure times stored at stamp_ptr + 2k * programs and + (2k + 1) * programs (decode_stack's
    timeline). R_*: rows (or columns) a program of qkv's output, the hidden size, the
    intermediate size; BN_*: those padded to a power of two. BLOCK_*: the hidden size, head_dim,
    the query heads of a KV head (at least 16, for tl.dot) and the splits, padded to powers of
    two."""
    eps = tl.cast(eps, tl.float32)
    scale_log2 = tl.cast(scale_log2, tl.float32)
    dt = x_ptr.dtype.element_ty
    QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    ATT: tl.constexpr = HEADS * HEAD_DIM

    if (PHASE == -1) or (PHASE == 0):  # the residual stream, its norm, qkv
        _store_sum(res1_ptr, x_ptr, res_ptr, pid * R_H, R_H, H, M, BN_H, HAS_RES)
        rms0 = _row_rms(x_ptr, res_ptr, H, eps, BLOCK_H, HAS_RES)
        rms1 = rms0
        if M > 1:
            rms1 = _row_rms(x_ptr + H, res_ptr + H, H, eps, BLOCK_H, HAS_RES)
        if PREFETCH_NEXT and (PHASE == -1):
            w = w_qkv_first
        else:
            w = _weight_chunk(w_qkv_ptr, pid * R_QKV, 0, R_QKV, QKV, H, BN_QKV, BK_H)
        acc0, acc1 = _gemv(w, w_qkv_ptr, pid * R_QKV, R_QKV, QKV, H, x_ptr, res_ptr, in_norm_ptr,
                           rms0, rms1, M, BN_QKV, BK_H, True, HAS_RES)
        _store_row_block(qkv_ptr, pid * R_QKV, R_QKV, QKV, acc0, acc1, M, BN_QKV)
    UNITS: tl.constexpr = M * KV_HEADS * SPLITS
    if PHASE == -1:
        _grid_arrive(counter_ptr, stamp_ptr, TIMELINE)
        if KV_EARLY:  # the prefix's rows never depend on this layer's qkv
            b, kvh, split = _unit_coords(tl.minimum(pid, UNITS - 1), KV_HEADS, SPLITS)
            kt0, vt0 = _first_tile(b, kvh, split, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                                   stride_bt, SPLITS, tl.float16 if F16_DOTS else dt, KV_HEADS,
                                   HEAD_DIM, BLOCK_D, PAGE, BLOCK_N, PTX_WIDEN, FP8_CACHE)
        _grid_wait(counter_ptr, base + programs, stamp_ptr, programs, TIMELINE)

    if (PHASE == -1) or (PHASE == 1):  # attention, split partials
        first = pid
        if KV_EARLY and (PHASE == -1):
            if pid < UNITS:
                _attention_unit(pid, qkv_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                                slot_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, eps,
                                attn_ptr, part_out_ptr, part_lse_ptr, scale_log2, stride_bt,
                                stride_rope, HEADS, KV_HEADS, HEAD_DIM, SPLITS, PAGE, BLOCK_N,
                                BLOCK_D, BLOCK_G, PRECISION, F16_DOTS, FP8_CACHE, PTX_WIDEN,
                                kt0, vt0, True)
            first += programs
        for unit in range(first, UNITS, programs):
            _attention_unit(unit, qkv_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr, slot_ptr,
                            q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, eps, attn_ptr,
                            part_out_ptr, part_lse_ptr, scale_log2, stride_bt, stride_rope,
                            HEADS, KV_HEADS, HEAD_DIM, SPLITS, PAGE, BLOCK_N, BLOCK_D, BLOCK_G,
                            PRECISION, F16_DOTS, FP8_CACHE, PTX_WIDEN, 0, 0, False)
    if PHASE == -1:
        _grid_arrive(counter_ptr, stamp_ptr + 2 * programs, TIMELINE)
        _grid_wait(counter_ptr, base + 2 * programs, stamp_ptr + 2 * programs, programs,
                   TIMELINE)

    if (PHASE == -1) or (PHASE == 2):  # the splits merged
        for unit in range(pid, M * HEADS, programs):
            _merge_unit(unit // HEADS, unit % HEADS, part_out_ptr, part_lse_ptr, attn_ptr, ATT,
                        HEAD_DIM, SPLITS, HEADS, HEAD_DIM, BLOCK_S, BLOCK_D)
    w_up_ptr = w_gu_ptr + INTER * H
    if PHASE == -1:
        _arrive_if(ARRIVE_FIRST, counter_ptr, stamp_ptr + 4 * programs, TIMELINE)
        w = _weight_chunk(w_o_ptr, pid * R_H, 0, R_H, H, ATT, BN_H, BK_ATT)
        if GATE_UP_EARLY:  # the DRAM and all but the merging programs are idle here
            w_gate, w_up = _gate_up_rows(w_gu_ptr, w_up_ptr, pid, H, INTER, R_I, BN_I, BK_H)
        _arrive_if(not ARRIVE_FIRST, counter_ptr, stamp_ptr + 4 * programs, TIMELINE)
        _grid_wait(counter_ptr, base + 3 * programs, stamp_ptr + 4 * programs, programs,
                   TIMELINE)

    if (PHASE == -1) or (PHASE == 3):  # o_proj
        if PHASE == 3:
            w = _weight_chunk(w_o_ptr, pid * R_H, 0, R_H, H, ATT, BN_H, BK_ATT)
        _project_rows(w, w_o_ptr, attn_ptr, y_ptr, pid * R_H, R_H, H, ATT, M, BN_H, BK_ATT)
    if PHASE == -1:
        _arrive_if(ARRIVE_FIRST, counter_ptr, stamp_ptr + 6 * programs, TIMELINE)
        if GATE_UP_EARLY:
            w = w_gate
        else:
            w, w_up = _gate_up_rows(w_gu_ptr, w_up_ptr, pid, H, INTER, R_I, BN_I, BK_H)
        _arrive_if(not ARRIVE_FIRST, counter_ptr, stamp_ptr + 6 * programs, TIMELINE)
        _grid_wait(counter_ptr, base + 4 * programs, stamp_ptr + 6 * programs, programs,
                   TIMELINE)

    if (PHASE == -1) or (PHASE == 4):  # the residual stream again, its norm, gate * up
        if PHASE == 4:
            w, w_up = _gate_up_rows(w_gu_ptr, w_up_ptr, pid, H, INTER, R_I, BN_I, BK_H)
        _store_sum(res2_ptr, y_ptr, res1_ptr, pid * R_H, R_H, H, M, BN_H, True)
        rms0 = _row_rms(y_ptr, res1_ptr, H, eps, BLOCK_H, True)
        rms1 = rms0
        if M > 1:
            rms1 = _row_rms(y_ptr + H, res1_ptr + H, H, eps, BLOCK_H, True)
        g0, g1 = _gemv(w, w_gu_ptr, pid * R_I, R_I, INTER, H, y_ptr, res1_ptr, post_norm_ptr,
                       rms0, rms1, M, BN_I, BK_H, True, True)
        u0, u1 = _gemv(w_up, w_up_ptr, pid * R_I, R_I, INTER, H, y_ptr, res1_ptr,
                       post_norm_ptr, rms0, rms1, M, BN_I, BK_H, True, True)
        _store_row_block(act_ptr, pid * R_I, R_I, INTER, _silu_mul(g0, u0, dt),
                         _silu_mul(g1, u1, dt), M, BN_I)
    if PHASE == -1:
        _arrive_if(ARRIVE_FIRST, counter_ptr, stamp_ptr + 8 * programs, TIMELINE)
        w = _weight_chunk(w_down_ptr, pid * R_H, 0, R_H, H, INTER, BN_H, BK_I)
        _arrive_if(not ARRIVE_FIRST, counter_ptr, stamp_ptr + 8 * programs, TIMELINE)
        _grid_wait(counter_ptr, base + 5 * programs, stamp_ptr + 8 * programs, programs,
                   TIMELINE)

    if (PHASE == -1) or (PHASE == 5):  # down
        if PHASE == 5:
            w = _weight_chunk(w_down_ptr, pid * R_H, 0, R_H, H, INTER, BN_H, BK_I)
        _project_rows(w, w_down_ptr, act_ptr, out_ptr, pid * R_H, R_H, H, INTER, M, BN_H, BK_I)
    w_next = tl.zeros([BN_QKV, BK_H], w_qkv_ptr.dtype.element_ty)
    if PHASE == -1:
        _arrive_if(ARRIVE_FIRST, counter_ptr, stamp_ptr + 10 * programs, TIMELINE)
        if PREFETCH_NEXT:
            w_next = _weight_chunk(next_qkv_ptr, pid * R_QKV, 0, R_QKV, QKV, H, BN_QKV, BK_H)
        _arrive_if(not ARRIVE_FIRST, counter_ptr, stamp_ptr + 10 * programs, TIMELINE)
        _grid_wait(counter_ptr, base + 6 * programs, stamp_ptr + 10 * programs, programs,
                   TIMELINE)
    return w_next


@triton.jit
def _decode_stack_kernel(
        table_ptr, first_layer, num_layers, counter_ptr, timeline_ptr, x_ptr, residual_ptr,
        outs_ptr, res2s_ptr, res1_ptr, qkv_ptr, part_out_ptr, part_lse_ptr, attn_ptr, y_ptr,
        act_ptr, k_cache0_ptr, bt_ptr, ctx_ptr, slot_ptr, cos_ptr, sin_ptr, eps, scale_log2,
        stride_bt, stride_rope,
        M: tl.constexpr, H: tl.constexpr, INTER: tl.constexpr, HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
        PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BK_H: tl.constexpr, BK_ATT: tl.constexpr,
        BK_I: tl.constexpr,
        R_QKV: tl.constexpr, BN_QKV: tl.constexpr, R_H: tl.constexpr, BN_H: tl.constexpr,
        R_I: tl.constexpr, BN_I: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
        PRECISION: tl.constexpr, F16_DOTS: tl.constexpr, FP8_CACHE: tl.constexpr,
        PTX_WIDEN: tl.constexpr, PREFETCH_NEXT: tl.constexpr, GATE_UP_EARLY: tl.constexpr,
        ARRIVE_FIRST: tl.constexpr, KV_EARLY: tl.constexpr,
        TIMELINE: tl.constexpr, PHASE: tl.constexpr):
    """Layers [first_layer, first_layer + num_layers) in one launch. table_ptr: [layers,
    TABLE_COLUMNS] int64 addresses (layer_table). Layer 0 reads x and residual ([M, H] each);
    a later layer l reads slot (l + 1) % 2 of outs / res2s ([2, M, H] each: its input and the
    residual stream); layer l writes slot l % 2. PREFETCH_NEXT:
    each layer's first qkv weight chunk is loaded before the barrier that ends the layer before
    it (see _layer_phases). TIMELINE (PHASE -1): timeline_ptr, [1 + num_layers * 2 * PHASES,
    programs] int64, gets each program's start time, then each barrier's arrival and departure
    times (decode_stack's timeline)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if TIMELINE:
        tl.store(timeline_ptr + pid, _globaltimer())
    base = 0
    if PHASE == -1:
        base = tl.atomic_add(counter_ptr, 0) // programs * programs  # see _grid_wait
    w_ty = outs_ptr.dtype  # the weights are in the activations' dtype
    c_ty = k_cache0_ptr.dtype
    QKV: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    last = first_layer + num_layers - 1
    w_first = tl.zeros([BN_QKV, BK_H], w_ty.element_ty)
    if PREFETCH_NEXT and (PHASE == -1):
        w_first = _weight_chunk(_table_ptr(table_ptr + first_layer * TABLE_COLUMNS, 1, w_ty),
                                pid * R_QKV, 0, R_QKV, QKV, H, BN_QKV, BK_H)
    for layer in range(first_layer, first_layer + num_layers):
        row = table_ptr + layer * TABLE_COLUMNS
        next_row = table_ptr + tl.minimum(layer + 1, last) * TABLE_COLUMNS
        read = ((layer + 1) % 2) * (M * H)
        write = (layer % 2) * (M * H)
        # layer 0 reads the stack's inputs where they are (no copy into slot 1 before the launch)
        x_in = tl.where(layer == 0, x_ptr, outs_ptr + read)
        residual_in = tl.where(layer == 0, residual_ptr, res2s_ptr + read)
        w_first = _layer_phases(
            pid, programs, base + (layer - first_layer) * LAYER_PHASES * programs, w_first,
            _table_ptr(next_row, 1, w_ty), counter_ptr,
            timeline_ptr + (1 + (layer - first_layer) * 2 * LAYER_PHASES) * programs + pid,
            x_in, residual_in, res1_ptr, res2s_ptr + write, qkv_ptr,
            part_out_ptr, part_lse_ptr, attn_ptr, y_ptr, act_ptr, outs_ptr + write,
            _table_ptr(row, 0, w_ty), _table_ptr(row, 1, w_ty), _table_ptr(row, 2, w_ty),
            _table_ptr(row, 3, w_ty), _table_ptr(row, 4, w_ty), _table_ptr(row, 5, w_ty),
            _table_ptr(row, 6, w_ty), _table_ptr(row, 7, w_ty), _table_ptr(row, 8, c_ty),
            _table_ptr(row, 9, c_ty), bt_ptr, ctx_ptr, slot_ptr, cos_ptr, sin_ptr, eps,
            scale_log2, stride_bt, stride_rope, M, H, INTER, HEADS, KV_HEADS, HEAD_DIM, SPLITS,
            PAGE, BLOCK_N, BK_H, BK_ATT, BK_I, R_QKV, BN_QKV, R_H, BN_H, R_I, BN_I, BLOCK_H,
            BLOCK_D, BLOCK_G, BLOCK_S, True, PRECISION, F16_DOTS, FP8_CACHE, PTX_WIDEN,
            PREFETCH_NEXT, GATE_UP_EARLY, ARRIVE_FIRST, KV_EARLY, TIMELINE, PHASE)


@triton.jit
def _table_ptr(row, column: tl.constexpr, ty: tl.constexpr):
    """An address of layer_table's row as a pointer of type ty, 16-byte aligned (so that loads
    through it vectorise as through a kernel argument)."""
    return tl.multiple_of(tl.load(row + column).to(ty, bitcast=True), 16)


def layer_table(layers: Sequence[LayerParams], k_caches: Sequence[torch.Tensor],
                v_caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """[layers, TABLE_COLUMNS] int64 on the weights' device: each layer's weight and cache
    addresses, which the stack kernel loads as pointers. Built once (it is a host-to-device
    copy, which a CUDA graph capture may not hold); valid while those tensors live where they
    are, as an engine's weights and donated cache do."""
    device = layers[0].qkv.device
    rows = []
    for lp, k, v in zip(layers, k_caches, v_caches, strict=True):
        row = (lp.input_norm, lp.qkv, lp.q_norm, lp.k_norm, lp.o_proj, lp.post_norm, lp.gate_up,
               lp.down, k, v)
        # The kernel takes every address as 16-byte aligned (vector loads); the CPU interpreter
        # does not care (a checkpoint mapped from disk may be unaligned there).
        if any(not t.is_contiguous() or (runs_ptx(device) and t.data_ptr() % 16) for t in row):
            raise ValueError("layer_table needs contiguous (and on a GPU 16-byte aligned) "
                             "weights and caches")
        rows.append([t.data_ptr() for t in row])
    return torch.tensor(rows, dtype=torch.int64, device=device)


def chunk_columns(block_rows: int, k: int) -> int:
    """Columns of a GEMV's weight load for a program's block of block_rows (a power of two)
    rows of a [*, k] weight: as many as hold CHUNK_WEIGHTS weights, at least MIN_COLUMNS, never
    more than the padded row."""
    return min(next_pow2(k), max(MIN_COLUMNS, CHUNK_WEIGHTS // block_rows))


def load_columns(bn_qkv: int, bn_h: int, bn_i: int, hidden: int, att: int, inter: int
                 ) -> dict[str, int]:
    """The stack's GEMV loads (BK_H: qkv's and gate/up's, which share the hidden-wide chunk;
    BK_ATT: o_proj's; BK_I: down's) for row blocks of bn_* rows: chunk_columns' each, then the
    hidden-wide and o_proj's halved, the larger share first, until o_proj's load and gate's
    and up's hold at most HELD_WEIGHTS weights together (see there)."""
    bk_h = min(chunk_columns(bn_qkv, hidden), chunk_columns(bn_i, hidden))
    bk_att = chunk_columns(bn_h, att)
    while bn_h * bk_att + 2 * bn_i * bk_h > HELD_WEIGHTS and max(bk_h, bk_att) > MIN_COLUMNS:
        if bk_h > MIN_COLUMNS and (2 * bn_i * bk_h >= bn_h * bk_att or bk_att <= MIN_COLUMNS):
            bk_h //= 2
        else:
            bk_att //= 2
    return dict(BK_H=bk_h, BK_ATT=bk_att, BK_I=chunk_columns(bn_h, inter))


def check_counter(counter: torch.Tensor | None, device: torch.device) -> None:
    """A persistent launch's grid-barrier counter, if given, must be int64 [1] on its device."""
    if counter is not None and (counter.shape != (1,) or counter.dtype != torch.int64 or
                                counter.device != device):
        raise ValueError(f"counter must be int64 [1] on {device}, got {counter.dtype} "
                         f"{list(counter.shape)} on {counter.device}")


def decode_stack(table: torch.Tensor, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, k_cache0: torch.Tensor, batch: Batch, *, config: ModelConfig,
                 dtype: torch.dtype, programs: int | None = None,
                 phase_by_phase: bool | None = None, num_warps: int = 8,
                 block_k: int | None = None, prefetch_next: bool = True,
                 gate_up_early: bool = True, arrive_first: bool = True,
                 kv_early: bool | None = None,
                 counter: torch.Tensor | None = None,
                 timeline: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layers of `table` (layer_table) for a decode batch of M <= MAX_ROWS rows on
    one GPU, as one persistent launch (phase_by_phase: one launch per layer and phase; the
    default under the CPU interpreter). x, residual: [M, hidden] (the stem's, or a layer's
    output and residual stream). Returns the last layer's (down's output, residual stream),
    [M, hidden] each, and writes this step's K/V into each layer's cache, as the
    functional layers do. k_cache0: any layer's K cache (its shape and dtype). block_k: GEMV
    columns a load (None: chunk_columns' rule, each GEMV its own). The load placements
    (single launch; the defaults measured fastest together, 25.4 against 28.2 us a layer at 1
    row and 33.1 against 38.0 at 2, BENCHMARKS.md session 18): prefetch_next: each layer's
    first qkv weight chunk loaded during the layer before it. gate_up_early: gate/up's weights
    are loaded during the merge phase, where the DRAM and all but the merging programs are
    idle, instead of during o_proj's. (Down's during o_proj's instead of gate/up's measured
    slower, 30.8 against 24.4 us a layer, session 19.) arrive_first: each program arrives at a
    grid barrier before it issues the next phase's weight loads, and waits after (the loads'
    issue overlaps the barrier instead of delaying the arrival; the weights never depend on the
    other programs' writes). (Asking for the next layer's cache rows into L2 as a layer ends
    measured slower, 30.6 against 28.2 us a layer, session 18; branch early-loads.) kv_early
    (None: at 1 row, 24.4 against 25.2 us a layer, session 19; at 2 it spills and measured 8%
    slower, session 18): each program loads the first tile of its first attention unit's cached
    K/V into registers after it arrives at the barrier before attention, so that attention's
    cache reads wait on neither the q/k/v loads, nor the new token's store, nor the DRAM.
    counter: the grid barriers' int64 [1] arrival counter, which only grows and which launches
    of this many programs may share (with_persistent_layers keeps one, so that a step zeroes
    none); None: a new one. timeline:
    for the probe, [1 + layers * 2 * PHASES, programs] int64 on the GPU (single launch only):
    row 0 gets each program's start time (ns, %globaltimer), row 1 + 2 * (layer * PHASES + k)
    the time it arrived at the barrier after phase k of that layer, the row after it when it
    left."""
    m, hidden = x.shape
    if not batch.is_decode or m > MAX_ROWS or m != batch.context_lens.shape[0]:
        raise ValueError(f"the persistent decode layers take a decode batch of at most "
                         f"{MAX_ROWS} rows, got {m} rows (decode: {batch.is_decode})")
    if hidden != config.hidden_size or residual.shape != x.shape:
        raise ValueError(f"x and residual must be [rows, {config.hidden_size}], got "
                         f"{tuple(x.shape)} and {tuple(residual.shape)}")
    if x.dtype != dtype or residual.dtype != dtype or not x.is_contiguous() or \
            not residual.is_contiguous():
        raise ValueError(f"x and residual must be contiguous {dtype}, got {x.dtype} and "
                         f"{residual.dtype}")
    check_counter(counter, x.device)
    dev, dt = x.device, dtype
    d, heads, kv_heads, inter = config.head_dim, config.num_heads, config.num_kv_heads, \
        config.intermediate_size
    qkv_size = (heads + 2 * kv_heads) * d
    programs = programs or num_sms(dev)
    if phase_by_phase is None:
        phase_by_phase = not runs_ptx(dev)
    if kv_early is None:
        kv_early = m == 1
    if timeline is not None:
        want = (1 + table.shape[0] * 2 * PHASES, programs)
        if phase_by_phase or not runs_ptx(dev):
            raise ValueError("a timeline needs the single launch on a CUDA GPU (%globaltimer)")
        if tuple(timeline.shape) != want or timeline.dtype != torch.int64 or \
                timeline.device != dev:
            raise ValueError(f"timeline must be int64 {list(want)} on {dev}, got "
                             f"{timeline.dtype} {list(timeline.shape)} on {timeline.device}")
    max_context = batch.block_tables.shape[1] * k_cache0.shape[1]
    splits = max(1, min(MAX_SPLITS, -(-max_context // SPLIT_TOKENS), programs // (m * kv_heads)))
    empty = lambda *shape, dtype=dt: torch.empty(*shape, device=dev, dtype=dtype)  # noqa: E731
    outs, res2s = empty(2, m, hidden), empty(2, m, hidden)
    res1, y = empty(m, hidden), empty(m, hidden)
    qkv, attn, act = empty(m, qkv_size), empty(m, heads * d), empty(m, inter)
    part_out = empty(m, heads, splits, d, dtype=torch.float32)
    part_lse = empty(m, heads, splits, dtype=torch.float32)
    if counter is None:
        counter = torch.zeros(1, device=dev, dtype=torch.int64)
    fp8 = k_cache0.dtype in FP8_DTYPES
    f16_dots = fp8 and dt.itemsize == 2
    rows = dict(R_QKV=-(-qkv_size // programs), R_H=-(-hidden // programs),
                R_I=-(-inter // programs))
    rows |= {f"BN_{k[2:]}": next_pow2(v) for k, v in list(rows.items())}
    if block_k is None:
        columns = load_columns(rows["BN_QKV"], rows["BN_H"], rows["BN_I"], hidden, heads * d,
                               inter)
    else:
        columns = dict(BK_H=min(block_k, next_pow2(hidden)),
                       BK_ATT=min(block_k, next_pow2(heads * d)),
                       BK_I=min(block_k, next_pow2(inter)))
    consts = dict(
        M=m, H=hidden, INTER=inter, HEADS=heads, KV_HEADS=kv_heads, HEAD_DIM=d, SPLITS=splits,
        PAGE=k_cache0.shape[1], BLOCK_N=64 if runs_ptx(dev) else 16,
        **columns, **rows, BLOCK_H=next_pow2(hidden),
        BLOCK_D=next_pow2(d), BLOCK_G=dot_block(heads // kv_heads),
        BLOCK_S=max(2, next_pow2(splits)),
        PRECISION=dot_precision(torch.float16 if f16_dots else dt), F16_DOTS=f16_dots,
        FP8_CACHE=fp8, PTX_WIDEN=int(fp8 and f16_dots and cuda_capability(dev) >= (8, 9)),
        PREFETCH_NEXT=prefetch_next, GATE_UP_EARLY=gate_up_early,
        ARRIVE_FIRST=arrive_first, KV_EARLY=kv_early, TIMELINE=timeline is not None)
    args = (counter, counter if timeline is None else timeline, x, residual, outs, res2s, res1,
            qkv, part_out, part_lse, attn, y, act, k_cache0,
            batch.block_tables, batch.context_lens, batch.slot_mapping, cos, sin,
            float(config.rms_norm_eps), d ** -0.5 * LOG2E, batch.block_tables.stride(0),
            cos.stride(0))
    layers = table.shape[0]
    launches = ([(layer, 1, phase) for layer in range(layers) for phase in range(PHASES)]
                if phase_by_phase else [(0, layers, -1)])
    # A cooperative launch: the driver refuses a grid that cannot be resident at once (an error
    # instead of a barrier that never returns).
    cooperative = {} if phase_by_phase or not runs_ptx(dev) else dict(launch_cooperative_grid=True)
    for first, count, phase in launches:
        _decode_stack_kernel[(programs,)](table, first, count, *args, **consts, PHASE=phase,
                                          num_warps=num_warps, **cooperative)
    last = (layers - 1) % 2
    return outs[last], res2s[last]


def decode_layer(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 batch: Batch, *, config: ModelConfig, **kwargs
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.layer.decoder_layer for one layer through decode_stack (residual None: x is
    the first layer's input, as there). kwargs: decode_stack's."""
    table = layer_table([lp], [k_cache], [v_cache])
    if residual is None:  # x + 0 is x exactly, and the residual stream becomes x
        residual = torch.zeros_like(x)
    return decode_stack(table, x, residual, cos, sin, k_cache, batch, config=config,
                        dtype=x.dtype, **kwargs)


def with_persistent_layers(forward_fn, params: Params, cache: KVCache):
    """forward_fn (functional.model.forward or a compiled one) with its layer stack run by
    persistent_layers over params' and cache's layer_table, built here once, and its stem by
    one kernel at decode steps (kernels.decode_stem, in place of four)."""
    from ..functional.model import stem as functional_stem
    from .decode_stem import stem_for

    table = layer_table(params.layers, cache.k, cache.v)
    counter = torch.zeros(1, device=table.device, dtype=torch.int64)
    stem = stem_for(params, getattr(forward_fn, "keywords", {}).get("stem", functional_stem))
    return functools.partial(forward_fn, stem=stem, layers=functools.partial(
        persistent_layers, table=table, counter=counter))


def persistent_layers(params: Params, cache: KVCache, batch: Batch, backend, x: torch.Tensor,
                      residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                      table: torch.Tensor, counter: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.model's layer stack: decode_stack over `table` (layer_table of params and
    cache; counter: decode_stack's) for a decode batch of at most MAX_ROWS rows on one rank,
    the functional layers for anything else (prefill, larger batches)."""
    from ..functional.model import _layers

    if batch.is_decode and batch.num_seqs <= MAX_ROWS and params.shard.world_size == 1:
        return decode_stack(table, x, residual, cos, sin, cache.k[0], batch,
                            config=params.config, dtype=params.dtype, counter=counter)
    return _layers(params, cache, batch, backend, x, residual, cos, sin, decoder_layer)
