"""Sampling the next token from logits, as pure functions on the device."""

from __future__ import annotations

import torch


def sample_tokens(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                  top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits: [B, vocab] -> token ids [B] (int64). Greedy when temperature == 0; otherwise
    softmax(logits / temperature) restricted to the top_k ids and the smallest top_p nucleus."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop an id when the mass strictly before it already reaches top_p (the top one stays).
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
