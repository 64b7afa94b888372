"""The mixture-of-experts MLP's expert part at decode-sized batches as three Triton kernels, in the
manner of vLLM's fused_moe (its moe_align_block_size and fused_moe_kernel; written here anew):

  1  align (one program; from ALIGN_COUNT_FROM chunks of pairs, a count kernel and then a
     program a chunk): the (token, expert) pairs' ids laid out by expert, each expert's run
     padded to whole BLOCK_M tiles (padding slots hold the id P = T * top_k, "no pair"); the
     expert of each tile; the number of tiles in use, as a device tensor. Not at one token,
     where each pair is a tile of its own (takes_pair_tiles)
  2  gate_up: a program takes a tile (BLOCK_M pairs of one expert) and BLOCK_N columns of the
     intermediate size, gathers the pairs' tokens' rows of h itself, multiplies them by that
     expert's gate and up rows, and writes silu(gate) * up for its pairs, rows in pair order:
     act [P, moe_local]
  3  down: the same over act's rows, times each pair's routing weight, fp32 rows in pair order:
     y [P, hidden]

then y.view(T, top_k, hidden).sum(1), a torch reduction over each token's k rows in a fixed order
(deterministic, no atomics), cast to h's dtype; or (unsummed, a few rows on one GPU) y's k rows
left to the next add + RMSNorm, which sums them inside its own kernel (functional.moe.moe_mlp).

What this replaces in functional.moe.moe_mlp's grouped-GEMM path: the argsort, the expert counts'
scatter and cumsum, the gather of h's rows into a [T * k, hidden] copy, the SiLU-and-mul between
the GEMMs, the index_copy back to pair order and the weighted bmm. BENCHMARKS.md session 53 left
the single stream at ~32% of its memory floor at the Qwen3-30B-A3B shape, with ~10 small kernels
a MoE layer suspected (unmeasured). On an H100 (session 54) these three made the single stream
13% faster and the throughput run, whose steps hold up to 256 tokens, 12% slower. Since session
69's align kernel (a count kernel, then a program a chunk of pairs), one layer in
benchmarks/moe_probe.py on an H100 is faster this way at every size from 1 to 256 tokens (470
against 595 us at 256, session 72), so functional.moe's default (auto) takes them for every step
of up to MAX_KERNEL_TOKENS tokens on a GPU.

Every size derives from T, top_k, the expert count and the block sizes, never from the routing:
the padded layout holds at most min(P, (P + min(E, P) * (BLOCK_M - 1)) // BLOCK_M) tiles (each
non-empty expert pads fewer than BLOCK_M slots, at most min(E, P) experts are non-empty, and
each tile holds at least one pair), which is the grid's tile count; tiles past the count in use
exit at once. No host sync: a step is one CUDA graph, and the kernels trace under
torch.compile(fullgraph=True) as user-defined Triton kernels (as skinny_gemm's do).

The GEMM tiles are computed transposed (acc[BLOCK_N, BLOCK_M] = w @ x.T, "swap AB", as
skinny_gemm): at one pair a tile (the single stream: each of 8 experts gets one token) the weight
is the MMA's large operand. Block sizes (gemm_config) follow skinny_gemm's reasoning, checked
against a sweep on an H100 (session 69).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dot_precision, next_pow2, num_sms, runs_ptx

MAX_KERNEL_TOKENS = 256  # functional.moe takes this path up to this many tokens (decode steps)
WAVES = 2  # programs per SM wanted, as skinny_gemm
BLOCK_NS = (64, 32, 16)
ALIGN_STORE_BLOCK = 512  # slots past every run the align kernel fills with padding at a time
ALIGN_COUNT_FROM = 3  # chunks of pairs from which align counts them in a kernel of its own
ALIGN_COUNT_ROWS = 16  # chunks' counts the placing programs read at a time
# pairs an expert on average up to which tiles (block_m_for) and align's chunks (align_block_for)
# are small: one bound for both, so that a compiled layer guards on one step size, not two
FEW_PAIRS_AN_EXPERT = 4


@triton.jit
def _pair_experts(ids_ptr, offs, P, stride_it, stride_ik, TOP_K: tl.constexpr,
                  E_PAD: tl.constexpr):
    # The experts of pairs offs (int32; pairs past P load as E_PAD, which no expert matches).
    return tl.load(ids_ptr + (offs // TOP_K) * stride_it + (offs % TOP_K) * stride_ik,
                   mask=offs < P, other=E_PAD).to(tl.int32)


@triton.jit
def _expert_counts(e, experts):
    # [E_PAD]: how many of the experts e are each of experts.
    return tl.sum((e[None, :] == experts[:, None]).to(tl.int32), axis=1)


@triton.jit
def _align_count_kernel(ids_ptr, chunk_counts_ptr, P, stride_it, stride_ik, TOP_K: tl.constexpr,
                        E_PAD: tl.constexpr, BLOCK_P: tl.constexpr):
    # Program c: chunk_counts[c, e] = the pairs of chunk c (pairs [c * BLOCK_P, +BLOCK_P)) that
    # chose expert e, for every e < E_PAD.
    c = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    e = _pair_experts(ids_ptr, c * BLOCK_P + tl.arange(0, BLOCK_P), P, stride_it, stride_ik,
                      TOP_K, E_PAD)
    tl.store(chunk_counts_ptr + c * E_PAD + experts, _expert_counts(e, experts))


@triton.jit
def _align_kernel(ids_ptr, chunk_counts_ptr, sorted_ptr, tile_expert_ptr, num_tiles_ptr, P, E,
                  SLOTS, TILES, stride_it, stride_ik, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                  E_PAD: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
                  COUNTED: tl.constexpr, ROWS: tl.constexpr):
    # ids: [T, TOP_K] (any strides: route's are a view of [T, experts]), the expert of each
    # pair; pair p is token p // TOP_K's choice p % TOP_K.
    # sorted: [SLOTS] the pairs by expert, each expert's run starting on a tile boundary, in
    # pair order within it; padding slots hold P. tile_expert: [TILES]; num_tiles: [1] int32,
    # the tiles in use (they come first). Every slot is written exactly once: pairs by pass 2,
    # each run's padding and the slots past every run by pass 3 (no two stores to one address,
    # so no barrier between them, and none between programs).
    # COUNTED: a program per chunk of BLOCK_P pairs, _align_count_kernel's chunk_counts [C,
    # E_PAD] read ROWS rows at a time (a constexpr of its own: one taken from the chunk count,
    # a size of the step, would make torch.compile guard on it and compile the layer again for
    # each value); the program places its chunk's pairs and takes its turn of pass 3.
    # Otherwise one program does every chunk in turn (chunk_counts unread).
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    experts = tl.arange(0, E_PAD)
    lanes = tl.arange(0, BLOCK_P)
    if COUNTED:
        # Pass 1 from the table: every expert's count, and the pairs of each expert in the
        # chunks before this program's.
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        seen = tl.zeros([E_PAD], dtype=tl.int32)
        rows = tl.arange(0, ROWS)
        for c0 in range(0, programs, ROWS):
            chunks = c0 + rows
            table = tl.load(chunk_counts_ptr + chunks[:, None] * E_PAD + experts[None, :],
                            mask=(chunks < programs)[:, None], other=0)  # [ROWS, E_PAD]
            counts += tl.sum(table, axis=0)
            seen += tl.sum(tl.where((chunks < pid)[:, None], table, 0), axis=0)
        first, last = pid * BLOCK_P, pid * BLOCK_P + BLOCK_P
    else:
        # Pass 1: each expert's pair count.
        counts = tl.zeros([E_PAD], dtype=tl.int32)
        for p0 in range(0, P, BLOCK_P):
            e = _pair_experts(ids_ptr, p0 + lanes, P, stride_it, stride_ik, TOP_K, E_PAD)
            counts += _expert_counts(e, experts)
        seen = tl.zeros([E_PAD], dtype=tl.int32)  # each expert's pairs in earlier chunks
        first, last = 0, P
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # each expert's run's end; experts >= E have none
    starts = ends - padded
    used = tl.sum(padded, 0)  # slots in use
    tl.store(num_tiles_ptr, used // BLOCK_M, mask=pid == 0)
    # Pass 2: pair p goes to its expert's start + the pairs of that expert before it.
    for p0 in range(first, last, BLOCK_P):
        offs = p0 + lanes
        e = _pair_experts(ids_ptr, offs, P, stride_it, stride_ik, TOP_K, E_PAD)
        onehot = e[:, None] == experts[None, :]  # [BLOCK_P, E_PAD]
        base = tl.sum(tl.where(onehot, (starts + seen)[None, :], 0), axis=1)
        earlier = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)  # same expert, earlier in this chunk
        tl.store(sorted_ptr + base + rank, offs, mask=offs < P)
        seen += tl.sum(onehot.to(tl.int32), axis=0)
    # Pass 3: padding, by where it lies rather than by searching each slot's run (that search,
    # [slots, experts] a chunk, was most of the kernel's time: session 69): an expert's run
    # pads the padded - counts (< BLOCK_M) slots right after its pairs (program 0 stores them);
    # the slots from `used` on belong to no run. A tile's expert is its first slot's run: the
    # experts whose runs end at or before it (clamped to E - 1 past the runs: those tiles exit
    # unread). The programs take the slots and tiles in turns of BLOCK_S and BLOCK_P.
    pads = tl.arange(0, BLOCK_M)
    pad_slots = (starts + counts)[:, None] + pads[None, :]  # [E_PAD, BLOCK_M]
    tl.store(sorted_ptr + pad_slots, P + pad_slots * 0,
             mask=(pads[None, :] < (padded - counts)[:, None]) & (pid == 0))
    tail = tl.arange(0, BLOCK_S)
    for s0 in range(pid * BLOCK_S, SLOTS, programs * BLOCK_S):
        slots = s0 + tail
        tl.store(sorted_ptr + slots, P + slots * 0, mask=(slots >= used) & (slots < SLOTS))
    for t0 in range(pid * BLOCK_P, TILES, programs * BLOCK_P):
        tiles = t0 + lanes
        run = tl.sum((ends[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(tile_expert_ptr + tiles, tl.minimum(run, E - 1), mask=tiles < TILES)


def max_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M tiles `pairs` pairs over `num_experts` experts can pad to (see above)."""
    return min(pairs, (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m)


def align_block_for(pairs: int, num_experts: int) -> int:
    """The pairs (and tiles) the align kernels handle at a time: 16 while experts average at most
    4 pairs, else 32. The boundary is block_m_for's first, so that a compiled layer's guards split
    its steps no further. benchmarks/moe_launch_probe.py on an H100 at 128 experts, top-8
    (session 72; one call in a CUDA graph of 20), against the chunk of 64 before: 3.5 against 6.4
    us at 1 token, 5.2 against 10.2 at 16, 6.3 against 8.3 at 64 (16); 7.5 against 8.5 at 128
    and 9.4 against 9.5 at 256 (32), where 16 reads 8.5 and 12.1. 4 warps: 8 were up to 0.3 us
    faster at 1-4 tokens and 2 us slower from 8."""
    return 16 if pairs <= FEW_PAIRS_AN_EXPERT * num_experts else 32


def align(experts: torch.Tensor, num_experts: int, block_m: int, *, block_p: int | None = None,
          num_warps: int = 4, count_from: int | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts: [T, k] or [P] (int32 or int64, any strides), each pair's expert -> (sorted
    [tiles * block_m] int32: the pair ids by expert, each expert's run padded to whole tiles
    with P; tile_expert [tiles] int32; num_tiles [1] int32, the tiles in use, which come
    first), tiles = max_tiles(P, num_experts, block_m). block_p, num_warps: the kernels' pair
    chunk (None: align_block_for's) and warps; count_from: the chunks from which the pairs are
    counted by a kernel of a program a chunk and placed by another (below, one program does
    every chunk in turn: its time grows with P, one more launch's does not; None:
    ALIGN_COUNT_FROM) (benchmarks/moe_launch_probe.py times others)."""
    if experts.dim() == 1:
        experts = experts[:, None]
    p = experts.numel()
    tiles = max_tiles(p, num_experts, block_m)
    block_p = align_block_for(p, num_experts) if block_p is None else block_p
    dev = experts.device
    e_pad = max(2, next_pow2(num_experts))
    chunks = triton.cdiv(p, block_p)
    counted = chunks >= (ALIGN_COUNT_FROM if count_from is None else count_from)
    sorted_ids = torch.empty(tiles * block_m, dtype=torch.int32, device=dev)
    tile_expert = torch.empty(tiles, dtype=torch.int32, device=dev)
    num_tiles = torch.empty(1, dtype=torch.int32, device=dev)
    programs = chunks if counted else 1
    chunk_counts = torch.empty((programs, e_pad), dtype=torch.int32, device=dev)
    if counted:
        _align_count_kernel[(chunks,)](experts, chunk_counts, p, experts.stride(0),
                                       experts.stride(1), TOP_K=experts.shape[1], E_PAD=e_pad,
                                       BLOCK_P=block_p, num_warps=num_warps)
    _align_kernel[(programs,)](
        experts, chunk_counts, sorted_ids, tile_expert, num_tiles, p, num_experts,
        tiles * block_m, tiles, experts.stride(0), experts.stride(1), TOP_K=experts.shape[1],
        BLOCK_M=block_m, E_PAD=e_pad, BLOCK_P=block_p, BLOCK_S=ALIGN_STORE_BLOCK,
        COUNTED=counted, ROWS=ALIGN_COUNT_ROWS, num_warps=num_warps)
    return sorted_ids, tile_expert, num_tiles


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, out_ptr, rw_ptr, ids_ptr, sorted_ptr, tile_expert_ptr,
                     num_tiles_ptr, P, N, K, stride_am, stride_we, stride_wn, stride_om,
                     stride_rt, stride_rk, stride_it, stride_ik,
                     A_DIV: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     GLU: tl.constexpr, WEIGHTED: tl.constexpr, PAIR_TILES: tl.constexpr,
                     PRECISION: tl.constexpr):
    # Program (tile, pid_n): the tile's pairs (sorted[tile * BLOCK_M:][:BLOCK_M], one expert's)
    # times that expert's weight rows [pid_n * BLOCK_N, +BLOCK_N). A pair's row of a is
    # pair // A_DIV (top_k for h's token rows, 1 for act's pair rows). w: [E, N, K] (GLU: [E,
    # 2N, K], gate rows then up rows; out = silu(gate) * up). WEIGHTED: each row times its
    # routing weight, rw: [T, TOP_K] (any strides) at (pair // TOP_K, pair % TOP_K).
    # PAIR_TILES: no align layout; tile p is pair p alone, its expert read from ids: [T, TOP_K]
    # (any strides), and the grid holds P tiles (see fused_experts).
    # out: [P, N], rows in pair order; padding rows (pair id P) are neither read nor written.
    tile = tl.program_id(0)
    slots = tl.arange(0, BLOCK_M)
    if PAIR_TILES:
        pairs = tl.where(slots == 0, tile, P)
        expert = tl.load(ids_ptr + (tile // TOP_K) * stride_it + (tile % TOP_K) * stride_ik
                         ).to(tl.int64)
    else:
        if tile >= tl.load(num_tiles_ptr):
            return
        pairs = tl.load(sorted_ptr + tile * BLOCK_M + slots)
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    pid_n = tl.program_id(1)
    valid = pairs < P
    rows = tl.where(valid, pairs // A_DIV, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Weight rows past N are clamped onto row N - 1 (read, never stored), as skinny_gemm's.
    w_rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :]
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    up_step = N * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            w = tl.load(w_ptrs)
            if GLU:
                w_up = tl.load(w_ptrs + up_step)
        else:
            mask_k = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0)
            if GLU:
                w_up = tl.load(w_ptrs + up_step, mask=mask_k[None, :], other=0.0)
        a_t = tl.trans(a)
        acc = tl.dot(w, a_t, acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        if GLU:
            acc_up = tl.dot(w_up, a_t, acc_up, input_precision=PRECISION)
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if GLU:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up in fp32, rounded once below
    if WEIGHTED:
        rw = tl.load(rw_ptr + (pairs // TOP_K) * stride_rt + (pairs % TOP_K) * stride_rk,
                     mask=valid, other=0.0).to(tl.float32)
        acc = acc * rw[None, :]
    out_ptrs = out_ptr + pairs[None, :].to(tl.int64) * stride_om + offs_n[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None] & valid[None, :])


def takes_pair_tiles(tokens: int) -> bool:
    """Whether a step of `tokens` tokens skips align and gives each pair a tile of its own
    (PAIR_TILES). At one token that is align's layout anyway: routing's top_k experts are
    distinct, so each pair has an expert, and a tile, to itself; the GEMMs then read each
    pair's expert from the routing's ids, and a step launches one kernel fewer (align took
    3.2 us of a sparse layer's ~46 at one token on an H100, BENCHMARKS.md session 73). The
    tiles' products are align's, bit for bit (the same pair in a tile's first slot, the same
    expert); only their order differs, and each pair writes its own rows. (With tiles a pair,
    any routing is computed right: pairs sharing an expert would read its weights once a
    pair.) One token only: torch.compile specializes a step size of 1, so the choice adds no
    guard to a compiled layer."""
    return tokens == 1


def block_m_for(pairs: int, num_experts: int, device: torch.device) -> int:
    """Pairs a tile: 16 (tl.dot's least) while experts average at most 4 pairs, 32 to 16, else
    64: fewer tiles an expert (its weights read once a tile) against padding. A guess."""
    if not runs_ptx(device) or pairs <= FEW_PAIRS_AN_EXPERT * num_experts:
        return 16
    return 32 if pairs <= 16 * num_experts else 64


def gemm_config(tiles: int, n: int, k: int, block_m: int, dtype: torch.dtype,
                device: torch.device, **override) -> dict:
    """block_n, block_k, num_warps, num_stages of a GEMM of `tiles` tiles into n columns over k.
    On a GPU, as skinny_gemm's unsplit tiles: the largest block_n of 64/32/16 that gives WAVES
    programs an SM from the grid (which counts every tile the layout may hold), 256-byte weight
    rows a load, num_stages 4 for 16-bit (3 for fp32 or 64-pair tiles, for shared memory).
    Session 69's sweep at the 30B-A3B shape (H100, benchmarks/moe_launch_probe.py) found the
    rest within a few percent of the best launch at 1-32 tokens; at block_n 16, 512-byte rows,
    the earlier guess, were up to 11% slower than 256 in 5 of its 8 cases and at most 2.5%
    faster in the others (the single stream's gate_up, the one default at block_n 16: 23.1
    against 21.2 us). Under the interpreter 16 x 32 tiles, so tiny test shapes cover the
    edges."""
    if not runs_ptx(device):
        cfg = dict(block_n=16, block_k=32, num_warps=1, num_stages=1)
        return cfg | override
    want = WAVES * num_sms(device)
    block_n = next((b for b in BLOCK_NS if tiles * triton.cdiv(n, b) >= want), BLOCK_NS[-1])
    elsize = dtype.itemsize
    block_k = min(256 // elsize, max(16, next_pow2(k)))
    stages = 4 if elsize == 2 and block_m < 64 else 3
    return dict(block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages) | override


def _gemm(a, w, out, rw, experts, layout, *, n, k, a_div, glu, block_m, config):
    """out = the tiles' products (see _moe_gemm_kernel); rw: [T, k] routing weights or None;
    experts: [T, k], each pair's expert; layout: align's (sorted_ids, tile_expert, num_tiles),
    or None for a tile a pair (PAIR_TILES)."""
    pairs = experts.numel()
    sorted_ids, tile_expert, num_tiles = layout or (experts, experts, experts)  # unread if None
    tiles = pairs if layout is None else tile_expert.shape[0]
    cfg = gemm_config(tiles, n, k, block_m, a.dtype, a.device, **(config or {}))
    weighted = rw is not None
    if not weighted:  # never read (WEIGHTED=False): any [T, k] tensor serves as the pointer
        rw = experts
    _moe_gemm_kernel[(tiles, triton.cdiv(n, cfg["block_n"]))](
        a, w, out, rw, experts, sorted_ids, tile_expert, num_tiles, pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0), rw.stride(0), rw.stride(1),
        experts.stride(0), experts.stride(1), A_DIV=a_div, TOP_K=experts.shape[1],
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        EVEN_K=k % cfg["block_k"] == 0, GLU=glu, WEIGHTED=weighted,
        PAIR_TILES=layout is None, PRECISION=dot_precision(a.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def fused_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                  experts_gate_up: torch.Tensor, experts_down: torch.Tensor, *,
                  block_m: int | None = None, config: dict | None = None,
                  pair_tiles: bool | None = None, unsummed: bool = False) -> torch.Tensor:
    """The expert part of functional.moe.moe_mlp: h: [T, hidden], weights: [T, k] (h's dtype or
    fp32), experts: [T, k] int, experts_gate_up: [E, 2 * inter, hidden], experts_down: [E,
    hidden, inter] -> [T, hidden] in h's dtype, sum over j of weights[t, j] * mlp_e(h[t]) with
    e = experts[t, j] (this rank's partial sum under tensor parallelism: the caller all-reduces).

    Roundings: gate and up stay fp32 into silu(gate) * up, which is rounded once to h's dtype
    (the grouped path rounds gate and up, then silu, then the product); down's rows times their
    weights stay fp32 to the sum, rounded once. block_m and config (gemm_config's keys) override
    the launch choices (tests); pair_tiles: a tile a pair without align's layout, or align's
    (None: takes_pair_tiles's choice); unsummed: the k weighted products unsummed, fp32
    [k, T, hidden] (a view), for a consumer that sums them (functional.moe.moe_mlp's
    unsummed_ok)."""
    t, hidden = h.shape
    top_k = experts.shape[1]
    num_experts, two_inter, _ = experts_gate_up.shape
    inter = two_inter // 2
    assert experts_gate_up.shape == (num_experts, 2 * inter, hidden), experts_gate_up.shape
    assert experts_down.shape == (num_experts, hidden, inter), experts_down.shape
    assert experts.shape == weights.shape == (t, top_k), (experts.shape, weights.shape)
    assert h.stride(1) == 1 and experts_gate_up.stride(2) == 1 and experts_down.stride(2) == 1
    assert h.dtype == experts_gate_up.dtype == experts_down.dtype, (
        h.dtype, experts_gate_up.dtype, experts_down.dtype)
    pairs = t * top_k
    if block_m is None:
        block_m = block_m_for(pairs, num_experts, h.device)
    # experts and weights may be views (functional.moe.route's are of [T, experts]; the kernel
    # path's moe_route writes them whole): the kernels take their strides rather than a copy
    if pair_tiles is None:
        pair_tiles = takes_pair_tiles(t)
    layout = None if pair_tiles else align(experts, num_experts, block_m)
    act = torch.empty((pairs, inter), dtype=h.dtype, device=h.device)
    _gemm(h, experts_gate_up, act, None, experts, layout, n=inter, k=hidden, a_div=top_k,
          glu=True, block_m=block_m, config=config)
    y = torch.empty((pairs, hidden), dtype=torch.float32, device=h.device)
    _gemm(act, experts_down, y, weights, experts, layout, n=hidden, k=inter, a_div=1, glu=False,
          block_m=block_m, config=config)
    if unsummed:
        return y.view(t, top_k, hidden).transpose(0, 1)
    return y.view(t, top_k, hidden).sum(1).to(h.dtype)
