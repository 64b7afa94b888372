"""config.json parity with transformers and vLLM: the defaults of an absent head_dim and
num_key_value_heads (transformers' Qwen3Config: 128 and 32, not hidden_size / heads and all
heads), and RoPE's linear scaling (transformers' and vLLM's) and dynamic-NTK scaling (vLLM's
fixed-base form, checked against its formula written out here)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.functional.rope import rope_attention_scale, rope_cos_sin, rope_inv_freq
from minivllm.state import SeqChunk, make_batch
from minivllm.state.config import ModelConfig

from engine_helpers import make_llm
from hf_tiny import DEVICE, TINY, contiguous_tables, make_hf_model, save_checkpoint

PROMPT = [3, 17, 25, 4, 99, 60, 12, 8, 41, 7, 1, 55, 90, 34, 2, 2, 18, 76, 43, 21, 9, 10, 64, 5,
          30, 31, 77, 50, 19, 88, 6, 14, 23, 45, 67, 81, 11, 39, 57, 100, 0, 36, 48, 13, 26, 70,
          52, 33]  # 48 tokens


def edit_config(path, **changes):
    """Rewrite `path`'s config.json: a value of ... drops the key."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    for key, value in changes.items():
        if value is ...:
            d.pop(key, None)
        else:
            d[key] = value
    with open(cfg_path, "w") as f:
        json.dump(d, f)
    return d


def minivllm_logits(path, prompt) -> torch.Tensor:
    """Every row's logits of `prompt` through minivllm loaded from `path`, on the CPU."""
    params = minivllm.load(path, device=DEVICE)
    tables, n = contiguous_tables([prompt], 4)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=4)
    batch = make_batch([SeqChunk(prompt, 0, tables[0])], block_size=4, device=DEVICE,
                       every_row=True)
    logits, _ = minivllm.forward(params, cache, batch)
    return logits.cpu()


def hf_logits(model, prompt) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0]


def hf_from(path) -> Qwen3ForCausalLM:
    """transformers' reading of the checkpoint at `path` (its config.json as written there)."""
    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# --- 1. absent head_dim / num_key_value_heads ----------------------------------------------------

# 64 heads: transformers' 32 KV heads divide them, and are not all of them.
BASE = dict(vocab_size=101, hidden_size=128, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=64, max_position_embeddings=512)


@pytest.mark.parametrize("model_type, extra", [
    ("qwen3", {}),
    ("qwen3", {"head_dim": 16}),
    ("qwen3", {"num_key_value_heads": 8}),
    ("qwen3", {"num_key_value_heads": None}),
    ("qwen3", {"num_key_value_heads": None, "head_dim": 8}),
    ("qwen3_moe", {}),
    ("qwen3_moe", {"num_key_value_heads": 16}),
])
def test_absent_sizes_default_as_transformers_configs(model_type, extra):
    """The head_dim and KV heads transformers' config class gives the same dict (its attention's
    head_dim: the config's, else hidden_size // num_attention_heads, as Qwen3MoeAttention). The
    cases with both keys given or null, and the MoE's absent head_dim, read as before."""
    d = {**BASE, **extra, "model_type": model_type}
    if model_type == "qwen3_moe":
        d.update(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32)
        hf = Qwen3MoeConfig.from_dict(d)
    else:
        hf = Qwen3Config.from_dict(d)
    ours = ModelConfig.from_dict(d)
    want_head_dim = getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert (ours.head_dim, ours.num_kv_heads) == (want_head_dim, hf.num_key_value_heads)


def test_absent_kv_heads_that_do_not_divide_the_heads_are_named():
    """transformers takes 32 KV heads for 4 query heads (its repeat_kv would then repeat each 0
    times): refused, naming the absent key, not run as 4 KV heads."""
    d = {**BASE, "num_attention_heads": 4, "head_dim": 16}
    with pytest.raises(ValueError, match="no num_key_value_heads.*32.*num_attention_heads \\(4\\)"):
        ModelConfig.from_dict(d)
    assert ModelConfig.from_dict({**d, "num_key_value_heads": None}).num_kv_heads == 4


def test_checkpoint_without_head_dim_and_kv_heads_gives_transformers_logits(tmp_path):
    """A config.json without head_dim and num_key_value_heads, read by transformers as 128 and 32
    (not 64 // 32 = 2 and 32 heads' all): minivllm's logits equal transformers' from it."""
    model = make_hf_model(seed=1, std=0.1, num_hidden_layers=1, num_attention_heads=32,
                          num_key_value_heads=32, head_dim=128)
    path = save_checkpoint(model, tmp_path / "m")
    edit_config(path, head_dim=..., num_key_value_heads=...)
    hf = hf_from(path)
    assert (hf.config.head_dim, hf.config.num_key_value_heads) == (128, 32)
    got = minivllm_logits(path, PROMPT[:20])
    assert (got - hf_logits(hf, PROMPT[:20])).abs().max().item() <= 1e-4


# --- 2. linear RoPE scaling ----------------------------------------------------------------------

LINEAR = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}


@pytest.fixture(scope="module")
def linear_model():
    return make_hf_model(seed=3, std=0.3, max_position_embeddings=32, rope_parameters=LINEAR)


def linear_checkpoint(model, path, layout):
    """`model` saved in one of three config layouts: transformers 5's rope_parameters, 4's
    rope_scaling + top-level rope_theta, and 4's with the older "type" key."""
    path = save_checkpoint(model, path, layout="v4" if layout != "v5" else "v5")
    if layout == "v4-type":
        edit_config(path, rope_scaling={"type": "linear", "factor": 2.0})
    return path


@pytest.mark.parametrize("layout", ["v5", "v4", "v4-type"])
def test_linear_scaling_logits_equal_transformers(linear_model, layout, tmp_path):
    path = linear_checkpoint(linear_model, tmp_path / layout, layout)
    hf = hf_from(path)
    assert hf.config.rope_parameters["rope_type"] == "linear"
    ours = ModelConfig.from_json(path)
    assert ours.rope_theta == 5000.0 and ours.max_context_len == 64  # vLLM's: 32 x factor 2
    assert torch.equal(rope_inv_freq(ours), hf.model.rotary_emb.inv_freq)
    got = minivllm_logits(path, PROMPT)  # 48 positions, past max_position_embeddings' 32
    assert (got - hf_logits(hf, PROMPT)).abs().max().item() <= 1e-4


def test_linear_scaling_engine_scores_and_decodes_as_transformers(linear_model, device, tmp_path):
    """Through the engine (its default max_model_len vLLM's 32 x 2, the decode steps' own cos and
    sin): prompt scores and greedy tokens as transformers'; one more position is refused."""
    path = linear_checkpoint(linear_model, tmp_path / "m", "v4")
    llm = make_llm(path, device, block_size=16)
    assert llm.config.max_model_len == 64
    out = llm.generate([{"prompt_token_ids": PROMPT[:40]}], SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0), use_tqdm=False)[0]
    scores = [e[t].logprob for t, e in zip(PROMPT[1:40], out.prompt_logprobs[1:])]
    lps = torch.log_softmax(hf_logits(linear_model, PROMPT[:40]).float(), -1)
    assert scores == pytest.approx([lps[i - 1, t].item() for i, t in enumerate(PROMPT[:40]) if i],
                                   abs=2e-4)
    with torch.no_grad():
        want = linear_model.generate(torch.tensor([PROMPT[:40]]), max_new_tokens=8,
                                     do_sample=False, attention_mask=torch.ones(1, 40, dtype=int),
                                     eos_token_id=None, pad_token_id=0)[0, 40:].tolist()
    assert list(out.outputs[0].token_ids) == want
    with pytest.raises(ValueError, match="max_position_embeddings x linear.*64"):
        LLM(path, device="cpu", num_kv_blocks=8, max_model_len=65)


# --- 3. dynamic (NTK) RoPE scaling: vLLM's fixed base ------------------------------------------

def vllm_dynamic_cos_sin(base, factor, max_position, rotary_dim):
    """vLLM's DynamicNTKScalingRotaryEmbedding._compute_cos_sin_cache (and RotaryEmbedding's
    _compute_inv_freq), as written there: [max_position * factor, rotary_dim // 2] each."""
    max_len = max_position * factor
    base = base * ((max_len / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    t = torch.arange(max_len, dtype=torch.float)
    freqs = torch.einsum("i,j -> ij", t, inv_freq)
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("factor, max_position, head_dim, theta", [
    (2.0, 64, 16, 10000.0), (3.7, 100, 16, 10000.0), (1.5, 1000, 128, 1e6), (8.0, 40, 6, 500.0)])
def test_dynamic_scaling_is_vllms_fixed_base_table(factor, max_position, head_dim, theta):
    d = {**TINY, "head_dim": head_dim, "max_position_embeddings": max_position,
         "rope_parameters": {"rope_type": "dynamic", "factor": factor, "rope_theta": theta}}
    ours = ModelConfig.from_dict(d)
    assert ours.max_context_len == int(max_position * factor)
    assert rope_attention_scale(ours) == 1.0
    want_cos, want_sin = vllm_dynamic_cos_sin(theta, factor, max_position, head_dim)
    cos, sin = rope_cos_sin(ours, torch.arange(want_cos.shape[0]))
    torch.testing.assert_close(cos, torch.cat([want_cos, want_cos], -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, torch.cat([want_sin, want_sin], -1), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def dynamic_pair(tmp_path_factory):
    """(transformers' dynamic model, the checkpoint minivllm reads, the same weights with plain
    RoPE in transformers)."""
    scaling = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model = make_hf_model(seed=5, std=0.3, max_position_embeddings=32, rope_parameters=scaling)
    path = save_checkpoint(model, tmp_path_factory.mktemp("dynamic") / "m", layout="v4")
    plain = make_hf_model(seed=5, std=0.3, max_position_embeddings=32,
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    plain.load_state_dict(model.state_dict())
    return hf_from(path), path, plain


def test_dynamic_scaling_within_max_positions_equals_transformers(dynamic_pair):
    """Up to max_position_embeddings positions transformers' dynamic RoPE is plain RoPE, and so
    is vLLM's (its base correction is 1): the logits agree."""
    hf, path, _ = dynamic_pair
    assert hf.config.rope_parameters["rope_type"] == "dynamic"
    got = minivllm_logits(path, PROMPT[:32])
    assert (got - hf_logits(hf, PROMPT[:32])).abs().max().item() <= 1e-4


def test_dynamic_scaling_past_max_positions_is_vllms_not_transformers(dynamic_pair):
    """Past max_position_embeddings transformers raises the base with the sequence's length;
    vLLM keeps it: minivllm's logits are plain RoPE's there, and not transformers' dynamic."""
    hf, path, plain = dynamic_pair
    got = minivllm_logits(path, PROMPT)  # 48 positions > 32
    assert (got - hf_logits(plain, PROMPT)).abs().max().item() <= 1e-4
    assert (got - hf_logits(hf, PROMPT))[32:].abs().max().item() > 1e-2


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "linear"}, "linear rope scaling needs factor > 0, got None"),
    ({"rope_type": "linear", "factor": "2"}, "linear rope scaling needs factor"),
    ({"rope_type": "dynamic", "factor": 0}, "dynamic rope scaling needs factor"),
    ({"rope_type": "dynamic", "factor": float("nan")}, "dynamic rope scaling needs factor"),
    ({"rope_type": "dynamic", "factor": 1e-9}, "less than one position"),
    ({"rope_type": "dynamic", "alpha": 2.0}, "needs factor"),
    ({"rope_type": "dynamic", "factor": 2.0, "alpha": 2.0}, "alpha"),
    ({"type": "longrope", "factor": 2.0}, "unsupported rope scaling type 'longrope'"),
    ({"rope_type": "ntk", "factor": 2.0}, "unsupported rope scaling type 'ntk'"),
])
def test_bad_or_unknown_scaling_is_refused_before_loading(linear_model, scaling, match, tmp_path):
    """hf_overrides' rope_scaling over a v5 file's rope_parameters: the scaling as given (a v4
    file's rope_scaling would merge with it)."""
    path = linear_checkpoint(linear_model, tmp_path / "m", "v5")
    with pytest.raises(ValueError, match=match):
        LLM(path, device="cpu", num_kv_blocks=8, hf_overrides={"rope_scaling": scaling})


def test_dynamic_scaling_needs_head_dim_above_two():
    d = {**TINY, "head_dim": 2, "num_attention_heads": 4,
         "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}
    with pytest.raises(ValueError, match="head_dim > 2"):
        ModelConfig.from_dict(d)
