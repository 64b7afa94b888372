"""A classifier's head over pooled hidden states (the pooling runner's classify and score tasks):
logits from the final-normed hidden state at each prompt's last token, then the activation that
makes them probabilities or a score, as vLLM's ClassifierPooler does.

    h = pool_last_token(params, cache, batch)        # [B, hidden] (functional/pooling.py)
    logits = classifier_logits(h, head.weight)       # [B, num_labels] fp32
    probs = activate(logits, "softmax")              # [B, num_labels]

Both in float32 whatever the model's dtype: vLLM's head_dtype, which keeps a one-label score's
logit (the difference of two LM-head rows' logits, for a reranker) from bf16's rounding.
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("softmax", "sigmoid", "identity")


def classifier_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[..., hidden] x [num_labels, hidden] -> [..., num_labels] float32: hidden @ weight.T, as
    transformers' bias-free `score` linear layer."""
    return hidden.float() @ weight.float().T


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """[..., num_labels] -> the same shape: softmax over the labels, a sigmoid per label, or the
    logits as they are ("identity")."""
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
