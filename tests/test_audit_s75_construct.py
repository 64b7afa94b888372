"""Constructing an engine (EngineConfig.create, LLM) and loading a checkpoint: config.json values
and arguments that used to be taken silently, or failed late with an error that named nothing."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import minivllm
from minivllm import LLM, CheckpointError, SamplingParams
from minivllm.runtime.config import EngineConfig
from minivllm.state.quant import quantization_from_config
from hf_tiny import make_hf_model, save_checkpoint
from test_load import ckpt, model  # noqa: F401  (the fixtures: a tiny checkpoint written fresh)


def _edit_config(path, **changes):
    cfg = os.path.join(path, "config.json")
    d = json.load(open(cfg))
    d.update(changes)
    json.dump(d, open(cfg, "w"))


def _create(path, **kw):
    return EngineConfig.create(path, device="cpu", **kw)


@pytest.mark.parametrize("changes, key", [(dict(dtype=5), "dtype"),
                                          (dict(dtype=None, torch_dtype=["bfloat16"]),
                                           "torch_dtype")])
def test_a_config_dtype_that_is_not_a_name_is_named(ckpt, changes, key):
    """It was parse_dtype's bare TypeError, "dtype must be a torch.dtype or a string", read as
    LLM's own dtype argument; neither LLM nor load named config.json (load's CheckpointError
    wrapping missed it: it catches ValueError)."""
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=rf"{ckpt}: config {key} must be a dtype name"):
        _create(ckpt)
    with pytest.raises(CheckpointError, match=rf"config\.json: config {key} must be"):
        minivllm.load(ckpt)


def test_an_unknown_config_dtype_says_it_is_the_configs(ckpt):
    _edit_config(ckpt, dtype="int8")
    with pytest.raises(ValueError, match=r"config dtype: unknown dtype 'int8'"):
        _create(ckpt)
    # A torch dtype set by hf_overrides is still taken.
    assert _create(ckpt, hf_overrides={"dtype": torch.bfloat16}).dtype == torch.bfloat16


@pytest.mark.parametrize("archs", ["Qwen3ForCausalLM", 5, {"Qwen3ForCausalLM": 1}])
def test_architectures_that_are_not_a_list_of_names_are_named(ckpt, archs):
    """A string was read letter by letter ("unsupported architecture 'Q'"), a number was
    "TypeError: 'int' object is not iterable"."""
    _edit_config(ckpt, architectures=archs)
    with pytest.raises(ValueError, match="config architectures must be a list of class names"):
        _create(ckpt)
    with pytest.raises(CheckpointError, match="config architectures must be a list"):
        minivllm.load(ckpt)


@pytest.mark.parametrize("key", ["num_hidden_layers", "vocab_size"])
def test_a_bool_size_is_refused(ckpt, key):
    """true was taken as 1: an engine of one layer whose load then listed the second layer's
    tensors as unexpected, or an embedding "expected (True, 64)"."""
    _edit_config(ckpt, **{key: True})
    with pytest.raises(ValueError, match=rf"{key}.* must be a positive integer, got True"):
        _create(ckpt)


@pytest.mark.parametrize("changes, key", [
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), "rope_theta")])
def test_an_infinite_eps_or_rope_theta_is_refused(ckpt, changes, key):
    """json reads Infinity: it loaded and generated other tokens than the model's (every norm's
    output zero, or every rotation but the first pair's frequency zero)."""
    _edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=rf"config {key} must be a positive float, got inf"):
        _create(ckpt)


def _odd_head_dim_checkpoint(path, head_dim=3):
    """The tiny checkpoint with attention weights of an odd head_dim (transformers builds no such
    Qwen3: its RoPE check refuses it; a hand-made checkpoint can hold one)."""
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    cfg = json.load(open(os.path.join(path, "config.json")))
    h, q, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}.self_attn."
        sd[p + "q_proj.weight"] = torch.randn(q * head_dim, h) * 0.1
        sd[p + "k_proj.weight"] = torch.randn(kv * head_dim, h) * 0.1
        sd[p + "v_proj.weight"] = torch.randn(kv * head_dim, h) * 0.1
        sd[p + "o_proj.weight"] = torch.randn(h, q * head_dim) * 0.1
        sd[p + "q_norm.weight"] = torch.ones(head_dim)
        sd[p + "k_norm.weight"] = torch.ones(head_dim)
    save_file(sd, file, metadata={"format": "pt"})
    _edit_config(path, head_dim=head_dim)
    return path


def test_an_odd_head_dim_is_refused_before_loading(ckpt):
    """It loaded, and the first request failed in the attention's index_copy_ (a RuntimeError:
    RoPE rotates two halves of head_dim)."""
    _odd_head_dim_checkpoint(ckpt)
    with pytest.raises(ValueError, match="config head_dim must be even.*got 3"):
        LLM(ckpt, device="cpu", attention_backend="reference", skip_tokenizer_init=True,
            num_kv_blocks=16)
    with pytest.raises(CheckpointError, match="head_dim must be even"):
        minivllm.load(ckpt)


def test_an_even_head_dim_other_than_hidden_over_heads_still_runs(tmp_path):
    """Qwen3's head_dim need not be hidden_size / num_attention_heads (o_proj maps back)."""
    path = save_checkpoint(make_hf_model(seed=3, head_dim=8), tmp_path / "hd8")
    llm = LLM(path, device="cpu", attention_backend="reference", skip_tokenizer_init=True,
              num_kv_blocks=16)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_a_yarn_context_below_one_position_is_refused(ckpt):
    """factor 1e-9 over 512 positions made max_context_len 0: an engine of max_model_len 0,
    each request then refused as leaving "no room to generate"."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 1e-9,
            "original_max_position_embeddings": 512}
    with pytest.raises(ValueError, match=r"yarn rope scaling's context.*less than one position"):
        _create(ckpt, hf_overrides={"rope_parameters": yarn})
    # A factor below 1 that leaves positions is still a context (of 256 here).
    yarn["factor"] = 0.5
    assert _create(ckpt, hf_overrides={"rope_parameters": yarn}).max_model_len == 256


def test_a_float_awq_group_size_is_named_with_the_config(ckpt):
    """group_size 64.0 passed (64.0 == 64) and then failed as a slice bound while layer 0's
    o_proj was read, named as the safetensors file's "cannot read the AWQ tensors"."""
    quant = {"quant_method": "awq", "bits": 4, "group_size": 64.0, "zero_point": True,
             "version": "gemm"}
    with pytest.raises(ValueError, match=r"group_size 64\.0"):
        quantization_from_config({"quantization_config": quant})
    _edit_config(ckpt, quantization_config=quant)
    with pytest.raises(CheckpointError, match=r"config\.json: .*group_size 64\.0"):
        minivllm.load(ckpt)
    assert quantization_from_config(
        {"quantization_config": dict(quant, group_size=64)}).group_size == 64


def test_a_bytes_model_path_is_a_path(ckpt):
    """os.fspath kept bytes, and is_random_model's startswith("random:") raised a TypeError."""
    config = _create(os.fsencode(ckpt))
    assert config.model == ckpt and type(config.model) is str


def test_load_names_an_unknown_device_before_reading(ckpt, monkeypatch):
    """It was torch's RuntimeError from the first tensor's .to(device), after the headers were
    checked and the embedding read."""
    from minivllm.state import load as load_mod

    monkeypatch.setattr(load_mod, "_index_tensors", lambda path: pytest.fail("read the files"))
    with pytest.raises(ValueError, match="unknown device 'bogus'"):
        minivllm.load(ckpt, device="bogus")
