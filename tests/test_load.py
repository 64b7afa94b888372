"""Loading HF checkpoints: merged weights, sharded files, tied heads, slices, and clear errors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import minivllm
from minivllm import CheckpointError, ShardSpec
from minivllm.state import expected_shapes
from hf_tiny import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=3)


@pytest.fixture
def ckpt(model, tmp_path):
    return save_checkpoint(model, tmp_path / "ckpt")


def test_load_merges_qkv_and_gate_up(model, ckpt):
    params = minivllm.load(ckpt)
    sd = model.state_dict()
    lp = params.layers[1]
    p = "model.layers.1."
    torch.testing.assert_close(lp.qkv, torch.cat([sd[p + "self_attn.q_proj.weight"],
                                                   sd[p + "self_attn.k_proj.weight"],
                                                   sd[p + "self_attn.v_proj.weight"]]))
    torch.testing.assert_close(lp.gate_up, torch.cat([sd[p + "mlp.gate_proj.weight"],
                                                       sd[p + "mlp.up_proj.weight"]]))
    torch.testing.assert_close(lp.down, sd[p + "mlp.down_proj.weight"])
    torch.testing.assert_close(params.lm_head, sd["lm_head.weight"])
    assert params.dtype == torch.float32


def test_load_several_files_with_index(model, tmp_path):
    path = save_checkpoint(model, tmp_path / "multi", max_shard_size="20KB")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) > 1 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    a, b = minivllm.load(path), minivllm.load(save_checkpoint(model, tmp_path / "one"))
    for x, y in zip(torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)):
        assert torch.equal(x, y)


def test_load_dtype_and_tied(tmp_path):
    tied = make_hf_model(tie_word_embeddings=True)
    params = minivllm.load(save_checkpoint(tied, tmp_path / "tied"), dtype="bfloat16")
    assert params.lm_head is None and params.dtype == torch.bfloat16
    torch.testing.assert_close(params.embed, tied.model.embed_tokens.weight.to(torch.bfloat16))


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_read_their_slices(model, ckpt, world_size):
    """Each rank's slices, put back together, are the whole model (vocab 101 is padded)."""
    full = minivllm.load(ckpt)
    config = full.config
    shards = [minivllm.load(ckpt, shard=ShardSpec(rank=r, world_size=world_size)) for r in range(world_size)]
    shapes = expected_shapes(config, shards[0].shard)
    assert tuple(shards[0].layers[0].qkv.shape) == shapes["qkv"]
    embed = torch.cat([s.embed for s in shards])
    torch.testing.assert_close(embed[: config.vocab_size], full.embed)
    assert torch.all(embed[config.vocab_size:] == 0)
    torch.testing.assert_close(torch.cat([s.layers[0].down for s in shards], dim=1), full.layers[0].down)
    d = config.head_dim
    q = torch.cat([s.layers[0].qkv[: shapes["o_proj"][1]] for s in shards])
    torch.testing.assert_close(q, full.layers[0].qkv[: config.num_heads * d])


def test_each_rank_holds_its_even_split_of_every_tensor(model, ckpt):
    """Two ranks of the tiny model (4 query heads, 2 KV heads, 96 intermediate, 101 ids padded
    to 102), checked against the Hugging Face tensors split by hand: q, k and v rows of the
    rank's heads in that order, gate then up rows of its half, o_proj's and down's columns,
    its 51 rows of the embedding and LM head (the last one's padding row zero)."""
    sd, d = model.state_dict(), 16
    for r in range(2):
        shard = minivllm.load(ckpt, shard=ShardSpec(rank=r, world_size=2))
        for n, layer in enumerate(shard.layers):
            p = f"model.layers.{n}."

            def rows(name, per):
                return sd[p + name][r * per:(r + 1) * per]
            torch.testing.assert_close(layer.qkv, torch.cat([
                rows("self_attn.q_proj.weight", 2 * d), rows("self_attn.k_proj.weight", d),
                rows("self_attn.v_proj.weight", d)]), rtol=0, atol=0)
            torch.testing.assert_close(layer.o_proj, sd[p + "self_attn.o_proj.weight"][
                :, r * 2 * d:(r + 1) * 2 * d], rtol=0, atol=0)
            torch.testing.assert_close(layer.gate_up, torch.cat([
                rows("mlp.gate_proj.weight", 48), rows("mlp.up_proj.weight", 48)]), rtol=0, atol=0)
            torch.testing.assert_close(layer.down, sd[p + "mlp.down_proj.weight"][
                :, r * 48:(r + 1) * 48], rtol=0, atol=0)
            torch.testing.assert_close(layer.input_norm, sd[p + "input_layernorm.weight"])
        for got, name in ((shard.embed, "model.embed_tokens.weight"),
                          (shard.lm_head, "lm_head.weight")):
            want = torch.cat([sd[name], torch.zeros(1, 64)])[r * 51:(r + 1) * 51]
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_random_params_match_expected_shapes():
    config = minivllm.config_for_shape("qwen3-0.6b", num_layers=1, vocab_size=1000)
    params = minivllm.random_params(config, seed=0, dtype="float32")
    shapes = expected_shapes(config, ShardSpec())
    for name in ("qkv", "o_proj", "gate_up", "down", "q_norm"):
        assert tuple(getattr(params.layers[0], name).shape) == shapes[name]
    assert params.lm_head is None  # 0.6B ties its head


def _tamper(ckpt, fn):
    file = os.path.join(ckpt, "model.safetensors")
    sd = load_file(file)
    fn(sd)
    save_file(sd, file, metadata={"format": "pt"})


def test_missing_tensor_is_named(ckpt):
    _tamper(ckpt, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        minivllm.load(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    _tamper(ckpt, lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.extra\.weight"):
        minivllm.load(ckpt)


def test_wrong_shape_is_named(ckpt):
    _tamper(ckpt, lambda sd: sd.__setitem__("model.norm.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.norm\.weight.*\(3,\)"):
        minivllm.load(ckpt)


def test_missing_config_is_named(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(CheckpointError, match="config.json"):
        minivllm.load(ckpt)


def test_corrupt_file_is_named(ckpt):
    with open(os.path.join(ckpt, "model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        minivllm.load(ckpt)


def test_truncated_file_is_named(ckpt):
    file = os.path.join(ckpt, "model.safetensors")
    data = open(file, "rb").read()
    open(file, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        minivllm.load(ckpt)


def test_wrong_architecture_is_named(ckpt):
    cfg_path = os.path.join(ckpt, "config.json")
    d = json.load(open(cfg_path))
    d["architectures"] = ["MistralForCausalLM"]
    json.dump(d, open(cfg_path, "w"))
    with pytest.raises(CheckpointError, match="MistralForCausalLM"):
        minivllm.load(ckpt)
