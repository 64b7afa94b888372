"""Linear layers as functions of a ShardSpec.

Column-parallel weights are split on their output rows, so each rank computes its own columns of
the result and nothing needs to be exchanged; row-parallel weights are split on their input
columns, so each rank holds a partial sum that an all-reduce completes.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.shard import ShardSpec
from .activation import silu_and_mul
from .parallel import all_reduce


# cuBLAS reads the weights of a decode GEMM of a few rows at 0.9-1.6 TB/s on the H200; the
# Triton skinny GEMM streams them at close to the HBM's bandwidth (BENCHMARKS.md).
# MINIVLLM_SKINNY_GEMM=0 keeps cuBLAS for every shape (for measuring one against the other).
_SKINNY = os.environ.get("MINIVLLM_SKINNY_GEMM", "1") != "0"


def _skinny(x: torch.Tensor) -> bool:
    if not (_SKINNY and x.is_cuda):
        return False
    from ..kernels.skinny_gemm import MAX_SKINNY_ROWS

    return x.shape[0] <= MAX_SKINNY_ROWS


def matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, in] @ weight[out, in].T -> [T, out]: the skinny Triton GEMM for a few rows on CUDA,
    else F.linear (cuBLAS on CUDA)."""
    if _skinny(x):
        from ..kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight)
    return F.linear(x, weight)


def column_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, in] @ weight[out_local, in].T -> [T, out_local]."""
    return matmul(x, weight)


def merged_column_linear(x: torch.Tensor, weight: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
    """One matmul for `parts` equal column-parallel weights stacked on rows (gate/up)."""
    return column_linear(x, weight).chunk(parts, dim=-1)


def qkv_linear(x: torch.Tensor, weight: torch.Tensor, config: ModelConfig, shard: ShardSpec
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [T, hidden] -> q: [T, heads_local, head_dim], k, v: [T, kv_heads_local, head_dim].
    The merged weight holds this rank's q heads, then its k heads, then its v heads."""
    d = config.head_dim
    nq, nkv = shard.num_heads(config), shard.num_kv_heads(config)
    qkv = column_linear(x, weight)
    q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
    t = x.shape[0]
    return q.reshape(t, nq, d), k.reshape(t, nkv, d), v.reshape(t, nkv, d)


def row_linear(x: torch.Tensor, weight: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """x: [T, in_local] @ weight[out, in_local].T, summed over ranks -> [T, out]."""
    return all_reduce(matmul(x, weight), shard)


def glu_row_linear(x: torch.Tensor, weight: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """row_linear(silu(gate) * up, weight) for x: [T, 2 * in_local] = (gate | up). Where the
    skinny GEMM applies, the activation is computed as it loads x: one kernel, not two."""
    if _skinny(x):
        from ..kernels.skinny_gemm import skinny_linear

        return all_reduce(skinny_linear(x, weight, glu=True), shard)
    return row_linear(silu_and_mul(x), weight, shard)
