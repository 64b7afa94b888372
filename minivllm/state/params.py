"""Params: the model's weights as an immutable pytree.

Layout (per rank; `local` sizes are the shard's):
  embed      [vocab_local, hidden]          vocab-parallel rows of the padded vocabulary
  layers     tuple of LayerParams, one per decoder layer
  final_norm [hidden]
  lm_head    [vocab_local, hidden] or None  None when tied to the embedding
  lora       LoRAParams or None             the LoRA adapters' slot weights (state/lora.py), set
                                            only by an engine with enable_lora
LayerParams:
  input_norm [hidden]
  qkv        [(heads + 2 * kv_heads)_local * head_dim, hidden]   q rows, then k rows, then v rows
  q_norm, k_norm [head_dim]
  o_proj     [hidden, heads_local * head_dim]
  post_norm  [hidden]
  gate_up    [2 * intermediate_local, hidden]                     gate rows, then up rows
  down       [hidden, intermediate_local]
  (an AWQ checkpoint's qkv, o_proj, gate_up and down are AwqWeight pytrees of that [out, in]:
  packed int4 weights, zero points and scales; a block-fp8 checkpoint's are Fp8BlockWeight
  pytrees: the fp8 [out, in] weight and its block scales; state/quant.py)
MoELayerParams (a mixture-of-experts layer, config.sparse_layers): the attention fields as above,
and in the MLP's place
  router          [experts, hidden]                               replicated on every rank
  experts_gate_up [experts, 2 * moe_intermediate_local, hidden]   each expert's gate, then up rows
  experts_down    [experts, hidden, moe_intermediate_local]
"""

from __future__ import annotations

import attrs
import torch

from .config import ModelConfig
from .pytree import pytree_class, static
from .quant import (FP8_DTYPE, AwqWeight, Fp8BlockWeight, cat_awq, cat_fp8, pack_awq)
from .shard import ShardSpec

# The LayerParams fields an AWQ checkpoint's linears may fill with an AwqWeight, and a block-fp8
# checkpoint's with an Fp8BlockWeight (state/quant.py), in place of a dense [out, in] tensor.
AWQ_FIELDS = ("qkv", "o_proj", "gate_up", "down")
QUANTIZED_WEIGHTS = (AwqWeight, Fp8BlockWeight)


@pytree_class
class LayerParams:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@pytree_class
class MoELayerParams:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    router: torch.Tensor
    experts_gate_up: torch.Tensor
    experts_down: torch.Tensor


def layer_class(config: ModelConfig, n: int) -> type:
    """The params class of layer n: MoELayerParams for a sparse layer, else LayerParams."""
    return MoELayerParams if config.is_sparse_layer(n) else LayerParams


@pytree_class
class Params:
    embed: torch.Tensor
    layers: tuple
    final_norm: torch.Tensor
    lm_head: torch.Tensor | None
    config: ModelConfig = static()
    shard: ShardSpec = static(factory=ShardSpec)
    # LoRA slot weights (state/lora.LoRAParams), or None: no adapters, and then no extra leaf
    # (a None child is not a leaf of the pytree) and exactly the forward without LoRA.
    lora: object = None

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed if self.lm_head is None else self.lm_head

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device


def expected_shapes(config: ModelConfig, shard: ShardSpec) -> dict[str, tuple[int, ...]]:
    """The per-rank shape of every LayerParams field and top-level tensor."""
    h, d = config.hidden_size, config.head_dim
    nq, nkv = shard.num_heads(config), shard.num_kv_heads(config)
    i0, i1 = shard.intermediate_range(config)
    m0, m1 = shard.moe_intermediate_range(config)
    e = config.num_experts
    v0, v1 = shard.vocab_range(config)
    return {
        "embed": (v1 - v0, h),
        "final_norm": (h,),
        "lm_head": (v1 - v0, h),
        "input_norm": (h,),
        "qkv": ((nq + 2 * nkv) * d, h),
        "q_norm": (d,),
        "k_norm": (d,),
        "o_proj": (h, nq * d),
        "post_norm": (h,),
        "gate_up": (2 * (i1 - i0), h),
        "down": (h, i1 - i0),
        "router": (e, h),
        "experts_gate_up": (e, 2 * (m1 - m0), h),
        "experts_down": (e, h, m1 - m0),
    }


def has_awq(params: Params) -> bool:
    """Whether any layer's linear is an AwqWeight (an AWQ checkpoint's)."""
    return any(isinstance(getattr(lp, f, None), AwqWeight) for lp in params.layers
               for f in AWQ_FIELDS)


def has_quantized(params: Params) -> bool:
    """Whether any layer's linear is an AwqWeight or an Fp8BlockWeight (a quantized checkpoint's,
    kept quantized): the kernels that multiply 16-bit dense weights themselves (the persistent
    decode layer, the fused MLP) are then off."""
    return any(isinstance(getattr(lp, f, None), QUANTIZED_WEIGHTS) for lp in params.layers
               for f in AWQ_FIELDS)


def check_layer_count(params: Params) -> None:
    """ValueError unless params holds a layer for each of its config's (what forward checks at
    every step; a zip over fewer layers would run them without a word)."""
    if len(params.layers) != params.config.num_layers:
        raise ValueError(f"params has {len(params.layers)} layers, its config "
                         f"{params.config.num_layers}")


def check_params(params: Params) -> None:
    """TypeError/ValueError naming what in `params` does not fit its config and shard: the layer
    count, a tensor's shape, a dtype other than the embedding's float dtype, another device.
    load and random_params make Params that pass; one built by hand or through attrs.evolve may
    not (forward, per step, checks only the layer count)."""
    if not isinstance(params, Params):
        raise TypeError(f"params must be a Params (minivllm.load, random_params), got "
                        f"{type(params).__name__}")
    config = params.config
    check_layer_count(params)
    shapes = expected_shapes(config, params.shard)
    named = [(name, getattr(params, name)) for name in ("embed", "final_norm", "lm_head")]
    for i, layer in enumerate(params.layers):
        cls = layer_class(config, i)
        if type(layer) is not cls:
            why = " (the config makes it a mixture-of-experts layer)" \
                if cls is MoELayerParams else ""
            raise TypeError(f"params.layers[{i}] must be a {cls.__name__}, got "
                            f"{type(layer).__name__}{why}")
        named += [(f"layers[{i}].{f.name}", getattr(layer, f.name))
                  for f in attrs.fields(cls)]
    for name, t in named:
        if t is None and name == "lm_head":
            if not config.tie_word_embeddings:
                raise ValueError("params.lm_head is None but the config's embeddings are untied")
            continue
        field = name.rsplit(".", 1)[-1]
        if isinstance(t, QUANTIZED_WEIGHTS) and field in AWQ_FIELDS:
            t.check(f"params.{name}")
            what = "an AWQ" if isinstance(t, AwqWeight) else "a block-fp8"
            if tuple(t.shape) != shapes[field]:
                raise ValueError(f"params.{name} is {what} weight of shape {tuple(t.shape)}, "
                                 f"expected {shapes[field]}")
            if any(leaf.device != params.device
                   for leaf in torch.utils._pytree.tree_leaves(t)):
                raise ValueError(f"params.{name} is on {t.device}, the embedding on "
                                 f"{params.device}: one device throughout")
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"params.{name} must be a tensor, got {type(t).__name__}")
        if name == "embed" and not t.is_floating_point():  # the dtype every weight must share
            raise ValueError(f"params.embed has dtype {t.dtype}: weights are float")
        want = shapes[name.rsplit(".", 1)[-1]]
        if tuple(t.shape) != want:
            raise ValueError(f"params.{name} has shape {tuple(t.shape)}, expected {want}")
        if t.dtype != params.dtype or t.device != params.device:
            raise ValueError(f"params.{name} is {t.dtype} on {t.device}, the embedding "
                             f"{params.dtype} on {params.device}: one dtype and device throughout")


# random_params(quantization=...): the decoder linears as the engine holds an AWQ checkpoint's
# (Qwen/Qwen3-*-AWQ: 4-bit, group 128) or a block-fp8 one's (Qwen/Qwen3-*-FP8: [128, 128] blocks).
RANDOM_QUANTIZATIONS = ("awq", "fp8")
RANDOM_AWQ_GROUP = 128
RANDOM_FP8_BLOCK = (128, 128)


def random_quantized_linear(quantization: str, out_features: int, in_features: int,
                            gen: torch.Generator, device: torch.device,
                            std: float = 0.02) -> AwqWeight | Fp8BlockWeight:
    """A random [out, in] linear as the engine holds a quantized checkpoint's, on `device`,
    its dequantized elements of about `std`: "awq" an AwqWeight (random 4-bit values and zero
    points, packed with pack_awq, fp16 scales, RANDOM_AWQ_GROUP input rows a group); "fp8" an
    Fp8BlockWeight (random float8_e4m3fn values, float32 scales, RANDOM_FP8_BLOCK blocks)."""
    if quantization == "awq":
        group = RANDOM_AWQ_GROUP
        if in_features % group or out_features % 8:
            raise ValueError(f"an AWQ weight of [{out_features}, {in_features}]: its inputs must "
                             f"be whole groups of {group} and its outputs whole int32s of 8")
        groups = in_features // group
        q = torch.randint(0, 16, (in_features, out_features), generator=gen, device=device)
        z = torch.randint(0, 16, (groups, out_features), generator=gen, device=device)
        # (q - z) of two uniform 4-bit values has a standard deviation of about 6.5
        scales = torch.rand(groups, out_features, generator=gen, device=device).add_(0.5)
        return AwqWeight(qweight=pack_awq(q), qzeros=pack_awq(z),
                         scales=scales.mul_(std / 6.5).to(torch.float16), group_size=group)
    if quantization == "fp8":
        bn, bk = RANDOM_FP8_BLOCK
        # values of standard deviation 64 (e4m3's range is +-448), scales that bring them to std
        w = torch.randn(out_features, in_features, generator=gen, device=device)
        w = w.mul_(64).clamp_(-448, 448).to(FP8_DTYPE)
        scale = torch.rand(-(-out_features // bn), -(-in_features // bk), generator=gen,
                           device=device).add_(0.5).mul_(std / 64)
        return Fp8BlockWeight(weight=w, scale_inv=scale, block=RANDOM_FP8_BLOCK)
    raise ValueError(f"quantization {quantization!r} is not one of {RANDOM_QUANTIZATIONS}")


def _merge_quantized(parts: list, what: str):
    """QKV or gate/up parts merged as state/load.py merges a checkpoint's (cat_awq, cat_fp8)."""
    if isinstance(parts[0], AwqWeight):
        return cat_awq(parts)
    merged = cat_fp8(parts)
    if merged is None:  # load would dequantize it: no fp8 weight to measure
        raise ValueError(f"{what}: parts of {[p.out_features for p in parts]} rows cut "
                         f"{list(RANDOM_FP8_BLOCK)} fp8 blocks, so a checkpoint's would load "
                         f"dequantized")
    return merged


def random_params(config: ModelConfig, *, seed: int = 0, dtype: torch.dtype | str | None = None,
                  device: torch.device | str | None = None, shard: ShardSpec | None = None,
                  std: float = 0.02, quantization: str | None = None) -> Params:
    """Synthetic weights at the config's real shapes (benchmarks, tests). Norm weights are near 1
    so that activations keep a realistic scale; every rank of a shard spec draws the same full
    tensors and keeps its slice, so TP=N equals TP=1 for the same seed.

    quantization "awq" or "fp8": the decoder linears (qkv, o_proj, gate_up, down) as the engine
    holds an AWQ or a block-fp8 checkpoint's (random_quantized_linear; q/k/v and gate/up merged
    as load merges them), for benchmarks of those paths; each rank draws its own slice's shape
    (the weights of TP=N are not TP=1's). Dense models only."""
    from .config import parse_dtype

    shard = shard or ShardSpec()
    shard.check(config)
    if quantization is not None:
        if quantization not in RANDOM_QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r} is not one of "
                             f"{RANDOM_QUANTIZATIONS}")
        if config.is_moe:
            raise ValueError(f"random {quantization} weights are for dense models; this one's "
                             f"layers are mixtures of experts")
    dtype = parse_dtype(dtype, config.dtype)
    # Drawn on the target device (an 8B model's weights take minutes on a CPU): the same seed
    # gives the same weights on the same kind of device, whatever the shard.
    draw_device = torch.device(device) if device is not None else torch.device("cpu")
    gen = torch.Generator(draw_device).manual_seed(seed)
    h, d, v = config.hidden_size, config.head_dim, config.vocab_size

    def normal(*shape):
        return torch.randn(*shape, generator=gen, device=draw_device, dtype=torch.float32).mul_(std)

    def norm_weight(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen, device=draw_device)

    def put(t):
        return t.to(dtype=dtype, device=device).contiguous()

    q0, q1 = shard.head_range(config)
    k0, k1 = shard.kv_head_range(config)
    i0, i1 = shard.intermediate_range(config)
    m0, m1 = shard.moe_intermediate_range(config)
    v0, v1 = shard.vocab_range(config)

    def vocab_slice(w):  # w: [vocab, hidden] -> this rank's rows of the padded vocabulary
        padded = torch.zeros(shard.padded_vocab(config), h, device=draw_device)
        padded[:v] = w
        return padded[v0:v1]

    embed = normal(v, h)
    if quantization is not None:
        return _random_quantized_params(config, quantization, embed, normal, norm_weight, put,
                                        vocab_slice, gen, draw_device, device, shard, std)
    layers = []
    for n in range(config.num_layers):
        wq = normal(config.num_heads * d, h).view(config.num_heads, d, h)
        wk = normal(config.num_kv_heads * d, h).view(config.num_kv_heads, d, h)
        wv = normal(config.num_kv_heads * d, h).view(config.num_kv_heads, d, h)
        wo = normal(h, config.num_heads * d).view(h, config.num_heads, d)
        qkv = torch.cat([wq[q0:q1].reshape(-1, h), wk[k0:k1].reshape(-1, h), wv[k0:k1].reshape(-1, h)])
        sparse = config.is_sparse_layer(n)
        if sparse:
            e, m = config.num_experts, config.moe_intermediate_size
            # The router drawn wider than the rest, so that routing is decided by more than noise.
            router = normal(e, h).mul_(10)
            wg, wu, wd = normal(e, m, h), normal(e, m, h), normal(e, h, m)
        else:  # drawn before the norms, as they always were: a seed's dense weights unchanged
            wg = normal(config.intermediate_size, h)
            wu = normal(config.intermediate_size, h)
            wd = normal(h, config.intermediate_size)
        attention = dict(input_norm=put(norm_weight(h)), qkv=put(qkv), q_norm=put(norm_weight(d)),
                         k_norm=put(norm_weight(d)), o_proj=put(wo[:, q0:q1].reshape(h, -1)),
                         post_norm=put(norm_weight(h)))
        if sparse:
            layers.append(MoELayerParams(
                **attention, router=put(router),
                experts_gate_up=put(torch.cat([wg[:, m0:m1], wu[:, m0:m1]], dim=1)),
                experts_down=put(wd[:, :, m0:m1])))
        else:
            layers.append(LayerParams(**attention, gate_up=put(torch.cat([wg[i0:i1], wu[i0:i1]])),
                                      down=put(wd[:, i0:i1])))
    final_norm = norm_weight(h)
    lm_head = None if config.tie_word_embeddings else put(vocab_slice(normal(v, h)))
    return Params(embed=put(vocab_slice(embed)), layers=tuple(layers), final_norm=put(final_norm),
                  lm_head=lm_head, config=config, shard=shard)


def _random_quantized_params(config, quantization, embed, normal, norm_weight, put, vocab_slice,
                             gen, draw_device, device, shard, std) -> Params:
    """random_params' quantized layers: this rank's linears drawn quantized at their local
    shapes, the norms and the embedding / head as the dense draw makes them."""
    h, d = config.hidden_size, config.head_dim
    q0, q1 = shard.head_range(config)
    k0, k1 = shard.kv_head_range(config)
    i0, i1 = shard.intermediate_range(config)

    def linear(out_features, in_features):
        w = random_quantized_linear(quantization, out_features, in_features, gen, draw_device,
                                    std)
        return torch.utils._pytree.tree_map(lambda t: t.to(device).contiguous(), w)

    layers = []
    for n in range(config.num_layers):
        where = f"layer {n}"
        qkv = _merge_quantized([linear((q1 - q0) * d, h), linear((k1 - k0) * d, h),
                                linear((k1 - k0) * d, h)], f"{where} qkv")
        gate_up = _merge_quantized([linear(i1 - i0, h), linear(i1 - i0, h)], f"{where} gate_up")
        layers.append(LayerParams(
            input_norm=put(norm_weight(h)), qkv=qkv, q_norm=put(norm_weight(d)),
            k_norm=put(norm_weight(d)), o_proj=linear(h, (q1 - q0) * d),
            post_norm=put(norm_weight(h)), gate_up=gate_up, down=linear(h, i1 - i0)))
    final_norm = norm_weight(h)
    v = config.vocab_size
    lm_head = None if config.tie_word_embeddings else put(vocab_slice(normal(v, h)))
    return Params(embed=put(vocab_slice(embed)), layers=tuple(layers), final_norm=put(final_norm),
                  lm_head=lm_head, config=config, shard=shard)
