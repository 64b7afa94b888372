"""RMSNorm, plain and fused with the residual add."""

from __future__ import annotations

import torch

from .linear import sum_partials


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> [..., hidden]. Statistics in fp32; the weight multiplies in x's dtype
    (as Qwen3's reference does, so bf16 results match it bit for bit where possible)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual stream in one call.
    residual None means x is the first block's input and becomes the residual as is. x may also
    be a row-parallel layer's fp32 split-K partials [split, T, hidden] (glu_row_linear's
    unsummed_ok), summed here with the residual in fp32 and rounded once to its dtype."""
    if residual is not None:
        # Added in fp32 and rounded once: the values of a 16-bit add, but not the `mm + add`
        # pattern that Inductor rewrites into an addmm, which cuBLAS runs as a copy of the
        # residual and a beta = 1 GEMM; this way the add fuses into the norm's kernel instead.
        x = (sum_partials(x, torch.float32) + residual.float()).to(residual.dtype)
    return rms_norm(x, weight, eps), x
