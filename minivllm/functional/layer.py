"""One Qwen3 decoder layer as a pure function (apart from the donated cache write)."""

from __future__ import annotations

import torch

from ..state.batch import Batch
from ..state.config import ModelConfig
from ..state.params import LayerParams
from ..state.shard import ShardSpec
from .activation import silu_and_mul
from .attention import AttentionBackend
from .linear import column_linear, qkv_linear, row_linear
from .norm import add_rms_norm, rms_norm
from .rope import apply_rope


def attention_block(lp: LayerParams, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
                    config: ModelConfig, shard: ShardSpec, backend: AttentionBackend) -> torch.Tensor:
    """x: [T, hidden] (normed) -> [T, hidden]. Writes this step's K/V into k_cache/v_cache."""
    q, k, v = qkv_linear(x, lp.qkv, config, shard)
    q = apply_rope(rms_norm(q, lp.q_norm, config.rms_norm_eps), cos, sin)
    k = apply_rope(rms_norm(k, lp.k_norm, config.rms_norm_eps), cos, sin)
    out = backend(q, k, v, k_cache, v_cache, batch, config.head_dim ** -0.5)
    return row_linear(out.reshape(out.shape[0], -1), lp.o_proj, shard)


def mlp_block(lp: LayerParams, x: torch.Tensor, shard: ShardSpec) -> torch.Tensor:
    """x: [T, hidden] (normed) -> [T, hidden]."""
    return row_linear(silu_and_mul(column_linear(x, lp.gate_up)), lp.down, shard)


def decoder_layer(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: Batch, *, config: ModelConfig, shard: ShardSpec, backend: AttentionBackend
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm attention then MLP. x: the previous block's output, residual: the stream it adds
    to (None for the first layer). Returns (this layer's MLP output, the residual stream)."""
    h, residual = add_rms_norm(x, residual, lp.input_norm, config.rms_norm_eps)
    h = attention_block(lp, h, cos, sin, k_cache, v_cache, batch, config=config, shard=shard,
                        backend=backend)
    h, residual = add_rms_norm(h, residual, lp.post_norm, config.rms_norm_eps)
    return mlp_block(lp, h, shard), residual
