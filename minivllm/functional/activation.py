"""The gated MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * inter] (gate, then up) -> silu(gate) * up: [T, inter]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
