"""Embeddings from the model's hidden states: vLLM's LAST pooling, the one Qwen3-Embedding is
trained for. A sequence's embedding is the final-normed hidden state at its last token, cut to its
first `dimensions` features (Matryoshka) and L2-normalised.

    rows = last_token_rows(batch)                  # each sequence's last token in the step
    h = pool_last_token(params, cache, batch)      # [B, hidden], the cache written (donated)
    e = pooled_embedding(h, dimensions=256)        # [B, 256] fp32, unit rows
"""

from __future__ import annotations

import torch

from ..state.batch import Batch
from ..state.cache import KVCache
from ..state.params import Params
from .attention import REFERENCE, AttentionBackend
from .model import hidden_states


def last_token_rows(batch: Batch) -> torch.Tensor:
    """[B] int64: the row of each sequence's last token among the step's T tokens."""
    return batch.cu_seqlens_q[1:].long() - 1


def pool_last_token(params: Params, cache: KVCache, batch: Batch,
                    backend: AttentionBackend = REFERENCE, rows: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """[B, hidden]: the final-normed hidden state at each sequence's last token of the step (at
    `rows` instead, when given), in the activation dtype. Writes the step's K/V into `cache`,
    which is donated (see minivllm.state.cache): a prompt's last chunk pools what its earlier
    chunks and a cached prefix left there."""
    return hidden_states(params, cache, batch, backend,
                         last_token_rows(batch) if rows is None else rows)


def pooled_embedding(hidden: torch.Tensor, dimensions: int | None = None,
              normalize: bool = True) -> torch.Tensor:
    """[..., hidden] -> [..., dimensions] fp32: the first `dimensions` features (all for None),
    then divided by their L2 norm when `normalize` (torch's F.normalize, as vLLM's pooler)."""
    h = hidden.float()
    if dimensions is not None:
        h = h[..., :dimensions]
    return torch.nn.functional.normalize(h, p=2.0, dim=-1) if normalize else h
