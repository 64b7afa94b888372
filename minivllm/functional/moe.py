"""The mixture-of-experts MLP of Qwen3-MoE's sparse layers, as pure functions.

A token's router picks num_experts_per_tok experts; each runs silu(gate) * up -> down on it and the
outputs are summed, weighted by the router's probabilities. The (token, expert) pairs are sorted by
expert so that each expert's rows are contiguous and every expert's GEMM is one grouped GEMM
(torch._grouped_mm over offsets), then put back in pair order and summed per token. Every shape is
fixed by the token count, so a step is one graph: no host sync, nothing data-dependent in size
(CUDA graphs, torch.compile); and the sum is in a fixed order, so it is deterministic (an
index_add_ of the pairs would add in whatever order the GPU's atomics land).

MINIVLLM_MOE_KERNEL=triton (read at import; opt-in: on an H100, +13% on a single stream, -12% on
the throughput run, BENCHMARKS.md session 54): steps of up to
kernels.fused_moe.MAX_KERNEL_TOKENS tokens on CUDA (or under TRITON_INTERPRET=1) run the experts
as kernels/fused_moe.py's three Triton kernels instead (the pairs' layout by expert, gate_up with
SiLU * up, down times the routing weights), then the same fixed-order per-token sum; never under
autograd (the kernels have no backward). Unset or anything else: the grouped GEMMs below.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.shard import ShardSpec
from .activation import silu_and_mul
from .parallel import all_reduce

_MOE_KERNEL = os.environ.get("MINIVLLM_MOE_KERNEL", "grouped")


def route(h: torch.Tensor, router: torch.Tensor, top_k: int, normalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """h: [T, hidden], router: [experts, hidden] -> (weights [T, top_k] in h's dtype, experts
    [T, top_k] int64): the top_k experts of each token's softmax (in fp32) over its router
    logits, in descending probability; `normalize` (config norm_topk_prob) divides the chosen
    probabilities by their sum. As transformers' Qwen3MoeTopKRouter computes them, but for
    exact ties (bf16 router logits make them common: a few % of tokens at 128 experts), where
    the lower expert index wins, as vLLM's topk_softmax kernel picks: torch.topk's choice
    among equals is its kernel's, and may differ between devices."""
    probs = torch.softmax(F.linear(h, router), dim=-1, dtype=torch.float32)  # [T, experts]
    weights, experts = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, experts = weights[:, :top_k], experts[:, :top_k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(h.dtype), experts


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes x @ w[e] here without a host sync: every operand's rows
    16-byte aligned (torch asks it of the inner dimension; the outer one is checked too, which
    real shapes meet); on a GPU, bf16 on a Hopper or Blackwell one (CUTLASS's grouped GEMM:
    elsewhere torch falls back to a loop that reads the offsets on the host, which no CUDA
    graph can hold); compiled, bf16 (its meta function's rule); eagerly on a CPU any float."""
    aligned = all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, w))
    if x.is_cuda:  # get_device_properties: constant-folded under torch.compile
        return aligned and x.dtype == torch.bfloat16 and \
            torch.cuda.get_device_properties(x.device).major in (9, 10)
    if torch.compiler.is_compiling():
        return aligned and x.dtype == torch.bfloat16
    return aligned


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x: [R, in] rows sorted by group, weight: [groups, out, in], offsets: [groups] int32, the
    end of each group's rows (the last is R) -> [R, out], row r times its group's weight.T."""
    w = weight.transpose(1, 2)  # [groups, in, out], a view: _grouped_mm reads either layout
    if _grouped_mm_applies(x, w):
        return torch._grouped_mm(x, w, offs=offsets)
    # Elsewhere (an odd size, fp32 or fp16 on a GPU): every group's product over all rows, each
    # row keeping its own group's. groups x the work, but the same fixed shapes and no sync.
    rows = torch.arange(x.shape[0], device=x.device)
    group = torch.searchsorted(offsets, rows, right=True).clamp_(max=weight.shape[0] - 1)  # [R]
    out = x.new_zeros(x.shape[0], weight.shape[1])
    for g in range(weight.shape[0]):
        out = torch.where((group == g)[:, None], F.linear(x, weight[g]), out)
    return out


def _takes_kernel(h: torch.Tensor, kernel: str | None) -> bool:
    """Whether moe_mlp runs kernels/fused_moe.py here: asked for (kernel, else the env flag), a
    decode-sized step (shapes only: a guard under torch.compile, no sync), a device Triton runs
    on, and no autograd."""
    if (kernel or _MOE_KERNEL) != "triton" or torch.is_grad_enabled():
        return False
    from ..kernels import launch
    from ..kernels.fused_moe import MAX_KERNEL_TOKENS

    return 1 <= h.shape[0] <= MAX_KERNEL_TOKENS and launch.triton_usable(h.device)


def moe_mlp(h: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor,
            experts_down: torch.Tensor, config: ModelConfig, shard: ShardSpec, *,
            kernel: str | None = None) -> torch.Tensor:
    """h: [T, hidden] (the post-attention RMSNorm's output) -> [T, hidden], the weighted sum of
    each token's experts' MLPs. experts_gate_up: [experts, 2 * moe_local, hidden],
    experts_down: [experts, hidden, moe_local]; each rank holds every expert's slice of the
    intermediate size, so the partial sums end in one all-reduce, as the dense MLP's.
    kernel: "grouped" or "triton" (see the module's doc), None for MINIVLLM_MOE_KERNEL's."""
    weights, experts = route(h, router, config.num_experts_per_tok, config.norm_topk_prob)
    if _takes_kernel(h, kernel):
        from ..kernels.fused_moe import fused_experts

        out = fused_experts(h, weights, experts, experts_gate_up, experts_down)
    else:
        out = grouped_experts(h, weights, experts, experts_gate_up, experts_down,
                              config.num_experts)
    return all_reduce(out, shard)


def grouped_experts(h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    experts_gate_up: torch.Tensor, experts_down: torch.Tensor, num_experts: int
                    ) -> torch.Tensor:
    """moe_mlp's expert part by grouped GEMMs: weights, experts: [T, k] (route's) -> [T, hidden],
    this rank's partial sum."""
    t, k = experts.shape
    pair_expert = experts.reshape(-1)  # [T * k]: pair p is token p // k's choice p % k
    order = torch.argsort(pair_expert, stable=True)  # pairs grouped by expert
    counts = torch.zeros(num_experts, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, pair_expert, torch.ones_like(pair_expert, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)  # [experts]: each group's end
    x = h[order // k]  # [T * k, hidden], sorted by expert
    gate_up = grouped_linear(x, experts_gate_up, offsets)  # [T * k, 2 * moe_local]
    del x  # eagerly, a prefill of 8k tokens' copies at top-8 are GBs: free each when used
    act = silu_and_mul(gate_up)  # [T * k, moe_local]
    del gate_up
    y = grouped_linear(act, experts_down, offsets)  # [T * k, hidden] in sorted order
    unsorted = torch.empty_like(y).index_copy_(0, order, y)  # back to pair order
    # [T, 1, k] @ [T, k, hidden]: the weighted sum accumulates in fp32 without an fp32 copy.
    return torch.bmm(weights.unsqueeze(1), unsorted.view(t, k, -1)).squeeze(1)  # [T, hidden]
