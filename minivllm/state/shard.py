"""ShardSpec: which slice of each weight a tensor-parallel rank holds.

One description, used both by the loader (what to read from disk) and by the functional layers
(what collective ends a layer). At world size 1 every slice is the whole tensor and every
collective is the identity.
"""

from __future__ import annotations

from typing import Any

import attrs

from .config import ModelConfig, ceil_div


@attrs.frozen
class ShardSpec:
    rank: int = 0
    world_size: int = 1
    # torch.distributed process group (None: the default group). Static metadata, never a leaf.
    group: Any = attrs.field(default=None, eq=False, hash=False)

    def __attrs_post_init__(self):
        if not (isinstance(self.world_size, int) and self.world_size >= 1):
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not (isinstance(self.rank, int) and 0 <= self.rank < self.world_size):
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")

    def check(self, config: ModelConfig) -> None:
        """Raise ValueError when `config` cannot be split `world_size` ways."""
        ws = self.world_size
        if config.num_heads % ws:
            raise ValueError(f"num_attention_heads ({config.num_heads}) is not divisible by the "
                             f"tensor-parallel size ({ws})")
        if config.num_kv_heads % ws and ws % config.num_kv_heads:
            raise ValueError(f"num_key_value_heads ({config.num_kv_heads}) and the tensor-parallel "
                             f"size ({ws}) must divide one another")
        if len(config.sparse_layers) < config.num_layers and config.intermediate_size % ws:
            raise ValueError(f"intermediate_size ({config.intermediate_size}) is not divisible by the "
                             f"tensor-parallel size ({ws})")
        if config.is_moe and config.moe_intermediate_size % ws:
            raise ValueError(f"moe_intermediate_size ({config.moe_intermediate_size}) is not "
                             f"divisible by the tensor-parallel size ({ws})")

    # --- heads -------------------------------------------------------------------------------
    def num_heads(self, config: ModelConfig) -> int:
        return config.num_heads // self.world_size

    def num_kv_heads(self, config: ModelConfig) -> int:
        # KV heads are replicated when there are more ranks than KV heads.
        return max(1, config.num_kv_heads // self.world_size)

    def head_range(self, config: ModelConfig) -> tuple[int, int]:
        n = self.num_heads(config)
        return self.rank * n, (self.rank + 1) * n

    def kv_head_range(self, config: ModelConfig) -> tuple[int, int]:
        n = self.num_kv_heads(config)
        if config.num_kv_heads >= self.world_size:
            start = self.rank * n
        else:
            start = self.rank * config.num_kv_heads // self.world_size
        return start, start + n

    # --- MLP ---------------------------------------------------------------------------------
    def intermediate_range(self, config: ModelConfig) -> tuple[int, int]:
        n = config.intermediate_size // self.world_size
        return self.rank * n, (self.rank + 1) * n

    def moe_intermediate_range(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's slice of every expert's intermediate size: each rank holds every expert,
        cut as the dense MLP is (vLLM's tensor-parallel MoE), so that a token's experts need no
        exchange and down's partial sums end in the layer's one all-reduce."""
        n = config.moe_intermediate_size // self.world_size
        return self.rank * n, (self.rank + 1) * n

    # --- vocabulary --------------------------------------------------------------------------
    def padded_vocab(self, config: ModelConfig) -> int:
        return ceil_div(config.vocab_size, self.world_size) * self.world_size

    def vocab_range(self, config: ModelConfig) -> tuple[int, int]:
        """This rank's rows of the padded vocabulary; rows >= vocab_size are zero padding."""
        n = self.padded_vocab(config) // self.world_size
        return self.rank * n, (self.rank + 1) * n
