"""Linear layers as functions of a ShardSpec.

Column-parallel weights are split on their output rows, so each rank computes its own columns of
the result and nothing needs to be exchanged; row-parallel weights are split on their input
columns, so each rank holds a partial sum that an all-reduce completes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.shard import ShardSpec
from .parallel import all_reduce


def column_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, in] @ weight[out_local, in].T -> [T, out_local]."""
    return F.linear(x, weight)


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
    return all_reduce(F.linear(x, weight), shard)
