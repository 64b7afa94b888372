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

Under tensor parallelism (state/lora.py: each rank holds its shard of the slot weights) a
column-parallel module's delta is the rank's own output columns, like its base product; a
row-parallel one's (o_proj, down) is a partial sum over the rank's input slice, added to the
rank's base partial before the layer's one all-reduce, which then sums both (lora_row_linear).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..state.lora import LoRALayer
from ..state.params import LayerParams
from .activation import silu_and_mul
from .layer import attention_output
from .linear import column_linear, glu_row_linear, row_linear, row_partial, sum_partials
from .parallel import all_reduce
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
    # A where, not a product: another slot's projection that overflows (an fp16 adapter's
    # inf; inf * 0 is nan) stays out of this row, as it stays out of a base row.
    h = F.linear(x, a).view(t, s, -1)
    h = torch.where(mask.unsqueeze(2) != 0, h, h.new_zeros(()))
    return F.linear(h.view(t, -1), b)


def plus(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """y + delta in y's dtype, added in fp32 and rounded once: a 16-bit add's values, but not
    the `mm + add` pattern that Inductor rewrites into an addmm (another GEMM call, whose kernel
    may round otherwise): a base row's y comes back bit for bit (its delta is exactly zero)."""
    return (y.float() + delta.float()).to(y.dtype)


def plus_wide(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A row-parallel output y (its skinny GEMM's fp32 partials [split, T, out] unsummed, or
    [T, out]) plus delta [T, out], as fp32 [T, out] for the add + RMSNorm after it to round once
    with the residual, as it rounds the base layer's partials: a base row's values are the base
    layer's."""
    return sum_partials(y, torch.float32) + delta.float()


def lora_row_linear(x: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                    mask: torch.Tensor, shard, *, glu: bool) -> torch.Tensor:
    """A row-parallel layer (x: [T, in_local], glu: [T, 2 * in_local] = (gate | up)) with its
    LoRA delta: a: [S * R, in_local] (the rank's columns of A), b: [out, S * R] (whole).

    One rank: the base layer's unsummed skinny partials (or [T, out]) plus the delta, fp32
    [T, out] (plus_wide). More ranks: x_local @ A_local.T is the rank's partial sum of the rank-R
    projection, and the mask and B are linear, so the rank's delta is a partial sum of the
    delta too: added in fp32 to the rank's base partial, rounded once to x's dtype as the base
    layer rounds its partial, and summed over ranks by the base layer's own all-reduce (no
    extra communication). A base row's delta is exact zeros: it all-reduces the base layer's
    own partials."""
    delta = lora_delta(silu_and_mul(x) if glu else x, a, b, mask)
    if shard.world_size == 1:
        base = glu_row_linear(x, weight, shard, unsummed_ok=True) if glu else \
            row_linear(x, weight, shard, unsummed_ok=True)
        return plus_wide(base, delta)
    partial = plus_wide(row_partial(x, weight, glu=glu), delta).to(x.dtype)
    return all_reduce(partial, shard)


def lora_decoder_layer(lp: LayerParams, ll: LoRALayer, mask: torch.Tensor, x: torch.Tensor,
                       residual: torch.Tensor, cos, sin, k_cache, v_cache, batch, *, config,
                       shard, backend) -> tuple[torch.Tensor, torch.Tensor]:
    """layer.decoder_layer with each linear's LoRA delta added to its output, on `shard`'s rank
    (its shard of the slot weights: the row-parallel deltas go into the base layer's
    all-reduce, lora_row_linear). mask: slot_mask of the rows' slots.

    The base products are decoder_layer's own calls (o_proj's and down's unsummed skinny
    partials, down's activation inside its GEMM), so that a base row (mask all zeros, a delta
    of exact zeros) gets the base layer's values: the decode graphs of a LoRA engine run every
    row through this layer. Returns down's output plus its delta as fp32 [T, hidden] (the next
    add + RMSNorm rounds it with the residual; above one rank, all-reduced in the activation
    dtype, as the base layer's) and the residual stream."""
    eps = config.rms_norm_eps
    h, residual = add_rms_norm(x, residual, lp.input_norm, eps)
    qkv = plus(column_linear(h, lp.qkv), lora_delta(h, ll.qkv_a, ll.qkv_b, mask))
    attn = attention_output(lp, qkv, cos, sin, k_cache, v_cache, batch, config=config,
                            shard=shard, backend=backend)
    o = lora_row_linear(attn, lp.o_proj, ll.o_a, ll.o_b, mask, shard, glu=False)
    h, residual = add_rms_norm(o, residual, lp.post_norm, eps)
    gate_up = plus(column_linear(h, lp.gate_up), lora_delta(h, ll.gate_up_a, ll.gate_up_b, mask))
    return lora_row_linear(gate_up, lp.down, ll.down_a, ll.down_b, mask, shard, glu=True), \
        residual


def lora_layers(params, cache, batch, backend, x, residual, cos, sin,
                layer=lora_decoder_layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Every decoder layer with LoRA deltas, the rows' slots from batch.lora_slots. `layer`:
    lora_decoder_layer or a compiled form of it (runtime.compiled); the mask [T, max_loras]
    is made once here, its shape fixed by T and max_loras alone (no recompile per mix of
    adapters: the slots are values, never guarded)."""
    lora = params.lora
    mask = slot_mask(batch.lora_slots, lora.max_loras, x.dtype)
    for lp, ll, k_cache, v_cache in zip(params.layers, lora.layers, cache.k, cache.v):
        x, residual = layer(lp, ll, mask, x, residual, cos, sin, k_cache, v_cache, batch,
                            config=params.config, shard=params.shard, backend=backend)
    return x, residual
