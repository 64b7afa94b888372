"""Vocab-parallel embedding and LM head.

The vocabulary is padded to a multiple of the world size and split into equal row ranges; a rank
embeds only the ids in its range (foreign ids give zeros) and an all-reduce sums the ranks'
parts. The head computes each rank's logit columns and gathers them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..state.config import ModelConfig
from ..state.shard import ShardSpec
from .parallel import all_gather_last, all_reduce


def embed(ids: torch.Tensor, weight: torch.Tensor, config: ModelConfig, shard: ShardSpec) -> torch.Tensor:
    """ids: [T] -> [T, hidden]. weight: [vocab_local, hidden]."""
    if shard.world_size == 1:
        return F.embedding(ids, weight)
    start, end = shard.vocab_range(config)
    mine = (ids >= start) & (ids < end)
    local = torch.where(mine, ids - start, torch.zeros_like(ids))
    out = F.embedding(local, weight) * mine[:, None].to(weight.dtype)
    return all_reduce(out, shard)


def lm_head(x: torch.Tensor, weight: torch.Tensor, config: ModelConfig, shard: ShardSpec) -> torch.Tensor:
    """x: [N, hidden] -> logits [N, vocab_size] (padding columns dropped), on every rank."""
    logits = F.linear(x, weight)
    logits = all_gather_last(logits, shard)
    return logits[:, : config.vocab_size]
