"""state/: config parsing in both layouts, pytree round trips, make_batch against a per-token
reference, compile without recompiles."""

import json

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given, strategies as st

import minivllm
from minivllm.state import KVCache, ModelConfig, ShardSpec, make_batch, SeqChunk
from minivllm.state.batch import slot_of
from hf_tiny import hf_config, make_hf_model, save_checkpoint

SMALL = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=8, dtype=torch.float32)


def test_config_reads_both_layouts(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = make_hf_model(rope_parameters={"rope_theta": 5000.0, **scaling}, tie_word_embeddings=True)
    v5 = ModelConfig.from_json(save_checkpoint(model, tmp_path / "v5"))
    v4 = ModelConfig.from_json(save_checkpoint(model, tmp_path / "v4", layout="v4"))
    assert "rope_theta" in json.loads((tmp_path / "v4" / "config.json").read_text())
    assert v4 == v5
    assert v5.rope_theta == 5000.0 and v5.rope_scaling_dict["factor"] == 8.0
    assert v5.tie_word_embeddings and v5.num_kv_heads == 2 and v5.head_dim == 16


def test_config_reads_the_old_type_key_in_both_layouts():
    """transformers reads a scaling dict's "type" as "rope_type" (rope_parameters included): a
    llama3 config that says "type" is still scaled, in either layout."""
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    for key, value in (("rope_parameters", {"rope_theta": 5000.0, **scaling}),
                       ("rope_scaling", scaling)):
        d = {k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
        c = ModelConfig.from_dict({**d, key: value})
        assert c.rope_scaling_dict == {**{k: v for k, v in scaling.items() if k != "type"},
                                       "rope_type": "llama3"}, key


@pytest.mark.parametrize("scaling, match", [
    ({"rope_type": "llama3"}, "factor"),
    ({"rope_type": "llama3", "factor": "8"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0},
     "low_freq_factor < high_freq_factor"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 0},
     "original_max_position_embeddings"),
])
def test_config_rejects_llama3_scaling_it_cannot_compute(scaling, match):
    d = {k: v for k, v in hf_config().to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_dict({**d, "rope_parameters": {"rope_theta": 1e4, **scaling}})


def test_config_rejects_other_architectures():
    d = hf_config().to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelConfig.from_dict(d)


def test_config_default_head_dim_and_kv_heads():
    """Absent, they default as transformers' Qwen3Config reads the same dict (head_dim 128, not
    hidden // heads); a null KV-head count means every head (transformers' and vLLM's rule)."""
    from transformers import Qwen3Config
    d = hf_config().to_dict()
    del d["head_dim"]
    d["num_key_value_heads"] = None
    c = ModelConfig.from_dict(d)
    oracle = Qwen3Config.from_dict(d)
    assert c.head_dim == oracle.head_dim == 128
    assert c.num_kv_heads == oracle.num_key_value_heads == c.num_heads


def test_params_pytree_round_trip():
    params = minivllm.random_params(SMALL, seed=0)
    leaves, spec = pytree.tree_flatten(params)
    # 3 top-level tensors (embed, final_norm, lm_head) + 8 per layer
    assert len(leaves) == 3 + 8 * SMALL.num_layers
    assert all(isinstance(t, torch.Tensor) for t in leaves)
    back = pytree.tree_unflatten(leaves, spec)
    assert back.config == SMALL and back.shard == params.shard
    assert all(a is b for a, b in zip(pytree.tree_leaves(back), leaves))
    doubled = pytree.tree_map(lambda t: t * 2, params)
    assert isinstance(doubled, minivllm.Params)
    torch.testing.assert_close(doubled.layers[1].qkv, params.layers[1].qkv * 2)


def test_tied_params_have_no_head_leaf():
    tied = minivllm.random_params(ModelConfig(**{**_fields(SMALL), "tie_word_embeddings": True}))
    assert tied.lm_head is None and tied.head_weight is tied.embed
    assert len(pytree.tree_leaves(tied)) == 2 + 8 * SMALL.num_layers


def _fields(config):
    import attrs
    return attrs.asdict(config, recurse=False)


def test_cache_and_batch_round_trip():
    params = minivllm.random_params(SMALL)
    cache = minivllm.init_cache(params, num_blocks=4, block_size=8)
    assert cache.k[0].shape == (4, 8, 2, 8) and cache.num_slots == 32
    leaves, spec = pytree.tree_flatten(cache)
    assert len(leaves) == 2 * SMALL.num_layers
    assert isinstance(pytree.tree_unflatten(leaves, spec), KVCache)
    batch = make_batch([SeqChunk([1, 2, 3], 0, [2])], block_size=8)
    leaves, spec = pytree.tree_flatten(batch)
    assert len(leaves) == 7
    assert pytree.tree_unflatten(leaves, spec).slot_mapping.tolist() == [16, 17, 18]


@given(st.data())
def test_make_batch_matches_a_per_token_reference(data):
    """make_batch's vectorized packing equals a token-by-token construction: each token's
    position, its cache slot through the block table (slot_of), the offsets, context lengths,
    padded block tables and the rows that get logits."""
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    every_row = data.draw(st.booleans())
    chunks, next_block = [], 0
    for _ in range(data.draw(st.integers(1, 5))):
        num_cached, n = data.draw(st.integers(0, 40)), data.draw(st.integers(1, 30))
        blocks = -(-(num_cached + n) // block_size) + data.draw(st.integers(0, 2))
        table = data.draw(st.permutations(range(next_block, next_block + blocks)))
        next_block += blocks
        ids = data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
        chunks.append(SeqChunk(ids, num_cached, table, want_logits=data.draw(st.booleans())))
    max_blocks = data.draw(st.none() | st.integers(0, 12))
    batch = make_batch(chunks, block_size=block_size, max_blocks=max_blocks, every_row=every_row)

    ids, positions, slots, cu, ctx, rows = [], [], [], [0], [], []
    width = max(max_blocks or 0, *(len(c.block_table) for c in chunks))
    for c in chunks:
        for j, tok in enumerate(c.token_ids):
            pos = c.num_cached + j
            ids.append(tok)
            positions.append(pos)
            slots.append(slot_of(c.block_table, pos, block_size))
            if every_row:
                rows.append(len(ids) - 1)
        cu.append(len(ids))
        ctx.append(c.num_cached + len(c.token_ids))
        if c.want_logits and not every_row:
            rows.append(len(ids) - 1)
    tables = [list(c.block_table) + [-1] * (width - len(c.block_table)) for c in chunks]
    assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions
    assert batch.slot_mapping.tolist() == slots and batch.cu_seqlens_q.tolist() == cu
    assert batch.context_lens.tolist() == ctx and batch.block_tables.tolist() == tables
    assert batch.logits_indices.tolist() == rows
    assert [batch.input_ids.dtype, batch.slot_mapping.dtype, batch.cu_seqlens_q.dtype,
            batch.block_tables.dtype] == [torch.int64, torch.int64, torch.int32, torch.int32]


def test_make_batch_rejects_bad_chunks():
    with pytest.raises(ValueError, match="at least one sequence"):
        make_batch([], block_size=4)
    with pytest.raises(ValueError, match="sequence 1 brings no new tokens"):
        make_batch([SeqChunk([1], 0, [0]), SeqChunk([], 0, [1])], block_size=4)
    with pytest.raises(ValueError, match="needs 5 slots but its block table holds 4"):
        make_batch([SeqChunk([1, 2], 3, [0])], block_size=4)
    bad = [  # what packing would truncate, wrap or hand on to the cache write
        ([SeqChunk([1.9, 5.5], 0, [0])], {}, TypeError, "chunk 0's token_ids"),
        ([SeqChunk([True, False], 0, [0])], {}, TypeError, "chunk 0's token_ids"),
        ([SeqChunk([1], 0, [0]), SeqChunk([1, -2], 0, [1])], {}, ValueError, "chunk 1's token_ids holds -2"),
        ([SeqChunk([1, 2], -3, [0])], {}, ValueError, "num_cached"),
        ([SeqChunk([1, 2], 0.7, [0])], {}, ValueError, "num_cached"),
        ([SeqChunk([1, 2], 0, [-1])], {}, ValueError, "block_table holds -1"),
        ([SeqChunk([1, 2], 0, [0.0])], {}, TypeError, "block_table"),
        ([SeqChunk([1, 2], 0, [0], 1)], {}, TypeError, "want_logits"),
        ([(([1], 0, [0]))], {}, TypeError, "SeqChunk"),
        ([SeqChunk([1, 2], 0, [8])], dict(num_blocks=8), ValueError, "num_blocks"),
        ([SeqChunk([1, 50], 0, [0])], dict(vocab_size=50), ValueError, "vocabulary size"),
        ([SeqChunk([1], 0, [0])], dict(block_size=True), ValueError, "block_size"),
    ]
    for chunks, kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            make_batch(chunks, **{"block_size": 4, **kwargs})
    # at the bounds, and numpy's integers, are accepted
    import numpy as np
    make_batch([SeqChunk(np.array([0, 49]), np.int64(2), [np.int32(7)])], block_size=4,
               num_blocks=8, vocab_size=50)
    make_batch([SeqChunk([0, 49], torch.tensor(2), [7], np.bool_(True))], block_size=4)


def test_decode_chunks_are_the_chunks_they_hold():
    """DecodeChunks (a decode step as columns) stands wherever its rows' SeqChunks do: indexed,
    sliced, pickled (a tensor-parallel rank's step) and packed by make_batch."""
    import pickle

    from minivllm.state.batch import DecodeChunks

    chunks = [SeqChunk([7], 5, [3, 1]), SeqChunk([2], 0, [4]), SeqChunk([9], 8, [0, 2, 5])]
    cols = DecodeChunks.of(chunks)
    assert len(cols) == 3 and list(cols) == chunks and cols[1:] == chunks[1:]
    again = pickle.loads(pickle.dumps(cols))
    assert isinstance(again, DecodeChunks) and list(again) == chunks
    a, b = make_batch(cols, block_size=4), make_batch(chunks, block_size=4)
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="one token"):
        DecodeChunks.of([SeqChunk([1, 2], 0, [0])])
    with pytest.raises(ValueError, match="one token"):
        DecodeChunks.of([SeqChunk([1], 0, [0], want_logits=False)])
    with pytest.raises(ValueError, match="differ in length"):
        DecodeChunks([1, 2], [0], [[0], [1]])


def test_shard_spec_ranges():
    c = ModelConfig(vocab_size=51, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=8,
                    num_kv_heads=2, head_dim=4)
    s = ShardSpec(rank=3, world_size=4)
    assert s.head_range(c) == (6, 8)
    assert s.kv_head_range(c) == (1, 2)  # 2 KV heads over 4 ranks: each replicated twice
    assert s.padded_vocab(c) == 52 and s.vocab_range(c) == (39, 52)
    with pytest.raises(ValueError, match="num_attention_heads"):
        ShardSpec(rank=0, world_size=3).check(c)


def test_compiled_forward_accepts_new_instances_without_recompiling():
    from torch._dynamo.testing import CompileCounter

    params = minivllm.random_params(SMALL, seed=1)
    counter = CompileCounter()
    fn = torch.compile(minivllm.forward, backend=counter, fullgraph=True)
    batch = make_batch([SeqChunk([1, 2, 3], 0, [0]), SeqChunk([4, 5], 0, [1])], block_size=8)
    for seed in range(3):
        p = minivllm.random_params(SMALL, seed=seed)  # a new Params around same-shaped tensors
        cache = minivllm.init_cache(p, num_blocks=4, block_size=8)
        b = pytree.tree_map(lambda t: t.clone(), batch)  # a new Batch too
        fn(p, cache, b)
    assert counter.frame_count == 1
