"""Regressions from an audit of the kernels and the attention backends' choice."""

import pytest
import torch

import minivllm
from minivllm.kernels import backends, select_backend
from minivllm.kernels.flash_attn_backend import FLASH_ATTN
from minivllm.state import ModelConfig

FP8 = torch.float8_e4m3fn


def test_generate_leaves_flash_attn_out_for_an_fp8_cache(monkeypatch):
    """generate() chose its backend without the cache's dtype: on a GPU with flash-attn-4
    installed it took flash_attn, which reads no fp8 cache, for an fp8 cache."""
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0)
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4, dtype="fp8")
    available = backends.available_backends
    monkeypatch.setattr(backends, "available_backends",
                        lambda device: ["flash_attn"] + available(device))  # flash-attn installed
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    made = []
    make = backends._make
    monkeypatch.setattr(backends, "_make", lambda name: (made.append(name), make(name))[1])
    out, _ = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=2)
    assert made == ["reference"] and len(out[0]) == 2


def test_a_flash_attn_backend_object_is_refused_for_an_fp8_cache():
    with pytest.raises(ValueError, match="fp8"):
        select_backend("cpu", FLASH_ATTN, FP8)


def test_triton_is_left_out_for_head_dims_it_does_not_compile_for_on_a_gpu(monkeypatch):
    """On the GPU the Triton kernels failed to compile at head_dim 8 (tl.dot's K below 16) and
    the decode kernel ran out of shared memory at 512: a ValueError naming head_dim when triton
    is asked for, left out when choosing. Under the interpreter every head_dim runs."""
    monkeypatch.setattr(backends, "available_backends", lambda device: ["triton", "reference"])
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    assert select_backend("cpu", "triton", head_dim=8).name == "triton"  # the interpreter
    monkeypatch.setattr(backends, "runs_ptx", lambda device: True)  # as on a GPU
    for bad in (8, 512):
        with pytest.raises(ValueError, match=f"head_dim 16-256 on a GPU, got {bad}"):
            select_backend("cpu", "triton", head_dim=bad)
        assert select_backend("cpu", None, head_dim=bad).name == "reference"
    for good in (16, 128, 256):
        assert select_backend("cpu", None, head_dim=good).name == "triton"
