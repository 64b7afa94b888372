"""Loading a local Hugging Face Qwen3 checkpoint into Params.

Q/K/V are merged into one QKV weight and gate/up into one weight as they are read; each
tensor-parallel rank reads only its own slice from disk (safetensors `get_slice`), so no rank ever
holds the full checkpoint. Block-fp8 checkpoints (Qwen3-*-FP8, state/quant.py) load their
quantized linears as Fp8BlockWeight pytrees (the fp8 weights and their block scales, sliced and
merged along whole blocks), which functional/linear.py multiplies without dequantizing them
first; where that cannot work (keeps_fp8, and a slice or a merge that would cut a block) a weight
is dequantized to the model's dtype as it is read, one tensor (one rank's slice of it) at a time.
AWQ checkpoints (Qwen3-*-AWQ, state/quant.py) load their quantized linears as
AwqWeight pytrees (packed int4 weights, zero points and scales, sliced and merged along the output
like the dense weights), which functional/linear.py multiplies without dequantizing them first.
"""

from __future__ import annotations

import json
import os

import attrs
import torch
from safetensors import safe_open
from torch.utils._pytree import tree_map

from .config import ModelConfig, ceil_div, parse_dtype
from .params import LayerParams, MoELayerParams, Params, has_quantized
from .quant import (AWQ_PACK, AwqQuantization, AwqWeight, Fp8BlockQuantization, Fp8BlockWeight,
                    cat_awq, cat_fp8, dequantize_awq, dequantize_fp8_blocks,
                    quantization_from_config)
from .shard import ShardSpec


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded: names the file and the tensor."""


# safetensors dtype names of the weights load() accepts (it casts them to the model dtype).
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# A block-fp8 checkpoint's quantized weights, and their scales (float32 in DeepSeek-V3's format;
# some Qwen3 FP8 checkpoints store them as bfloat16 or float16: each widens to float32 exactly).
_FP8_WEIGHT_DTYPE = "F8_E4M3"
_SCALE_DTYPES = ("F32", "F16", "BF16")
# The decoder's linear layers: what a block-fp8 checkpoint may quantize (never the embedding or
# the LM head: vLLM's quantization methods never take them, and Qwen's checkpoints keep them
# bf16).
_ATTENTION_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
# An AWQ linear's tensors (state/quant.py): packed int32 weights and zero points, float scales.
_AWQ_PACKED = ("qweight", "qzeros")
_AWQ_SCALES = "scales"


def _layer_linears(config: ModelConfig, n: int) -> list[str]:
    """Layer n's linear modules (names after "layers.{n}."): attention's, then the dense MLP's or
    every expert's (mlp.experts.{e}.gate_proj, ...; a sparse layer's router, mlp.gate, is never
    quantized: vLLM's Qwen3-MoE builds it without a quantization method)."""
    if config.is_sparse_layer(n):
        mlp = [f"mlp.experts.{e}.{linear}" for e in range(config.num_experts)
               for linear in _MLP_LINEARS]
    else:
        mlp = [f"mlp.{linear}" for linear in _MLP_LINEARS]
    return list(_ATTENTION_LINEARS) + mlp


def _index_tensors(path: str) -> dict[str, str]:
    """tensor name -> safetensors file, from the index when there is one, else from the files."""
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e!r})") from e
        # A malformed map would otherwise surface as an AttributeError/TypeError naming nothing.
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index_path}: not a valid safetensors index (weight_map must map "
                                  f"tensor names to file names)")
        files = {name: os.path.join(path, fname) for name, fname in weight_map.items()}
        for fname in set(files.values()):
            if not os.path.isfile(fname):
                raise CheckpointError(f"{index_path} names {os.path.basename(fname)}, which is missing")
        return files
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not shards:
        bins = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth")))
        hint = (f" (found {', '.join(bins)}: minivllm reads only safetensors; convert the "
                f"checkpoint, e.g. save_pretrained(..., safe_serialization=True))" if bins else "")
        raise CheckpointError(f"no *.safetensors files in {path}{hint}")
    files = {}
    for fname in shards:
        full = os.path.join(path, fname)
        for name in _open(full).keys():
            # Without an index nothing says which copy is meant: refuse rather than take the
            # later file's (a stale shard left next to a re-saved checkpoint looks like this).
            if name in files:
                raise CheckpointError(f"{path}: tensor {name} is in both "
                                      f"{os.path.basename(files[name])} and {fname}, and there is "
                                      f"no model.safetensors.index.json to say which to use")
            files[name] = full
    return files


# RoPE buffers some checkpoints hold, which load skips as vLLM's Qwen2/Qwen3 load_weights does
# (minivllm computes RoPE from the config): rotary_emb.inv_freq (older transformers saved it),
# rotary_emb.cos_cached and sin_cached (ColossalAI-trained checkpoints).
_ROTARY_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def _rotary_buffer(name: str) -> bool:
    return name.endswith(_ROTARY_BUFFERS)


def _open(file: str):
    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e


def _hf_shapes(config: ModelConfig, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    h, d, i, v = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    shapes = {f"{prefix}embed_tokens.weight": (v, h), f"{prefix}norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"{prefix}layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.v_proj.weight": (config.num_kv_heads * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_heads * d),
            p + "self_attn.q_norm.weight": (d,),
            p + "self_attn.k_norm.weight": (d,),
        })
        if config.is_sparse_layer(n):
            m = config.moe_intermediate_size
            shapes[p + "mlp.gate.weight"] = (config.num_experts, h)
            for e in range(config.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes.update({q + "gate_proj.weight": (m, h), q + "up_proj.weight": (m, h),
                               q + "down_proj.weight": (h, m)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                           p + "mlp.down_proj.weight": (h, i)})
    return shapes


def _quantized_weights(config: ModelConfig, prefix: str,
                       quant: Fp8BlockQuantization | None) -> list[str]:
    """The names of the linear weights a block-fp8 checkpoint stores quantized (with a
    weight_scale_inv each): every decoder linear not in modules_to_not_convert."""
    if quant is None:
        return []
    return [f"{prefix}layers.{n}.{linear}.weight" for n in range(config.num_layers)
            for linear in _layer_linears(config, n)
            if quant.quantizes(f"{prefix}layers.{n}.{linear}")]


def _awq_modules(config: ModelConfig, prefix: str, awq: AwqQuantization | None,
                 expected: dict[str, tuple[int, ...]], path: str) -> dict[str, tuple[int, int]]:
    """The decoder linears an AWQ checkpoint stores quantized (not in modules_to_not_convert),
    each with its dense [out, in] shape; a CheckpointError for a shape AWQ cannot pack (out not a
    multiple of 8, in not of the group size)."""
    if awq is None:
        return {}
    out = {}
    for n in range(config.num_layers):
        for linear in _layer_linears(config, n):
            module = f"{prefix}layers.{n}.{linear}"
            if not awq.quantizes(module):
                continue
            rows, cols = expected[module + ".weight"]
            if rows % AWQ_PACK:
                raise CheckpointError(f"{path}: {module} has {rows} outputs: AWQ packs 8 output "
                                      f"columns per int32, so they must be a multiple of 8")
            if cols % awq.group(cols):
                raise CheckpointError(f"{path}: {module} has {cols} inputs, not a multiple of "
                                      f"the AWQ group_size {awq.group_size}")
            out[module] = (rows, cols)
    return out


def _check_awq_shard(config: ModelConfig, shard: ShardSpec, awq: AwqQuantization | None,
                     awq_modules: dict[str, tuple[int, int]]) -> None:
    """A ValueError (CheckpointError) before any weight is read when this rank's slice of an AWQ
    linear cuts a packed int32 (column-parallel: q/k/v, gate/up rows must start and end at
    multiples of 8) or a group (row-parallel: o_proj's and down's input columns must be whole
    groups; a whole-input group, group_size -1, is kept whole by every rank, as vLLM's
    awq_marlin repeats its scales)."""
    if awq is None or shard.world_size == 1:
        return
    places = hf_placements(config, shard)  # this rank's rows (column-parallel) or columns
    where = f"tensor-parallel rank {shard.rank} of {shard.world_size}"
    for module, (out_features, in_features) in awq_modules.items():
        place = places[_hf_name(module + ".weight")]
        if place.src_rows is not None:
            a, b = place.src_rows
            if a % AWQ_PACK or b % AWQ_PACK:
                raise CheckpointError(
                    f"{module}: {where} takes output rows [{a}, {b}), which cuts a packed "
                    f"int32 of its AWQ qweight (8 output columns each): the tensor-parallel "
                    f"size must split it at multiples of 8")
        else:
            a, b = place.src_cols
            group = awq.group(in_features)
            if group < in_features and (a % group or b % group):
                raise CheckpointError(
                    f"{module}: {where} takes input columns [{a}, {b}), which cuts an AWQ "
                    f"group of {group} rows (its scales and zero points): the tensor-parallel "
                    f"size must split the {in_features} inputs at whole groups")


# What load does with a block-fp8 checkpoint's quantized linears: "fp8" keeps them in fp8
# (Fp8BlockWeight) where keeps_fp8 says it can, "dequantize" dequantizes them to the model's
# dtype as they are read (minivllm's behaviour before Fp8BlockWeight: the bf16 model's memory and
# GEMMs). load's fp8_weights argument, else MINIVLLM_FP8_WEIGHTS, else DEFAULT_FP8_WEIGHTS.
FP8_WEIGHTS_MODES = ("fp8", "dequantize")
# "fp8", as vLLM serves these checkpoints, since the kernel's GPU tests passed (benchmarks/
# gpu_checks.sh fp8w, an H100, session 56), where the Qwen3-8B shape's single stream ran 222
# tok/s with fp8 weights against 117 dequantized to bf16.
DEFAULT_FP8_WEIGHTS = "fp8"
# The Triton block-fp8 GEMM's K steps are 16-128 columns and must divide a scale block's columns
# (kernels/fp8_gemm.block_k_for): a checkpoint whose blocks are not a multiple of 16 wide is
# dequantized at load instead (Qwen's are 128 x 128).
_FP8_KERNEL_K_STEP = 16


def fp8_weights_mode(fp8_weights: str | None = None) -> str:
    """load's fp8_weights, else MINIVLLM_FP8_WEIGHTS, else DEFAULT_FP8_WEIGHTS; a ValueError
    naming any other value (the engine checks it when it is configured, before the model
    loads)."""
    mode = fp8_weights if fp8_weights is not None else \
        os.environ.get("MINIVLLM_FP8_WEIGHTS", DEFAULT_FP8_WEIGHTS)
    if mode not in FP8_WEIGHTS_MODES:
        raise ValueError(f"fp8_weights (MINIVLLM_FP8_WEIGHTS) {mode!r} is not one of "
                         f"{FP8_WEIGHTS_MODES}")
    return mode


def keeps_fp8(quant, config: ModelConfig, fp8_weights: str | None = None) -> bool:
    """Whether load keeps a checkpoint's quantized linears as Fp8BlockWeight: a block-fp8
    checkpoint (`quant`, its quantization) of a dense model (a mixture of experts' experts are
    stacked dense tensors that functional/moe.py multiplies: its layers load dequantized, as
    before), blocks the kernel's K step divides, and fp8_weights_mode "fp8". Any engine dtype
    (fp32 too: the kernel and the torch path round the dequantized weight to the activation
    dtype, as dequantizing at load does). Single weights may still be dequantized at load: a
    tensor-parallel slice that cuts a block, a merge whose parts cut one (see load)."""
    return (isinstance(quant, Fp8BlockQuantization) and not config.is_moe
            and quant.block[1] % _FP8_KERNEL_K_STEP == 0
            and fp8_weights_mode(fp8_weights) == "fp8")


def scale_name(weight_name: str) -> str:
    """The name of a quantized weight's block scales: X.weight -> X.weight_scale_inv."""
    return weight_name + "_scale_inv"


def _read_quantization(config_path: str) -> Fp8BlockQuantization | AwqQuantization | None:
    """config.json's quantization_config, checked (a CheckpointError naming what is
    unsupported); read whether or not load() was given a config."""
    try:
        with open(config_path) as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError(f"a model config is a JSON object, got {type(d).__name__}")
        return quantization_from_config(d)
    except (json.JSONDecodeError, ValueError) as e:
        raise CheckpointError(f"{config_path}: {e}") from e


def backbone_prefix(names) -> str:
    """The prefix of the backbone's tensor names: "model." as Qwen3ForCausalLM saves them, or ""
    as transformers' Qwen3Model saves them (embed_tokens.weight, layers.0..., norm.weight: the
    Qwen3-Embedding checkpoints, which hold no lm_head.weight either)."""
    return "" if "embed_tokens.weight" in names and "model.embed_tokens.weight" not in names \
        else "model."


def load(path: str | os.PathLike, *, dtype=None, device=None, shard: ShardSpec | None = None,
         config: ModelConfig | None = None, fp8_weights: str | None = None) -> Params:
    """Params from a local HF checkpoint directory (config.json + safetensors, sharded or not).

    dtype: "auto"/None keeps the checkpoint's dtype; device: where the tensors go; shard: the
    tensor-parallel rank whose slice to read (default: the whole model); config: the model's
    config instead of config.json's (ModelConfig.from_json with overrides, say; the pooling
    runner passes one with tied embeddings, so that no lm_head.weight is read or needed). The
    backbone's tensors may be named with or without the "model." prefix (backbone_prefix).

    A block-fp8 checkpoint (config.json's quantization_config {"quant_method": "fp8",
    "weight_block_size": [128, 128], ...}: Qwen/Qwen3-*-FP8) loads its quantized decoder linears
    as Fp8BlockWeight (fp8 weights and float32 block scales; `dtype`, by default the checkpoint's
    unquantized one, bf16, is the rest's and the activations') where keeps_fp8 says so
    (fp8_weights: "fp8" or "dequantize", default MINIVLLM_FP8_WEIGHTS, else
    DEFAULT_FP8_WEIGHTS). A weight is
    dequantized to `dtype` as it is read instead where keeping it cannot work: a rank's slice
    whose boundary cuts a scale block (it reads the whole blocks that hold its slice,
    dequantizes them and keeps its slice, so the boundary is exact), or a merged q/k/v or
    gate/up weight whose parts cut one (cat_fp8). Any other quantization_config is refused
    before any weight is read."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        what = "is a file, not a directory" if os.path.exists(path) else "does not exist"
        raise CheckpointError(f"checkpoint directory {path} {what}")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path} is missing")
    if config is None:
        try:
            config = ModelConfig.from_json(config_path)
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{config_path}: {e}") from e
    quant = _read_quantization(config_path)
    keep_fp8 = keeps_fp8(quant, config, fp8_weights)
    awq = quant if isinstance(quant, AwqQuantization) else None
    if awq is not None:
        quant = None  # what follows of `quant` is block-fp8's
        if config.is_moe:
            raise CheckpointError(f"{config_path}: AWQ checkpoints of mixture-of-experts models "
                                  f"are not supported (minivllm loads dense Qwen3 AWQ models)")
    shard = shard or ShardSpec()
    shard.check(config)
    dtype = parse_dtype(dtype, config.dtype)
    if device is not None:  # named now, not by the first tensor's .to(device)
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"unknown device {device!r}: {e}") from None

    files = _index_tensors(path)
    prefix = backbone_prefix(files)
    expected = _hf_shapes(config, prefix)
    # AWQ: module name -> its dense [out, in] shape, for the linears stored as qweight, qzeros
    # and scales (in place of X.weight).
    awq_modules = _awq_modules(config, prefix, awq, expected, path)
    for module, (out_features, in_features) in awq_modules.items():
        del expected[module + ".weight"]
        for suffix, shape in awq.shapes(out_features, in_features).items():
            expected[f"{module}.{suffix}"] = shape
    _check_awq_shard(config, shard, awq, awq_modules)
    # weight name -> its scales' name, for the weights stored in fp8 blocks.
    scales = {name: scale_name(name) for name in _quantized_weights(config, prefix, quant)}
    if quant is not None:
        # A sparse layer's router (mlp.gate) is unquantized in Qwen's FP8 checkpoints (their
        # modules_to_not_convert lists it); one stored in fp8 blocks with its scales loads too
        # (vLLM gives the gate the checkpoint's quantization method).
        for n in config.sparse_layers:
            router = f"{prefix}layers.{n}.mlp.gate.weight"
            if scale_name(router) in files:
                scales[router] = scale_name(router)
    for name, scale in scales.items():
        expected[scale] = quant.scale_shape(expected[name])
    missing_scales = sorted(set(scales.values()) - set(files))
    if missing_scales:
        raise CheckpointError(
            f"{path}: missing tensor(s) {', '.join(missing_scales[:5])}"
            + (f" and {len(missing_scales) - 5} more" if len(missing_scales) > 5 else "")
            + f": the block scales of the fp8 weights its quantization_config "
              f"({quant.describe()}) quantizes (a module stored unquantized is listed in "
              f"modules_to_not_convert)")
    missing = sorted(set(expected) - set(files))
    if missing:
        hint = ""
        if awq is None and any(n.removesuffix(".weight") + ".qweight" in files
                               for n in missing):
            hint = (": the checkpoint holds AWQ tensors (X.qweight, X.qzeros, X.scales) in "
                    "their place, but config.json has no AWQ quantization_config")
        if awq is not None and any(n.rsplit(".", 1)[-1] in _AWQ_PACKED + (_AWQ_SCALES,)
                                   for n in missing):
            hint = (f": the AWQ tensors (qweight, qzeros, scales) of linears its "
                    f"quantization_config ({awq.describe()}) quantizes (a module stored "
                    f"unquantized is listed in modules_to_not_convert)")
        fused = sorted(set(files) & {prefix + n.removeprefix("model.")
                                     for n in _fused_expert_shapes(config)})
        if fused:
            # transformers 5's in-memory layout written as it is (a torch save of its
            # state_dict): vLLM's Qwen3-MoE loader reads experts one by one only, and so does
            # load; save_pretrained writes them one by one.
            hint = (f": the checkpoint holds its experts fused ({', '.join(fused[:2])}"
                    f"{', ...' if len(fused) > 2 else ''}), as transformers 5 holds them in "
                    f"memory; minivllm, as vLLM, reads a checkpoint's experts one by one "
                    f"(mlp.experts.E.gate_proj.weight, up_proj, down_proj), as Qwen's "
                    f"checkpoints and transformers' save_pretrained write them "
                    f"(LLM.load_weights takes the fused tensors)")
        raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}"
                              + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                              + hint)
    # A config with tied embeddings (the pooling runner's) loads no head: an LM head (every
    # lm_head.* tensor, a quantized one's scales too, as vLLM's Qwen3 skips the prefix), or a
    # Qwen3ForSequenceClassification's score (state/classifier.py reads it), is left unread.
    tied = config.tie_word_embeddings
    extra = sorted(n for n in set(files) - set(expected)
                   if not _rotary_buffer(n)
                   and not (tied and (n == "score.weight" or n.startswith("lm_head."))))
    if extra:
        hint = ""
        if any(n.endswith((".qweight", ".qzeros", ".scales")) for n in extra):
            hint = (" (AWQ tensors, but config.json has no AWQ quantization_config)"
                    if awq is None else
                    f" (AWQ tensors of linears its quantization_config ({awq.describe()}) does "
                    f"not quantize: modules_to_not_convert lists them)")
        elif any(n.endswith("_scale_inv") or n.endswith("_scale") for n in extra):
            hint = (" (quantization scales, but config.json has no quantization_config: "
                    "minivllm loads block-fp8 checkpoints whose config says so)" if quant is None
                    else f" (scales of weights its quantization_config ({quant.describe()}) "
                         f"does not quantize: modules_to_not_convert lists them)")
        raise CheckpointError(f"{path}: unexpected tensor(s) {', '.join(extra[:5])}"
                              + (f" and {len(extra) - 5} more" if len(extra) > 5 else "") + hint)

    # Every tensor's file, name, shape and dtype are checked from the safetensors headers before
    # any data is read: a bad checkpoint fails at once, not after most of the weights are loaded
    # onto the device.
    handles: dict[str, object] = {}
    slices: dict[str, object] = {}
    scale_of = {scale: name for name, scale in scales.items()}  # scale name -> weight name
    for name in expected:
        file = files[name]
        if file not in handles:
            handles[file] = _open(file)
        try:
            sl = handles[file].get_slice(name)
            shape, stored = tuple(sl.get_shape()), sl.get_dtype()
        except Exception as e:
            raise CheckpointError(f"{file}: cannot read tensor {name} ({e})") from e
        if shape != expected[name]:
            what = ""
            if name in scale_of:  # the block grid of its weight
                what = (f" (one scale per {list(quant.block)} block of the "
                        f"{expected[scale_of[name]]} weight {scale_of[name]})")
            raise CheckpointError(f"{file}: tensor {name} has shape {shape}, expected "
                                  f"{expected[name]}{what}")
        if name in scales:
            if stored != _FP8_WEIGHT_DTYPE:
                raise CheckpointError(
                    f"{file}: tensor {name} is stored as {stored}, but the checkpoint's "
                    f"quantization_config ({quant.describe()}) quantizes it: a block-fp8 "
                    f"weight is {_FP8_WEIGHT_DTYPE} (a module stored unquantized is listed in "
                    f"modules_to_not_convert)")
        elif name in scale_of:
            if stored not in _SCALE_DTYPES:
                raise CheckpointError(f"{file}: tensor {name} is stored as {stored}; block "
                                      f"scales are {'/'.join(_SCALE_DTYPES)}")
        elif name.rsplit(".", 1)[0] in awq_modules:
            kind = name.rsplit(".", 1)[-1]
            want = ("I32",) if kind in _AWQ_PACKED else _SCALE_DTYPES
            if stored not in want:
                raise CheckpointError(f"{file}: tensor {name} is stored as {stored}; an AWQ "
                                      f"{kind} is {'/'.join(want)}")
        # An 8-bit or integer tensor is a quantized weight whose scales are elsewhere: casting
        # it to the model dtype would load garbage silently.
        elif stored not in _FLOAT_DTYPES:
            why = ("minivllm loads unquantized F32/F16/BF16 weights and, in block-fp8 "
                   "checkpoints, fp8 decoder linears with their weight_scale_inv")
            if awq is not None and stored == "I32":
                why = (f"the checkpoint's quantization_config ({awq.describe()}) does not "
                       f"quantize it" + (" (modules_to_not_convert lists it)"
                                         if name.endswith("_proj.weight") else
                                         ": embeddings, norms and the LM head are unquantized"))
            if quant is not None and stored == _FP8_WEIGHT_DTYPE:
                why = (f"the checkpoint's quantization_config ({quant.describe()}) does not "
                       f"quantize it" + (" (modules_to_not_convert lists it)"
                                         if name.endswith("_proj.weight") else
                                         ": embeddings, norms and the LM head are unquantized"))
            raise CheckpointError(f"{file}: tensor {name} is stored as {stored}; {why}")
        slices[name] = sl

    # Where tensors are read to: the CPU, but for a block-fp8 checkpoint bound for a GPU the GPU,
    # which dequantizes its weights (half bf16's bytes cross to it, and it converts them at
    # memory speed where a CPU takes seconds per GB; the products are the same, exactly).
    work = torch.device("cpu")
    if quant is not None and device is not None and torch.device(device).type == "cuda":
        work = torch.device(device)

    def read(name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None):
        if name in scales:
            return read_fp8(name, rows, cols)
        sl = slices[name]
        try:
            if rows is not None:
                t = sl[rows[0]:rows[1]]
            elif cols is not None:
                t = sl[:, cols[0]:cols[1]]
            else:
                t = sl[:]
        except Exception as e:
            raise CheckpointError(f"{files[name]}: cannot read tensor {name} ({e})") from e
        return t.to(dtype).to(work)

    def fp8_span(name: str, rows, cols) -> tuple[int, int, int, int]:
        """The rows r0:r1 and columns c0:c1 of fp8 weight `name` that a rank's `rows` or `cols`
        (None: all) name."""
        out_dim, in_dim = expected[name]
        r0, r1 = rows if rows is not None else (0, out_dim)
        c0, c1 = cols if cols is not None else (0, in_dim)
        return r0, r1, c0, c1

    def read_fp8_range(name: str, a0: int, a1: int, b0: int, b1: int):
        """Rows a0:a1 and columns b0:b1 of fp8 weight `name` (on block boundaries, or the
        tensor's end) and the scales of those blocks, as read."""
        bn, bk = quant.block
        try:
            weight = slices[name][a0:a1, b0:b1]
            scale = slices[scales[name]][a0 // bn:ceil_div(a1, bn), b0 // bk:ceil_div(b1, bk)]
        except Exception as e:
            raise CheckpointError(f"{files[name]}: cannot read tensor {name} or its scales "
                                  f"({e})") from e
        return weight, scale

    def read_fp8(name: str, rows, cols):
        # The whole blocks that hold the slice (a boundary inside a block takes that block and
        # its scale), dequantized, then cut to the slice: as dequantizing the whole tensor and
        # slicing it, with one rank's slice (plus at most a block each side) in memory.
        out_dim, in_dim = expected[name]
        bn, bk = quant.block
        r0, r1, c0, c1 = fp8_span(name, rows, cols)
        a0, a1 = r0 // bn * bn, min(ceil_div(r1, bn) * bn, out_dim)
        b0, b1 = c0 // bk * bk, min(ceil_div(c1, bk) * bk, in_dim)
        weight, scale = read_fp8_range(name, a0, a1, b0, b1)
        return dequantize_fp8_blocks(weight.to(work), scale.to(work), quant.block,
                                     dtype)[r0 - a0:r1 - a0, c0 - b0:c1 - b0]

    def read_fp8_blocks(name: str, rows, cols):
        """This rank's `rows` or `cols` of fp8 weight `name` as an Fp8BlockWeight, where they
        are whole scale blocks (a boundary at a block multiple or at the weight's end), else
        None."""
        out_dim, in_dim = expected[name]
        bn, bk = quant.block
        r0, r1, c0, c1 = fp8_span(name, rows, cols)
        if r0 % bn or (r1 % bn and r1 != out_dim) or c0 % bk or (c1 % bk and c1 != in_dim):
            return None
        weight, scale = read_fp8_range(name, r0, r1, c0, c1)
        return Fp8BlockWeight(weight=weight.to(work), scale_inv=scale.to(work, torch.float32),
                              block=quant.block)

    def put(t):
        if isinstance(t, Fp8BlockWeight):
            return Fp8BlockWeight(weight=put(t.weight), scale_inv=put(t.scale_inv), block=t.block)
        if isinstance(t, AwqWeight):
            return AwqWeight(qweight=put(t.qweight), qzeros=put(t.qzeros), scales=put(t.scales),
                             group_size=t.group_size)
        return t.contiguous().to(device)

    def read_linear(module: str, rows: tuple[int, int] | None = None,
                    cols: tuple[int, int] | None = None):
        """Linear `module`'s weight, this rank's output `rows` or input `cols` of it: a dense
        [out, in] tensor, or for an AWQ module an AwqWeight of those columns or rows (whole
        packed int32s and whole groups: _check_awq_shard made sure)."""
        if keep_fp8 and module + ".weight" in scales:
            kept = read_fp8_blocks(module + ".weight", rows, cols)
            if kept is not None:
                return kept
        if module not in awq_modules:
            return read(module + ".weight", rows=rows, cols=cols)
        out_features, in_features = awq_modules[module]
        group = awq.group(in_features)
        qweight, qzeros, scales_ = (slices[f"{module}.{k}"] for k in ("qweight", "qzeros",
                                                                         "scales"))
        try:
            if rows is not None:
                r0, r1 = rows
                p0, p1 = r0 // AWQ_PACK, r1 // AWQ_PACK
                parts = qweight[:, p0:p1], qzeros[:, p0:p1], scales_[:, r0:r1]
            elif cols is not None and group < in_features:
                c0, c1 = cols
                parts = qweight[c0:c1], qzeros[c0 // group:c1 // group], \
                    scales_[c0 // group:c1 // group]
            elif cols is not None:  # one group: every rank keeps its zeros and scales
                group = cols[1] - cols[0]
                parts = qweight[cols[0]:cols[1]], qzeros[:], scales_[:]
            else:
                parts = qweight[:], qzeros[:], scales_[:]
        except Exception as e:
            raise CheckpointError(f"{files[module + '.qweight']}: cannot read the AWQ tensors of "
                                  f"{module} ({e})") from e
        return AwqWeight(qweight=parts[0].to(work), qzeros=parts[1].to(work),
                         scales=parts[2].to(work), group_size=group)

    def dense(p):
        """A part of a merge as a dense [out, in] tensor in `dtype`."""
        if isinstance(p, AwqWeight):
            return dequantize_awq(p, dtype).T
        if isinstance(p, Fp8BlockWeight):
            return dequantize_fp8_blocks(p.weight, p.scale_inv, p.block, dtype)
        return p

    def merge(parts):
        """Weights of one input stacked along the output (QKV, gate/up): AWQ ones concatenated
        packed, block-fp8 ones along their whole block rows (cat_fp8); a mix
        (modules_to_not_convert naming some of them, a slice cutting a block) or fp8 parts that
        would cut a block (a part before the last whose rows are not a multiple of the block's:
        q_proj of 192 rows in 128-row blocks, say) dequantized to `dtype`: correct, though not
        fp8 in memory."""
        if all(isinstance(p, AwqWeight) for p in parts):
            return cat_awq(parts)
        if all(isinstance(p, Fp8BlockWeight) for p in parts):
            merged_fp8 = cat_fp8(parts)
            if merged_fp8 is not None:
                return merged_fp8
        return torch.cat([dense(p) for p in parts])

    # This rank's slice of every tensor: the table LLM.load_weights copies by (one place for the
    # shard ranges and the merged layouts).
    places = hf_placements(config, shard)

    def sliced(name: str) -> dict:
        """read's or read_linear's rows= and cols= for `name` (a weight, with load's prefix)."""
        place = places[_hf_name(name)]
        return dict(rows=place.src_rows, cols=place.src_cols)

    def linear(module: str):
        return read_linear(module, **sliced(module + ".weight"))

    def vocab_rows(name):
        # Rows past the real vocabulary are zero padding (the vocabulary is padded to a multiple
        # of the world size); a rank reads only the real rows it owns.
        v0, v1 = shard.vocab_range(config)
        out = torch.zeros(v1 - v0, config.hidden_size, dtype=dtype, device=work)
        place = places[_hf_name(name)]
        if place.rows[1] > 0:
            out[:place.rows[1]] = read(name, rows=place.src_rows)
        return put(out)

    layers = []
    for n in range(config.num_layers):
        p = f"{prefix}layers.{n}."
        qkv = merge([linear(p + "self_attn.q_proj"), linear(p + "self_attn.k_proj"),
                     linear(p + "self_attn.v_proj")])
        attention = dict(
            input_norm=put(read(p + "input_layernorm.weight")),
            qkv=put(qkv),
            q_norm=put(read(p + "self_attn.q_norm.weight")),
            k_norm=put(read(p + "self_attn.k_norm.weight")),
            o_proj=put(linear(p + "self_attn.o_proj")),
            post_norm=put(read(p + "post_attention_layernorm.weight")),
        )
        if config.is_sparse_layer(n):
            # Every expert's gate and up rows of this rank's slice, then its down columns,
            # stacked expert by expert: [experts, 2 * moe_local, hidden], [experts, hidden,
            # moe_local]. Filled in place, so that one expert's slices at a time are extra.
            e = f"{p}mlp.experts."
            m0, m1 = shard.moe_intermediate_range(config)
            gate_up = torch.empty(config.num_experts, 2 * (m1 - m0), config.hidden_size,
                                  dtype=dtype, device=device)
            down = torch.empty(config.num_experts, config.hidden_size, m1 - m0, dtype=dtype,
                               device=device)
            for x in range(config.num_experts):
                gate, up, down_x = (f"{e}{x}.{w}_proj.weight" for w in ("gate", "up", "down"))
                gate_up[x, :m1 - m0] = read(gate, **sliced(gate))
                gate_up[x, m1 - m0:] = read(up, **sliced(up))
                down[x] = read(down_x, **sliced(down_x))
            layers.append(MoELayerParams(**attention, router=put(read(p + "mlp.gate.weight")),
                                         experts_gate_up=gate_up, experts_down=down))
            continue
        gate_up = merge([linear(p + "mlp.gate_proj"), linear(p + "mlp.up_proj")])
        layers.append(LayerParams(**attention, gate_up=put(gate_up),
                                  down=put(linear(p + "mlp.down_proj"))))
    return Params(
        embed=vocab_rows(f"{prefix}embed_tokens.weight"),
        layers=tuple(layers),
        final_norm=put(read(f"{prefix}norm.weight")),
        lm_head=None if config.tie_word_embeddings else vocab_rows("lm_head.weight"),
        config=config,
        shard=shard,
    )


# -- in-place weight updates (LLM.load_weights: an RL loop's new policy weights) -----------------


@attrs.frozen
class Placement:
    """Where a Hugging Face tensor goes in one rank's Params: `field`, the path to the param
    (("embed",), ("layers", n, "qkv"), ..., ("layers", n, "experts_down", e): expert e's
    [hidden, moe_local] of the stacked experts); `rows`, the param's rows it fills ((start,
    stop), or None: all of it, as a norm or o_proj is); `src_rows` / `src_cols`, this rank's
    slice of the Hugging Face tensor (as load reads it: None, the whole)."""

    field: tuple
    rows: tuple[int, int] | None = None
    src_rows: tuple[int, int] | None = None
    src_cols: tuple[int, int] | None = None


def hf_placements(config: ModelConfig, shard: ShardSpec) -> dict[str, Placement]:
    """Every Hugging Face tensor name of a Qwen3 or Qwen3-MoE checkpoint (with the "model."
    prefix) -> its Placement in `shard`'s Params: load's layout (load reads each rank's slice
    by this table, and LLM.load_weights copies by it), from the shard ranges (q,
    k, v rows of the merged qkv in that order; gate, then up rows of gate_up; this rank's columns
    of o_proj and down; this rank's real rows of the vocabulary-parallel embedding and LM head,
    the padding rows past the vocabulary left as load leaves them). A sparse layer's router
    (mlp.gate) is its router whole; expert e's gate_proj and up_proj fill this rank's gate, then
    up rows of experts_gate_up[e] (their rows of moe_intermediate_range), its down_proj this
    rank's columns into experts_down[e] (the expert index is the field path's last step). A
    tied model has no lm_head.weight. tests/test_load_weights.py checks the table's target rows
    against load's params, rank by rank, dense and mixture of experts; test_load.py checks
    load's slices against the Hugging Face tensors split by hand."""
    d = config.head_dim
    q0, q1 = shard.head_range(config)
    k0, k1 = shard.kv_head_range(config)
    i0, i1 = shard.intermediate_range(config)
    m0, m1 = shard.moe_intermediate_range(config)
    v0, v1 = shard.vocab_range(config)
    nq, nkv, ni = (q1 - q0) * d, (k1 - k0) * d, i1 - i0
    real = min(v1, config.vocab_size)
    # A rank whose vocabulary slice is all padding reads nothing (load's vocab_rows).
    vocab = Placement(None, rows=(0, max(real - v0, 0)), src_rows=(v0, max(real, v0)))
    out = {"model.embed_tokens.weight": attrs.evolve(vocab, field=("embed",)),
           "model.norm.weight": Placement(("final_norm",))}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = attrs.evolve(vocab, field=("lm_head",))
    for n in range(config.num_layers):
        p = f"model.layers.{n}."

        def at(field, **kw):
            return Placement(("layers", n, field), **kw)
        out.update({
            p + "input_layernorm.weight": at("input_norm"),
            p + "post_attention_layernorm.weight": at("post_norm"),
            p + "self_attn.q_norm.weight": at("q_norm"),
            p + "self_attn.k_norm.weight": at("k_norm"),
            p + "self_attn.q_proj.weight": at("qkv", rows=(0, nq), src_rows=(q0 * d, q1 * d)),
            p + "self_attn.k_proj.weight": at("qkv", rows=(nq, nq + nkv),
                                              src_rows=(k0 * d, k1 * d)),
            p + "self_attn.v_proj.weight": at("qkv", rows=(nq + nkv, nq + 2 * nkv),
                                              src_rows=(k0 * d, k1 * d)),
            p + "self_attn.o_proj.weight": at("o_proj", src_cols=(q0 * d, q1 * d)),
        })
        if config.is_sparse_layer(n):
            nm = m1 - m0
            out[p + "mlp.gate.weight"] = at("router")
            for e in range(config.num_experts):
                q = f"{p}mlp.experts.{e}."
                out.update({
                    q + "gate_proj.weight": Placement(("layers", n, "experts_gate_up", e),
                                                      rows=(0, nm), src_rows=(m0, m1)),
                    q + "up_proj.weight": Placement(("layers", n, "experts_gate_up", e),
                                                    rows=(nm, 2 * nm), src_rows=(m0, m1)),
                    q + "down_proj.weight": Placement(("layers", n, "experts_down", e),
                                                      src_cols=(m0, m1)),
                })
            continue
        out.update({
            p + "mlp.gate_proj.weight": at("gate_up", rows=(0, ni), src_rows=(i0, i1)),
            p + "mlp.up_proj.weight": at("gate_up", rows=(ni, 2 * ni), src_rows=(i0, i1)),
            p + "mlp.down_proj.weight": at("down", src_cols=(i0, i1)),
        })
    return out


def _fused_expert_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers 5's in-memory names of a sparse layer's experts, each all experts' one
    tensor (its checkpoints are written, and load reads them, expert by expert):
    model.layers.N.mlp.experts.gate_up_proj [experts, 2 * moe_intermediate, hidden], every
    expert's gate_proj rows then its up_proj rows, and ...experts.down_proj [experts, hidden,
    moe_intermediate]."""
    e, h, m = config.num_experts, config.hidden_size, config.moe_intermediate_size
    shapes = {}
    for n in range(config.num_layers):
        if config.is_sparse_layer(n):
            p = f"model.layers.{n}.mlp.experts."
            shapes[p + "gate_up_proj"] = (e, 2 * m, h)
            shapes[p + "down_proj"] = (e, h, m)
    return shapes


def _per_expert(config: ModelConfig, name: str, tensor: torch.Tensor):
    """A fused experts tensor (_fused_expert_shapes) as the per-expert (name, view) pairs of a
    checkpoint, which hf_placements places; any other pair as it is."""
    p, _, last = name.rpartition(".")
    if ".mlp.experts." in name and last == "gate_up_proj":
        m = config.moe_intermediate_size
        for e in range(config.num_experts):
            yield f"{p}.{e}.gate_proj.weight", tensor[e, :m]
            yield f"{p}.{e}.up_proj.weight", tensor[e, m:]
    elif ".mlp.experts." in name and last == "down_proj":
        for e in range(config.num_experts):
            yield f"{p}.{e}.down_proj.weight", tensor[e]
    else:
        yield name, tensor


def _hf_name(name: str) -> str:
    """`name` with the backbone's "model." prefix, which a Qwen3Model's names lack
    (backbone_prefix)."""
    return name if name.startswith("model.") or name == "lm_head.weight" else "model." + name


def check_hf_weights(params: Params, weights) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of `weights` (an iterable of Hugging Face names and whole,
    unsharded tensors) to copy into `params`, every one checked first, so that a bad update
    changes nothing: a ValueError naming the first name that is not the model's, the first
    shape that is not the checkpoint's (_hf_shapes, what load checks), a non-tensor or a
    non-float tensor (a quantized weight's integers would be cast to garbage, as load refuses
    them). Skipped as load skips them: lm_head.weight of a tied model (load leaves it unread,
    the head being the embedding) and the rotary buffers (_rotary_buffer). No NaN check (vLLM
    makes none: a scan of every tensor is the caller's to pay for). A mixture of experts'
    experts are named as in its checkpoint (model.layers.N.mlp.experts.E.gate_proj.weight, ...)
    or as transformers 5 holds them in memory, fused (...mlp.experts.gate_up_proj,
    ...down_proj: _fused_expert_shapes); a fused pair stays whole here (so that tensor
    parallelism sends one tensor) and copy_hf_weights_ cuts it. Quantized params (AWQ, block
    fp8) are refused whole."""
    config = params.config
    if has_quantized(params):
        raise ValueError("load_weights cannot update quantized (AWQ or block-fp8) weights: "
                         "their packed layout is not a Hugging Face tensor's")
    shapes = {**_hf_shapes(config), **_fused_expert_shapes(config)}
    out = []
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"load_weights takes (name, tensor) pairs, got {item!r:.80}")
        name, tensor = item
        full = _hf_name(name)
        if _rotary_buffer(full) or \
                (full == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if full not in shapes:
            raise ValueError(f"load_weights: {name} is not a weight of this model")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"load_weights: {name} is a {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != shapes[full]:
            raise ValueError(f"load_weights: {name} has shape {tuple(tensor.shape)}, expected "
                             f"{shapes[full]}")
        if not tensor.is_floating_point():
            raise ValueError(f"load_weights: {name} is {tensor.dtype}; weights are floats")
        out.append((full, tensor))
    return out


def copy_hf_weights_(params: Params, checked: list[tuple[str, torch.Tensor]]) -> None:
    """Copy check_hf_weights' pairs into `params` in place (copy_, cast to the params' dtype):
    this rank's slice of each (hf_placements), into the tensors that compiled code, CUDA graphs
    and the persistent decode's layer table hold by address, so that they see the new values
    without a recapture. Later pairs of one name win."""
    places = hf_placements(params.config, params.shard)
    with torch.no_grad():
        for name, tensor in (pair for fused in checked
                             for pair in _per_expert(params.config, *fused)):
            place = places[name]
            dst = params
            for key in place.field:
                dst = dst[key] if isinstance(key, int) else getattr(dst, key)
            if place.rows is not None:
                dst = dst[place.rows[0]:place.rows[1]]
            src = tensor
            if place.src_rows is not None:
                src = src[place.src_rows[0]:place.src_rows[1]]
            if place.src_cols is not None:
                src = src[:, place.src_cols[0]:place.src_cols[1]]
            dst.copy_(src)


def assign_hf_weights(params: Params, weights) -> Params:
    """The functional form: new Params, `params` with `weights` (check_hf_weights') in place of
    its tensors; `params` is left as it was."""
    checked = check_hf_weights(params, weights)
    fresh = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, params)
    copy_hf_weights_(fresh, checked)
    return fresh
