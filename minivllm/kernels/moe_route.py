"""A MoE step's routing in one kernel: each token's router logits -> its top_k experts and their
weights, as functional.moe.route computes them (softmax in fp32, the top_k in descending order,
optionally renormalized to sum to one).

  logits: [S, T, E], S partial sums of the router's product (the skinny GEMM's fp32 split-K
          partials, summed here in a fixed order) or S = 1 for a finished product
  -> weights [T, top_k] in the activation's dtype, experts [T, top_k] int64

Why a kernel: torch.compile leaves routing as the router GEMM (cuBLAS) and three Inductor
kernels (softmax with the sort, the slice, the renormalization); on an H100 at one token that is
5.0 + 2.8 + 1.1 + 1.1 us of a sparse layer's ~46 (benchmarks/moe_probe.py --compiled,
BENCHMARKS.md session 73). For a few rows the router's product goes to the skinny split-K GEMM
(0.5 MB of weight over ~64 programs, not one cuBLAS tile's handful) and its partials come here
unsummed. On an H100 (benchmarks/moe_launch_probe.py, session 73) a step's routing took 4.8
against compiled torch's 8.5 us at 1 token, 7.6 against 10.1 at 256; the Qwen3-30B-A3B single
stream went from 246 to 263 tok/s.

The experts are ranked by their logits after the rounding to the activation's dtype that
F.linear's output takes, the lower index first among equal logits (torch.sort(stable=True) over
the softmax, and vLLM's topk_softmax, rank equal probabilities that way). The softmax is
monotonic, so the order is route's wherever distinct logits keep distinct fp32 probabilities,
which is everywhere a logit is not within ~1e-5 of zero against a max far from it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .launch import next_pow2


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_ls, stride_lt,
                  SPLITS: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, NORMALIZE: tl.constexpr):
    # A program a token: its E logits fit one warp's registers (128 experts: 4 a thread).
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, E_PAD)
    mask_e = offs_e < E
    row = logits_ptr + t * stride_lt + offs_e
    acc = tl.zeros([E_PAD], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(row + s * stride_ls, mask=mask_e, other=0.0).to(tl.float32)
    # rounded to the weights' dtype, the activation's: F.linear's output would be in it
    logits = tl.where(mask_e, acc.to(weights_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    # Ranked on the logits, each pick masked to -inf after it; padding lanes are -inf from the
    # start, so with top_k <= E (the wrapper's check) they are never picked.
    offs_k = tl.arange(0, K_PAD)
    picked = tl.full([K_PAD], float("-inf"), tl.float32)
    ids = tl.zeros([K_PAD], tl.int32)
    rest = logits
    for j in tl.static_range(TOP_K):
        best = tl.max(rest, 0)
        # A row of NaN logits matches no lane: its pick would be E_PAD, past the experts, which
        # the GEMMs would read out of bounds. Clamped, it is a valid expert (the output is NaN
        # as the torch path's; other tokens are untouched).
        pick = tl.minimum(tl.min(tl.where(rest == best, offs_e, E_PAD), 0), E - 1)
        picked = tl.where(offs_k == j, best, picked)
        ids = tl.where(offs_k == j, pick, ids)
        rest = tl.where(offs_e == pick, float("-inf"), rest)
    top = tl.max(logits, 0)  # the first pick; finite since E >= 1
    denom = tl.sum(tl.exp(logits - top), 0)  # the softmax's, over every expert
    w = tl.exp(picked - top) / denom  # [K_PAD]: 0 on padding lanes (exp(-inf))
    if NORMALIZE:
        w = w / tl.sum(w, 0)
    mask_k = offs_k < TOP_K
    tl.store(weights_ptr + t * TOP_K + offs_k, w.to(weights_ptr.dtype.element_ty), mask=mask_k)
    tl.store(ids_ptr + t * TOP_K + offs_k, ids.to(tl.int64), mask=mask_k)


# K ranges of the router's skinny product. The skinny GEMM's own choice (32 at 128 experts,
# hidden 2048: two programs an SM) left the routing kernel 32 partial rows to sum; 8 took
# 4.61-4.74 against 4.81-5.00 us a step's routing at 1-16 tokens on an H100, 16 about the same
# (benchmarks/moe_launch_probe.py, BENCHMARKS.md session 73).
ROUTER_SPLIT = 8


def route_from_logits(logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype, *,
                      num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [S, T, E] (S partial sums, any float dtype, each [T, E] row-major) -> weights
    [T, top_k] in `dtype`, experts [T, top_k] int64. The logits are summed over S in fp32 and
    rounded to `dtype` (F.linear's output in the activation's dtype), then ranked.

    One warp a token by default (num_warps overrides it: benchmarks): the top_k picks are 2 *
    top_k reductions over E, in one warp shuffles alone, in more a shared-memory round trip and
    a barrier each."""
    s, t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}] (the experts), got {top_k}")
    if not dtype.is_floating_point:
        raise TypeError(f"routing's dtype must be a floating-point one, got {dtype}")
    assert logits.stride(2) == 1, "each token's logits must be contiguous"
    weights = torch.empty((t, top_k), device=logits.device, dtype=dtype)
    experts = torch.empty((t, top_k), device=logits.device, dtype=torch.int64)
    if t == 0:
        return weights, experts
    e_pad = next_pow2(e)
    _route_kernel[(t,)](
        logits, weights, experts, e, logits.stride(0), logits.stride(1), SPLITS=s,
        TOP_K=top_k, K_PAD=next_pow2(top_k), E_PAD=e_pad, NORMALIZE=normalize,
        num_warps=num_warps or 1)
    return weights, experts


def fused_route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool, *,
                skinny: bool, skinny_config: dict | None = None, num_warps: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """functional.moe.route's result in two kernels: h: [T, hidden], router: [experts, hidden]
    -> (weights [T, top_k] in h's dtype, experts [T, top_k] int64). skinny: the router's product
    by the skinny GEMM, its fp32 split-K partials summed by the routing kernel (a few rows);
    otherwise F.linear's. skinny_config and num_warps override launch choices (benchmarks)."""
    if skinny:
        from .skinny_gemm import skinny_linear

        logits = skinny_linear(h, router, partials=True,  # [S, T, E] fp32
                               config=skinny_config or {"split": ROUTER_SPLIT})
    else:
        logits = F.linear(h, router)[None]  # [1, T, E] in h's dtype
    return route_from_logits(logits, top_k, normalize, h.dtype, num_warps=num_warps)
