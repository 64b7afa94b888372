"""Quantized checkpoints: block-FP8 (Qwen/Qwen3-0.6B-FP8 ... Qwen3-32B-FP8), kept in fp8
(Fp8BlockWeight), and AWQ 4-bit (Qwen/Qwen3-4B-AWQ ... Qwen3-32B-AWQ), kept packed (AwqWeight,
see the AWQ section below): their quantization_config, and the arithmetic on their weights.

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

minivllm keeps each such weight in fp8 as it is stored (Fp8BlockWeight below: the fp8 bytes and
their scales, in the place of the dense [out, in] tensor), and functional/linear.py multiplies it
with a Triton kernel that dequantizes tile by tile (kernels/fp8_gemm.py), or, from 256 rows and
wherever Triton cannot run, dequantizes the whole weight (dequantize_fp8_weight) and calls torch:
half bf16's weight memory and bytes read per decode step, as vLLM. Dequantizing, at load or at
run time, is the product in float32, then cast to the engine's dtype, as transformers'
Fp8Dequantize computes it; partial edge blocks are indexed as vLLM's and DeepSeek-V3's kernels
index them (transformers 5.25's Fp8Dequantize, its path without a GPU, derives the block from the
scale grid, rows // scale_rows, and misreads them). state/load.py still dequantizes at load
(dequantize_fp8_blocks) where keeping fp8 cannot work (see load's docstring), and on request
(MINIVLLM_FP8_WEIGHTS=dequantize).
"""

from __future__ import annotations

import re

import attrs
import torch

from .config import ceil_div
from .pytree import pytree_class, static

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
        return converts(module, self.modules_to_not_convert)

    def scale_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The shape of weight_scale_inv for a weight of `shape`: one scale per block, the edge
        blocks partial."""
        return ceil_div(shape[0], self.block[0]), ceil_div(shape[1], self.block[1])


def converts(module: str, modules_to_not_convert: tuple[str, ...] | None) -> bool:
    """Whether `module` is stored quantized given a config's modules_to_not_convert (None: every
    decoder linear is): transformers' should_convert_module, which its fp8 and AWQ integrations
    both use (see Fp8BlockQuantization.quantizes)."""
    if modules_to_not_convert is None:
        return True
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key)
                   for key in modules_to_not_convert)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"quantization_config {what} is not supported: minivllm loads unquantized "
                      f"checkpoints, block-fp8 ones (quant_method 'fp8', fmt 'e4m3', "
                      f"activation_scheme 'dynamic', weight_block_size [128, 128], as "
                      f"Qwen/Qwen3-*-FP8), whose weights it keeps in fp8, and AWQ ones "
                      f"(quant_method 'awq', bits 4, zero_point true, version 'gemm', group_size "
                      f"32, 64, 128 or -1, as Qwen/Qwen3-*-AWQ)")


def _modules_to_not_convert(quant: dict) -> tuple[str, ...] | None:
    """quantization_config's modules_to_not_convert (or MiniMax's ignored_layers), checked."""
    skip = quant.get("modules_to_not_convert")
    if skip is None:
        skip = quant.get("ignored_layers")
    if skip is None:
        return None
    if not isinstance(skip, (list, tuple)) or not all(isinstance(k, str) for k in skip):
        raise _unsupported(f"modules_to_not_convert {skip!r} (it must be a list of module "
                           f"names)")
    for key in skip:
        try:
            re.compile(key)
        except re.error as e:
            raise _unsupported(f"modules_to_not_convert entry {key!r} ({e})") from None
    return tuple(skip)


def quantization_from_config(d: dict) -> Fp8BlockQuantization | AwqQuantization | None:
    """The block-fp8 or AWQ quantization a HF config dict declares, None when it declares none; a
    ValueError naming what is unsupported otherwise (GPTQ, bitsandbytes, compressed-tensors, AWQ
    other than 4-bit GEMM with zero points (awq_from_config),
    per-tensor fp8 without weight_block_size, static activation scales, fp8 e5m2 or UE8M0 scales,
    fp8 embeddings). Called when config.json is read, so that a checkpoint minivllm cannot load is
    refused before any weight is read."""
    quant = d.get("quantization_config")
    if quant is None or quant == {}:
        return None
    if not isinstance(quant, dict):
        raise _unsupported(f"{quant!r:.80} (not a JSON object)")
    method = quant.get("quant_method")
    if method == AWQ_METHOD:
        return awq_from_config(quant)
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
    skip = _modules_to_not_convert(quant)
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


@pytree_class
class Fp8BlockWeight:
    """A linear layer's block-fp8 weight, in the place of its [out, in] tensor in LayerParams:
    weight float8_e4m3fn [out, in] as stored, scale_inv float32 [ceil(out / block[0]),
    ceil(in / block[1])]; element (i, j) is weight[i, j] * scale_inv[i // block[0],
    j // block[1]] (edge blocks partial), as dequantize_fp8_blocks reads it. block: the
    checkpoint's weight_block_size (static: the kernel's tiles and the torch path's shapes
    depend on it). Merged QKV and gate/up weights are concatenated along the output rows (weights
    and scale rows: cat_fp8, where every part but the last fills whole block rows)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = static(converter=tuple)

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape, [out, in] (nn.Linear's)."""
        return tuple(self.weight.shape)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def check_grid(self, name: str = "fp8 weight") -> None:
        """ValueError unless the weight is a 2-D fp8 tensor and its scales are its block grid:
        what dequantize_fp8_weight and kernels/fp8_gemm.py need to read it (a short grid would
        broadcast, or be read past its end, without a word). Shapes and dtypes only: free under
        torch.compile, where the checks are settled once, at tracing."""
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"{name}.weight is {self.weight.dtype} of {self.weight.dim()} "
                             f"dimensions, not a 2-D {FP8_DTYPE}")
        grid = (ceil_div(self.weight.shape[0], self.block[0]),
                ceil_div(self.weight.shape[1], self.block[1]))
        if tuple(self.scale_inv.shape) != grid:
            raise ValueError(f"{name}.scale_inv has shape {tuple(self.scale_inv.shape)}, "
                             f"expected {grid} ({list(self.block)} blocks of {self.shape})")

    def check(self, name: str = "fp8 weight") -> None:
        """ValueError unless the weight is fp8 and its scales fit its block grid, in float32
        (as load holds them)."""
        self.check_grid(name)
        if self.scale_inv.dtype != torch.float32:
            raise ValueError(f"{name}.scale_inv is {self.scale_inv.dtype}, not float32")


def dequantize_fp8_weight(w: Fp8BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dense [out, in] weight in `dtype`: weight * its block's scale in float32, cast once
    (dequantize_fp8_blocks's values). Static shapes and no loop: the torch path of
    functional.linear, under torch.compile too (where Inductor fuses it into one pass)."""
    w.check_grid()
    (n, k), (bn, bk) = w.shape, w.block
    if n % bn == 0 and k % bk == 0:  # whole blocks: a broadcast, no expanded scale tensor
        q = w.weight.to(torch.float32).view(n // bn, bn, k // bk, bk)
        return (q * w.scale_inv[:, None, :, None]).view(n, k).to(dtype)
    s = w.scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w.weight.to(torch.float32) * s).to(dtype)


def cat_fp8(parts: list[Fp8BlockWeight]) -> Fp8BlockWeight | None:
    """Block-fp8 weights of the same input concatenated along the output (QKV, gate/up), or None
    where that would break their block grids: a part before the last whose rows are not a
    multiple of the block's (its last scale row would cover the next part's first rows). The
    caller then dequantizes the merged weight (state/load.py)."""
    blocks = {p.block for p in parts}
    if len(blocks) != 1:
        return None
    bn = parts[0].block[0]
    if any(p.out_features % bn for p in parts[:-1]):
        return None
    return Fp8BlockWeight(weight=torch.cat([p.weight for p in parts]),
                          scale_inv=torch.cat([p.scale_inv for p in parts]), block=blocks.pop())


# --- AWQ ---------------------------------------------------------------------------------------
#
# AutoAWQ's GEMM format (Qwen/Qwen3-4B-AWQ ... Qwen3-32B-AWQ; vLLM's "awq" and "awq_marlin"
# methods read it): config.json says
#     "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128,
#                             "zero_point": true, "version": "gemm", "modules_to_not_convert": null}
# and each quantized linear X (nn.Linear weight [out, in]) is stored as three tensors:
#     X.qweight int32 [in, out / 8]          4-bit weights, 8 output columns per int32
#     X.qzeros  int32 [in / group, out / 8]  4-bit zero points, packed the same way
#     X.scales  fp16  [in / group, out]
# with the 8 nibbles of an int32 (bits 4i..4i+3, i = 0..7) holding the columns 8j + AWQ_ORDER[i]
# of its group of 8 (AutoAWQ's WQLinear_GEMM.from_linear). Element (i, o) of the transposed
# weight is (q[i, o] - z[i // group, o]) * s[i // group, o], and y = x @ that. group_size -1
# quantizes each column over the whole input (one group; vLLM's awq_marlin takes it).

AWQ_METHOD = "awq"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its 8
AWQ_PACK = 8  # 4-bit values per int32
AWQ_GROUP_SIZES = (32, 64, 128, -1)


@attrs.frozen
class AwqQuantization:
    """A checkpoint's AWQ quantization (4-bit, zero points, GEMM packing): `group_size` input
    rows share a scale and a zero point (-1: all of them); `modules_to_not_convert` as
    Fp8BlockQuantization's."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] | None = None

    def describe(self) -> str:
        return f"quant_method 'awq', bits 4, group_size {self.group_size}"

    def quantizes(self, module: str) -> bool:
        """Whether the linear layer `module` is stored as qweight/qzeros/scales (transformers'
        should_convert_module, which its AWQ integration applies)."""
        return converts(module, self.modules_to_not_convert)

    def group(self, in_features: int) -> int:
        """Input rows per group of a weight with `in_features` inputs."""
        return in_features if self.group_size == -1 else self.group_size

    def shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, int]]:
        """The stored tensors' shapes for an nn.Linear of [out_features, in_features]."""
        groups = in_features // self.group(in_features)
        return {"qweight": (in_features, out_features // AWQ_PACK),
                "qzeros": (groups, out_features // AWQ_PACK),
                "scales": (groups, out_features)}


def _int_field(quant: dict, keys: tuple[str, ...], default=None):
    for key in keys:
        if key in quant:
            return key, quant[key]
    return keys[0], default


def awq_from_config(quant: dict) -> AwqQuantization:
    """An AWQ quantization_config, checked: bits 4 (or AutoAWQ's w_bit), group_size (or
    q_group_size) 32, 64, 128 or -1, zero_point true, version (or transformers' format) "gemm"
    (transformers' default), not the llm-awq backend's packing. A ValueError names any other."""
    key, bits = _int_field(quant, ("bits", "w_bit"), 4)
    if bits != 4 or isinstance(bits, bool):
        raise _unsupported(f"{key} {bits!r} (AWQ weights are 4-bit)")
    key, group = _int_field(quant, ("group_size", "q_group_size"), 128)
    # An int: 64.0 equals 64, but as a slice bound it failed once the weights were being read.
    if isinstance(group, bool) or not isinstance(group, int) or group not in AWQ_GROUP_SIZES:
        raise _unsupported(f"{key} {group!r} (AWQ groups of 32, 64 or 128 input rows, or -1: "
                           f"the whole input)")
    zero_point = quant.get("zero_point", True)
    if zero_point is not True:
        raise _unsupported(f"zero_point {zero_point!r} (AWQ without zero points; minivllm "
                           f"takes asymmetric AWQ, zero_point true)")
    for key in ("version", "format"):
        version = quant.get(key)
        if version is not None and (not isinstance(version, str) or version.lower() != "gemm"):
            raise _unsupported(f"{key} {version!r} (AWQ packing other than AutoAWQ's 'gemm': "
                               f"GEMV, GEMV_fast, llm-awq and exllama lay the nibbles out "
                               f"differently)")
    backend = quant.get("backend")
    if isinstance(backend, str) and backend.lower() == "llm-awq":
        raise _unsupported(f"backend {backend!r} (llm-awq's packing, not AutoAWQ's 'gemm')")
    return AwqQuantization(group_size=group, modules_to_not_convert=_modules_to_not_convert(quant))


def _shifts(device=None) -> torch.Tensor:
    """Bit offset of column r (0..7) of a packed group: 4 * (the nibble AWQ_ORDER puts it in)."""
    return torch.tensor([4 * AWQ_ORDER.index(r) for r in range(AWQ_PACK)], dtype=torch.int32,
                        device=device)


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[rows, cols] integers in 0..15 (cols a multiple of 8) -> int32 [rows, cols / 8] in AWQ's
    nibble order."""
    rows, cols = q.shape
    if cols % AWQ_PACK:
        raise ValueError(f"AWQ packs 8 columns per int32: {cols} columns")
    q = q.to(torch.int64).view(rows, cols // AWQ_PACK, AWQ_PACK) & 0xF
    packed = (q << _shifts(q.device).to(torch.int64)).sum(-1)  # disjoint bits: sum = or
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> int32 [rows, cols] of values 0..15 (pack_awq's inverse). Any
    strides (reshape: the elementwise result keeps a transposed input's layout, which view
    cannot flatten)."""
    rows, n = packed.shape
    return ((packed.unsqueeze(-1) >> _shifts(packed.device)) & 0xF).reshape(rows, n * AWQ_PACK)


@pytree_class
class AwqWeight:
    """A linear layer's AWQ weight, in the place of its [out, in] tensor in LayerParams:
    qweight int32 [in, out / 8], qzeros int32 [in / group, out / 8], scales [in / group, out] (as
    stored: fp16). group_size: input rows per group of this (rank's) weight: the checkpoint's,
    or `in` where the whole input is one group. Merged QKV and gate/up weights are concatenated
    along the output (packed) columns, as the dense weights are along their rows."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    group_size: int = static()

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1] * AWQ_PACK

    @property
    def shape(self) -> tuple[int, int]:
        """The dense weight's shape, [out, in] (nn.Linear's)."""
        return (self.out_features, self.in_features)

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    def check(self, name: str = "AWQ weight") -> None:
        """ValueError unless the three tensors fit one another and the group size: what
        dequantize_awq and kernels/awq_gemm.py need to read them (short zero points or scales
        would broadcast, or be read past their end, and int8 words would unpack to other
        nibbles, without a word). Shapes and dtypes only: free under torch.compile, where the
        checks are settled once, at tracing."""
        for field in ("qweight", "qzeros"):
            t = getattr(self, field)
            if t.dtype != torch.int32 or t.dim() != 2:
                raise ValueError(f"{name}.{field} is {t.dtype} of {t.dim()} dimensions, not a "
                                 f"2-D int32 (8 packed 4-bit values a word)")
        k, n = self.in_features, self.out_features
        g = self.group_size
        if not (isinstance(g, int) and g >= 1 and k % g == 0):
            raise ValueError(f"{name}: group_size {g!r} does not divide its {k} input rows")
        shapes = {"qzeros": (k // g, n // AWQ_PACK), "scales": (k // g, n)}
        for field, shape in shapes.items():
            t = getattr(self, field)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}.{field} has shape {tuple(t.shape)}, expected {shape}")
        if not self.scales.is_floating_point():
            raise ValueError(f"{name}.scales is {self.scales.dtype}, not a float dtype")


def dequantize_awq(weight: AwqWeight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as x @ it would multiply: [in, out] in `dtype`, (q - z) * s computed in float32
    (exact: a 4-bit difference times an fp16 or bf16 scale) and rounded once to `dtype`. Static
    shapes throughout (the torch path of functional.linear, under torch.compile too)."""
    weight.check()
    k, n, g = weight.in_features, weight.out_features, weight.group_size
    q = unpack_awq(weight.qweight).view(k // g, g, n)
    z = unpack_awq(weight.qzeros).unsqueeze(1)
    s = weight.scales.to(torch.float32).unsqueeze(1)
    return ((q - z).to(torch.float32) * s).view(k, n).to(dtype)


def cat_awq(parts: list[AwqWeight]) -> AwqWeight:
    """AWQ weights of the same input concatenated along the output (QKV, gate/up)."""
    groups = {p.group_size for p in parts}
    if len(groups) != 1:
        raise ValueError(f"AWQ weights of group sizes {sorted(groups)} cannot be merged")
    return AwqWeight(qweight=torch.cat([p.qweight for p in parts], dim=1),
                     qzeros=torch.cat([p.qzeros for p in parts], dim=1),
                     scales=torch.cat([p.scales for p in parts], dim=1), group_size=groups.pop())
