"""Checkpoint loading audit: inputs that used to load silently wrong, or fail late or unclearly."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import minivllm
from minivllm import CheckpointError
from minivllm.state import load as load_mod
from hf_tiny import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=5)


@pytest.fixture
def ckpt(model, tmp_path):
    return save_checkpoint(model, tmp_path / "ckpt")


@pytest.fixture
def sharded(model, tmp_path):
    return save_checkpoint(model, tmp_path / "sharded", max_shard_size="20KB")


def _edit_config(path, **changes):
    cfg = os.path.join(path, "config.json")
    d = json.load(open(cfg))
    d.update(changes)
    json.dump(d, open(cfg, "w"))


def _shards(path):
    return sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_tensor_in_two_files_without_index_is_refused(sharded):
    """Without an index, a tensor in two files is ambiguous: it used to load the later file's."""
    os.remove(os.path.join(sharded, "model.safetensors.index.json"))
    first, last = _shards(sharded)[0], _shards(sharded)[-1]
    moved = load_file(os.path.join(sharded, last))
    name = sorted(moved)[0]
    sd = load_file(os.path.join(sharded, first))
    sd[name] = torch.zeros_like(moved[name])
    save_file(sd, os.path.join(sharded, first), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*{first}.*{last}"):
        minivllm.load(sharded)


@pytest.mark.parametrize("index", [[1], {"weight_map": [1]}, {"weight_map": {"model.norm.weight": 3}}])
def test_malformed_index_is_named(sharded, index):
    json.dump(index, open(os.path.join(sharded, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        minivllm.load(sharded)


def _count_reads(monkeypatch):
    """Counts tensor data reads (slicing a safetensors slice) through load's _open."""
    reads = []
    real_open = load_mod._open

    class Slice:
        def __init__(self, sl, name):
            self.sl, self.name = sl, name

        def __getattr__(self, attr):
            return getattr(self.sl, attr)

        def __getitem__(self, key):
            reads.append(self.name)
            return self.sl[key]

    class Handle:
        def __init__(self, h):
            self.h = h

        def __getattr__(self, attr):
            return getattr(self.h, attr)

        def get_slice(self, name):
            return Slice(self.h.get_slice(name), name)

    monkeypatch.setattr(load_mod, "_open", lambda file: Handle(real_open(file)))
    return reads


def test_index_naming_the_wrong_file_fails_before_reading(sharded, monkeypatch):
    """The index points the last tensor at a file without it: an error naming both, before any
    tensor data is read (it used to come after every earlier tensor was loaded)."""
    index_path = os.path.join(sharded, "model.safetensors.index.json")
    index = json.load(open(index_path))
    files = sorted(set(index["weight_map"].values()))
    name = "model.layers.1.mlp.down_proj.weight"
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    json.dump(index, open(index_path, "w"))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"{index['weight_map'][name]}.*{name}"):
        minivllm.load(sharded)
    assert reads == []


def test_wrong_shape_fails_before_reading(ckpt, monkeypatch):
    file = os.path.join(ckpt, "model.safetensors")
    sd = load_file(file)
    sd["model.norm.weight"] = torch.zeros(3)
    save_file(sd, file, metadata={"format": "pt"})
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\(3,\)"):
        minivllm.load(ckpt)
    assert reads == []


def test_non_float_tensor_is_refused(ckpt):
    """An 8-bit weight at the right shape used to be cast to the model dtype as if it were real."""
    file = os.path.join(ckpt, "model.safetensors")
    sd = load_file(file)
    name = "model.layers.0.self_attn.q_proj.weight"
    sd[name] = sd[name].to(torch.float8_e4m3fn)
    save_file(sd, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*F8_E4M3"):
        minivllm.load(ckpt)


def test_quantized_checkpoint_is_refused(ckpt):
    """A quantization_config used to be ignored. A block-fp8 one (Qwen3-*-FP8) now loads
    (tests/test_fp8_checkpoint.py), but not over weights without their fp8 block scales; nor AWQ
    (tests/test_awq.py) over weights without their qweight/qzeros/scales; other methods (GPTQ,
    ...) are refused by name."""
    _edit_config(ckpt, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*quantiz.*fp8"):
        minivllm.load(ckpt)
    _edit_config(ckpt, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 32})
    with pytest.raises(CheckpointError, match=r"missing tensor.*qweight.*the AWQ tensors"):
        minivllm.load(ckpt)
    _edit_config(ckpt, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(CheckpointError, match="quant_method 'gptq' is not supported"):
        minivllm.load(ckpt)


def test_hidden_act_other_than_silu_is_refused(ckpt):
    """The MLP is SiLU-gated; another activation used to load and compute SiLU silently."""
    _edit_config(ckpt, hidden_act="gelu")
    with pytest.raises(CheckpointError, match="hidden_act.*gelu"):
        minivllm.load(ckpt)


def test_silu_config_still_loads(model, ckpt):
    _edit_config(ckpt, hidden_act="silu", quantization_config=None)
    params = minivllm.load(ckpt)
    torch.testing.assert_close(params.final_norm, model.model.norm.weight)


def test_file_path_is_called_a_file(ckpt):
    with pytest.raises(CheckpointError, match="is a file, not a directory"):
        minivllm.load(os.path.join(ckpt, "model.safetensors"))


def test_bin_only_checkpoint_says_so(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    torch.save(load_file(file), os.path.join(ckpt, "pytorch_model.bin"))
    os.remove(file)
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors"):
        minivllm.load(ckpt)


@pytest.mark.parametrize("key, value", [("rms_norm_eps", None), ("max_position_embeddings", None),
                                        ("rope_theta", "x"), ("tie_word_embeddings", "false"),
                                        ("num_attention_heads", 0), ("num_key_value_heads", 0),
                                        ("eos_token_id", "x"), ("eos_token_id", [1, 2.5]),
                                        ("bos_token_id", [1]), ("rope_parameters", [1, 2]),
                                        ("rope_scaling", "llama3")])
def test_bad_config_value_is_named(ckpt, key, value):
    """These used to be a TypeError / ZeroDivisionError naming nothing, or ("false") a tied head;
    a 0 KV heads was taken as absent (all heads), a malformed EOS id failed in an int() once the
    weights had loaded, a rope dict that is not one raised dict()'s TypeError."""
    changes = {key: value}
    if key == "num_attention_heads":
        changes["head_dim"] = None  # head_dim derived from hidden_size // num_attention_heads
    if key in ("rope_theta", "rope_scaling"):
        changes["rope_parameters"] = None
    _edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=key):
        minivllm.load(ckpt)


def test_a_float64_checkpoint_loads_in_float32(model, tmp_path):
    """Its config says float64, which minivllm does not compute in: "auto" is float32, and the
    weights are narrowed as they load (they were refused as an unknown dtype)."""
    path = save_checkpoint(model.double(), tmp_path / "f64")
    assert json.load(open(os.path.join(path, "config.json")))["dtype"] == "float64"
    params = minivllm.load(path)
    assert params.dtype == torch.float32
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with torch.no_grad():
        want = model.double()(ids).logits[0, -1].float()
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
    got, _ = minivllm.forward(params, cache, minivllm.make_batch(
        [minivllm.SeqChunk(ids[0].tolist(), 0, [0, 1])], block_size=4))
    torch.testing.assert_close(got[0], want, atol=1e-4, rtol=1e-4)


def test_null_dtype_defers_to_torch_dtype():
    """{"dtype": null, "torch_dtype": "float16"} used to load as bfloat16 (the default)."""
    d = dict(vocab_size=10, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=2, dtype=None,
             torch_dtype="float16")
    assert minivllm.ModelConfig.from_dict(d).dtype == torch.float16
