"""LoRA deltas over a batch whose rows use different adapters (or none), as pure functions.

Each token row carries its adapter's slot (Batch.lora_slots, -1: the base model). A module's
delta for every row at once is

    delta = F.linear(F.linear(x, A) * mask, B)

with A, B the module's stacked slot weights (state/lora.py: A [S * P * R, in], B [out,
S * P * R]) and mask [T, S * P * R] keeping only the columns of the row's own slot: the
"shrink" x @ A computes every slot's rank-R projection (S * P * R columns, a few hundred at
most, against the base weight's thousands), the mask drops the other slots' (a base row's
all of them: its delta is exactly zero), and the "expand" by B maps the row's own slot into the
output, the fused QKV / gate-up columns included (B is block diagonal over the parts). No
gather of weights per row, no data-dependent shapes: one function of static shapes for any mix
of adapters, as CUDA graphs and torch.compile need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..state.lora import LoRALayer
from ..state.params import LayerParams
from .activation import silu_and_mul
from .layer import attention_output
from .linear import column_linear, row_linear
from .norm import add_rms_norm


def slot_mask(lora_slots: torch.Tensor, num_slots: int, dtype: torch.dtype) -> torch.Tensor:
    """[T] slots (-1: none) -> [T, num_slots] one-hot rows in `dtype` (a -1 row all zeros)."""
    slots = torch.arange(num_slots, device=lora_slots.device)
    return (lora_slots.unsqueeze(1) == slots).to(dtype)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
    """x: [T, in], a: [S * P * R, in], b: [out, S * P * R], mask: [T, S] -> [T, out], each
    row's own slot's B @ A @ x."""
    t, s = mask.shape
    h = F.linear(x, a).view(t, s, -1) * mask.unsqueeze(2)
    return F.linear(h.view(t, -1), b)


def lora_decoder_layer(lp: LayerParams, ll: LoRALayer, mask: torch.Tensor, x: torch.Tensor,
                       residual: torch.Tensor, cos, sin, k_cache, v_cache, batch, *, config,
                       shard, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """layer.decoder_layer with each linear's LoRA delta added to its output (one rank: the
    engine refuses LoRA under tensor parallelism). Always returns down's summed output."""
    eps = config.rms_norm_eps
    h, residual = add_rms_norm(x, residual, lp.input_norm, eps)
    qkv = column_linear(h, lp.qkv) + lora_delta(h, ll.qkv_a, ll.qkv_b, mask)
    attn = attention_output(lp, qkv, cos, sin, k_cache, v_cache, batch, config=config,
                            shard=shard, backend=backend)
    o = row_linear(attn, lp.o_proj, shard) + lora_delta(attn, ll.o_a, ll.o_b, mask)
    h, residual = add_rms_norm(o, residual, lp.post_norm, eps)
    gate_up = column_linear(h, lp.gate_up) + lora_delta(h, ll.gate_up_a, ll.gate_up_b, mask)
    act = silu_and_mul(gate_up)
    return row_linear(act, lp.down, shard) + lora_delta(act, ll.down_a, ll.down_b, mask), residual


def lora_layers(params, cache, batch, backend, x, residual, cos, sin
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer with LoRA deltas, the rows' slots from batch.lora_slots."""
    lora = params.lora
    mask = slot_mask(batch.lora_slots, lora.max_loras, x.dtype)
    for lp, ll, k_cache, v_cache in zip(params.layers, lora.layers, cache.k, cache.v):
        x, residual = lora_decoder_layer(lp, ll, mask, x, residual, cos, sin, k_cache, v_cache,
                                         batch, config=params.config, shard=params.shard,
                                         backend=backend)
    return x, residual
