"""The mixture-of-experts MLP of Qwen3-MoE's sparse layers, as pure functions.

A token's router picks num_experts_per_tok experts; each runs silu(gate) * up -> down on it and the
outputs are summed, weighted by the router's probabilities. The (token, expert) pairs are sorted by
expert so that each expert's rows are contiguous and every expert's GEMM is one grouped GEMM
(torch._grouped_mm over offsets), then put back in pair order and summed per token. Every shape is
fixed by the token count, so a step is one graph: no host sync, nothing data-dependent in size
(CUDA graphs, torch.compile); and the sum is in a fixed order, so it is deterministic (an
index_add_ of the pairs would add in whatever order the GPU's atomics land).

Steps of up to 256 tokens on a GPU (decode) run the experts as kernels/fused_moe.py's three
Triton kernels instead (the pairs' layout by expert, gate_up with SiLU * up, down times the
routing weights), then the same fixed-order per-token sum, and route with kernels/moe_route.py
(one kernel; the router's product by the skinny GEMM at up to 16 tokens); never under autograd
(the kernels have no backward).
MINIVLLM_MOE_KERNEL (read at import) picks:
  auto (default)  the kernels on CUDA for every step of up to kernels.fused_moe.MAX_KERNEL_TOKENS
                  tokens, the grouped GEMMs for larger steps and on the CPU. On an H100
                  (BENCHMARKS.md session 72, benchmarks/moe_probe.py) one Qwen3-30B-A3B layer's
                  experts take 67 against 109 us at 1 token, 439 against 553 at 64 and 470
                  against 595 at 256 with the kernels; the throughput run 2,938 against 2,657
                  tok/s with the kernels to 256 tokens against to 64 (session 55's kernels lost
                  from 96 tokens, before session 69's align rewrite).
  triton          the kernels for every step of up to MAX_KERNEL_TOKENS tokens, on CUDA or under
                  TRITON_INTERPRET=1 (tests)
  grouped         never the kernels
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.shard import ShardSpec
from .activation import silu_and_mul
from .parallel import all_reduce

_MOE_KERNEL = os.environ.get("MINIVLLM_MOE_KERNEL", "auto")
MOE_KERNELS = ("auto", "triton", "grouped")


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


def kernel_path(kernel: str, tokens: int, *, on_gpu: bool, triton_usable: bool,
                grad: bool = False) -> bool:
    """Whether a step of `tokens` tokens takes kernels/fused_moe.py's path under `kernel` (one of
    MOE_KERNELS, see the module's doc): on_gpu, the tensors are on CUDA; triton_usable, Triton
    runs on their device (CUDA or the interpreter); grad, autograd records (the kernels have no
    backward)."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"MoE kernel {kernel!r} is not one of {MOE_KERNELS} "
                         "(MINIVLLM_MOE_KERNEL or moe_mlp's kernel=)")
    from ..kernels.fused_moe import MAX_KERNEL_TOKENS

    if kernel == "grouped" or grad or not 1 <= tokens <= MAX_KERNEL_TOKENS:
        return False
    if kernel == "triton":
        return triton_usable
    # auto: on a GPU only; under the interpreter the CPU keeps the grouped path unless asked
    return on_gpu


def _takes_kernel(h: torch.Tensor, kernel: str | None) -> bool:
    """kernel_path for moe_mlp's operands: kernel, else MINIVLLM_MOE_KERNEL's. Shapes and
    devices only: under torch.compile a guard, no sync."""
    from ..kernels import launch

    return kernel_path(kernel or _MOE_KERNEL, h.shape[0], on_gpu=h.is_cuda,
                       triton_usable=launch.triton_usable(h.device),
                       grad=torch.is_grad_enabled())


def moe_mlp(h: torch.Tensor, router: torch.Tensor, experts_gate_up: torch.Tensor,
            experts_down: torch.Tensor, config: ModelConfig, shard: ShardSpec, *,
            kernel: str | None = None, unsummed_ok: bool = False) -> torch.Tensor:
    """h: [T, hidden] (the post-attention RMSNorm's output) -> [T, hidden], the weighted sum of
    each token's experts' MLPs. experts_gate_up: [experts, 2 * moe_local, hidden],
    experts_down: [experts, hidden, moe_local]; each rank holds every expert's slice of the
    intermediate size, so the partial sums end in one all-reduce, as the dense MLP's.
    kernel: "auto", "triton" or "grouped" (see the module's doc), None for
    MINIVLLM_MOE_KERNEL's. unsummed_ok: on one rank, where the kernel path runs and the skinny
    GEMM applies (a few rows on a GPU, as glu_row_linear's unsummed_ok), the top_k weighted
    expert products may come back unsummed, fp32 [top_k, T, hidden], for a consumer that sums
    them (add_rms_norm, final_hidden): compiled, the sum then fuses into that consumer's kernel
    instead of taking one of its own (see sum_partials)."""
    top_k, normalize = config.num_experts_per_tok, config.norm_topk_prob
    if _takes_kernel(h, kernel):
        from ..kernels.fused_moe import fused_experts
        from ..kernels.moe_route import fused_route
        from .linear import skinny_applies

        skinny = skinny_applies(h)
        weights, experts = fused_route(h, router, top_k, normalize, skinny=skinny)
        unsummed = unsummed_ok and skinny and shard.world_size == 1
        out = fused_experts(h, weights, experts, experts_gate_up, experts_down,
                            unsummed=unsummed)
        if unsummed:
            return out
    else:
        weights, experts = route(h, router, top_k, normalize)
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
