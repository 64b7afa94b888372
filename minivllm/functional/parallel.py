"""Collectives named by a ShardSpec. At world size 1 they are the identity, so every function that
uses them runs on one CPU process; above 1 they are torch.distributed's functional collectives,
which trace into compiled graphs."""

from __future__ import annotations

import torch

from ..state.shard import ShardSpec


def all_reduce(x: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """Sum of x over the ranks."""
    if shard.world_size == 1:
        return x
    import torch.distributed._functional_collectives as fc

    return fc.all_reduce(x, "sum", shard.group if shard.group is not None else _default_group())


def all_gather_last(x: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """x: [..., n] on each rank -> [..., world_size * n], rank r's part at r * n."""
    if shard.world_size == 1:
        return x
    import torch.distributed._functional_collectives as fc

    group = shard.group if shard.group is not None else _default_group()
    # all_gather_single is all_gather_tensor's new name (recent torch warns on the old one)
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    gathered = gather(x.contiguous(), 0, group)  # [world * rows, n]
    parts = gathered.chunk(shard.world_size, dim=0)
    return torch.cat(parts, dim=-1)


def _default_group():
    import torch.distributed as dist

    return dist.group.WORLD
