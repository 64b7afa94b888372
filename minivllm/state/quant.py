"""Block-FP8 checkpoints (Qwen/Qwen3-0.6B-FP8 ... Qwen3-32B-FP8): their quantization_config, and
the dequantization of their weights as they are loaded.

Such a checkpoint's config.json says
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}
(DeepSeek-V3's format, transformers' FineGrainedFP8Config, vLLM's Fp8Config with a block size).
Each quantized linear weight `X.weight` is float8_e4m3fn [out, in], with `X.weight_scale_inv`
(float32; some checkpoints store it as bfloat16 or float16) of shape
[ceil(out / block_out), ceil(in / block_in)]; element (i, j) of the weight is
weight[i, j] * scale_inv[i // block_out, j // block_in]: the blocks at the bottom and right edges
are partial when a dimension is not a multiple of the block. Embeddings, norms and the LM head are
stored unquantized (bf16).

minivllm dequantizes each such weight when it loads it (the product in float32, then cast to the
engine's dtype, as transformers' Fp8Dequantize computes it; partial edge blocks indexed as vLLM's
and DeepSeek-V3's kernels index them, where transformers 5.25's Fp8Dequantize, its path without a
GPU, derives the block from the scale grid, rows // scale_rows, and misreads them) and runs its
usual GEMMs on the result; vLLM instead keeps the fp8 weights and runs fp8 GEMMs. Compute is
unchanged, and so is memory: the weights take as much as the bf16 checkpoint's.
"""

from __future__ import annotations

import re

import attrs
import torch

from .config import ceil_div

FP8_DTYPE = torch.float8_e4m3fn

# quantization_from_config reads quant_method, weight_block_size, activation_scheme, fmt,
# scale_fmt, modules_to_convert and modules_to_not_convert (or ignored_layers); any other key is
# metadata it ignores, as transformers and vLLM do ("dequantize" is transformers' own loading
# flag, "expert_dtype" describes MoE experts' storage, which the safetensors headers give).
_SUPPORTED_METHOD = "fp8"


@attrs.frozen
class Fp8BlockQuantization:
    """A checkpoint's block-fp8 quantization: `block` = (rows, cols) of a scale block of an
    [out, in] weight; `modules_to_not_convert`: the modules whose linear weights stay unquantized
    (None: every decoder linear is quantized, as in Qwen's checkpoints)."""

    block: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] | None = None

    def describe(self) -> str:
        return f"quant_method 'fp8', weight_block_size {list(self.block)}"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` (a checkpoint name without ".weight", e.g.
        "model.layers.0.mlp.down_proj") is stored quantized: transformers' should_convert_module
        (FineGrainedFP8HfQuantizer). A pattern of modules_to_not_convert skips it when it matches
        the name from the start up to a module boundary ("model.layers.1" skips
        "model.layers.1.mlp.up_proj", not "model.layers.11..."), as a regex with the same boundary
        ("model.layers.*.mlp" skips every MLP; "mlp.gate" does not skip "mlp.gate_proj"), or as a
        suffix ("down_proj" skips every layer's down_proj)."""
        if self.modules_to_not_convert is None:
            return True
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                       for key in self.modules_to_not_convert)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The shape of weight_scale_inv for a weight of `shape`: one scale per block, the edge
        blocks partial."""
        return ceil_div(shape[0], self.block[0]), ceil_div(shape[1], self.block[1])


def _unsupported(what: str) -> ValueError:
    return ValueError(f"quantization_config {what} is not supported: minivllm loads unquantized "
                      f"checkpoints and block-fp8 ones (quant_method 'fp8', fmt 'e4m3', "
                      f"activation_scheme 'dynamic', weight_block_size [128, 128], as "
                      f"Qwen/Qwen3-*-FP8), whose weights it dequantizes at load")


def quantization_from_config(d: dict) -> Fp8BlockQuantization | None:
    """The block-fp8 quantization a HF config dict declares, None when it declares none; a
    ValueError naming what is unsupported otherwise (AWQ, GPTQ, bitsandbytes, compressed-tensors,
    per-tensor fp8 without weight_block_size, static activation scales, fp8 e5m2 or UE8M0 scales,
    fp8 embeddings). Called when config.json is read, so that a checkpoint minivllm cannot load is
    refused before any weight is read."""
    quant = d.get("quantization_config")
    if quant is None or quant == {}:
        return None
    if not isinstance(quant, dict):
        raise _unsupported(f"{quant!r:.80} (not a JSON object)")
    method = quant.get("quant_method")
    if method != _SUPPORTED_METHOD:
        raise _unsupported(f"quant_method {method!r}")
    block = quant.get("weight_block_size")
    if block is None:
        raise _unsupported("quant_method 'fp8' without weight_block_size (per-tensor fp8 "
                           "scales)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _unsupported(f"weight_block_size {block!r} (it must be two positive integers, "
                           f"e.g. [128, 128])")
    # transformers reads the scheme case-insensitively and defaults it to "dynamic"; vLLM takes
    # block-wise fp8 only with dynamic activation scales.
    scheme = quant.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":
        raise _unsupported(f"activation_scheme {scheme!r} (per-tensor activation scales: "
                           f"block-fp8 checkpoints are 'dynamic')")
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"fmt {fmt!r} (fp8 weights are float8_e4m3fn)")
    scale_fmt = quant.get("scale_fmt", "float")
    if scale_fmt != "float":
        raise _unsupported(f"scale_fmt {scale_fmt!r} (weight_scale_inv is a float tensor)")
    if quant.get("modules_to_convert"):
        raise _unsupported(f"modules_to_convert {quant['modules_to_convert']!r} (fp8 "
                           f"embeddings)")
    # transformers takes MiniMax's "ignored_layers" where modules_to_not_convert is absent (vLLM
    # reads either).
    skip = quant.get("modules_to_not_convert")
    if skip is None:
        skip = quant.get("ignored_layers")
    if skip is not None:
        if not isinstance(skip, (list, tuple)) or not all(isinstance(k, str) for k in skip):
            raise _unsupported(f"modules_to_not_convert {skip!r} (it must be a list of module "
                               f"names)")
        for key in skip:
            try:
                re.compile(key)
            except re.error as e:
                raise _unsupported(f"modules_to_not_convert entry {key!r} ({e})") from None
        skip = tuple(skip)
    return Fp8BlockQuantization(block=(block[0], block[1]), modules_to_not_convert=skip)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                          dtype: torch.dtype, *, chunk_elements: int = 1 << 22) -> torch.Tensor:
    """`weight` (float8_e4m3fn [rows, cols], starting at a block corner) dequantized to `dtype`:
    element (i, j) is weight[i, j] * scale_inv[i // block[0], j // block[1]], computed in float32
    and then cast (transformers' Fp8Dequantize: (q.float() * s.float()).to(dtype)). The last
    block row and column may be partial. Works through the rows a few blocks at a time, so that
    the float32 temporaries stay near `chunk_elements` elements whatever the weight's size."""
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"an fp8 block-quantized weight is {FP8_DTYPE}, got {weight.dtype}")
    if weight.dim() != 2 or scale_inv.dim() != 2:
        raise ValueError(f"fp8 weight and scales must be 2-D, got {tuple(weight.shape)} and "
                         f"{tuple(scale_inv.shape)}")
    bn, bk = block
    rows, cols = weight.shape
    grid = (ceil_div(rows, bn), ceil_div(cols, bk))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a weight of "
                         f"shape {(rows, cols)} in {list(block)} blocks: expected {grid}")
    scale = scale_inv.to(device=weight.device, dtype=torch.float32)
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    full = cols // bk  # whole column blocks; a partial one may follow
    step = max(1, chunk_elements // max(cols, 1) // bn) * bn  # rows per chunk, whole row blocks
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        w = weight[r0:r1].to(torch.float32)
        # Each row's scales (the chunk starts at a block row), broadcast over each block's columns.
        s = scale[r0 // bn:ceil_div(r1, bn)].repeat_interleave(bn, dim=0)[:r1 - r0]
        if full:
            w[:, :full * bk].unflatten(1, (full, bk)).mul_(s[:, :full, None])
        if full * bk < cols:
            w[:, full * bk:].mul_(s[:, full:])
        out[r0:r1] = w  # cast to dtype (round to nearest even)
    return out
