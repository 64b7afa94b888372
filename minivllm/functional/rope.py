"""Rotary position embedding (neox / rotate-half layout), with YaRN, Llama-3, linear and
dynamic-NTK frequency scaling."""

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
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(config.rope_theta ** exponents, dim, config.rope_theta, scaling)
    if scaling["rope_type"] == "linear":
        # Positions divided by factor (vLLM) is frequencies divided by it; divided here, as
        # transformers does, so that the fp32 products round as its do.
        return inv_freq / float(scaling["factor"])
    if scaling["rope_type"] == "dynamic":
        base = dynamic_ntk_base(config.rope_theta, float(scaling["factor"]),
                                config.max_position_embeddings, dim)
        return 1.0 / (base ** exponents)
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    # Without original_max_position_embeddings: max_position_embeddings, as transformers
    # (ModelConfig.from_dict fills it in; a ModelConfig built in code may leave it out).
    factor = float(scaling["factor"])
    scaling = {**LLAMA3_DEFAULTS, **scaling}
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings",
                                config.max_position_embeddings))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def dynamic_ntk_base(base: float, factor: float, max_position_embeddings: int,
                     dim: int) -> float:
    """Dynamic-NTK RoPE's base as vLLM fixes it (DynamicNTKScalingRotaryEmbedding: one table
    for max_position_embeddings x factor positions), in its float arithmetic. Its correction,
    (max_len / max_position_embeddings - (factor - 1)) ** (dim / (dim - 2)), is 1 up to
    rounding: the base stays base, and RoPE is plain RoPE at every position. transformers'
    dynamic instead raises the base once a sequence passes max_position_embeddings (the
    correction with factor * seq_len in place of max_len), so the two agree only up to
    max_position_embeddings positions, where transformers' is plain RoPE too."""
    max_len = max_position_embeddings * factor
    return base * ((max_len / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))


def _yarn_inv_freq(pos_freqs: torch.Tensor, dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN (arXiv 2309.00071) as transformers and vLLM compute it: the highest frequencies kept
    (extrapolated), the lowest divided by `factor` (interpolated), a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over original_max_position_embeddings.
    pos_freqs: [dim // 2] base ** (2i / dim)."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dimension(rotations):  # the dimension that turns `rotations` times over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp (0 / 0 at the dimension `low`)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=pos_freqs.device) - low)
            / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # the share of each frequency kept as it is
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated


def rope_attention_scale(config: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: YaRN's attention_factor (by default
    0.1 * ln(factor) + 1, or the ratio of two such with mscale / mscale_all_dim, as
    transformers), else 1."""
    scaling = config.rope_scaling_dict
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(scaling["mscale"]) / mscale(scaling["mscale_all_dim"]))
    return mscale()


def rope_cos_sin(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, head_dim] fp32 (each frequency repeated for both halves,
    times rope_attention_scale)."""
    inv_freq = rope_inv_freq(config, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = rope_attention_scale(config)
    if scale != 1.0:
        return emb.cos() * scale, emb.sin() * scale
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim] fp32. Rotated in x's dtype, like the
    reference implementation (cos/sin are cast to x's dtype first)."""
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
