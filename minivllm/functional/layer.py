"""One Qwen3 decoder layer as a pure function (apart from the donated cache write)."""

from __future__ import annotations

import torch

from ..state.batch import Batch
from ..state.config import ModelConfig
from ..state.params import LayerParams, MoELayerParams
from ..state.shard import ShardSpec
from .attention import AttentionBackend
from .linear import column_linear, glu_row_linear, row_linear, split_qkv
from .moe import moe_mlp
from .norm import add_rms_norm, rms_norm
from .rope import apply_rope


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, nq, d], k: [T, nkv, d] -> each head RMS-normed (q's heads by q_weight: [d], k's by
    k_weight) and rotated. Taken as one [T, nq + nkv, d] tensor so that the compiled layer makes
    it one kernel rather than one for q and one for k (a decode step of a few rows pays per
    kernel, not per byte)."""
    nq, nkv = q.shape[1], k.shape[1]
    weight = torch.cat([q_weight.expand(nq, -1), k_weight.expand(nkv, -1)])  # [nq + nkv, d]
    qk = apply_rope(rms_norm(torch.cat([q, k], dim=1), weight, eps), cos, sin)
    return qk.split([nq, nkv], dim=1)


def attention_block(lp: LayerParams, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
                    config: ModelConfig, shard: ShardSpec, backend: AttentionBackend) -> torch.Tensor:
    """qkv: [T, (heads_local + 2 kv_heads_local) * head_dim], the normed rows' projection ->
    [T, hidden], or on one rank at a few rows o_proj's unsummed fp32 partials [split, T, hidden]
    (the add + RMSNorm after it sums them). Writes this step's K/V into k_cache/v_cache."""
    out = attention_output(lp, qkv, cos, sin, k_cache, v_cache, batch, config=config,
                           shard=shard, backend=backend)
    return row_linear(out, lp.o_proj, shard, unsummed_ok=True)


def attention_output(lp: LayerParams, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
                     config: ModelConfig, shard: ShardSpec, backend: AttentionBackend
                     ) -> torch.Tensor:
    """attention_block before o_proj: [T, heads_local * head_dim]."""
    q, k, v = split_qkv(qkv, config, shard)
    norm_rope = (lp.q_norm, lp.k_norm, cos, sin, config.rms_norm_eps)
    step = "decode" if batch.is_decode else "prefill"
    fused = getattr(backend, f"{step}_with_norm_rope", None)
    if fused is not None:  # the backend norms and rotates q and k itself
        out = fused(q, k, v, k_cache, v_cache, batch, config.head_dim ** -0.5, norm_rope)
    else:
        q, k = qk_norm_rope(q, k, *norm_rope)
        out = backend(q, k, v, k_cache, v_cache, batch, config.head_dim ** -0.5)
    return out.reshape(out.shape[0], -1)


def norm_qkv(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv projection of rms_norm(x + residual), x + residual): the attention block's entry."""
    h, residual = add_rms_norm(x, residual, lp.input_norm, eps)
    return column_linear(h, lp.qkv), residual


def mlp_block(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor, shard: ShardSpec,
              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The post-attention add + RMSNorm and the MLP: (down's output, x + residual). Down's output
    is [T, hidden], or on one rank at a few rows its unsummed fp32 partials [split, T, hidden]
    (see glu_row_linear), which the next layer's add + RMSNorm sums."""
    h, residual = add_rms_norm(x, residual, lp.post_norm, eps)
    return glu_row_linear(column_linear(h, lp.gate_up), lp.down, shard, unsummed_ok=True), residual


def moe_block(lp: MoELayerParams, x: torch.Tensor, residual: torch.Tensor, config: ModelConfig,
              shard: ShardSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """mlp_block for a mixture-of-experts layer: (the experts' weighted sum [T, hidden], or at a
    few rows on one GPU its unsummed fp32 terms [top_k, T, hidden] (moe_mlp's unsummed_ok),
    x + residual)."""
    h, residual = add_rms_norm(x, residual, lp.post_norm, config.rms_norm_eps)
    return moe_mlp(h, lp.router, lp.experts_gate_up, lp.experts_down, config, shard,
                   unsummed_ok=True), residual


def attention_half(lp: LayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, batch: Batch, *, config: ModelConfig, shard: ShardSpec,
                   backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
    """decoder_layer up to attention's output, before o_proj: ([T, heads_local * head_dim],
    the residual stream x + residual). For a caller that runs the rest as one kernel
    (kernels.decode_mlp)."""
    qkv, residual = norm_qkv(lp, x, residual, config.rms_norm_eps)
    return attention_output(lp, qkv, cos, sin, k_cache, v_cache, batch, config=config,
                            shard=shard, backend=backend), residual


def decoder_layer(lp: LayerParams | MoELayerParams, x: torch.Tensor, residual: torch.Tensor | None,
                  cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: Batch, *, config: ModelConfig, shard: ShardSpec, backend: AttentionBackend
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-norm attention then MLP (a sparse layer's: the mixture of experts). x: the previous
    block's output, residual: the stream it adds to (None for the first layer). Returns (this
    layer's MLP output, the residual stream).

    The MLP output may be down's unsummed fp32 split-K partials [split, T, hidden] (decode of a
    few rows on one GPU; a sparse layer's: its top_k weighted expert products): the next
    layer's add + RMSNorm, or the final norm, sums them. Either
    form is accepted as x. (Compiled, the sum fuses into that add + RMSNorm's kernel, as o_proj's
    does into the one after it: sum_partials writes it as additions. A kernel running the add +
    RMSNorm inside qkv's and gate_up's GEMMs was measured slower, BENCHMARKS.md session 6.)"""
    eps = config.rms_norm_eps
    qkv, residual = norm_qkv(lp, x, residual, eps)
    h = attention_block(lp, qkv, cos, sin, k_cache, v_cache, batch, config=config, shard=shard,
                        backend=backend)
    if isinstance(lp, MoELayerParams):  # a static choice: the compiled layer guards on the type
        return moe_block(lp, h, residual, config, shard)
    return mlp_block(lp, h, residual, shard, eps)
