"""ModelConfig: what a Qwen3 checkpoint's config.json says, as an immutable, hashable value."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import attrs
import torch

# Qwen3Model: the backbone alone, as transformers' AutoModel saves it (an embedding model's).
# Qwen3MoeForCausalLM: the mixture-of-experts models (Qwen3-30B-A3B, Qwen3-235B-A22B).
# Qwen3ForSequenceClassification: the backbone and a linear head on its last token (the pooling
# runner's classifiers and rerankers: state/classifier.py).
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model", "Qwen3MoeForCausalLM",
                           "Qwen3ForSequenceClassification")
_MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3Model": "qwen3",
                "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForSequenceClassification": "qwen3"}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


FP8_DTYPES = (torch.float8_e4m3fn,)
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def parse_kv_cache_dtype(kv_cache_dtype: Any, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype: "auto" / None is the model's; "fp8" / "fp8_e4m3" (as vLLM's
    --kv-cache-dtype) stores keys and values as float8_e4m3fn, half of bf16's bytes, as they are
    (no scale: e4m3 holds |x| <= 448 with 3 mantissa bits; attention widens them to the model's
    dtype as it reads them). A model dtype (name or torch dtype) is taken as it is."""
    if isinstance(kv_cache_dtype, str) and kv_cache_dtype.lower() in _KV_CACHE_DTYPES:
        return _KV_CACHE_DTYPES[kv_cache_dtype.lower()]
    if kv_cache_dtype in FP8_DTYPES:
        return kv_cache_dtype
    if not isinstance(kv_cache_dtype, (str, torch.dtype, type(None))):
        raise TypeError(f"kv_cache_dtype must be a string or a torch.dtype, got "
                        f"{type(kv_cache_dtype).__name__}")
    try:
        return parse_dtype(kv_cache_dtype, model_dtype)
    except ValueError:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; use 'auto', 'fp8' (float8 "
                         f"e4m3), 'float32', 'bfloat16' or 'float16'") from None


def parse_dtype(dtype: Any, default: torch.dtype | None = None) -> torch.dtype:
    """A torch dtype from a torch dtype, a name ("bfloat16", "torch.float16") or "auto"/None."""
    if dtype is None or dtype == "auto":
        if default is None:
            raise ValueError("dtype 'auto' needs a default (the checkpoint's dtype)")
        return default
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; use float32, bfloat16 or float16")
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name in _DTYPES:
            return _DTYPES[name]
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32', 'bfloat16' or 'float16'")
    raise TypeError(f"dtype must be a torch.dtype or a string, got {type(dtype).__name__}")


def _config_dtype(key: str, name: Any) -> torch.dtype:
    """config.json's dtype (or torch_dtype) `name` as a torch dtype; a ValueError that names the
    key, so that it is not taken for LLM's own dtype argument."""
    try:
        return parse_dtype(name)
    except ValueError as e:
        raise ValueError(f"config {key}: {e}") from None


def _freeze(value: Any) -> Any:
    """Dicts and lists to sorted tuples, so that the config stays hashable (it is treedef context)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


# Llama-3 RoPE scaling's frequency factors where a ModelConfig built in code leaves them out
# (Llama 3.1's values; functional.rope). A config.json must give them: from_dict refuses one
# without them, as transformers and vLLM do (a KeyError there).
LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}

# transformers' Qwen3Config and Qwen3MoeConfig's max_position_embeddings, where config.json has
# none (vLLM reads the same: its max_model_len, and YaRN's default original length).
DEFAULT_MAX_POSITIONS = 32768


def _llama3_scaling(scaling: dict, max_position_embeddings: int) -> dict:
    """Llama-3 RoPE scaling's parameters checked, as functional.rope computes with them: a
    factor, frequency factors low < high (their difference divides), and
    original_max_position_embeddings (default max_position_embeddings, as transformers'
    standardize_rope_params fills it in). low_freq_factor and high_freq_factor have no default:
    transformers and vLLM refuse a config without them."""
    out = dict(scaling)
    out.setdefault("original_max_position_embeddings", max_position_embeddings)

    def number(key):
        value = out.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or not math.isfinite(value):
            raise ValueError(f"llama3 rope scaling needs {key} > 0, got {value!r}")
        return value

    number("factor")
    original = number("original_max_position_embeddings")
    if original != int(original):
        raise ValueError(f"llama3 rope scaling needs original_max_position_embeddings, a "
                         f"positive integer, got {original!r}")
    out["original_max_position_embeddings"] = int(original)
    absent = [k for k in ("low_freq_factor", "high_freq_factor") if k not in scaling]
    if absent:
        raise ValueError(f"llama3 rope scaling needs {' and '.join(absent)} (transformers and "
                         f"vLLM have no default for them)")
    if not number("low_freq_factor") < number("high_freq_factor"):
        raise ValueError(f"llama3 rope scaling needs low_freq_factor < high_freq_factor, got "
                         f"{out['low_freq_factor']!r} and {out['high_freq_factor']!r}")
    return out


def _yarn_scaling(scaling: dict, max_position_embeddings) -> dict:
    """YaRN's parameters checked, with transformers' defaults filled in (functional.rope reads
    them): factor (default max_position_embeddings / original_max_position_embeddings),
    original_max_position_embeddings (default max_position_embeddings), optional
    attention_factor, beta_fast, beta_slow, mscale, mscale_all_dim, and truncate."""
    def number(key, default=None, *, positive=True):
        value = scaling.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                not math.isfinite(value) or (positive and not value > 0):
            raise ValueError(f"yarn rope scaling needs {key} > 0, got {value!r}")
        return value

    out = dict(scaling)
    original = number("original_max_position_embeddings", max_position_embeddings)
    if original is None or original != int(original):
        raise ValueError(f"yarn rope scaling needs original_max_position_embeddings, a positive "
                         f"integer, got {original!r}")
    out["original_max_position_embeddings"] = int(original)
    factor = number("factor")
    out["factor"] = factor if factor is not None else max_position_embeddings / original
    if int(out["original_max_position_embeddings"] * out["factor"]) < 1:
        raise ValueError(f"yarn rope scaling's context, original_max_position_embeddings x "
                         f"factor ({original} x {out['factor']}), is less than one position")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        number(key)
    if not isinstance(out.setdefault("truncate", True), bool):
        raise ValueError(f"yarn rope scaling's truncate must be true or false, got "
                         f"{out['truncate']!r}")
    return out


def _factor_scaling(kind: str, scaling: dict, max_position_embeddings: int) -> dict:
    """Linear or dynamic-NTK RoPE scaling's parameters checked (functional.rope computes them):
    a factor > 0, over which both stretch max_position_embeddings (vLLM's context for them:
    max_position_embeddings x factor). transformers and vLLM read factor and nothing else
    (rope_theta aside); vLLM's other dynamic form, with `alpha` (DynamicNTKAlpha), is refused."""
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0 \
            or not math.isfinite(factor):
        raise ValueError(f"{kind} rope scaling needs factor > 0, got {factor!r}")
    if kind == "dynamic" and "alpha" in scaling:
        raise ValueError("dynamic rope scaling with alpha (vLLM's DynamicNTKAlpha) is not "
                         "supported: minivllm computes dynamic scaling by factor")
    if int(max_position_embeddings * factor) < 1:
        raise ValueError(f"{kind} rope scaling's context, max_position_embeddings x factor "
                         f"({max_position_embeddings} x {factor}), is less than one position")
    return dict(scaling)


def _token_ids(key: str, value: Any, *, many: bool) -> Any:
    """config.json's bos / eos id as given (null, an id, or for eos a list of ids), checked: a
    string or a float there would otherwise surface as a failed int() after the weights load."""
    listed = value if many and isinstance(value, list) else [value]
    if not all(i is None or (isinstance(i, int) and not isinstance(i, bool) and i >= 0)
               for i in listed):
        what = "a token id or a list of them" if many else "a token id"
        raise ValueError(f"config {key} must be {what} (or null), got {value!r}")
    return [i for i in value if i is not None] if many and isinstance(value, list) else value


def _positive_number(key: str, value: Any, kind: type) -> Any:
    """`value` (config key `key`) as a positive float or int; a ValueError naming the key
    otherwise (float(None) would be a TypeError that names nothing)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
            or not math.isfinite(value) or (kind is int and not float(value).is_integer())):
        raise ValueError(f"config {key} must be a positive {kind.__name__}, got {value!r}")
    return kind(value)


def _experts(d: dict) -> dict:
    """A qwen3_moe config's expert fields (ModelConfig's), checked. Qwen's checkpoints write
    num_experts, transformers 5 num_local_experts: either is read. A layer n is sparse as
    transformers' Qwen3MoeDecoderLayer decides: not in mlp_only_layers, and (n + 1) a multiple
    of decoder_sparse_step."""
    named = {k: d[k] for k in ("num_experts", "num_local_experts") if d.get(k) is not None}
    if len(set(map(repr, named.values()))) > 1:
        raise ValueError(f"config num_experts ({named['num_experts']!r}) and num_local_experts "
                         f"({named['num_local_experts']!r}) disagree")
    if not named:
        raise ValueError("a qwen3_moe config needs num_experts (or num_local_experts)")
    num_experts = next(iter(named.values()))
    for key in ("num_experts_per_tok", "moe_intermediate_size"):
        if key not in d:
            raise ValueError(f"a qwen3_moe config needs {key}")
    num_layers = d["num_hidden_layers"]
    step = d.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"config decoder_sparse_step must be a positive integer, got {step!r}")
    dense = d.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in dense):
        raise ValueError(f"config mlp_only_layers must be a list of layer indices, got {dense!r}")
    norm = d.get("norm_topk_prob", False)
    if norm not in (True, False):
        raise ValueError(f"config norm_topk_prob must be true or false, got {norm!r}")
    # transformers' Qwen3MoeConfig ignores the key; Qwen2-MoE-style models (and some Qwen3-MoE
    # implementations) add a sigmoid-gated shared expert when it is above 0. minivllm computes
    # routed experts only: such a model would silently run without a part it was trained with.
    shared = d.get("shared_expert_intermediate_size")
    if shared is not None and not (isinstance(shared, (int, float)) and shared <= 0):
        raise ValueError(f"config shared_expert_intermediate_size={shared!r}: a shared expert "
                         f"(mlp.shared_expert, gated by mlp.shared_expert_gate) is not "
                         f"supported: minivllm runs Qwen3-MoE's routed experts only")
    sparse = ()
    if isinstance(num_experts, int) and num_experts > 0 and isinstance(num_layers, int):
        sparse = tuple(n for n in range(num_layers) if n not in dense and (n + 1) % step == 0)
    return dict(num_experts=num_experts, num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"], norm_topk_prob=bool(norm),
                sparse_layers=sparse)


def _rope(d: dict, max_positions: int) -> tuple[Any, dict | None]:
    """config.json's RoPE: (rope_theta, the scaling dict checked, or None for plain RoPE).

    As transformers reads a config (5: `rope_scaling or rope_parameters`; vLLM on 4 sets
    rope_parameters to rope_scaling), a non-empty rope_scaling is the scaling, over any
    rope_parameters: hf_overrides {"rope_scaling": ...} replaces a transformers-5 file's
    scaling ({"rope_type": "default"} turns it off). rope_theta: the scaling dict's own, else
    rope_parameters', else the top-level key, else 1e4. (transformers 5 drops rope_parameters'
    rope_theta where rope_scaling wins; that loses Qwen3's 1e6 for 1e4, and is not followed.)
    Refused: per-layer-type (nested) parameters, and a partial_rotary_factor other than 1 (vLLM
    rotates that share of each head, transformers' Qwen3 the whole head)."""
    rope_params = d.get("rope_parameters")
    rope_theta = d.get("rope_theta")
    rope_scaling = d.get("rope_scaling")
    for key, value in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config {key} must be a JSON object, got {value!r}")
        nested = [k for k, v in (value or {}).items() if isinstance(v, dict)]
        if nested:
            raise ValueError(f"config {key} gives RoPE parameters per layer type "
                             f"({', '.join(nested)}): minivllm runs one RoPE for every layer")
    partial = [v for v in (d.get("partial_rotary_factor"), (rope_params or {}).get(
        "partial_rotary_factor"), (rope_scaling or {}).get("partial_rotary_factor"))
               if v is not None]
    if any(v != 1 for v in partial):
        raise ValueError(f"config partial_rotary_factor {partial[0]!r} is not supported: "
                         f"minivllm rotates the whole head (partial_rotary_factor 1)")
    if rope_params:
        rope_params = dict(rope_params)
        rope_theta = rope_params.pop("rope_theta", rope_theta)
    if rope_scaling:
        rope_scaling = dict(rope_scaling)
        rope_theta = rope_scaling.pop("rope_theta", rope_theta)
    else:
        rope_scaling = rope_params or None
    if rope_theta is None:
        rope_theta = 10000.0
    if rope_scaling is None:
        return rope_theta, None
    rope_scaling.pop("partial_rotary_factor", None)
    kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    rope_scaling["rope_type"] = kind
    rope_scaling.pop("type", None)
    if kind == "default":
        return rope_theta, None
    if kind == "yarn":  # Qwen3's long context (its model card: factor 4 over 32,768)
        return rope_theta, _yarn_scaling(rope_scaling, max_positions)
    if kind == "llama3":
        return rope_theta, _llama3_scaling(rope_scaling, max_positions)
    if kind in ("linear", "dynamic"):
        return rope_theta, _factor_scaling(kind, rope_scaling, max_positions)
    raise ValueError(f"unsupported rope scaling type {kind!r}: minivllm supports 'yarn', "
                     f"'llama3', 'linear' and 'dynamic'")


# transformers' values for keys that config.json leaves out (vLLM reads the same config
# objects): Qwen3Config's head_dim is 128 whatever hidden_size / num_attention_heads is, and its
# num_key_value_heads 32 (all heads only when the key is null). Qwen3MoeConfig has no head_dim
# (its attention takes hidden_size // num_attention_heads) and 4 KV heads.
_ABSENT_DEFAULTS = {"qwen3": {"head_dim": 128, "num_key_value_heads": 32},
                    "qwen3_moe": {"num_key_value_heads": 4}}

# ModelConfig field -> its config.json key, where they differ (for error messages).
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads"}


@attrs.frozen
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # rope_scaling as sorted (key, value) pairs, or None: hashable so the config can be static.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    dtype: torch.dtype = torch.bfloat16
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # Mixture of experts (qwen3_moe; all zero for a dense model): each of `sparse_layers` routes
    # a token to num_experts_per_tok of num_experts MLPs of moe_intermediate_size, weighted by
    # their router probabilities (renormalized over the chosen when norm_topk_prob); the other
    # layers' MLP is the dense one of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()

    def __attrs_post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                # Named as config.json names it too, when that differs (num_hidden_layers, ...).
                hf = _HF_NAMES.get(name)
                label = f"{name} ({hf} in config.json)" if hf else name
                raise ValueError(f"config {label} must be a positive integer, got {value!r}")
        if self.head_dim % 2:  # an odd one would fail deep in the attention, after the load
            raise ValueError(f"config head_dim must be even (RoPE rotates its two halves), got "
                             f"{self.head_dim}")
        if (isinstance(self.rope_scaling, tuple) and self.head_dim == 2
                and dict(self.rope_scaling).get("rope_type") == "dynamic"):
            raise ValueError("dynamic rope scaling needs head_dim > 2 (its base is raised to the "
                             "power head_dim / (head_dim - 2))")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        self._check_experts()

    def _check_experts(self) -> None:
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"config {name} must be a non-negative integer, got {value!r}")
        if not self.num_experts:
            if self.sparse_layers:
                raise ValueError("config sparse_layers given without experts (num_experts 0)")
            return
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"config num_experts_per_tok must be in [1, num_experts="
                             f"{self.num_experts}], got {self.num_experts_per_tok!r}")
        if self.moe_intermediate_size < 1:
            raise ValueError(f"config moe_intermediate_size must be a positive integer, got "
                             f"{self.moe_intermediate_size!r}")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"config norm_topk_prob must be true or false, got "
                             f"{self.norm_topk_prob!r}")
        layers = self.sparse_layers
        if not (isinstance(layers, tuple) and all(
                isinstance(n, int) and 0 <= n < self.num_layers for n in layers)
                and list(layers) == sorted(set(layers))):
            raise ValueError(f"config sparse_layers must be increasing layer indices below "
                             f"{self.num_layers}, got {layers!r}")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a mixture of experts."""
        return bool(self.sparse_layers)

    def is_sparse_layer(self, n: int) -> bool:
        """Whether layer n's MLP is the mixture of experts (else the dense MLP)."""
        return n in self.sparse_layers

    @property
    def rope_scaling_dict(self) -> dict | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def max_context_len(self) -> int:
        """The longest context the model's positions serve, as vLLM derives it: with YaRN
        original_max_position_embeddings * factor (Qwen3's card: 32,768 * 4), with linear or
        dynamic scaling max_position_embeddings * factor, else max_position_embeddings."""
        scaling = self.rope_scaling_dict
        if scaling is not None and scaling["rope_type"] == "yarn":
            return int(scaling["original_max_position_embeddings"] * scaling["factor"])
        if scaling is not None and scaling["rope_type"] in ("linear", "dynamic"):
            return int(self.max_position_embeddings * scaling["factor"])
        return self.max_position_embeddings

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Read a HF config dict in the transformers 4 layout (rope_theta, rope_scaling, torch_dtype)
        or the transformers 5 layout (rope_parameters, dtype)."""
        if not isinstance(d, dict):
            raise ValueError(f"a model config is a JSON object, got {type(d).__name__}")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in d]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}")
        archs = d.get("architectures")
        if archs is not None and not (isinstance(archs, list)
                                      and all(isinstance(a, str) for a in archs)):
            # A string would be read letter by letter, a number not at all.
            raise ValueError(f"config architectures must be a list of class names, got "
                             f"{archs!r:.80}")
        # Without architectures, the model_type's causal LM (as transformers' Auto classes).
        archs = archs or [
            "Qwen3MoeForCausalLM" if d.get("model_type") == "qwen3_moe" else "Qwen3ForCausalLM"]
        for arch in archs:
            if arch not in SUPPORTED_ARCHITECTURES:
                raise ValueError(
                    f"unsupported architecture {arch!r}: minivllm runs {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
        model_type = d.get("model_type", _MODEL_TYPES[archs[0]])
        if model_type not in ("qwen3", "qwen3_moe"):
            raise ValueError(f"unsupported model_type {model_type!r}: minivllm runs qwen3 and "
                             f"qwen3_moe")
        if any(_MODEL_TYPES[arch] != model_type for arch in archs):
            raise ValueError(f"model_type {model_type!r} does not match the architecture(s) "
                             f"{', '.join(archs)}")
        experts = _experts(d) if model_type == "qwen3_moe" else {}
        if d.get("attention_bias", False):
            raise ValueError("attention_bias=True is not supported (Qwen3 checkpoints have none)")
        if d.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        # vLLM reads both (its Qwen3 layers: is_causal false is bidirectional attention, as
        # gte-Qwen embedding models ask; a dual_chunk_attention_config, Qwen's 1M-token
        # config, is dual-chunk attention and its RoPE): minivllm computes neither, so a config
        # that asks for one is refused rather than run as a causal, plain-RoPE model.
        if "is_causal" in d and d["is_causal"] is not True:
            raise ValueError(f"is_causal={d['is_causal']!r} (bidirectional attention, as vLLM "
                             f"runs it) is not supported: minivllm's attention is causal")
        if d.get("dual_chunk_attention_config"):
            raise ValueError("dual_chunk_attention_config (dual-chunk attention, Qwen's 1M-token "
                             "context) is not supported")
        # The MLP computes silu(gate) * up whatever the config says: refuse any other activation
        # rather than compute the wrong function.
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={d['hidden_act']!r} is not supported (Qwen3 uses 'silu')")
        # Block-fp8 checkpoints (Qwen3-*-FP8) load, their weights dequantized, and 4-bit AWQ
        # ones (Qwen3-*-AWQ), kept packed (state/quant.py); any other quantization (GPTQ,
        # bitsandbytes, per-tensor fp8, other AWQ, ...) is refused here,
        # before any weight is read, instead of failing later on its extra tensors.
        from .quant import quantization_from_config
        quantization_from_config(d)

        max_positions = _positive_number(
            "max_position_embeddings", d.get("max_position_embeddings", DEFAULT_MAX_POSITIONS), int)
        rope_theta, rope_scaling = _rope(d, max_positions)

        tie = d.get("tie_word_embeddings", False)
        if tie not in (True, False):  # bool("false") would be True: a silently tied head
            raise ValueError(f"config tie_word_embeddings must be true or false, got {tie!r}")
        num_heads = d["num_attention_heads"]
        absent = _ABSENT_DEFAULTS[model_type]
        head_dim = d["head_dim"] if "head_dim" in d else absent.get("head_dim")
        if head_dim is None:
            # Divided only when both are positive ints: otherwise __attrs_post_init__ names the
            # bad key (hidden_size // 0 would be a ZeroDivisionError that names nothing).
            sizes = (d["hidden_size"], num_heads)
            ok = all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sizes)
            head_dim = sizes[0] // sizes[1] if ok else None
        # transformers 5 writes "dtype", 4 "torch_dtype"; a null one defers to the other.
        dtype_key = "dtype" if d.get("dtype") else "torch_dtype"
        dtype_name = d.get("dtype") or d.get("torch_dtype") or "bfloat16"
        if not isinstance(dtype_name, (str, torch.dtype)):
            raise ValueError(f"config {dtype_key} must be a dtype name such as \"bfloat16\", got "
                             f"{dtype_name!r:.80}")
        if isinstance(dtype_name, str) and dtype_name.removeprefix("torch.") in ("float64",
                                                                                 "double"):
            dtype_name = "float32"  # stored wider than minivllm computes: load narrows it
        # Absent: transformers' default; null: all heads (Qwen3Config's __post_init__). A 0 is
        # named by __attrs_post_init__, not taken as either.
        num_kv_heads = d.get("num_key_value_heads", absent["num_key_value_heads"])
        if "num_key_value_heads" not in d and type(num_heads) is int and num_heads > 0 \
                and num_heads % num_kv_heads:
            raise ValueError(f"config has no num_key_value_heads: transformers' {model_type} "
                             f"config then takes {num_kv_heads}, which does not divide "
                             f"num_attention_heads ({num_heads}); give num_key_value_heads")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_positive_number("rms_norm_eps", d.get("rms_norm_eps", 1e-6), float),
            rope_theta=_positive_number("rope_theta", rope_theta, float),
            rope_scaling=_freeze(rope_scaling),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(tie),
            dtype=_config_dtype(dtype_key, dtype_name),
            bos_token_id=_token_ids("bos_token_id", d.get("bos_token_id"), many=False),
            eos_token_id=_freeze(_token_ids("eos_token_id", d.get("eos_token_id"), many=True)),
            **experts,
        )

    @classmethod
    def from_json(cls, path: str | os.PathLike, overrides: dict | None = None) -> "ModelConfig":
        """From a config.json file, or a checkpoint directory holding one. overrides: values set
        over the file's (vLLM's hf_overrides, e.g. {"rope_scaling": {...}}); an object merges
        into the file's object of that key."""
        return cls.from_dict(read_config_dict(path, overrides))


def read_config_dict(path: str | os.PathLike, overrides: dict | None = None) -> dict:
    """config.json (of a checkpoint directory, or the file itself) as a dict, with `overrides`
    set over it (merge_overrides). ModelConfig reads the model's shape from it; the pooling
    runner's classifier (state/classifier.py) its head's keys."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json at {path}")
    try:
        with open(path) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if overrides:
        d = merge_overrides(d, overrides)
    return d


# config.json keys that name one field (transformers 5's Qwen3MoeConfig writes num_local_experts).
_ALIASES = {"num_experts": "num_local_experts", "num_local_experts": "num_experts"}


def merge_overrides(base: dict, overrides) -> dict:
    """`base` with `overrides` set over it: a dict value merges into base's dict of that key
    (so {"rope_parameters": {"rope_type": "yarn", ...}} keeps the file's rope_theta)."""
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ValueError(f"hf_overrides must be a dict of config.json keys, got {overrides!r:.80}")
    out = dict(base) if isinstance(base, dict) else {}
    for key, value in overrides.items():
        # An override names one field whatever the file calls it: transformers sets it through
        # the config's attribute_map, so the file's other name for it goes (it would disagree).
        twin = _ALIASES.get(key)
        if twin is not None and twin not in overrides:
            out.pop(twin, None)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = value
    return out


# Real Qwen3 shapes, for random-weight benchmarks.
SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
                       num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_heads=32, num_kv_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True,
                          sparse_layers=tuple(range(48))),
}


def config_for_shape(name: str, **overrides) -> ModelConfig:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    kwargs = dict(SHAPES[name], rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  max_position_embeddings=40960, eos_token_id=151645)
    kwargs.update(overrides)
    return ModelConfig(**kwargs)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


