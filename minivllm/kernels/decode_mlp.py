"""The second half of a Qwen3 decoder layer at a decode step of 1-256 rows as one persistent
kernel: o_proj and the residual add, the post-attention RMSNorm, gate/up with SiLU * up, down.

Why (BENCHMARKS.md session 33's traces of bf16 steps at ~256 and ~100 sequences): after attention, a
layer runs six kernels (o_proj as cuBLAS's copy + addmm, Inductor's add + RMSNorm, gate_up,
Inductor's SiLU * up, down), ~26 us at 256 rows and ~22 at ~100, for 22 MB of weights that the
DRAM reads in ~5 us and ~6 GFLOP that the tensor cores do in ~8 at 256 rows: each kernel pays
its launch, ramp-up and tail (~2-5 us). Here one program an SM stays resident and runs the
three GEMMs as tensor-core tiles, its phases separated by grid barriers (~1 us each, session
17):

  0  tiles of attn @ o_proj.T, fp32 sums over SPLIT_O ranges of its columns (split-K: at a
     few rows there are too few output tiles for the SMs otherwise)
  1  a row at a time: the residual stream r = round(sum) + residual, h = RMSNorm(r) (it needs
     r's whole rows)
  2  tiles of act = silu(gate) * up, (gate | up) = h @ gate_up.T
  3  tiles of out = act @ down.T; split SPLIT_D ways, its fp32 partial sums [SPLIT_D, M, H]
     are left to the next layer's add + RMSNorm to sum (functional.norm.add_rms_norm takes
     them, as from the skinny GEMM)

A tile is BLOCK_M rows by BLOCK_N output columns; a phase's tiles are dealt to the programs in
turn, row block fastest (the programs that share a weight tile run side by side and read it
from L2 once). Values are rounded to the activation dtype where functional.layer.mlp_block
and functional.norm round them (o_proj's output, the sum, the norm, gate and up, SiLU, the
product, down's output). A probe (benchmarks/mlp_block_probe.py) times it against the compiled
layer's kernels; the engine's decode graphs of 3-128 rows use it (through with_fused_mlp) at the
shape the probe measured, where it paid (runtime.runner.FUSED_MLP_ROWS; MINIVLLM_FUSED_MLP sets
the rows or turns it off).

On the CPU, Triton's interpreter runs programs one after another, so a spin barrier among several
programs never returns: there the kernel is launched once per phase (the launch boundary is the
barrier), or as one launch of one program (the tests run both), as kernels.decode_layer does. On
a GPU the grid is launched cooperatively: the driver refuses a grid that cannot be resident at
once rather than start one whose barrier never returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_layer import _grid_barrier, check_counter
from .launch import dot_precision, next_pow2, num_sms, runs_ptx

MIN_ROWS, MAX_ROWS = 1, 256  # tl.dot pads the rows to BLOCK_M >= 16 itself
PHASES = 4


@triton.jit
def _tile_dot(a_ptr, w_ptr, m0, n0, k_lo, M, K: tl.constexpr, K_SPAN: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PRECISION: tl.constexpr):
    """A[m0:m0+BM, k_lo:k_lo+K_SPAN] @ W[n0:n0+BN, k_lo:k_lo+K_SPAN].T in fp32, A: [M, K], W:
    [N, K] (row-major; K_SPAN a multiple of BLOCK_K, N of BLOCK_N); rows past M are zeros."""
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rows[:, None].to(tl.int64) * K + offs_k[None, :]
    w_rows = w_ptr + (n0 + tl.arange(0, BLOCK_N))[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K_SPAN, BLOCK_K):
        a = tl.load(a_rows + k0, mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(tl.load(w_rows + k0)), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _projection_phase(a_ptr, w_ptr, out_ptr, pid, programs, M, N: tl.constexpr,
                      K: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                      PARTIALS: tl.constexpr):
    """A @ W.T, A: [M, K], W: [N, K], over SPLIT ranges of K: PARTIALS, each range's fp32 sum
    into out [SPLIT, M, N] (summed by whoever reads them); else (SPLIT 1) rounded into out
    [M, N]. Phase 0 (o_proj; phase 1 sums) and phase 3 (down). Tiles go row block fastest, then
    split, so that the programs reading one weight tile run side by side."""
    dt = out_ptr.dtype.element_ty
    tiles_m = tl.cdiv(M, BLOCK_M)
    K_SPAN: tl.constexpr = K // SPLIT
    for t in range(pid, tiles_m * SPLIT * (N // BLOCK_N), programs):
        m0 = (t % tiles_m) * BLOCK_M
        split = (t // tiles_m) % SPLIT
        n0 = (t // (tiles_m * SPLIT)) * BLOCK_N
        y = _tile_dot(a_ptr, w_ptr, m0, n0, split * K_SPAN, M, K, K_SPAN, BLOCK_M, BLOCK_N,
                      BLOCK_K, PRECISION)
        rows = m0 + tl.arange(0, BLOCK_M)
        offs = rows[:, None].to(tl.int64) * N + (n0 + tl.arange(0, BLOCK_N))[None, :]
        mask = (rows < M)[:, None]
        if PARTIALS:
            tl.store(out_ptr + split * M * N + offs, y, mask=mask)
        else:
            tl.store(out_ptr + offs, y.to(dt), mask=mask)


@triton.jit
def _norm_phase(o_part_ptr, res_ptr, norm_w_ptr, r_ptr, h_ptr, eps, pid, programs, M,
                H: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Phase 1, a row at a time: o_proj's output (its SPLIT fp32 partial sums, [SPLIT, M, H]),
    rounded, plus the residual, rounded: the residual stream r; h = RMSNorm(r) * weight
    (functional.norm.rms_norm: normed in fp32, rounded, times the weight, rounded). Once here
    rather than in every gate/up tile, which would norm each row INTER / BN_GU times over."""
    dt = h_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    w = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(pid, M, programs):
        o = tl.zeros([BLOCK_H], tl.float32)
        for split in tl.static_range(SPLIT):
            o += tl.load(o_part_ptr + (split * M + row) * H + offs, mask=mask, other=0.0)
        res = tl.load(res_ptr + row * H + offs, mask=mask, other=0.0).to(tl.float32)
        r = (o.to(dt).to(tl.float32) + res).to(dt)
        tl.store(r_ptr + row * H + offs, r, mask=mask)
        x = r.to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / H + eps)
        tl.store(h_ptr + row * H + offs, (w * (x * inv_rms).to(dt).to(tl.float32)).to(dt),
                 mask=mask)


@triton.jit
def _gate_up_phase(h_ptr, w_gu_ptr, act_ptr, pid, programs, M, H: tl.constexpr,
                   INTER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Phase 2: act = silu(gate) * up, (gate | up) = h @ W_gu.T; h: [M, H], W_gu: [2 * INTER, H]
    (gate rows, then up rows), act: [M, INTER]. A tile's gate and up columns are the same
    intermediate columns, so the product needs nothing from another tile."""
    dt = act_ptr.dtype.element_ty
    tiles_m = tl.cdiv(M, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    for t in range(pid, tiles_m * (INTER // BLOCK_N), programs):
        m0, n0 = (t % tiles_m) * BLOCK_M, (t // tiles_m) * BLOCK_N
        rows = m0 + tl.arange(0, BLOCK_M)
        cols = n0 + tl.arange(0, BLOCK_N)
        h_rows = h_ptr + rows[:, None].to(tl.int64) * H + offs_k[None, :]
        g_rows = w_gu_ptr + cols[:, None].to(tl.int64) * H + offs_k[None, :]
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):  # one load of h's chunk for both products
            a = tl.load(h_rows + k0, mask=(rows < M)[:, None], other=0.0)
            gate = tl.dot(a, tl.trans(tl.load(g_rows + k0)), gate, input_precision=PRECISION)
            up = tl.dot(a, tl.trans(tl.load(g_rows + INTER * H + k0)), up,
                        input_precision=PRECISION)
        g = gate.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu, rounded
        tl.store(act_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :],
                 (s * up.to(dt).to(tl.float32)).to(dt), mask=(rows < M)[:, None])


@triton.jit
def _decode_mlp_kernel(
        attn_ptr, res_ptr, w_o_ptr, norm_w_ptr, w_gu_ptr, w_down_ptr, o_part_ptr, r_ptr, h_ptr,
        act_ptr, out_ptr, counter_ptr, eps, M, H: tl.constexpr, ATT: tl.constexpr,
        INTER: tl.constexpr, BLOCK_M: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
        BN_D: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_O: tl.constexpr, SPLIT_D: tl.constexpr,
        BLOCK_H: tl.constexpr, PRECISION: tl.constexpr, PHASE: tl.constexpr):
    """The four phases with a grid barrier after each of the first three (PHASE -1), or phase
    PHASE alone. counter_ptr: the barriers' int64 arrival counter, which only grows (a launch
    waits for base + k * programs arrivals, base the multiple of programs it finds at its
    start)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    base = 0
    if PHASE == -1:
        base = tl.atomic_add(counter_ptr, 0) // programs * programs
    if (PHASE == -1) or (PHASE == 0):
        _projection_phase(attn_ptr, w_o_ptr, o_part_ptr, pid, programs, M, H, ATT, SPLIT_O,
                          BLOCK_M, BN_O, BLOCK_K, PRECISION, True)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + programs)
    if (PHASE == -1) or (PHASE == 1):
        _norm_phase(o_part_ptr, res_ptr, norm_w_ptr, r_ptr, h_ptr, eps, pid, programs, M, H,
                    SPLIT_O, BLOCK_H)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 2 * programs)
    if (PHASE == -1) or (PHASE == 2):
        _gate_up_phase(h_ptr, w_gu_ptr, act_ptr, pid, programs, M, H, INTER, BLOCK_M, BN_GU,
                       BLOCK_K, PRECISION)
    if PHASE == -1:
        _grid_barrier(counter_ptr, base + 3 * programs)
    if (PHASE == -1) or (PHASE == 3):
        _projection_phase(act_ptr, w_down_ptr, out_ptr, pid, programs, M, H, INTER, SPLIT_D,
                          BLOCK_M, BN_D, BLOCK_K, PRECISION, SPLIT_D > 1)


SPLIT_KEYS = ("split_o", "split_d")


def default_config(rows: int, device: torch.device, hidden: int, att: int, inter: int,
                   programs: int | None = None) -> dict:
    """default_tiles, and splits for them over `programs` (default one an SM)."""
    tiles = default_tiles(rows, device, hidden, att, inter)
    return tiles | splits(tiles, rows, hidden, att, inter, programs or num_sms(device))


def default_tiles(rows: int, device: torch.device, hidden: int, att: int, inter: int) -> dict:
    """Tile sizes: BLOCK_M rows a tile (at least 16, tl.dot's least), BN_* output columns a tile
    for o_proj, gate/up and down, BLOCK_K columns a step of the dots; num_warps, num_stages (the
    dots' software pipeline). (SPLIT_O / SPLIT_D, the ranges o_proj's and down's columns are
    split into, depend on these and the grid: splits.) Each the widest of its candidates that
    divides its dimension (hidden, attention width, intermediate size: multiples of 16).

    On the GPU, benchmarks/mlp_block_probe.py's --deep sweep at the 0.6B shape on the H200
    (BENCHMARKS.md session 34): one program an SM is latency-bound on its loads (3 stages: a
    tile's K loop ran at ~30 KB a us an SM, gate/up 22.7 us at 256 rows against cuBLAS's 7.6), so
    the pipelines are deep: at 64 rows 64-row tiles, 32 columns, 6 stages (18.3 us against the
    engine's 25.5); at 128, 64 gate/up columns and 128-column K steps in 4 stages (21.3 against
    26.3); at 256, 128-row tiles in 6 stages (30.3 against 29.2: no tiling found wins there).
    Small under the CPU interpreter, so that the tests' tiny shapes have several tiles a phase."""
    def widest(candidates, *dims):
        return next((c for c in candidates if all(d % c == 0 for d in dims)), candidates[-1])

    if not runs_ptx(device):
        return dict(block_m=16, bn_o=16, bn_gu=16, bn_d=16, block_k=16, num_warps=4,
                    num_stages=1)
    bn = (32, 16)
    tiles = dict(block_m=min(64, max(16, next_pow2(rows))), bn_o=widest(bn, hidden),
                 bn_gu=widest(bn, inter), bn_d=widest(bn, hidden),
                 block_k=widest((64, 32, 16), hidden, att, inter),
                 num_warps=8 if rows > 32 else 4, num_stages=6)
    if 64 < rows <= 128:
        tiles |= dict(bn_gu=widest((64, *bn), inter), num_warps=4, num_stages=4,
                      block_k=widest((128, 64, 32, 16), hidden, att, inter))
    elif rows > 128:
        tiles |= dict(block_m=128, bn_gu=widest((64, *bn), inter))
    return tiles


def splits(cfg: dict, rows: int, hidden: int, att: int, inter: int, programs: int) -> dict:
    """split_o and split_d for cfg's tiles: each doubled, up to 8, while o_proj's or down's
    tiles (row blocks x column blocks x splits) stay within one a program and the split
    ranges within whole BLOCK_K steps."""
    tiles = -(-rows // cfg["block_m"])
    out = {}
    for key, bn, k in (("split_o", "bn_o", att), ("split_d", "bn_d", inter)):
        split = 1
        while split < 8 and tiles * (hidden // cfg[bn]) * split * 2 <= programs and \
                k % (split * 2 * cfg["block_k"]) == 0:
            split *= 2
        out[key] = split
    return out


def decode_mlp(attn: torch.Tensor, residual: torch.Tensor, o_proj: torch.Tensor,
               post_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float, *,
               programs: int | None = None, phase_by_phase: bool | None = None,
               counter: torch.Tensor | None = None, config: dict | None = None,
               phases: tuple[int, ...] | None = None, unsummed_ok: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.layer's attention output projection and mlp_block on one rank:
    attn: [M, heads * head_dim] (attention's output), residual: [M, hidden] ->
    (down's output [M, hidden], the residual stream attn @ o_proj.T + residual [M, hidden]).
    unsummed_ok: down's output may be its fp32 split-K partial sums [split, M, hidden] (as
    functional.layer.mlp_block's may be; the next add + RMSNorm sums them), else summed here.
    Weights as in state.params.LayerParams. phase_by_phase: one launch a phase (the default
    under the CPU interpreter); programs: the persistent grid (default one an SM); counter: the
    grid barriers' int64 [1] counter, which only grows and which launches may share (None: a
    new one); config: default_config's keys, overriding it. phases: with phase_by_phase, launch
    only these (for timing a phase alone, benchmarks/mlp_block_probe.py: a phase's inputs are
    then whatever the earlier phases' buffers hold, and the outputs are not the layer's)."""
    m, att = attn.shape
    hidden = residual.shape[1]
    inter = down.shape[1]
    if not MIN_ROWS <= m <= MAX_ROWS:
        raise ValueError(f"decode_mlp takes {MIN_ROWS}-{MAX_ROWS} rows, got {m}")
    want = {"residual": (residual, (m, hidden)), "o_proj": (o_proj, (hidden, att)),
            "post_norm": (post_norm, (hidden,)), "gate_up": (gate_up, (2 * inter, hidden)),
            "down": (down, (hidden, inter))}
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for attn {list(attn.shape)}, got "
                             f"{list(t.shape)}")
    tensors = [attn, *(t for t, _ in want.values())]
    if any(t.dtype != attn.dtype or t.device != attn.device or not t.is_contiguous()
           for t in tensors):
        raise ValueError("decode_mlp's tensors must be contiguous, of one dtype and device, got "
                         + ", ".join(f"{t.dtype} on {t.device}" for t in tensors))
    dev = attn.device
    given = dict(config or {})
    tiles = default_tiles(m, dev, hidden, att, inter)
    if unknown := set(given) - set(tiles) - set(SPLIT_KEYS):
        raise ValueError(f"unknown decode_mlp config keys {sorted(unknown)}; known: "
                         f"{sorted([*tiles, *SPLIT_KEYS])}")
    programs = programs or num_sms(dev)
    tiles |= given
    # splits not given: for these tiles and this grid
    cfg = tiles | splits(tiles, m, hidden, att, inter, programs) | given
    for key, dim in (("bn_o", hidden), ("bn_gu", inter), ("bn_d", hidden), ("block_k", att),
                     ("block_k", hidden), ("block_k", inter)):
        if dim % cfg[key]:
            raise ValueError(f"{key}={cfg[key]} must divide {dim}")
    for key, dim in (("split_o", att), ("split_d", inter)):
        if cfg[key] < 1 or dim % (cfg[key] * cfg["block_k"]):
            raise ValueError(f"{key}={cfg[key]} times block_k={cfg['block_k']} must divide {dim}")
    if phase_by_phase is None:
        phase_by_phase = not runs_ptx(dev)
    if not (phase_by_phase or runs_ptx(dev) or programs == 1):
        raise ValueError(f"a single launch of {programs} programs needs a GPU: the interpreter "
                         f"runs programs one after another, so their barriers would never pass")
    if phases is not None and not (phase_by_phase and set(phases) <= set(range(PHASES))):
        raise ValueError(f"phases must name phases 0-{PHASES - 1} of a phase_by_phase run, got "
                         f"{phases} (phase_by_phase {phase_by_phase})")
    check_counter(counter, dev)
    if counter is None:
        counter = torch.zeros(1, device=dev, dtype=torch.int64)
    r, h = torch.empty_like(residual), torch.empty_like(residual)
    act = attn.new_empty(m, inter)
    f32 = dict(device=dev, dtype=torch.float32)
    o_part = torch.empty(cfg["split_o"], m, hidden, **f32)
    out = torch.empty(cfg["split_d"], m, hidden, **f32) if cfg["split_d"] > 1 else \
        torch.empty_like(residual)
    consts = dict(H=hidden, ATT=att, INTER=inter, BLOCK_M=cfg["block_m"], BN_O=cfg["bn_o"],
                  BN_GU=cfg["bn_gu"], BN_D=cfg["bn_d"], BLOCK_K=cfg["block_k"],
                  SPLIT_O=cfg["split_o"], SPLIT_D=cfg["split_d"], BLOCK_H=next_pow2(hidden),
                  PRECISION=dot_precision(attn.dtype), num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"])
    args = (attn, residual, o_proj, post_norm, gate_up, down, o_part, r, h, act, out, counter,
            float(eps), m)
    if phase_by_phase:
        for phase in range(PHASES) if phases is None else phases:
            _decode_mlp_kernel[(programs,)](*args, **consts, PHASE=phase)
    else:
        cooperative = dict(launch_cooperative_grid=True) if runs_ptx(dev) else {}
        _decode_mlp_kernel[(programs,)](*args, **consts, PHASE=-1, **cooperative)
    if out.dim() == 3 and not unsummed_ok:
        out = out.sum(0).to(residual.dtype)
    return out, r


def with_fused_mlp(layer, attention_half, rows: tuple[int, int], counter: torch.Tensor):
    """A decoder layer function (functional.layer.decoder_layer's signature) that runs decode
    steps of rows[0]..rows[1] rows on one rank as attention_half (functional.layer's, or a
    compiled one) and decode_mlp, and anything else through `layer`. counter: decode_mlp's,
    one for every layer and step (it only grows)."""
    lo, hi = rows
    if not MIN_ROWS <= lo <= hi <= MAX_ROWS:
        raise ValueError(f"fused MLP rows must lie within {MIN_ROWS}-{MAX_ROWS}, got {lo}-{hi}")

    def fused_mlp_layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, *, config, shard,
                        backend):
        # x: the previous layer's output, [T, hidden] or down's fp32 partials [split, T, hidden]
        if batch.is_decode and shard.world_size == 1 and lo <= x.shape[-2] <= hi:
            attn, residual = attention_half(lp, x, residual, cos, sin, k_cache, v_cache, batch,
                                            config=config, shard=shard, backend=backend)
            # (no-ops on the compiled half's outputs, which are contiguous)
            return decode_mlp(attn.contiguous(), residual.contiguous(), lp.o_proj, lp.post_norm,
                              lp.gate_up, lp.down, config.rms_norm_eps, counter=counter,
                              unsummed_ok=True)
        return layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, config=config,
                     shard=shard, backend=backend)

    return fused_mlp_layer
