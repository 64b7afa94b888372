"""Block-fp8 checkpoints in the layout of Qwen's official Qwen3-*-FP8 (config.json's
quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
"weight_block_size": [128, 128]}; each decoder linear's `X.weight` float8_e4m3fn [out, in] with a
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)]; embeddings, norms and the LM head bf16).

The checkpoints here are tiny random Qwen3s written by transformers, whose linear weights this
file quantizes itself (quantize_blocks: per 128 x 128 block, scale_inv = absmax / 448, the block
divided by it and cast to float8_e4m3fn), at sizes that are not multiples of 128 (hidden 320:
blocks of 128, 128 and 64 columns; intermediate 200: 128 and 72 rows; q 192 rows; k/v 96) so
that the edge blocks are partial, and so that a tensor-parallel boundary (q rows 96, k/v rows 48,
intermediate 100) falls inside a block. They check:
  1. minivllm's loaded weights equal an independent, block-by-block dequantization exactly
     (bf16 by default, the checkpoint's unquantized dtype; float32 on request; float32, bfloat16
     and float16 scales);
  2. the engine's greedy tokens and logprobs equal transformers':
     a. transformers' own fp8 loader (FineGrainedFP8Config(dequantize=True): its Fp8Dequantize,
        the path it takes without a GPU) on a checkpoint whose dimensions are multiples of 128:
        there its weights equal minivllm's exactly;
     b. on the partial-block checkpoint, transformers run in float32 on a checkpoint holding the
        independent dequantization: transformers 5.25's own fp8 loader is wrong there (its
        Fp8Dequantize derives the block from the scale grid, rows // scale_rows: a 200-row
        weight with 2 scale rows is dequantized in blocks of 100 rows, not 128 and 72), while
        its GPU kernels, vLLM and DeepSeek-V3's reference dequantization index scale
        [i // 128, j // 128] as minivllm does;
  3. tensor parallelism: each rank's slices (2 and 4 ranks) are exactly the TP=1 weights'; TP=2
     over gloo gives TP=1's logits and greedy tokens;
  4. quantization configs minivllm cannot load (8-bit AWQ, GPTQ, per-tensor fp8, static activation
     scales, e5m2, UE8M0 scales, fp8 embeddings) and a missing, mis-shaped or mistyped
     weight_scale_inv are refused with an error naming them before any weight is read.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

import minivllm
from minivllm import CheckpointError, LLM, SamplingParams, ShardSpec
from minivllm.runtime.config import EngineConfig
from minivllm.state import ModelConfig
from minivllm.state import load as load_mod
from minivllm.state.quant import Fp8BlockQuantization, dequantize_fp8_blocks

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint
from test_load_audit import _count_reads
from tp_worker import _free_port, _run, _worker

BLOCK = (128, 128)
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Partial edge blocks everywhere, several blocks across some dimensions (q_proj [192, 320]: 2 x 3
# blocks; gate/up [200, 320]: 2 x 3; down [320, 200]: 3 x 2), and TP=2 boundaries inside blocks.
EDGE = dict(hidden_size=320, intermediate_size=200, num_attention_heads=4, num_key_value_heads=2,
            head_dim=48)
# Every quantized dimension a multiple of 128: where transformers' own fp8 loader is right.
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2,
               head_dim=64)


# --- the independent quantizer and dequantizer ------------------------------------------------

def quantize_blocks(w: torch.Tensor, block=BLOCK):
    """w [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/bn), ceil(in/bk)]): each
    block (partial at the edges) divided by its absmax / 448 and cast to e4m3."""
    bn, bk = block
    w = w.float()
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale_inv = torch.empty(math.ceil(rows / bn), math.ceil(cols / bk))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale_inv[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (tile / s).clamp(-448, 448).to(q.dtype)
    return q, scale_inv


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor, block=BLOCK) -> torch.Tensor:
    """float32: each block of q times its own scale, block by block."""
    bn, bk = block
    out = q.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= scale_inv[i, j].float()
    return out


def write_fp8_checkpoint(path, *, seed=0, dtype=torch.bfloat16, scale_dtype=torch.float32,
                         skip=(), quant_config=None, **dims):
    """A tiny random Qwen3 (untied head) saved by transformers, its decoder linears (but those
    whose module name starts with an entry of `skip`) rewritten as block fp8, the other tensors
    as `dtype`, config.json given the quantization_config. Returns (path, reference): reference
    maps each tensor name to the float32 weight it stands for (the dequantized one for fp8)."""
    path = save_checkpoint(make_hf_model(seed=seed, **dims), path)
    file = os.path.join(path, "model.safetensors")
    out, reference = {}, {}
    for name, t in load_file(file).items():
        module = name.removesuffix(".weight")
        if module.endswith(LINEARS) and not module.startswith(tuple(skip)):
            q, s = quantize_blocks(t)
            s = s.to(scale_dtype)
            out[name], out[name + "_scale_inv"] = q, s
            reference[name] = dequantize_blocks(q, s)
        else:
            out[name] = t.to(dtype)
            reference[name] = out[name].float()
    save_file(out, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = dict(FP8_CONFIG if quant_config is None else quant_config)
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    return path, reference


def merged(reference, layer: int, prefix="model."):
    """The reference weights of one layer, merged as minivllm's Params hold them."""
    p = f"{prefix}layers.{layer}."
    r = {k.removeprefix(p): v for k, v in reference.items() if k.startswith(p)}
    return {"qkv": torch.cat([r["self_attn.q_proj.weight"], r["self_attn.k_proj.weight"],
                              r["self_attn.v_proj.weight"]]),
            "o_proj": r["self_attn.o_proj.weight"],
            "gate_up": torch.cat([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
            "down": r["mlp.down_proj.weight"],
            "input_norm": r["input_layernorm.weight"],
            "post_norm": r["post_attention_layernorm.weight"],
            "q_norm": r["self_attn.q_norm.weight"], "k_norm": r["self_attn.k_norm.weight"]}


def as_dense(t, dtype):
    """A loaded linear as a dense tensor: an Fp8BlockWeight (kept in fp8, test_fp8_weights.py)
    dequantized by dequantize_blocks, the independent dequantizer, and cast to `dtype`."""
    from minivllm.state.quant import Fp8BlockWeight

    if isinstance(t, Fp8BlockWeight):
        return dequantize_blocks(t.weight.cpu(), t.scale_inv.cpu(), t.block).to(dtype)
    return t


def assert_params_equal(params, reference, dtype):
    """Every tensor of `params` equals the reference, cast to `dtype`, exactly (a linear kept in
    fp8: its dequantization)."""
    assert params.dtype == dtype
    for n, layer in enumerate(params.layers):
        for field, want in merged(reference, n).items():
            got, want = as_dense(getattr(layer, field), dtype), want.to(dtype)
            assert torch.equal(got, want), \
                f"layer {n} {field}: max |diff| {(got.float() - want.float()).abs().max()}"
    vocab = reference["model.embed_tokens.weight"].shape[0]
    assert torch.equal(params.embed[:vocab], reference["model.embed_tokens.weight"].to(dtype))
    assert torch.equal(params.lm_head[:vocab], reference["lm_head.weight"].to(dtype))
    assert torch.equal(params.final_norm, reference["model.norm.weight"].to(dtype))


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """The official layout (bf16 unquantized tensors, float32 scales), partial edge blocks."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8") / "edge", seed=1, **EDGE)


# --- 1. the loaded weights ---------------------------------------------------------------------

def test_checkpoint_is_in_the_official_layout(edge):
    """What the loader is tested on: fp8 e4m3 weights, [ceil(out/128), ceil(in/128)] scales, the
    rest bf16; the quantizer's error is e4m3's (3 mantissa bits: at most 1/16 of a value)."""
    path, reference = edge
    sd = load_file(os.path.join(path, "model.safetensors"))
    p = "model.layers.0.mlp.gate_proj."
    w, s = sd[p + "weight"], sd[p + "weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (200, 320)
    assert s.dtype == torch.float32 and s.shape == (2, 3)
    assert sd["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (3, 2)
    assert sd["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (2, 3)
    assert sd["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 3)
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert not any(k.startswith(("lm_head", "model.embed")) and "scale" in k for k in sd)
    original = make_hf_model(seed=1, **EDGE).state_dict()["model.layers.0.mlp.gate_proj.weight"]
    assert (reference["model.layers.0.mlp.gate_proj.weight"] - original).abs().max() <= \
        original.abs().max() / 16


def test_loaded_weights_equal_the_independent_dequantization(edge):
    """Default dtype: bf16, the checkpoint's unquantized dtype (config.json's); float32 on request
    holds the float32 products themselves. Every tensor equals the block-by-block dequantization
    exactly: a block grid read any other way (blocks of rows // scale_rows, say) fails here."""
    path, reference = edge
    assert_params_equal(minivllm.load(path), reference, torch.bfloat16)
    assert EngineConfig.create(path, device="cpu").dtype == torch.bfloat16  # LLM(path)'s too
    assert_params_equal(minivllm.load(path, dtype="float32"), reference, torch.float32)
    assert_params_equal(minivllm.load(path, dtype="float16"), reference, torch.float16)
    if torch.cuda.is_available():  # bound for a GPU, the GPU dequantizes: the same products
        on_gpu = minivllm.load(path, device="cuda", shard=ShardSpec(rank=1, world_size=2))
        on_cpu = minivllm.load(path, shard=ShardSpec(rank=1, world_size=2))
        for got, want in zip(torch.utils._pytree.tree_leaves(on_gpu),
                             torch.utils._pytree.tree_leaves(on_cpu)):
            if got.dtype == torch.float8_e4m3fn:  # a weight kept in fp8: compare its bytes
                got, want = got.view(torch.uint8), want.view(torch.uint8)
            assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_bf16_and_fp16_scales(tmp_path, scale_dtype):
    """Some Qwen3 FP8 checkpoints store weight_scale_inv as bf16 or fp16: widened exactly."""
    path, reference = write_fp8_checkpoint(tmp_path / "ckpt", seed=2, scale_dtype=scale_dtype,
                                           **EDGE)
    assert load_file(os.path.join(path, "model.safetensors"))[
        "model.layers.1.mlp.up_proj.weight_scale_inv"].dtype == scale_dtype
    assert_params_equal(minivllm.load(path, dtype="float32"), reference, torch.float32)


def test_modules_to_not_convert_stay_unquantized(tmp_path):
    """A module modules_to_not_convert names (transformers' matching: a prefix up to a module
    boundary, a regex, or a suffix) is stored unquantized, without scales, and loads as it is."""
    config = dict(FP8_CONFIG, modules_to_not_convert=["lm_head", "model.layers.1.mlp",
                                                      r"model\.layers\.\d+\.self_attn\.o_proj"])
    path, reference = write_fp8_checkpoint(
        tmp_path / "ckpt", seed=3, quant_config=config, dtype=torch.float32,
        skip=("model.layers.1.mlp", "model.layers.0.self_attn.o_proj",
              "model.layers.1.self_attn.o_proj"), **EDGE)
    sd = load_file(os.path.join(path, "model.safetensors"))
    assert sd["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32
    assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert_params_equal(minivllm.load(path), reference, torch.float32)


@pytest.mark.parametrize("pattern", ["lm_head", "model.layers.1", "model.layers.1.mlp", "mlp",
                                     "down_proj", "up_proj", "mlp.gate", r"model\.layers\.\d+\.mlp",
                                     "model.layers.*.self_attn", "layers.1", "self_attn.o_proj"])
def test_modules_to_not_convert_matches_as_transformers(pattern):
    """Which modules a modules_to_not_convert entry keeps unquantized: transformers' own
    should_convert_module decides the same for every decoder linear (a prefix up to a module
    boundary, a regex, a suffix: "mlp" alone matches none of them, "model.layers.1" not layer
    11's)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    if not should_convert_module("model.layers.11.mlp.up_proj", ["model.layers.1"]):
        pytest.skip("this transformers (5.17, the GPU machine's) matches a pattern as a bare "
                    "prefix: 'model.layers.1' skips layer 11's modules too; minivllm follows "
                    "5.25's module boundary")
    quant = Fp8BlockQuantization(block=BLOCK, modules_to_not_convert=(pattern,))
    names = [f"model.layers.{n}.{linear}" for n in (0, 1, 11) for linear in LINEARS]
    got = [quant.quantizes(name) for name in names]
    assert got == [should_convert_module(name, [pattern]) for name in names]


def test_dequantize_in_chunks_equals_whole():
    """dequantize_fp8_blocks works through the rows a few blocks at a time (float32 temporaries
    of ~chunk_elements): any chunking gives the same tensor, partial edge blocks included."""
    g = torch.Generator().manual_seed(0)
    q, s = quantize_blocks(torch.randn(300, 200, generator=g))
    want = dequantize_blocks(q, s)
    for chunk in (1, 128 * 200, 3 * 128 * 200, 1 << 22):
        assert torch.equal(dequantize_fp8_blocks(q, s, BLOCK, torch.float32, chunk_elements=chunk),
                           want)
    assert torch.equal(dequantize_fp8_blocks(q, s, BLOCK, torch.bfloat16), want.bfloat16())
    with pytest.raises(ValueError, match=r"\(3, 1\).*expected \(3, 2\)"):
        dequantize_fp8_blocks(q, s[:, :1], BLOCK, torch.float32)


# --- 2. the engine against transformers --------------------------------------------------------

def hf_greedy(model, prompt, n):
    """transformers' greedy tokens and each step's log-softmax, recomputing the whole sequence."""
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            out.append(int(logits.argmax()))
            logprobs.append(torch.log_softmax(logits, -1))
            ids.append(out[-1])
    return out, logprobs


PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55], [90, 34, 2, 2, 18, 76, 43, 21, 9, 10, 5]]
MAX_TOKENS = 8


def assert_engine_matches(path, hf_model, device):
    """The engine (float32) on the fp8 checkpoint: transformers' greedy tokens, and its top-5
    logprobs at every step within 1e-4."""
    with make_llm(path, device, dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                           logprobs=5), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert len(set(t for seq in tokens for t in seq)) > 3  # the outputs vary: a real comparison
    for prompt, out in zip(PROMPTS, outs):
        want_ids, want_lps = hf_greedy(hf_model, prompt, MAX_TOKENS)
        c = out.outputs[0]
        assert c.token_ids == want_ids
        for entry, ref in zip(c.logprobs, want_lps):
            assert set(entry) == set(ref.topk(5).indices.tolist())
            for i, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[i].item(), abs=1e-4)


def test_engine_equals_transformers_own_fp8_loader(tmp_path, device, monkeypatch):
    """transformers' own loader of the fp8 checkpoint (its Fp8Dequantize; it takes this path on a
    machine without a GPU, and dequantize=True takes it everywhere) on dimensions that are
    multiples of 128. transformers checks that accelerate is installed before it loads an fp8
    checkpoint, although its dequantize path does not use it: the check is patched out."""
    from transformers import FineGrainedFP8Config, Qwen3ForCausalLM
    import transformers.quantizers.quantizer_finegrained_fp8 as hf_fp8

    monkeypatch.setattr(hf_fp8, "is_accelerate_available", lambda: True)
    path, reference = write_fp8_checkpoint(tmp_path / "aligned", seed=4, **ALIGNED)
    dequantize = FineGrainedFP8Config(dequantize=True)
    hf32 = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                            quantization_config=dequantize).eval()
    hf_default = Qwen3ForCausalLM.from_pretrained(path, quantization_config=dequantize)
    assert hf_default.dtype == torch.bfloat16  # its default: the checkpoint's dtype, as ours
    for hf, params in ((hf32, minivllm.load(path, dtype="float32")),
                       (hf_default, minivllm.load(path))):
        hf_weights = {k: v.float() for k, v in hf.state_dict().items()}
        assert_params_equal(params, hf_weights, params.dtype)
    assert_params_equal(minivllm.load(path, dtype="float32"), reference, torch.float32)
    assert_engine_matches(path, hf32, device)


def test_engine_equals_transformers_on_the_dequantized_weights(edge, device, tmp_path):
    """Partial edge blocks: transformers (float32) on a checkpoint holding the independent
    dequantization, since its own fp8 loader reads these blocks wrong (see the module's
    docstring)."""
    from transformers import Qwen3ForCausalLM

    path, reference = edge
    hf = make_hf_model(seed=1, **EDGE)
    hf.load_state_dict(reference)
    hf = Qwen3ForCausalLM.from_pretrained(save_checkpoint(hf, tmp_path / "dequantized"),
                                          dtype=torch.float32).eval()
    assert_engine_matches(path, hf, device)


# --- 3. tensor parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_are_slices_of_the_whole(edge, world_size):
    """Each rank dequantizes the whole blocks that hold its slice and keeps the slice: at 2 ranks
    q rows (and o_proj columns) split at 96, k/v rows at 48, the MLP at 100, inside the first
    block; at 4 ranks q at 48, 96 and 144 (one k/v head per rank, replicated) and the MLP at 50,
    100 and 150. Every slice equals the TP=1 tensor's exactly."""
    path, _ = edge
    full = minivllm.load(path)
    d, nq, nkv = EDGE["head_dim"], EDGE["num_attention_heads"], EDGE["num_key_value_heads"]
    inter = EDGE["intermediate_size"]
    for rank in range(world_size):
        part = minivllm.load(path, shard=ShardSpec(rank=rank, world_size=world_size))
        q = slice(rank * nq // world_size * d, (rank + 1) * nq // world_size * d)
        kv_heads = max(1, nkv // world_size)
        k0 = (rank * kv_heads if nkv >= world_size else rank * nkv // world_size) * d
        kv = slice(k0, k0 + kv_heads * d)
        i = slice(rank * inter // world_size, (rank + 1) * inter // world_size)
        for layer, whole in zip(part.layers, full.layers):
            dt = torch.bfloat16
            wq, wk, wv = as_dense(whole.qkv, dt).split([nq * d, nkv * d, nkv * d])
            assert torch.equal(as_dense(layer.qkv, dt), torch.cat([wq[q], wk[kv], wv[kv]]))
            assert torch.equal(as_dense(layer.o_proj, dt), as_dense(whole.o_proj, dt)[:, q])
            wg, wu = as_dense(whole.gate_up, dt).split([inter, inter])
            assert torch.equal(as_dense(layer.gate_up, dt), torch.cat([wg[i], wu[i]]))
            assert torch.equal(as_dense(layer.down, dt), as_dense(whole.down, dt)[:, i])


def test_tp2_equals_tp1(tmp_path):
    """TP=2 over gloo on the fp8 checkpoint (its unquantized tensors float32, so that the
    comparison is at float32's rounding): TP=1's logits, eager and compiled, and greedy tokens.
    Each rank also loads it through the engine's runner (tp_worker._kv_blocks)."""
    path, _ = write_fp8_checkpoint(tmp_path / "fp8", seed=5, dtype=torch.float32, **EDGE)
    ref_logits, ref_compiled, ref_tokens = _run(path, 0, 1)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), ["fp8"]), nprocs=2,
                       join=True, start_method="spawn")
    assert len(set(t for seq in ref_tokens for t in seq)) > 3
    for rank in range(2):
        got = torch.load(tmp_path / f"fp8.rank{rank}.pt")
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["compiled_logits"], ref_compiled, rtol=1e-5, atol=1e-5)
        assert got["tokens"] == ref_tokens, f"rank {rank}"


# --- 4. what is refused, before any weight is read ---------------------------------------------


@pytest.fixture
def ckpt(edge, tmp_path):
    """A copy of the fp8 checkpoint to break."""
    return shutil.copytree(edge[0], tmp_path / "ckpt")


def _set_quant(path, quant):
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = quant
    json.dump(cfg, open(cfg_path, "w"))


def _rewrite(path, edit):
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    edit(sd)
    save_file(sd, file, metadata={"format": "pt"})


UNSUPPORTED = [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "zero_point": True},
     "bits 8"),  # AWQ loads (test_awq.py), 4-bit only
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
     "quant_method 'gptq'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"},
     "quant_method 'compressed-tensors'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
    ({"bits": 4}, "quant_method None"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
     r"quant_method .fp8. without weight_block_size \(per-tensor"),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     "quant_method .fp8. without weight_block_size"),
    (dict(FP8_CONFIG, activation_scheme="static"), "activation_scheme 'static'"),
    (dict(FP8_CONFIG, fmt="e5m2"), "fmt 'e5m2'"),
    (dict(FP8_CONFIG, scale_fmt="ue8m0"), "scale_fmt 'ue8m0'"),
    (dict(FP8_CONFIG, weight_block_size=[128]), r"weight_block_size \[128\]"),
    (dict(FP8_CONFIG, weight_block_size=[0, 128]), r"weight_block_size \[0, 128\]"),
    (dict(FP8_CONFIG, weight_block_size="128"), "weight_block_size '128'"),
    (dict(FP8_CONFIG, modules_to_convert=["model.embed_tokens"]), "modules_to_convert.*embeddings"),
    (dict(FP8_CONFIG, modules_to_not_convert="lm_head"), "modules_to_not_convert 'lm_head'"),
    ("fp8", r"'fp8' \(not a JSON object\)"),
]


@pytest.mark.parametrize("quant,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_quantization_is_refused_before_reading(ckpt, monkeypatch, quant, message):
    _set_quant(ckpt, quant)
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"quantization_config {message}.*not supported"):
        minivllm.load(ckpt)
    assert reads == []
    with pytest.raises(ValueError, match=rf"quantization_config {message}.*not supported"):
        ModelConfig.from_json(ckpt)


def test_unsupported_quantization_is_refused_by_the_engine(ckpt, monkeypatch):
    """LLM(...) refuses it when it reads config.json, before any process starts or weight loads;
    so does load() when it is given a config (the engine's runners pass theirs)."""
    config = ModelConfig.from_json(ckpt)
    _set_quant(ckpt, {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        LLM(str(ckpt), device="cpu")
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        minivllm.load(ckpt, config=config)
    assert reads == []


def test_missing_scale_is_named_before_reading(ckpt, monkeypatch):
    name = "model.layers.1.mlp.down_proj.weight_scale_inv"
    _rewrite(ckpt, lambda sd: sd.pop(name))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {name}: the block scales"):
        minivllm.load(ckpt)
    assert reads == []


@pytest.mark.parametrize("shape", [(1, 3), (2, 2), (3, 3), (6,)])
def test_misshaped_scale_is_named_before_reading(ckpt, monkeypatch, shape):
    """gate_proj [200, 320] has a 2 x 3 grid: floor division (1 row) or another block size is
    refused, naming the scale, its shape, the grid and the weight."""
    name = "model.layers.0.mlp.gate_proj.weight_scale_inv"
    _rewrite(ckpt, lambda sd: sd.__setitem__(name, torch.ones(shape)))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{name} has shape {re.escape(str(shape))}, "
                                              rf"expected \(2, 3\) \(one scale per \[128, 128\] "
                                              rf"block of the \(200, 320\) weight"):
        minivllm.load(ckpt)
    assert reads == []


@pytest.mark.parametrize("dtype,stored", [(torch.int32, "I32"), (torch.float8_e4m3fn, "F8_E4M3")])
def test_mistyped_scale_is_named_before_reading(ckpt, monkeypatch, dtype, stored):
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    _rewrite(ckpt, lambda sd: sd.__setitem__(name, sd[name].to(dtype)))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{name} is stored as {stored}; block scales"):
        minivllm.load(ckpt)
    assert reads == []


def test_unquantized_weight_the_config_quantizes_is_named(ckpt, monkeypatch):
    """A bf16 weight where the config says fp8 (with its scale present) would be garbage to an fp8
    GEMM: refused, naming it and modules_to_not_convert."""
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda sd: sd.__setitem__(name, sd[name].to(torch.bfloat16)))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{name} is stored as BF16, but .*quantization_"
                                              rf"config.*quantizes it.*modules_to_not_convert"):
        minivllm.load(ckpt)
    assert reads == []


def test_fp8_weight_the_config_keeps_unquantized_is_named(ckpt, monkeypatch):
    """An fp8 weight of a module modules_to_not_convert lists (its scale gone with it): cast as it
    is, it would load wrong by its scale."""
    name = "model.layers.0.mlp.up_proj"
    _set_quant(ckpt, dict(FP8_CONFIG, modules_to_not_convert=[name]))
    _rewrite(ckpt, lambda sd: sd.pop(name + ".weight_scale_inv"))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{name}.weight is stored as F8_E4M3; .*does not "
                                              rf"quantize it \(modules_to_not_convert lists it\)"):
        minivllm.load(ckpt)
    assert reads == []


def test_scale_of_an_unquantized_module_is_named(ckpt):
    name = "model.layers.0.mlp.up_proj"
    _set_quant(ckpt, dict(FP8_CONFIG, modules_to_not_convert=[name]))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor\(s\) {name}.weight_scale_inv "
                                              rf"\(scales of weights its quantization_config"):
        minivllm.load(ckpt)


def test_fp8_tensors_without_a_quantization_config_are_refused(ckpt):
    _set_quant(ckpt, None)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) .*weight_scale_inv.*no "
                                              r"quantization_config"):
        minivllm.load(ckpt)


def test_fp8_lm_head_is_refused(ckpt, monkeypatch):
    """The LM head and the embedding are never quantized (vLLM's fp8 method never takes them)."""
    _rewrite(ckpt, lambda sd: sd.__setitem__("lm_head.weight",
                                             sd["lm_head.weight"].to(torch.float8_e4m3fn)))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"lm_head.weight is stored as F8_E4M3; .*does not "
                                              r"quantize it: embeddings, norms and the LM head"):
        minivllm.load(ckpt)
    assert reads == []
