"""Audit (session 77) of the Qwen3-MoE path against transformers and vLLM: configs and checkpoints
that minivllm must refuse by name before any work, rather than run as another model.

- shared_expert_intermediate_size > 0: transformers' Qwen3MoeConfig ignores it, Qwen2-MoE-style
  models add a sigmoid-gated shared expert for it; minivllm has none, so it refuses the config.
- hf_overrides' num_experts over a transformers-5 file's num_local_experts: one field, as
  transformers' attribute_map sets it.
- experts saved fused (transformers 5's in-memory mlp.experts.gate_up_proj / down_proj written
  as they are): vLLM's loader and load read experts one by one (as save_pretrained writes
  them); the refusal names the fused tensors it found.
- LoRA slots for a mixture of experts: the engine refuses enable_lora; init_lora (the
  functional path) now refuses too, rather than forward failing part-way with an
  AttributeError."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import minivllm
from minivllm import LLM
from minivllm.state import ModelConfig
from minivllm.state.lora import init_lora

from hf_tiny import MOE_TINY, make_hf_moe_model, save_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")


def _moe_dict(**changes):
    d = dict(MOE_TINY, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe")
    d.update(changes)
    return d


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A transformers-written Qwen3-MoE (layer 1 dense) and its path."""
    model = make_hf_moe_model(seed=5, std=0.3, mlp_only_layers=[1])
    return model, save_checkpoint(model, tmp_path_factory.mktemp("moe"))


def _edit_config(path, **changes):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    d.update(changes)
    with open(cfg_path, "w") as f:
        json.dump(d, f)


# --- shared experts ----------------------------------------------------------------------------

def test_a_shared_expert_config_is_refused_by_name():
    """A shared expert (shared_expert_intermediate_size > 0) would have been dropped silently:
    minivllm would have run the routed experts alone. 0 or null (no shared expert) reads as
    before."""
    for size in (64, 1, True, "64"):
        with pytest.raises(ValueError, match=r"shared_expert_intermediate_size=.*not supported"):
            ModelConfig.from_dict(_moe_dict(shared_expert_intermediate_size=size))
    for size in (0, None):
        config = ModelConfig.from_dict(_moe_dict(shared_expert_intermediate_size=size))
        assert config.sparse_layers == (0, 1, 2) and config.num_experts == 8


def test_a_shared_expert_checkpoint_is_refused_before_loading(checkpoint, tmp_path, monkeypatch):
    """The config names the shared expert (its tensors absent, as transformers would save a
    Qwen3MoeConfig carrying the key): load and LLM refuse it before a tensor is read."""
    import shutil

    model, path = checkpoint
    bad = str(tmp_path / "shared")
    shutil.copytree(path, bad)
    _edit_config(bad, shared_expert_intermediate_size=64)
    read = []
    monkeypatch.setattr(minivllm.state.load, "safe_open",
                        lambda *a, **k: read.append(a) or safe_open(*a, **k))
    with pytest.raises(minivllm.CheckpointError, match="shared_expert_intermediate_size=64"):
        minivllm.load(bad)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=64"):
        LLM(bad, device="cpu", dtype="float32")
    assert read == []


# --- fused experts on disk ---------------------------------------------------------------------

def test_fused_experts_on_disk_are_refused_naming_the_fused_tensors(checkpoint, tmp_path):
    """transformers 5's state_dict holds each sparse layer's experts as two fused tensors;
    save_pretrained writes them one by one (checked here), vLLM loads only that layout, and so
    does load: a checkpoint written fused is refused naming the fused tensors it holds."""
    model, path = checkpoint
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names

    fused = str(tmp_path / "fused")
    model.save_pretrained(fused, safe_serialization=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, os.path.join(fused, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(minivllm.CheckpointError,
                       match=r"holds its experts fused \(model\.layers\.0\.mlp\.experts\."
                             r"down_proj, model\.layers\.0\.mlp\.experts\.gate_up_proj, \.\.\.\)"):
        minivllm.load(fused)
    # The same tensors as an in-memory update are taken (LLM.load_weights' fused names).
    params = minivllm.load(path)
    updated = minivllm.state.load.assign_hf_weights(params, state.items())
    assert torch.equal(updated.layers[2].experts_down, params.layers[2].experts_down)


# --- LoRA ----------------------------------------------------------------------------------------

def test_init_lora_refuses_a_mixture_of_experts(checkpoint):
    """As LLM(enable_lora=True) refuses: the sparse layers have no dense MLP for the deltas."""
    _, path = checkpoint
    config = ModelConfig.from_json(path)
    with pytest.raises(ValueError, match=r"init_lora: LoRA on a mixture-of-experts model is not "
                                         r"supported \(layers \[0, 2\] are sparse"):
        init_lora(config, max_loras=2, max_rank=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="enable_lora: LoRA on a mixture-of-experts model"):
        LLM(path, device="cpu", enable_lora=True)
    # A qwen3_moe config whose layers are all dense (mlp_only_layers) takes LoRA as a dense one.
    dense = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[0, 1, 2]))
    assert not dense.is_moe
    assert len(init_lora(dense, max_loras=1, max_rank=2, dtype=torch.float32).layers) == 3


@pytest.mark.parametrize("file_key, override_key", [("num_local_experts", "num_experts"),
                                                    ("num_experts", "num_local_experts")])
def test_an_override_of_the_expert_count_wins_under_either_name(file_key, override_key):
    """transformers' Qwen3MoeConfig maps num_local_experts to num_experts (attribute_map): an
    hf_overrides of either name sets the one field (vLLM applies overrides to that object).
    Before, the file's other name stayed beside it and the two 'disagree'd."""
    from transformers import Qwen3MoeConfig

    from minivllm.state.config import merge_overrides

    d = _moe_dict()
    d[file_key] = d.pop("num_experts")
    hf = Qwen3MoeConfig(**{k: v for k, v in d.items() if k != "num_local_experts"},
                        **({"num_experts": d["num_local_experts"]}
                           if "num_local_experts" in d else {}))
    setattr(hf, override_key, 6)
    merged = merge_overrides(d, {override_key: 6})
    assert ModelConfig.from_dict(merged).num_experts == hf.num_experts == 6 != d[file_key]


def test_forward_refuses_hand_built_lora_weights_on_a_mixture_of_experts():
    """LoRA slots attached by hand to a MoE model's params (init_lora refuses to make them): a
    ValueError from forward's free checks, before any K/V is written, not an AttributeError
    from the first sparse layer part-way through."""
    import attrs

    from minivllm.state.batch import SeqChunk, make_batch

    config = ModelConfig.from_dict(_moe_dict())
    params = minivllm.random_params(config, seed=0)
    dense = ModelConfig.from_dict(_moe_dict(mlp_only_layers=[0, 1, 2]))
    lora = init_lora(dense, max_loras=1, max_rank=2, dtype=params.dtype)
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
    before = [t.clone() for t in cache.k] if isinstance(cache.k, (list, tuple)) else None
    batch = make_batch([SeqChunk([1, 2, 3], 0, [0])], block_size=4, lora_slots=[0])
    with pytest.raises(ValueError, match="mixture-of-experts"):
        minivllm.forward(attrs.evolve(params, lora=lora), cache, batch)
    if before is not None:
        assert all(torch.equal(a, b) for a, b in zip(before, cache.k))
