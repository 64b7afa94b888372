"""Paged decode attention as one flat loop of tiles a program (stream-K), an experiment.

decode_attention.py launches a program per (sequence, KV head): at 256 sequences 2,048 short
programs (~5 tiles of 128 tokens each), which start in step and each pay q's load and the
pipeline's fill before K/V streams. On the H200 that launch reads ~10% below the read rate at
the throughput run's contexts, ~27 us a launch that does not grow with the contexts
(BENCHMARKS.md session 26). Here a fixed grid of programs (a few an SM) walks the whole batch's
tiles as one list, each program a contiguous, equal share of it, so a program's pipeline keeps
loading across the boundaries between sequences and is filled once a launch, not once a
sequence. A (sequence, KV head) whose tiles two or more programs share leaves each share's
partial result (normalised output and log2-sum-exp), and a second kernel merges those.

  q: [B, heads, head_dim] (normed and rotated), k/v: [B, kv_heads, head_dim] this step's token
  k_cache/v_cache: [num_blocks, PAGE, kv_heads, head_dim], block_tables: [B, M] int32
  context_lens: [B] int32, tokens including the new one; the cached prefix is context_lens - 1.
  The tile list (tile_map): unit u = b * kv_heads + kvh owns max(1, ceil(prefix / BLOCK_N))
  consecutive tiles; tile_unit[g], tile_j[g]: tile g's unit and its index within the unit;
  unit_first[u]: u's first tile; total[0]: the tiles of the batch.

Like paged_decode_attention it can take q and k raw from the qkv projection and RMS-norm and
rotate them (norm_rope), and store the new K/V in the cache (slot_mapping): the engine's form.
Not yet measured on a GPU, so off by default: benchmarks/sweep_decode_attention.py --flat times
it against paged_decode_attention in both forms, and under MINIVLLM_FLAT_ATTENTION=1 the
engine's compiled decode graphs run it (runtime.compiled.layers_with_decode_tiles gives each
decode batch its tile list, device_tile_map, once a step for every layer; the triton backend
takes this kernel for a batch that carries one).
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from .decode_attention import LOG2E, _decode_tile, _load_norm_rope, _rope_lanes, norm_rope_args
from .launch import attention_launch_op, dot_precision, next_pow2, num_sms, runs_ptx


@triton.jit
def _span(p, programs, total):
    """Program p's share [g0, g1) of `total` tiles."""
    return (p * total) // programs, ((p + 1) * total) // programs


@triton.jit
def _flat_decode_kernel(q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, ctx_ptr,
                        slot_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps, tile_unit_ptr,
                        tile_j_ptr, total_ptr, out_ptr, part_out_ptr, part_lse_ptr, scale_log2,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_bt, stride_rope, stride_ot, stride_oh,
                        KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, STORE: tl.constexpr,
                        NORM_ROPE: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    scale_log2 = tl.cast(scale_log2, tl.float32)
    eps = tl.cast(eps, tl.float32)
    ROW: tl.constexpr = KV_HEADS * HEAD_DIM
    dt = q_ptr.dtype.element_ty
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    D_MASKED: tl.constexpr = BLOCK_D != HEAD_DIM
    o_mask = mask_g[:, None] & mask_d[None, :]
    g0, g1 = _span(pid, programs, tl.load(total_ptr))

    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    m_i = tl.zeros([BLOCK_G], tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    # the tile index (within its unit) that this program's current share of the unit began at
    seg_j0 = tl.zeros([], tl.int32)
    for g in range(g0, g1):
        u = tl.load(tile_unit_ptr + g)
        j = tl.load(tile_j_ptr + g)
        b = u // KV_HEADS
        kvh = u % KV_HEADS
        b64 = tl.cast(b, tl.int64)
        prefix = tl.load(ctx_ptr + b) - 1
        last_j = tl.maximum(tl.cdiv(prefix, BLOCK_N), 1) - 1
        heads = kvh * GROUP + offs_g
        # q (and with NORM_ROPE its norm and rotation) every tile: 512 bytes against the tile's
        # 64 KB, from L2 after the first, and no load hangs on a branch, so the pipeliner can
        # issue it stages ahead like the rest (held across a branch it cost 238 registers a
        # thread against 168, offline sm_90 compile).
        q_rows = q_ptr + b64 * stride_qt + heads[:, None] * stride_qh
        k_row = k_ptr + b64 * stride_kt + kvh * stride_kh
        if NORM_ROPE:
            partner, cos, sin = _rope_lanes(cos_ptr + b64 * stride_rope,
                                            sin_ptr + b64 * stride_rope, offs_d, mask_d, HEAD_DIM)
            q = _load_norm_rope(q_rows, o_mask, qw_ptr, offs_d, partner, mask_d, cos, sin, eps,
                                HEAD_DIM).to(dt)
            k_new = tl.reshape(_load_norm_rope(k_row, mask_d[None, :], kw_ptr, offs_d, partner,
                                               mask_d, cos, sin, eps, HEAD_DIM), [BLOCK_D])
        else:
            q = tl.load(q_rows + offs_d[None, :], mask=o_mask, other=0.0).to(dt)
            k_new = tl.load(k_row + offs_d, mask=mask_d, other=0.0)
        starts = (j == 0) | (g == g0)
        seg_j0 = tl.where(starts, j, seg_j0)
        # A unit's tile 0 is seeded with the new token (from k/v, not the cache); a share that
        # starts later starts empty.
        v_new = tl.load(v_ptr + b64 * stride_vt + kvh * stride_vh + offs_d, mask=mask_d, other=0.0)
        s_new = tl.sum(q.to(tl.float32) * k_new.to(dt).to(tl.float32)[None, :], 1) * scale_log2
        first = j == 0
        if STORE:
            # Tile 0's program also writes the new token's K/V into its slot (-1: a padding
            # row, none). No program reads that slot: the new token comes from k/v.
            slot = tl.load(slot_ptr + b)
            dst = slot.to(tl.int64) * ROW + kvh * HEAD_DIM + offs_d
            put = mask_d & first & (slot >= 0)
            tl.store(k_cache_ptr + dst, k_new.to(k_cache_ptr.dtype.element_ty), mask=put)
            tl.store(v_cache_ptr + dst, v_new.to(v_cache_ptr.dtype.element_ty), mask=put)
        m_i = tl.where(starts, tl.where(first, s_new, float("-inf")), m_i)
        l_i = tl.where(starts, tl.where(first, 1.0, 0.0), l_i)
        acc = tl.where(starts, tl.where(first, 1.0, 0.0) * v_new.to(dt).to(tl.float32)[None, :],
                       acc)
        # The tile: positions [j * BLOCK_N, prefix), masked (a unit with no prefix has one
        # tile with none; its new token keeps the running max finite).
        acc, m_i, l_i = _decode_tile(
            q, acc, m_i, l_i, j * BLOCK_N, prefix, offs_n, offs_d, mask_d,
            bt_ptr + b64 * stride_bt, kvh * HEAD_DIM, k_cache_ptr, v_cache_ptr, scale_log2, dt,
            PAGE, BLOCK_N, ROW, D_MASKED, PRECISION, 0, False, True, 0, 0, False)
        ends = (j == last_j) | (g == g1 - 1)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        whole = ends & (seg_j0 == 0) & (j == last_j)
        tl.store(out_ptr + b64 * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask & whole)
        # A share of a unit that others share too: slot 0 if it began at the program's first
        # tile, else 1 (a program holds at most one share of each kind).
        slot = tl.where(g - j + seg_j0 == g0, 0, 1)
        row = (pid * 2 + slot) * BLOCK_G + offs_g
        part = ends & ~whole
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :], out,
                 mask=o_mask & part)
        tl.store(part_lse_ptr + row, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)),
                 mask=mask_g & part)


@triton.jit
def _flat_merge_kernel(unit_first_ptr, ctx_ptr, total_ptr, part_out_ptr, part_lse_ptr, out_ptr,
                       programs, stride_ot, stride_oh, KV_HEADS: tl.constexpr,
                       GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Unit u's shares, if more than one program held it, weighted by their log2-sum-exps."""
    u = tl.program_id(0)
    b = u // KV_HEADS
    kvh = u % KV_HEADS
    total = tl.load(total_ptr)
    first = tl.load(unit_first_ptr + u)
    last = first + tl.maximum(tl.cdiv(tl.load(ctx_ptr + b) - 1, BLOCK_N), 1) - 1
    # the program holding tile g: the last p with p * total // programs <= g
    p_first = ((first + 1) * programs - 1) // total
    p_last = ((last + 1) * programs - 1) // total
    if p_first != p_last:
        offs_g = tl.arange(0, BLOCK_G)
        offs_d = tl.arange(0, BLOCK_D)
        o_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        m = tl.full([BLOCK_G], -1e30, tl.float32)  # finite: no inf - inf on the first share
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        for p in range(p_first, p_last + 1):
            g0, g1 = _span(p, programs, total)
            slot = tl.where((p > p_first) | (first == g0), 0, 1)
            row = (p * 2 + slot) * BLOCK_G + offs_g
            held = g1 > g0  # a program with no tiles (fewer tiles than programs) holds none
            lse = tl.load(part_lse_ptr + row, mask=(offs_g < GROUP) & held, other=-1e30)
            o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + offs_d[None, :],
                        mask=o_mask & held, other=0.0)
            m_new = tl.maximum(m, lse)
            w_old = tl.exp2(m - m_new)
            w = tl.where(held, tl.exp2(lse - m_new), 0.0)
            acc = acc * w_old[:, None] + w[:, None] * o
            den = den * w_old + w
            m = m_new
        heads = kvh * GROUP + offs_g
        res = acc / tl.where(den > 0, den, 1.0)[:, None]
        tl.store(out_ptr + tl.cast(b, tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], res.to(out_ptr.dtype.element_ty), mask=o_mask)


def _launch_flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 slots: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float, tile_unit: torch.Tensor,
                 tile_j: torch.Tensor, unit_first: torch.Tensor, total: torch.Tensor,
                 out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
                 scale_log2: float, programs: int, block_n: int, num_warps: int,
                 num_stages: int, maxnreg: int, store: bool, norm_rope: bool) -> None:
    """The two kernels on flat_decode_attention's checked arguments (maxnreg 0: no cap)."""
    b, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    consts = dict(KV_HEADS=kv_heads, GROUP=heads // kv_heads, HEAD_DIM=head_dim,
                  BLOCK_G=max(16, next_pow2(heads // kv_heads)), BLOCK_D=next_pow2(head_dim))
    _flat_decode_kernel[(programs,)](
        q, k, v, k_cache, v_cache, block_tables, context_lens, slots, q_weight, k_weight, cos,
        sin, eps, tile_unit, tile_j, total, out, part_out, part_lse, scale_log2, q.stride(0),
        q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_tables.stride(0),
        cos.stride(0), out.stride(0), out.stride(1), **consts, PAGE=page, BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype), STORE=store, NORM_ROPE=norm_rope,
        num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    _flat_merge_kernel[(b * kv_heads,)](
        unit_first, context_lens, total, part_out, part_lse, out, programs, out.stride(0),
        out.stride(1), **consts, BLOCK_N=block_n, num_warps=4)


# Launched through a custom op that declares what it writes: torch.compile's tracing of Triton
# launches takes num_warps and num_stages but not maxnreg, and cannot trace the interpreter's.
_launch_flat_op = attention_launch_op("flat_decode_attention_launch", _launch_flat)


def _unit_tiles(context_lens: torch.Tensor, kv_heads: int, block_n: int) -> torch.Tensor:
    """[B * kv_heads]: each unit's tiles, max(1, ceil(prefix / block_n))."""
    prefix = context_lens.long() - 1
    return torch.clamp((prefix + block_n - 1) // block_n, min=1).repeat_interleave(kv_heads)


def tile_map(context_lens: torch.Tensor, kv_heads: int, block_n: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch's tile list for flat_decode_attention: (tile_unit [T] int32, tile_j [T] int32,
    unit_first [B * kv_heads] int32, total [1] int32), units b-major (a sequence's KV heads
    one after another)."""
    tiles = _unit_tiles(context_lens, kv_heads, block_n)
    first = torch.cumsum(tiles, 0) - tiles
    units = torch.arange(tiles.numel(), device=tiles.device)
    tile_unit = torch.repeat_interleave(units, tiles)
    tile_j = torch.arange(tile_unit.numel(), device=tiles.device) - first[tile_unit]
    total = tiles.sum().reshape(1)
    return (tile_unit.to(torch.int32), tile_j.to(torch.int32), first.to(torch.int32),
            total.to(torch.int32))


def device_tile_map(context_lens: torch.Tensor, kv_heads: int, block_n: int,
                    max_unit_tiles: int) -> tuple:
    """tile_map's list computed on the device from shapes alone (no host sync, so a CUDA graph
    can hold it): tile_unit and tile_j sized for max_unit_tiles tiles a unit, the entries past
    `total` unused."""
    tiles = _unit_tiles(context_lens, kv_heads, block_n)
    ends = torch.cumsum(tiles, 0)  # [U]: each unit's end in the list
    first = ends - tiles
    g = torch.arange(tiles.numel() * max_unit_tiles, device=tiles.device)
    tile_unit = torch.searchsorted(ends, g, right=True).clamp(max=tiles.numel() - 1)
    tile_j = g - first[tile_unit]
    return (tile_unit.to(torch.int32), tile_j.to(torch.int32), first.to(torch.int32),
            ends[-1:].to(torch.int32))


def with_decode_tiles(batch, kv_heads: int, dtype: torch.dtype, page: int):
    """A decode batch carrying its tile list (Batch.decode_tiles), so that the triton backend
    takes flat_decode_attention; once a step, for every layer (kv_heads: a rank's, dtype: the
    cache's, page: its page size)."""
    block_n = flat_config(batch.context_lens.device, dtype)["block_n"]
    max_unit_tiles = -(-batch.block_tables.shape[1] * page // block_n)
    return attrs.evolve(batch, decode_tiles=device_tile_map(batch.context_lens, kv_heads,
                                                            block_n, max_unit_tiles))


def flat_config(device: torch.device, dtype: torch.dtype) -> dict:
    """Tiles and grid: 128-token tiles in 3 stages as the engine's unsplit launch takes them,
    3 programs an SM (its ~74 KB of shared memory each, decode_config), which needs the
    registers capped at 168 a thread (maxnreg): uncapped, the engine's form took 238 and so two
    programs an SM (offline sm_90 compile; capped, no spills). fp32 in small tiles (its dots
    run on FMA units, as decode_config's); small on the CPU."""
    if not runs_ptx(device):
        return dict(block_n=16, num_warps=1, num_stages=1, programs_per_sm=1)
    if dtype == torch.float32:
        return dict(block_n=32, num_warps=4, num_stages=2, programs_per_sm=4)
    return dict(block_n=128, num_warps=4, num_stages=3, programs_per_sm=3, maxnreg=168)


def flat_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                          tiles: tuple | None = None, *, out: torch.Tensor | None = None,
                          slot_mapping: torch.Tensor | None = None, norm_rope: tuple | None = None,
                          programs: int | None = None, config: dict | None = None
                          ) -> torch.Tensor:
    """out: [B, heads, head_dim], what paged_decode_attention returns for the same arguments
    (slot_mapping and norm_rope as there). tiles: tile_map(context_lens, kv_heads, block_n) or
    device_tile_map's, for the block_n this call's config takes (built here if None);
    programs: the grid (default: programs_per_sm an SM); config: overrides of flat_config. A
    cache of q's dtype (no fp8 yet)."""
    b, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    if heads != group * kv_heads or k.shape != (b, kv_heads, head_dim):
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} do not match the cache's "
                         f"{kv_heads} KV heads")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"flat_decode_attention takes a cache of q's dtype (no fp8), got "
                         f"{k_cache.dtype} for q {q.dtype}")
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and block_tables.stride(1) == 1
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    cfg = flat_config(q.device, q.dtype) | dict(config or {})
    if tiles is None:
        tiles = tile_map(context_lens, kv_heads, cfg["block_n"])
    tile_unit, tile_j, unit_first, total = tiles
    if programs is None:
        programs = cfg["programs_per_sm"] * num_sms(q.device)
    if programs < 1:
        raise ValueError(f"programs must be at least 1, got {programs}")
    if out is None:
        out = torch.empty_like(q)
    block_g, block_d = max(16, next_pow2(group)), next_pow2(head_dim)
    part_out = torch.empty(programs * 2 * block_g, block_d, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(programs * 2 * block_g, device=q.device, dtype=torch.float32)
    store = slot_mapping is not None
    if store and slot_mapping.shape != (b,):
        raise ValueError(f"slot_mapping must be [{b}], got {list(slot_mapping.shape)}")
    q_weight, k_weight, cos, sin, eps = norm_rope_args(norm_rope, q)
    _launch_flat_op(q, k, v, k_cache, v_cache, block_tables, context_lens,
                    slot_mapping if store else context_lens, q_weight, k_weight, cos, sin,
                    float(eps), tile_unit, tile_j, unit_first, total, out, part_out, part_lse,
                    scale * LOG2E, programs, cfg["block_n"], cfg["num_warps"], cfg["num_stages"],
                    int(cfg.get("maxnreg") or 0), store, norm_rope is not None)
    return out
