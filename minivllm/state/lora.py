"""LoRA adapters: PEFT checkpoints read on the host, and the engine's stacked slot weights.

An adapter (`LoRAAdapter`) is what a PEFT LoRA directory holds, checked against the model:
`adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors` with `base_model.model.model.layers.{i}.{module}.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r], for modules among q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj and down_proj. B is kept with the scale folded in (alpha / r, or alpha /
sqrt(r) under rsLoRA), fp32, on the CPU.

The engine holds up to `max_loras` adapters at once in `LoRAParams`, the optional `lora` child
of Params: per decoder layer one `LoRALayer` of stacked slot weights, zero-padded to
`max_rank`, laid out for the fused weights the engine computes with (QKV, gate/up):

  qkv_a     [S * 3 * R, hidden]             slot-major, then q / k / v, then rank
  qkv_b     [(heads + 2 kv_heads) * d, S * 3 * R]   q's B in the q rows and the q columns of
                                            each slot, k's in the k rows, ...: block diagonal
  o_a       [S * R, heads * d]              o_b     [hidden, S * R]
  gate_up_a [S * 2 * R, hidden]             gate_up_b [2 * intermediate, S * 2 * R]
  down_a    [S * R, intermediate]           down_b  [hidden, S * R]

(S slots, R = max_rank.) Under tensor parallelism each rank holds its shard of these, cut as
the base weights are (vLLM's): for the column-parallel groups (qkv, gate_up) A whole and B's
rows of the rank's q / k / v heads and gate / up rows; for the row-parallel ones (o, down) A's
columns of the rank's input slice (its heads, its intermediate rows) and B whole, so that a
rank's delta is a partial sum that the base layer's all-reduce completes. The shapes above are
then the rank's (module_shapes).

With these, a row's delta is F.linear(F.linear(x, A) * its slot's
mask, B) (functional/lora.py): the columns of other slots are zeroed, and a module an adapter
does not target, like the padding past its rank, is zeros. Slots are written in place
(write_slot), like the KV cache: the tensors keep their addresses for good.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from .config import ModelConfig
from .pytree import pytree_class, static
from .shard import ShardSpec

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# module name -> (LoRALayer group, part within the group's fused weight)
MODULES = {
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
GROUP_PARTS = {"qkv": 3, "o": 1, "gate_up": 2, "down": 1}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# The keys PEFT writes: base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight (an
# adapter name, "lora_A.default.weight", is accepted too).
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\."
                  r"lora_([AB])(?:\.[\w-]+)?\.weight$")


@pytree_class
class LoRALayer:
    qkv_a: torch.Tensor
    qkv_b: torch.Tensor
    o_a: torch.Tensor
    o_b: torch.Tensor
    gate_up_a: torch.Tensor
    gate_up_b: torch.Tensor
    down_a: torch.Tensor
    down_b: torch.Tensor


@pytree_class
class LoRAParams:
    layers: tuple
    max_loras: int = static()
    max_rank: int = static()


def module_shapes(config: ModelConfig, shard: ShardSpec = ShardSpec()
                  ) -> dict[str, tuple[int, int]]:
    """Each target module's (in, out) features on `shard`'s rank: its slice of the column-parallel
    modules' outputs and of the row-parallel ones' inputs (the whole model's at world size 1)."""
    h, d = config.hidden_size, config.head_dim
    i = config.intermediate_size // shard.world_size
    q, kv = shard.num_heads(config) * d, shard.num_kv_heads(config) * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def module_slices(config: ModelConfig, shard: ShardSpec) -> dict[str, tuple[str, int, int]]:
    """module -> (which of its LoRA weights is cut, first, end): the rows of B [out, r] that
    `shard`'s rank holds of a column-parallel module (q / k / v: its heads' rows, gate / up: its
    intermediate rows), the columns of A [r, in] of a row-parallel one (o: its heads' columns,
    down: its intermediate columns), as state/load.py cuts the base weights; the other weight
    is whole on every rank."""
    d = config.head_dim
    q0, q1 = shard.head_range(config)
    k0, k1 = shard.kv_head_range(config)
    i0, i1 = shard.intermediate_range(config)
    return {"q_proj": ("B", q0 * d, q1 * d), "k_proj": ("B", k0 * d, k1 * d),
            "v_proj": ("B", k0 * d, k1 * d), "o_proj": ("A", q0 * d, q1 * d),
            "gate_proj": ("B", i0, i1), "up_proj": ("B", i0, i1), "down_proj": ("A", i0, i1)}


def _part_rows(config: ModelConfig, group: str, shard: ShardSpec) -> list[tuple[int, int]]:
    """The output rows of each part of a group's fused weight (on `shard`'s rank)."""
    shapes = module_shapes(config, shard)
    names = [m for m, (g, _) in MODULES.items() if g == group]
    rows, start = [], 0
    for m in names:
        rows.append((start, start + shapes[m][1]))
        start += shapes[m][1]
    return rows


def init_lora(config: ModelConfig, *, max_loras: int, max_rank: int,
              dtype: torch.dtype, device=None, shard: ShardSpec = ShardSpec()) -> LoRAParams:
    """max_loras empty (zero) slots of rank max_rank for every decoder layer, `shard`'s rank's
    shard of them. A mixture-of-experts config is refused, as the engine's enable_lora refuses
    it: its sparse layers have no dense gate/up/down for the slots' deltas (lora_decoder_layer
    would fail part-way through a forward, with an AttributeError that names nothing)."""
    if config.is_moe:
        raise ValueError(f"init_lora: LoRA on a mixture-of-experts model is not supported "
                         f"(layers {list(config.sparse_layers)} are sparse; dense Qwen3 models "
                         f"only)")
    shapes = module_shapes(config, shard)
    fields = {}
    for group, parts in GROUP_PARTS.items():
        first = next(m for m, (g, _) in MODULES.items() if g == group)
        n_in = shapes[first][0]
        n_out = sum(shapes[m][1] for m, (g, _) in MODULES.items() if g == group)
        width = max_loras * parts * max_rank
        fields[group] = (n_in, n_out, width)

    def layer():
        kw = {}
        for group, (n_in, n_out, width) in fields.items():
            kw[f"{group}_a"] = torch.zeros(width, n_in, dtype=dtype, device=device)
            kw[f"{group}_b"] = torch.zeros(n_out, width, dtype=dtype, device=device)
        return LoRALayer(**kw)

    return LoRAParams(layers=tuple(layer() for _ in range(config.num_layers)),
                      max_loras=max_loras, max_rank=max_rank)


@dataclass(frozen=True, eq=False)
class LoRAAdapter:
    """A PEFT LoRA adapter read and checked against a model (load_adapter). weights: (layer,
    module) -> (A [rank, in], B [out, rank] with the scale folded in), fp32 on the CPU."""

    path: str
    rank: int
    scale: float
    weights: dict = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def _adapter_error(path: str, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {path!r}: {what}")


# PEFT LoraConfig fields that, when set, make an adapter's tensors mean something other than
# W + scale * B @ A on every token: served as plain LoRA they would give other outputs, so they
# are refused (the tensors of some would be refused too, but by a less telling name or shape).
_CHANGED_MEANING = {
    "alora_invocation_tokens": "Activated LoRA: the adapter applies only from its invocation "
                               "tokens on, the tokens before them run the base model",
    "use_qalora": "QA-LoRA: A reads the input pooled over groups of qalora_group_size",
    "use_bdlora": "BD-LoRA: block-diagonal A or B factors",
    "arrow_config": "Arrow: a router mixes LoRA experts per token",
    "lora_bias": "a bias on lora_B",
}


def read_adapter_config(path: str) -> dict:
    """adapter_config.json of a PEFT LoRA directory, checked for what minivllm can serve."""
    if not os.path.isdir(path):
        what = "a file, not a directory" if os.path.exists(path) else "no such directory"
        raise _adapter_error(path, f"{what} (a PEFT adapter directory holds "
                                   f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    cfg_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(cfg_path):
        raise _adapter_error(path, f"no {ADAPTER_CONFIG}")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _adapter_error(path, f"{ADAPTER_CONFIG} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _adapter_error(path, f"{ADAPTER_CONFIG} must hold a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _adapter_error(path, f"peft_type {peft_type!r}: only LoRA adapters are supported")
    if cfg.get("use_dora"):
        raise _adapter_error(path, "DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise _adapter_error(path, f"modules_to_save {cfg['modules_to_save']!r} is not supported "
                                   f"(an adapter may only add LoRA deltas to linear layers)")
    if cfg.get("bias", "none") != "none":
        raise _adapter_error(path, f"bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise _adapter_error(path, "fan_in_fan_out is not supported")
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            raise _adapter_error(path, f"{key} is not supported (one rank and alpha for every "
                                       f"module)")
    if cfg.get("layers_to_transform") is not None or cfg.get("layer_replication"):
        raise _adapter_error(path, "layers_to_transform / layer_replication are not supported")
    for key, what in _CHANGED_MEANING.items():
        if cfg.get(key):
            raise _adapter_error(path, f"{key}={cfg[key]!r} is not supported ({what}; only plain "
                                       f"LoRA, W + scale * B @ A on every token, is)")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", 8)  # PEFT's default alpha
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _adapter_error(path, f"r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _adapter_error(path, f"lora_alpha must be a number, got {alpha!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        if targets != "all-linear":
            # PEFT's regex form: full-matched against module names; the tensors say which.
            try:
                re.compile(targets)
            except re.error as e:
                raise _adapter_error(path, f"target_modules {targets!r} is not a regex ({e})")
    elif isinstance(targets, (list, tuple)) and targets:
        names = [str(t).rsplit(".", 1)[-1] for t in targets]
        bad = sorted(set(n for n in names if n not in MODULES))
        if bad:
            raise _adapter_error(path, f"target_modules {bad} are not supported (LoRA applies to "
                                       f"{', '.join(MODULES)})")
    else:
        raise _adapter_error(path, f"target_modules must be a list of module names or "
                                   f"'all-linear', got {targets!r}")
    return cfg


def load_adapter(path: str, config: ModelConfig, max_rank: int,
                 dtype: torch.dtype | None = None) -> LoRAAdapter:
    """Read and check the PEFT adapter at `path` for a model of `config`: ValueError naming what
    does not fit (a rank above max_rank, a missing file, an unsupported module, DoRA, a tensor of
    the wrong shape, a weight that is not finite, ...). dtype: the slots' (the model's) dtype,
    if given: A and the scaled B must be finite in it too.

    Finite weights are what keeps adapters apart: a row's delta multiplies every slot's B by
    zeros but its own (functional/lora.py), and 0 * inf is nan, so a slot holding an inf or a
    nan would spoil every row of the batch, the base model's too."""
    from safetensors import safe_open

    path = os.path.expanduser(os.fspath(path))  # "~/adapter", as vLLM's get_adapter_absolute_path
    cfg = read_adapter_config(path)
    rank = cfg["r"]
    if rank > max_rank:
        raise _adapter_error(path, f"rank {rank} exceeds max_lora_rank={max_rank}")
    alpha = float(cfg.get("lora_alpha", 8))
    targets = cfg["target_modules"]
    listed = None if isinstance(targets, str) else {str(t).rsplit(".", 1)[-1] for t in targets}
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    if not math.isfinite(scale):
        raise _adapter_error(path, f"lora_alpha {cfg.get('lora_alpha')!r} is not finite")
    limit = torch.finfo(dtype).max if dtype is not None and dtype.is_floating_point else None
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        bins = os.path.isfile(os.path.join(path, "adapter_model.bin"))
        raise _adapter_error(path, f"no {ADAPTER_WEIGHTS}" +
                             (" (adapter_model.bin is not read: save with safetensors)"
                              if bins else ""))
    try:
        handle = safe_open(file, framework="pt", device="cpu")
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
    except Exception as e:  # safetensors raises its own error types
        raise _adapter_error(path, f"cannot read {ADAPTER_WEIGHTS} ({e})") from None
    shapes = module_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _adapter_error(path, f"tensor {key!r} is not a LoRA A/B weight of a decoder "
                                       f"layer's linear module (embeddings, the LM head and "
                                       f"biases are not supported)")
        layer, parent, module, which = int(m[1]), m[2], m[3], m[4]
        if which in parts.get((layer, module), {}):
            # Two names of one weight (lora_A.weight and lora_A.default.weight, or two adapter
            # names in one file): keeping either would silently drop the other.
            raise _adapter_error(path, f"tensor {key!r}: layer {layer}'s {module} has a second "
                                       f"lora_{which} weight (one adapter per directory)")
        if module not in MODULES or _PARENT[module] != parent:
            raise _adapter_error(path, f"tensor {key!r}: module {parent}.{module} is not "
                                       f"supported (LoRA applies to {', '.join(MODULES)})")
        if listed is not None and module not in listed:
            raise _adapter_error(path, f"tensor {key!r}: {module} is not in target_modules "
                                       f"{sorted(listed)}")
        if layer >= config.num_layers:
            raise _adapter_error(path, f"tensor {key!r}: the model has {config.num_layers} layers")
        n_in, n_out = shapes[module]
        want = (rank, n_in) if which == "A" else (n_out, rank)
        if tuple(t.shape) != want:
            raise _adapter_error(path, f"tensor {key!r} has shape {tuple(t.shape)}, expected "
                                       f"{want} (r={rank})")
        if not t.is_floating_point():
            raise _adapter_error(path, f"tensor {key!r} has dtype {t.dtype}, not a float")
        parts.setdefault((layer, module), {})[which] = t.to(torch.float32)
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            missing = "B" if "A" in ab else "A"
            raise _adapter_error(path, f"layer {layer}'s {module} has no lora_{missing} weight")
        a, b = ab["A"].contiguous(), (ab["B"] * scale).contiguous()
        for which, w in (("A", a), ("B", b)):
            big = w.abs().max().item()
            if math.isfinite(big) and (limit is None or big <= limit):
                continue
            what = "holds nan or inf" if not math.isfinite(big) else \
                f"reaches {big:g}{' (times the scale)' if which == 'B' else ''}, past {dtype}"
            raise _adapter_error(path, f"layer {layer}'s {module} lora_{which} {what}: it would "
                                       f"spoil the other adapters' and the base model's rows")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise _adapter_error(path, f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    return LoRAAdapter(path=path, rank=rank, scale=scale, weights=weights)


@torch.no_grad()
def write_slot(lora: LoRAParams, slot: int, adapter: LoRAAdapter | None,
               config: ModelConfig, shard: ShardSpec = ShardSpec()) -> LoRAParams:
    """Put `adapter` (None: nothing, a zero delta) in slot `slot` of every layer, in place, and
    return `lora` (its buffers are donated, as the KV cache's: the tensors keep their addresses,
    so that a captured graph or a compiled function would see the new weights). `lora` is
    `shard`'s rank's (init_lora): only that rank's slice of each weight is copied
    (module_slices)."""
    if not 0 <= slot < lora.max_loras:
        raise ValueError(f"slot {slot} outside [0, {lora.max_loras})")
    R = lora.max_rank
    if adapter is not None and adapter.rank > R:
        raise ValueError(f"adapter rank {adapter.rank} exceeds the slots' rank {R}")
    rows = {g: _part_rows(config, g, shard) for g in GROUP_PARTS}
    cuts = module_slices(config, shard)
    for n, layer in enumerate(lora.layers):
        for group, parts in GROUP_PARTS.items():
            a = getattr(layer, f"{group}_a").view(lora.max_loras, parts, R, -1)
            b = getattr(layer, f"{group}_b")
            b = b.view(b.shape[0], lora.max_loras, parts, R)
            a[slot].zero_()
            b[:, slot].zero_()
        if adapter is None:
            continue
        for module, (group, p) in MODULES.items():
            ab = adapter.weights.get((n, module))
            if ab is None:
                continue
            A, B = ab
            which, c0, c1 = cuts[module]
            if which == "A":
                A = A[:, c0:c1]
            else:
                B = B[c0:c1]
            r = A.shape[0]
            parts = GROUP_PARTS[group]
            a = getattr(layer, f"{group}_a").view(lora.max_loras, parts, R, -1)
            b = getattr(layer, f"{group}_b")
            b = b.view(b.shape[0], lora.max_loras, parts, R)
            lo, hi = rows[group][p]
            a[slot, p, :r].copy_(A)
            b[lo:hi, slot, p, :r].copy_(B)
    return lora
