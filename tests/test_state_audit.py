"""What mutating state/ let through (session 49): each test fails on its mutant. The references
are transformers' Qwen3Config (defaults, key precedence) and the documented contracts of
ModelConfig, init_cache, check_cache_fits, make_batch and ShardSpec."""

import pytest
import torch
from transformers import Qwen3Config

import minivllm
from minivllm.state import KVCache, ModelConfig, SeqChunk, ShardSpec, make_batch
from hf_tiny import hf_config, make_hf_model, save_checkpoint

SMALL = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, dtype=torch.float32)


def _hf_dict(**changes):
    d = {k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    d.update(changes)
    return {k: v for k, v in d.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# config.py: what transformers reads the same config.json as


def test_defaults_of_a_sparse_config_are_transformers_defaults():
    """A config.json without rope_theta or rms_norm_eps reads as transformers' Qwen3Config reads
    it (a RoPE base of 1e4, an eps of 1e-6)."""
    d = _hf_dict(rms_norm_eps=None)
    hf = Qwen3Config.from_dict(d)
    ours = ModelConfig.from_dict(d)
    assert ours.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert ours.rms_norm_eps == hf.rms_norm_eps


def test_dtype_takes_precedence_over_torch_dtype_as_in_transformers():
    d = _hf_dict(dtype="float16", torch_dtype="bfloat16")
    assert Qwen3Config.from_dict(d).dtype == torch.float16
    assert ModelConfig.from_dict(d).dtype == torch.float16


def test_a_default_rope_scaling_is_no_scaling():
    """rope_scaling {"rope_type": "default"} (or "type") is plain RoPE, as transformers reads it:
    no scaling dict survives, and the frequencies are the unscaled ones."""
    from minivllm.functional import rope_inv_freq

    plain = ModelConfig.from_dict(_hf_dict(rope_theta=5000.0))
    for scaling in ({"rope_type": "default"}, {"type": "default"}):
        c = ModelConfig.from_dict(_hf_dict(rope_theta=5000.0, rope_scaling=scaling))
        assert c.rope_scaling is None and c == plain
        assert torch.equal(rope_inv_freq(c), rope_inv_freq(plain))


def test_key_order_does_not_make_two_configs_unequal():
    """The config is treedef context (static): two readings of one config.json whose rope dict
    lists its keys in another order must be equal and hash alike, or a compiled step would
    recompile for nothing."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    a = ModelConfig.from_dict(_hf_dict(rope_scaling=scaling))
    b = ModelConfig.from_dict(_hf_dict(rope_scaling=dict(reversed(list(scaling.items())))))
    assert a == b and hash(a) == hash(b)


def test_a_single_eos_id_is_an_eos_id():
    assert ModelConfig(**{**_asdict(SMALL), "eos_token_id": 7}).eos_token_ids == (7,)
    assert ModelConfig.from_dict(_hf_dict(eos_token_id=7)).eos_token_ids == (7,)
    assert ModelConfig.from_dict(_hf_dict(eos_token_id=[7, 9])).eos_token_ids == (7, 9)
    assert ModelConfig.from_dict(_hf_dict(eos_token_id=None)).eos_token_ids == ()


@pytest.mark.parametrize("changes, match", [
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(eos_token_id=[3, -2]), "eos_token_id"),
    (dict(bos_token_id=-1), "bos_token_id"),
    (dict(max_position_embeddings=4096.5), "max_position_embeddings"),
    (dict(num_attention_heads=6, num_key_value_heads=4, head_dim=8), "not a multiple"),
    (dict(use_sliding_window=True), "sliding"),
    (dict(model_type="llama"), "model_type"),
])
def test_config_values_it_cannot_run_are_refused(changes, match):
    """Each of these used to read as a config: a negative EOS id (that no token equals), a
    fractional position limit (int() truncated it), query heads that do not group over the KV
    heads, a sliding window minivllm does not implement, another model type."""
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict(_hf_dict(**changes))


def test_whole_valued_float_sizes_are_taken():
    """4096.0 is an integer value (some exporters write them so): read as 4096."""
    assert ModelConfig.from_dict(_hf_dict(max_position_embeddings=4096.0)).max_position_embeddings == 4096


def _asdict(config):
    import attrs
    return attrs.asdict(config, recurse=False)


# ---------------------------------------------------------------------------------------------
# cache.py and batch.py: what a step would otherwise run on silently


@pytest.fixture(scope="module")
def params():
    return minivllm.random_params(SMALL, seed=0, std=0.2)


def test_a_block_size_of_zero_is_refused(params):
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        minivllm.init_cache(params, num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        make_batch([SeqChunk([1], 0, [0])], block_size=0)


def test_a_cache_with_fewer_v_layers_than_k_layers_is_refused(params):
    """forward zips the layers with cache.k and cache.v: one V layer short, the last layer
    would silently not run."""
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
    short = KVCache(k=cache.k, v=cache.v[:1])
    batch = make_batch([SeqChunk([1, 2], 0, [0])], block_size=4)
    with pytest.raises(ValueError, match="layers"):
        minivllm.forward(params, short, batch)
    with pytest.raises(ValueError, match="layers"):
        minivllm.generate(params, short, [[1, 2]], max_new_tokens=2)


@pytest.mark.parametrize("what", ["dtype", "shape"])
def test_generate_checks_every_layer_of_the_cache_not_only_the_first(params, what):
    """The step check looks at layer 0 only (its cost is per step); generate's whole check
    looks at each layer: here only layer 1's V buffer is wrong."""
    good = minivllm.init_cache(params, num_blocks=4, block_size=4)
    wrong = (minivllm.init_cache(params, num_blocks=4, block_size=4, dtype=torch.float16)
             if what == "dtype" else minivllm.init_cache(params, num_blocks=3, block_size=4))
    cache = KVCache(k=good.k, v=(good.v[0], wrong.v[1]))
    with pytest.raises(ValueError, match=rf"cache\.v\[1\].*{what}"):
        minivllm.generate(params, cache, [[1, 2]], max_new_tokens=2)


# ---------------------------------------------------------------------------------------------
# load.py: tensors a checkpoint may carry beside the model's


def test_a_tied_checkpoint_may_carry_lm_head_and_rotary_buffers(tmp_path):
    """Some exporters write a tied model's lm_head.weight anyway, and older transformers saved
    each layer's rotary_emb.inv_freq buffer: both load (the head stays the embedding), and the
    logits are transformers'."""
    import os

    from safetensors.torch import load_file, save_file

    model = make_hf_model(seed=6, std=0.3, tie_word_embeddings=True)
    path = save_checkpoint(model, tmp_path / "tied")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    for n in range(2):
        tensors[f"model.layers.{n}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, file, metadata={"format": "pt"})
    params = minivllm.load(path)
    assert params.lm_head is None
    prompt = [5, 9, 2, 77, 31]
    cache = minivllm.init_cache(params, num_blocks=2, block_size=4)
    logits, _ = minivllm.forward(params, cache, make_batch([SeqChunk(prompt, 0, [0, 1])], block_size=4))
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# shard.py and params.py: a rank's slices


@pytest.mark.parametrize("heads, kv_heads, world_size", [(8, 2, 4), (8, 2, 8), (4, 1, 2), (8, 4, 2),
                                                          (16, 4, 8), (6, 2, 2)])
def test_a_ranks_kv_heads_are_those_its_query_heads_attend_to(heads, kv_heads, world_size):
    """Query head h reads KV head h // (heads / kv_heads) (transformers' repeat_kv). A rank
    holding query heads [q0, q1) must hold exactly the KV heads they read, whether KV heads
    are split (kv_heads >= world_size) or replicated (kv_heads < world_size)."""
    c = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                    num_heads=heads, num_kv_heads=kv_heads, head_dim=4)
    group = heads // kv_heads
    for rank in range(world_size):
        s = ShardSpec(rank=rank, world_size=world_size)
        s.check(c)
        q0, q1 = s.head_range(c)
        k0, k1 = s.kv_head_range(c)
        assert k1 - k0 == s.num_kv_heads(c)
        assert {h // group for h in range(q0, q1)} == set(range(k0, k1)), (rank, (q0, q1), (k0, k1))


def test_a_rank_must_be_below_the_world_size():
    with pytest.raises(ValueError, match="rank"):
        ShardSpec(rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        ShardSpec(rank=-1, world_size=2)


def test_random_params_refuses_a_shard_the_config_cannot_split():
    with pytest.raises(ValueError, match="num_attention_heads"):
        minivllm.random_params(SMALL, shard=ShardSpec(rank=0, world_size=3))


def test_random_params_ranks_hold_slices_of_the_single_rank_tensors():
    """Every rank draws the same full tensors and keeps its slice, so TP=N equals TP=1 for the
    same seed: the ranks' column-parallel rows stack, and their row-parallel columns join, into
    the world-size-1 tensors (in head order)."""
    c = ModelConfig(vocab_size=51, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                    num_kv_heads=2, head_dim=8, dtype=torch.float32)
    full = minivllm.random_params(c, seed=3)
    ranks = [minivllm.random_params(c, seed=3, shard=ShardSpec(rank=r, world_size=2)) for r in range(2)]
    lp, parts = full.layers[0], [p.layers[0] for p in ranks]
    d, h = c.head_dim, c.hidden_size
    for name, dim in (("o_proj", 1), ("down", 1)):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts], dim), getattr(lp, name)), name
    # qkv: each rank holds its q heads, then its k heads, then its v heads
    q, k, v = lp.qkv.split([4 * d, 2 * d, 2 * d])
    for r, p in enumerate(parts):
        assert torch.equal(p.qkv, torch.cat([q[2 * r * d:(2 * r + 2) * d], k[r * d:(r + 1) * d],
                                             v[r * d:(r + 1) * d]]))
    gate, up = lp.gate_up.chunk(2)
    for r, p in enumerate(parts):
        assert torch.equal(p.gate_up, torch.cat([gate[24 * r:24 * (r + 1)], up[24 * r:24 * (r + 1)]]))
    embed = torch.cat([p.embed for p in ranks])  # vocabulary padded to 52
    assert torch.equal(embed[:51], full.embed) and not embed[51:].any()
    for name in ("input_norm", "q_norm", "k_norm", "post_norm"):
        assert torch.equal(getattr(parts[1], name), getattr(lp, name))


def test_random_norm_weights_are_near_one():
    """random_params' norm weights are near 1 (its docstring: activations keep a realistic
    scale), its linear weights of scale std."""
    p = minivllm.random_params(SMALL, seed=0, std=0.02)
    for w in (p.final_norm, p.layers[0].input_norm, p.layers[1].q_norm, p.layers[1].post_norm):
        assert 0.6 < w.min() and w.max() < 1.4 and abs(w.mean().item() - 1) < 0.1
    assert abs(p.layers[0].qkv.std().item() - 0.02) < 0.004


def test_check_params_names_a_layer_that_is_not_a_layerparams():
    import attrs

    from minivllm.state import check_params

    p = minivllm.random_params(SMALL, seed=0)
    bad = attrs.evolve(p, layers=(p.layers[0], attrs.asdict(p.layers[1], recurse=False)))
    with pytest.raises(TypeError, match=r"params.layers\[1\] must be a LayerParams, got dict"):
        check_params(bad)


# ---------------------------------------------------------------------------------------------
# pytree.py


def test_key_paths_name_the_fields_they_lead_to():
    """flatten_with_keys names each leaf after its field, None fields skipped: a SamplingBatch
    without penalties (output_ids, prompt_ids None) but with banned ids, and an untied Params."""
    import torch.utils._pytree as pytree

    from minivllm.functional.sampling import SamplingRow, make_sampling_batch

    sb = make_sampling_batch([SamplingRow(banned_ids=(1, 2))], vocab_size=10)
    assert sb.output_ids is None and sb.banned_rows is not None
    p = minivllm.random_params(SMALL, seed=0)
    for obj in (sb, p):
        leaves = pytree.tree_flatten_with_path(obj)[0]
        assert leaves
        for path, leaf in leaves:
            value = obj
            for key in path:
                value = getattr(value, key.name) if isinstance(key, pytree.GetAttrKey) else value[key.idx]
            assert value is leaf, pytree.keystr(path)
