"""Session 76 audit of checkpoint and config loading, against transformers' reading of the same
config.json (the oracle: its config values, RoPE frequencies and logits) and vLLM's loader.

Each bug test failed before its fix: a config.json without max_position_embeddings read as
40,960 positions (transformers and vLLM: 32,768); llama3 RoPE scaling without
original_max_position_embeddings took 8,192 (transformers: max_position_embeddings), and without
its frequency factors invented Llama 3.1's (transformers and vLLM refuse); a rope_scaling beside
a non-default rope_parameters (hf_overrides on a transformers-5 checkpoint) was ignored, and a
rope_theta inside rope_scaling too; nested (per-layer-type) rope_parameters, a
partial_rotary_factor, is_causal false and a dual_chunk_attention_config loaded as plain causal
RoPE; rotary_emb.cos_cached / sin_cached tensors (which vLLM skips) were refused. The last test
checks that the config variants that load score as transformers."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3MoeConfig

import minivllm
from minivllm import LLM, CheckpointError
from minivllm.functional import rope_inv_freq
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.load import assign_hf_weights
from hf_tiny import (DEVICE, MOE_TINY, contiguous_tables, hf_config, make_hf_model,
                     make_hf_moe_model, save_checkpoint)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def _dict(moe: bool = False, **changes) -> dict:
    """A config.json's dict (transformers 4 layout, no RoPE keys) with `changes` (None drops)."""
    if moe:
        d = Qwen3MoeConfig(**MOE_TINY).to_dict()
        d["num_experts"] = d.pop("num_local_experts", d.get("num_experts"))
    else:
        d = hf_config().to_dict()
    d = {k: v for k, v in d.items() if k not in ("rope_parameters", "rope_scaling")}
    d["rope_theta"] = 10000.0
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


def _hf(d: dict, moe: bool = False):
    """transformers' reading of `d` (a copy: transformers fills in the dicts it is given)."""
    return (Qwen3MoeConfig if moe else Qwen3Config).from_dict(copy.deepcopy(d))


def _edit(path, drop=(), **changes) -> None:
    p = os.path.join(path, "config.json")
    with open(p) as f:
        d = json.load(f)
    for key in drop:
        d.pop(key, None)
    d.update(changes)
    with open(p, "w") as f:
        json.dump(d, f)


def _prompt(n: int, seed: int = 4) -> list[int]:
    return torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _logits_gap(model, params, prompt) -> float:
    """Largest |minivllm - transformers| logit over every position of `prompt`."""
    tables, n = contiguous_tables([prompt], 8)
    cache = minivllm.init_cache(params, num_blocks=n, block_size=8)
    batch = make_batch([SeqChunk(prompt, 0, tables[0])], block_size=8, device=DEVICE,
                       every_row=True)
    got, _ = minivllm.forward(params, cache, batch)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float()
    return (got.float().cpu() - want).abs().max().item()


# -- max_position_embeddings ----------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True])
def test_a_config_without_max_position_embeddings_has_transformers_default(moe):
    """transformers' Qwen3Config and Qwen3MoeConfig default it to 32,768, and vLLM derives
    max_model_len from that: 40,960 let prompts run past what vLLM accepts."""
    d = _dict(moe, max_position_embeddings=None)
    ours = ModelConfig.from_dict(d)
    assert ours.max_position_embeddings == _hf(d, moe).max_position_embeddings == 32768
    assert ours.max_context_len == 32768
    # YaRN without a factor: max_position_embeddings / original (transformers' "implicit
    # factor"), here 32,768 / 8,192.
    yarn = ModelConfig.from_dict({**d, "rope_scaling": {"rope_type": "yarn",
                                                        "original_max_position_embeddings": 8192}})
    assert yarn.rope_scaling_dict["factor"] == 4.0 and yarn.max_context_len == 32768


def test_the_engine_bounds_max_model_len_by_that_default(tmp_path):
    path = save_checkpoint(make_hf_model(seed=1), tmp_path / "m")
    _edit(path, drop=["max_position_embeddings"])
    assert LLM(path, device="cpu", num_kv_blocks=8).config.max_model_len == 32768
    with pytest.raises(ValueError, match="max_model_len=32769 exceeds"):
        LLM(path, device="cpu", num_kv_blocks=8, max_model_len=32769)


# -- llama3 ---------------------------------------------------------------------------------


def test_llama3_without_original_length_takes_max_position_embeddings(tmp_path):
    """transformers fills original_max_position_embeddings in from max_position_embeddings;
    minivllm took Llama 3.1's 8,192, other frequencies at every position."""
    model = make_hf_model(seed=5, std=0.3, max_position_embeddings=128,
                          rope_parameters={"rope_theta": 10000.0, **LLAMA3})
    assert model.config.rope_parameters["original_max_position_embeddings"] == 128
    path = save_checkpoint(model, tmp_path / "m", layout="v4")
    _edit(path, rope_scaling=LLAMA3)  # as a hand-written config leaves it out
    params = minivllm.load(path, device=DEVICE)
    assert params.config.rope_scaling_dict["original_max_position_embeddings"] == 128
    assert torch.equal(rope_inv_freq(params.config), model.model.rotary_emb.inv_freq)
    assert _logits_gap(model, params, _prompt(100)) <= 1e-4


@pytest.mark.parametrize("absent", [("low_freq_factor",), ("high_freq_factor",),
                                    ("low_freq_factor", "high_freq_factor")])
def test_llama3_without_its_frequency_factors_is_refused(absent):
    """transformers (and vLLM) raise a KeyError for them; minivllm took Llama 3.1's 1 and 4."""
    scaling = {k: v for k, v in LLAMA3.items() if k not in absent}
    d = _dict(rope_scaling=scaling)
    with pytest.raises(KeyError, match=absent[-1]):
        _hf(d)
    with pytest.raises(ValueError, match=" and ".join(absent)):
        ModelConfig.from_dict(d)


# -- rope_scaling, rope_parameters and rope_theta -------------------------------------------


@pytest.fixture(scope="module")
def yarn_pair(tmp_path_factory):
    """A transformers-5 checkpoint (rope_parameters) with YaRN factor 4 over 64 positions."""
    model = make_hf_model(seed=2, std=0.3, max_position_embeddings=256,
                          rope_parameters={**YARN, "rope_theta": 10000.0})
    return model, save_checkpoint(model, tmp_path_factory.mktemp("yarn") / "m")


def test_rope_scaling_in_hf_overrides_replaces_the_files_rope_parameters(yarn_pair, tmp_path):
    """transformers 5 reads `rope_scaling or rope_parameters` (vLLM on transformers 4 sets
    rope_parameters to rope_scaling): the override was ignored, the file's factor 4 kept."""
    model, path = yarn_pair
    other = {**YARN, "factor": 2.0}
    merged = minivllm.state.config.read_config_dict(path, {"rope_scaling": other})
    assert _hf(merged).rope_parameters["factor"] == 2.0
    config = ModelConfig.from_json(path, {"rope_scaling": other})
    assert config.rope_scaling_dict["factor"] == 2.0 and config.max_context_len == 128
    # Scores as transformers' model with that scaling (the same weights: the seed draws them).
    want = make_hf_model(seed=2, std=0.3, max_position_embeddings=256,
                         rope_parameters={**other, "rope_theta": 10000.0})
    params = minivllm.load(path, config=config, device=DEVICE)
    assert _logits_gap(want, params, _prompt(120)) <= 1e-4
    # {"rope_type": "default"} turns the file's YaRN off, as transformers reads it.
    plain = ModelConfig.from_json(path, {"rope_scaling": {"rope_type": "default"}})
    assert _hf(minivllm.state.config.read_config_dict(
        path, {"rope_scaling": {"rope_type": "default"}})).rope_parameters["rope_type"] == "default"
    assert plain.rope_scaling is None and plain.max_context_len == 256
    # The LLM's hf_overrides take the same path.
    llm = LLM(path, device="cpu", num_kv_blocks=8, hf_overrides={"rope_scaling": other})
    assert llm.config.model_config == config


def test_a_config_json_with_both_keys_reads_rope_scaling(yarn_pair, tmp_path):
    model, path = yarn_pair
    d = minivllm.state.config.read_config_dict(path)
    d["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    hf = _hf(d).rope_parameters
    ours = ModelConfig.from_dict(d).rope_scaling_dict
    assert (ours["factor"], ours["original_max_position_embeddings"]) == \
        (hf["factor"], hf["original_max_position_embeddings"]) == (2.0, 32)
    # An empty rope_scaling is none (transformers: `{} or rope_parameters`).
    assert ModelConfig.from_dict({**d, "rope_scaling": {}}).rope_scaling_dict["factor"] == 4.0


def test_rope_theta_inside_rope_scaling_is_the_base():
    d = _dict(rope_theta=10000.0, rope_scaling={**YARN, "rope_theta": 5000.0})
    assert ModelConfig.from_dict(d).rope_theta == _hf(d).rope_parameters["rope_theta"] == 5000.0
    # and it does not stay in the scaling dict (two spellings of one config are equal)
    assert ModelConfig.from_dict(d) == ModelConfig.from_dict(
        _dict(rope_theta=5000.0, rope_scaling=YARN))


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters={"full_attention": {"rope_type": "yarn", **YARN}}),
     "per layer type \\(full_attention\\)"),
    (dict(rope_scaling={"full_attention": {**YARN}, "sliding_attention": {"rope_type": "default"}}),
     "per layer type"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.25}), "partial_rotary_factor 0.25"),
    (dict(is_causal=False), "is_causal=False"),
    (dict(dual_chunk_attention_config={"chunk_size": 262144, "local_size": 8192,
                                       "original_max_position_embeddings": 262144}),
     "dual_chunk_attention_config"),
])
def test_configs_minivllm_would_run_otherwise_are_refused(changes, match, tmp_path):
    """Each loaded as a causal, whole-head, one-RoPE model: nested rope_parameters read as
    plain RoPE (their scaling dropped), vLLM rotates partial_rotary_factor of each head,
    is_causal false is bidirectional attention in vLLM, dual_chunk_attention_config its
    dual-chunk attention. Refused before any weight is read."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_dict(**changes))
    path = save_checkpoint(make_hf_model(seed=1), tmp_path / "m", layout="v4")
    _edit(path, **changes)
    with pytest.raises(CheckpointError, match=match):
        minivllm.load(path)


def test_what_asks_for_nothing_else_still_loads():
    for changes in (dict(is_causal=True), dict(partial_rotary_factor=1.0),
                    dict(dual_chunk_attention_config=None),
                    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                          "partial_rotary_factor": 1.0})):
        assert ModelConfig.from_dict(_dict(**changes)) == ModelConfig.from_dict(_dict())


# -- extra tensors --------------------------------------------------------------------------


def test_rotary_caches_in_the_checkpoint_are_skipped_as_vllm_skips_them(tmp_path):
    """vLLM's Qwen2/Qwen3 load_weights skips rotary_emb.inv_freq, cos_cached and sin_cached
    (ColossalAI-trained checkpoints hold the last two); minivllm refused the caches as
    unexpected tensors. load_weights skips them as load does."""
    model = make_hf_model(seed=6, std=0.3)
    path = save_checkpoint(model, tmp_path / "m")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    names = [f"model.layers.{n}.self_attn.rotary_emb.{b}_cached" for n in range(2)
             for b in ("cos", "sin")]
    tensors.update({name: torch.zeros(512, 16) for name in names})
    save_file(tensors, file, metadata={"format": "pt"})
    params = minivllm.load(path, device=DEVICE)
    assert _logits_gap(model, params, _prompt(40)) <= 1e-4
    same = assign_hf_weights(params, [(name, torch.zeros(512, 16)) for name in names])
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(same),
                                                 torch.utils._pytree.tree_leaves(params)))
    tensors["model.layers.0.self_attn.rotary_emb.other"] = torch.zeros(4)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor.*rotary_emb.other"):
        minivllm.load(path)


# -- the variants that load score as transformers -------------------------------------------


def _qwen3_like(model, path):
    """config.json as Qwen's own read: rope_theta and rope_scaling {"type": "yarn", ...} (the
    old key), max_position_embeddings above original x factor (Qwen3's 40,960 over 32,768 x 4),
    the sliding-window keys off, torch_dtype, tied embeddings with lm_head.weight in the
    file (vLLM and transformers skip it)."""
    _edit(path, drop=["rope_parameters", "dtype", "layer_types"], rope_theta=10000.0,
          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
          use_sliding_window=False, sliding_window=None, max_window_layers=28,
          torch_dtype="float32", tie_word_embeddings=True)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, file, metadata={"format": "pt"})


VARIANTS = {
    # Qwen3's own layout, positions past original_max_position_embeddings (32) to 119
    "qwen3-layout-yarn": (dict(max_position_embeddings=512, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32,
                                                "rope_theta": 10000.0}), _qwen3_like, {}),
    # head_dim 24 (not hidden / heads), llama3 past its original length, sharded with an index
    "headdim-llama3-sharded": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=24,
                                    rope_parameters={"rope_theta": 5e5, **LLAMA3,
                                                     "original_max_position_embeddings": 32}),
                               None, dict(max_shard_size="40KB")),
    # Qwen3-MoE: unnormalized top-2, every second layer sparse, layer 3 dense by mlp_only_layers
    "moe-raw-step2": (dict(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=4,
                           mlp_only_layers=[3]), None, {}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_config_variants_that_load_score_as_transformers(name, tmp_path):
    overrides, edit, save = VARIANTS[name]
    make = make_hf_moe_model if name.startswith("moe") else make_hf_model
    model = make(seed=len(name), std=0.3, **overrides)
    path = save_checkpoint(model, tmp_path / "m", layout="v4", **save)
    if edit is not None:
        edit(model, path)
    if "sharded" in name:
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    params = minivllm.load(path, device=DEVICE)
    assert _logits_gap(model, params, _prompt(120)) <= 1e-4
