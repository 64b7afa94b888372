"""Linear layers as functions of a ShardSpec.

Column-parallel weights are split on their output rows, so each rank computes its own columns of
the result and nothing needs to be exchanged; row-parallel weights are split on their input
columns, so each rank holds a partial sum that an all-reduce completes.
"""

from __future__ import annotations

import functools
import operator
import os

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.quant import AwqWeight, Fp8BlockWeight, dequantize_awq, dequantize_fp8_weight
from ..state.shard import ShardSpec
from .activation import silu_and_mul
from .parallel import all_reduce


# A decode GEMM of a few rows is bound by its launch and ramp-up, not by its bytes: on the H200
# (benchmarks/bench_linear.py, BENCHMARKS.md) every one of the 0.6B shape's GEMMs takes 5-13 us
# whoever computes it. cuBLAS is slowest where N is small and K is split (o_proj: 8.4-13 us at
# 1-4 rows; down: 7.7 us), and there the Triton skinny GEMM takes 3.6 and 5 us (session 6),
# with down's SiLU-and-mul folded in (a kernel fewer); for qkv and gate_up cuBLAS was 5-15%
# faster (session 4, at 16 x 256 tiles). So the row-parallel layers take the skinny GEMM, the
# column-parallel ones cuBLAS. Never under autograd: the Triton kernels have no backward.
# MINIVLLM_SKINNY_GEMM=0: cuBLAS everywhere.
_SKINNY = os.environ.get("MINIVLLM_SKINNY_GEMM", "1") != "0"


def skinny_applies(x: torch.Tensor) -> bool:
    """Whether a product of x's rows takes the skinny GEMM (on a GPU, a few rows, no autograd)."""
    if not (_SKINNY and x.is_cuda) or torch.is_grad_enabled():
        return False
    from ..kernels.skinny_gemm import MAX_SKINNY_ROWS

    return x.shape[0] <= MAX_SKINNY_ROWS


# AWQ weights (state/quant.AwqWeight, Qwen3-*-AWQ checkpoints) and block-fp8 ones
# (state/quant.Fp8BlockWeight, Qwen3-*-FP8 kept in fp8) are multiplied by a Triton GEMM that
# dequantizes tile by tile inside the GEMM (kernels/awq_gemm.py, kernels/fp8_gemm.py), for steps
# of fewer than DEQUANTIZE_ROWS rows wherever Triton runs outside autograd: on a GPU, and on a
# CPU under TRITON_INTERPRET=1 when not being traced by torch.compile (an interpreted kernel is
# opaque to dynamo). Elsewhere the weight is dequantized to the activation dtype and multiplied
# by torch (awq_torch_linear, fp8_torch_linear). From 256 rows on (prefill) that is vLLM's AWQ
# choice too: the GEMM is bound by its FLOPs there, where cuBLAS's tiles beat a kernel that
# unpacks in its inner loop, and writing the dequantized weight costs what reading a few hundred
# rows does (not measured here; vLLM's block-fp8 method runs its own fp8 GEMMs throughout).
# MINIVLLM_AWQ_KERNEL=torch / MINIVLLM_FP8_KERNEL=torch: the torch path everywhere.
_AWQ_KERNEL = os.environ.get("MINIVLLM_AWQ_KERNEL", "triton")
_FP8_KERNEL = os.environ.get("MINIVLLM_FP8_KERNEL", "triton")
QUANTIZED_KERNELS = ("triton", "torch")  # MINIVLLM_AWQ_KERNEL's and MINIVLLM_FP8_KERNEL's
DEQUANTIZE_ROWS = 256


def _dequant_kernel(x: torch.Tensor, flag: str,
                    min_capability: tuple[int, int] | None = None) -> bool:
    """Whether a dequantizing Triton GEMM takes x here (see above): `flag` (the format's env
    choice) "triton", no autograd, 1 .. DEQUANTIZE_ROWS - 1 rows; on a GPU of at least
    `min_capability` (None: any), or under the interpreter outside torch.compile, where bf16
    takes the torch path (its products come out wrong: numpy has no bf16)."""
    if flag != "triton" or torch.is_grad_enabled() or not 1 <= x.shape[0] < DEQUANTIZE_ROWS:
        return False
    from ..kernels.launch import cuda_capability, runs_ptx, triton_usable

    if runs_ptx(x.device):
        return min_capability is None or cuda_capability(x.device) >= min_capability
    return triton_usable(x.device) and x.dtype != torch.bfloat16 and \
        not torch.compiler.is_compiling()


def _awq_kernel(x: torch.Tensor) -> bool:
    return _dequant_kernel(x, _AWQ_KERNEL)


def _fp8_kernel(x: torch.Tensor) -> bool:
    # Triton converts float8_e4m3fn (its fp8e4nv) on sm_89 and later only (Ada, Hopper, ...):
    # older GPUs take the torch path, which torch converts anywhere.
    return _dequant_kernel(x, _FP8_KERNEL, (8, 9))


def awq_torch_linear(x: torch.Tensor, weight: AwqWeight) -> torch.Tensor:
    """x: [T, in] @ the AWQ weight, dequantized to x's dtype first (dequantize_awq): the torch
    path, and the reference the kernel is tested against."""
    return x @ dequantize_awq(weight, x.dtype)


def awq_matmul(x: torch.Tensor, weight: AwqWeight) -> torch.Tensor:
    """x: [T, in] @ the AWQ weight -> [T, out] in x's dtype: the kernel or the torch path."""
    if _awq_kernel(x):
        from ..kernels.awq_gemm import awq_linear

        return awq_linear(x, weight)
    return awq_torch_linear(x, weight)


def fp8_torch_linear(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """x: [T, in] @ the block-fp8 weight [out, in].T, dequantized to x's dtype first: the torch
    path, and the reference the kernel is tested against."""
    return F.linear(x, dequantize_fp8_weight(weight, x.dtype))


def fp8_matmul(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """x: [T, in] @ the block-fp8 weight [out, in].T -> [T, out] in x's dtype: the kernel or the
    torch path."""
    if _fp8_kernel(x):
        from ..kernels.fp8_gemm import fp8_linear

        return fp8_linear(x, weight)
    return fp8_torch_linear(x, weight)


# The weight types that are not a dense tensor: the dense-only kernels (skinny GEMM) skip them.
QUANTIZED = (AwqWeight, Fp8BlockWeight)


def column_linear(x: torch.Tensor, weight: torch.Tensor | AwqWeight | Fp8BlockWeight
                  ) -> torch.Tensor:
    """x: [T, in] @ weight[out_local, in].T -> [T, out_local] (an AwqWeight: awq_matmul; an
    Fp8BlockWeight: fp8_matmul)."""
    if isinstance(weight, AwqWeight):  # a static choice: the compiled layer guards on the type
        return awq_matmul(x, weight)
    if isinstance(weight, Fp8BlockWeight):
        return fp8_matmul(x, weight)
    return F.linear(x, weight)


def merged_column_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """One matmul for `parts` equal column-parallel weights stacked on rows (gate/up)."""
    return column_linear(x, weight).chunk(parts, dim=-1)


def qkv_linear(x: torch.Tensor, weight: torch.Tensor, config: ModelConfig, shard: ShardSpec
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, hidden] -> q: [T, heads_local, head_dim], k, v: [T, kv_heads_local, head_dim].
    The merged weight holds this rank's q heads, then its k heads, then its v heads."""
    return split_qkv(column_linear(x, weight), config, shard)


def split_qkv(qkv: torch.Tensor, config: ModelConfig, shard: ShardSpec
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merged projection [T, (heads_local + 2 kv_heads_local) * head_dim] -> q, k, v."""
    d = config.head_dim
    nq, nkv = shard.num_heads(config), shard.num_kv_heads(config)
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    t = qkv.shape[0]
    return q.reshape(t, nq, d), k.reshape(t, nkv, d), v.reshape(t, nkv, d)


def row_linear(x: torch.Tensor, weight: torch.Tensor, shard: ShardSpec, *,
               unsummed_ok: bool = False) -> torch.Tensor:
    """x: [T, in_local] @ weight[out, in_local].T, summed over ranks -> [T, out]. unsummed_ok:
    as in glu_row_linear, the skinny GEMM's fp32 partials may come back unsummed (one rank)."""
    return _reduced(x, row_partial(x, weight), shard, unsummed_ok)


def glu_row_linear(x: torch.Tensor, weight: torch.Tensor, shard: ShardSpec, *,
                   unsummed_ok: bool = False) -> torch.Tensor:
    """row_linear(silu(gate) * up, weight) for x: [T, 2 * in_local] = (gate | up). Where the
    skinny GEMM applies, the activation is computed as it loads x: one kernel, not two.

    unsummed_ok: on one rank, the skinny GEMM's fp32 split-K partials [split, T, out] may be
    returned unsummed, for a consumer that sums them: add_rms_norm, into whose kernel the
    compiled layer fuses the sum (see sum_partials), down's at the next layer's entry too."""
    return _reduced(x, row_partial(x, weight, glu=True), shard, unsummed_ok)


def row_partial(x: torch.Tensor, weight: torch.Tensor, *, glu: bool = False) -> torch.Tensor:
    """This rank's row-parallel product before the all-reduce: x: [T, in_local] (glu: [T, 2 *
    in_local] = (gate | up), silu(gate) * up taken first) @ weight[out, in_local].T -> [T, out]
    in x's dtype, or the skinny GEMM's fp32 split-K partials [split, T, out] (sum_partials sums
    them). For a caller that adds its own partial sum before the layer's one all-reduce (a
    LoRA delta: functional/lora.py)."""
    if isinstance(weight, QUANTIZED):
        return column_linear(silu_and_mul(x) if glu else x, weight)
    if skinny_applies(x):
        return _skinny_partials(x, weight, glu=glu)
    return F.linear(silu_and_mul(x) if glu else x, weight)


def _reduced(x: torch.Tensor, partial: torch.Tensor, shard: ShardSpec, unsummed_ok: bool
             ) -> torch.Tensor:
    """row_partial's product summed over ranks in x's dtype; the skinny GEMM's partials left
    unsummed where the caller allows and one rank holds the whole sum."""
    if unsummed_ok and shard.world_size == 1 and partial.dim() == 3:
        return partial
    return all_reduce(sum_partials(partial, x.dtype), shard)


def sum_partials(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[split, T, out] fp32 partial products -> [T, out] in dtype; [T, out] passes through.

    Under torch.compile the sum is written as split - 1 additions in split order: Inductor
    unrolls a reduction only below 8 elements (config.unroll_reductions_threshold), and the
    skinny GEMM's 16 splits otherwise cost a reduction kernel of their own ahead of the add +
    RMSNorm that consumes them; as additions they are pointwise and fuse into it. On the H200 a
    single-stream layer is then 8 kernels, and the stream ran 900 against 855/858 tok/s
    (BENCHMARKS.md, session 7)."""
    if x.dim() != 3:
        return x
    if torch.compiler.is_compiling():
        return functools.reduce(operator.add, x.unbind(0)).to(dtype)
    return x.sum(0).to(dtype)


def _skinny_partials(x: torch.Tensor, weight: torch.Tensor, *, glu: bool) -> torch.Tensor:
    """The skinny GEMM's fp32 partial products [split, T, out], for the caller to sum as a torch
    op rather than by the kernel's second launch: the compiled layer fuses the sum into the add +
    RMSNorm after it."""
    from ..kernels.skinny_gemm import skinny_linear

    return skinny_linear(x, weight, glu=glu, partials=True)
