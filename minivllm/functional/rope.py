"""Rotary position embedding (neox / rotate-half layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math

import torch

from ..state.config import LLAMA3_DEFAULTS, ModelConfig


def rope_inv_freq(config: ModelConfig, device=None) -> torch.Tensor:
    """[head_dim // 2] fp32 inverse frequencies, scaled as the config's rope_scaling says. Built
    on `device` directly (no host-to-device copy, so it can run inside a CUDA graph capture)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling_dict
    if scaling is None:
        return inv_freq
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    factor = float(scaling["factor"])
    scaling = {**LLAMA3_DEFAULTS, **scaling}
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, head_dim] fp32 (each frequency repeated for both halves)."""
    inv_freq = rope_inv_freq(config, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] fp32. Rotated in x's dtype, like the
    reference implementation (cos/sin are cast to x's dtype first)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
