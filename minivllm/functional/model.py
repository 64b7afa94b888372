"""forward(params, cache, batch) -> (logits, cache): the whole Qwen3 model."""

from __future__ import annotations

import torch

from ..state.batch import Batch
from ..state.cache import KVCache
from ..state.params import Params
from .attention import REFERENCE, AttentionBackend
from .embedding import embed, lm_head
from .layer import decoder_layer
from .linear import sum_partials
from .norm import add_rms_norm
from .rope import rope_cos_sin


def hidden_states(params: Params, cache: KVCache, batch: Batch, backend: AttentionBackend = REFERENCE,
                  rows: torch.Tensor | None = None, *, layer=decoder_layer) -> torch.Tensor:
    """The final-normed hidden state of each token in `rows` (default all): [rows, hidden].
    Writes this step's K/V into `cache`. `layer` is decoder_layer or a compiled form of it."""
    config, shard = params.config, params.shard
    x = embed(batch.input_ids, params.embed, config, shard)
    cos, sin = rope_cos_sin(config, batch.positions)
    # A zero residual rather than None: x + 0 is x exactly, and every layer then has one
    # signature, so a compiled layer is one graph for all of them.
    residual = torch.zeros_like(x)
    for lp, k_cache, v_cache in zip(params.layers, cache.k, cache.v):
        x, residual = layer(lp, x, residual, cos, sin, k_cache, v_cache, batch,
                                    config=config, shard=shard, backend=backend)
    x = sum_partials(x, residual.dtype)  # see decoder_layer
    if rows is not None:
        x, residual = x[rows], residual[rows]
    x, _ = add_rms_norm(x, residual, params.final_norm, config.rms_norm_eps)
    return x


def forward(params: Params, cache: KVCache, batch: Batch, backend: AttentionBackend = REFERENCE,
            *, layer=decoder_layer) -> tuple[torch.Tensor, KVCache]:
    """logits: [len(batch.logits_indices), vocab_size] fp32, and the cache with this step's K/V.

    The cache is donated: its buffers are written in place and the returned cache is the one to
    use from now on (see minivllm.state.cache). `layer` lets a caller run the layers compiled
    (torch.compile(decoder_layer)): the function is unchanged, only how it is executed."""
    x = hidden_states(params, cache, batch, backend, batch.logits_indices, layer=layer)
    logits = lm_head(x, params.head_weight, params.config, params.shard)
    return logits.float(), cache
