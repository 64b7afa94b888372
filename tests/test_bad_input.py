"""Bad input to the functional API: a clear ValueError/TypeError before any work, cache untouched."""

import attrs
import pytest
import torch
import torch.utils._pytree as pytree

import minivllm
from minivllm.state import ModelConfig, check_params

CONFIG = ModelConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def params():
    return minivllm.random_params(CONFIG, seed=0, std=0.2)


@pytest.fixture
def cache(params):
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    for t in pytree.tree_leaves(cache):
        t.normal_()  # a cache that already holds other requests' data
    return cache


def assert_untouched(cache, snapshot):
    for a, b in zip(pytree.tree_leaves(cache), snapshot):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens, error, match", [
    ([[1, 2, 60]], ValueError, r"token id 60, outside the vocabulary \[0, 60\)"),
    ([[1, -1]], ValueError, "token id -1"),
    ([[1, 2], []], ValueError, "prompt 1 is empty"),
    ([], ValueError, "non-empty list"),
    ([[1, 2.5]], TypeError, "not an int"),
    ([3, 4], TypeError, "prompt 0 must be a list"),
    (torch.tensor([[1, 2]]), TypeError, "not a tensor"),
])
def test_bad_prompts(params, cache, tokens, error, match):
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(error, match=match):
        minivllm.generate(params, cache, tokens, max_new_tokens=4)
    assert_untouched(cache, snapshot)


def test_too_many_tokens_for_the_cache(params, cache):
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    # 8 blocks of 4 = 32 slots; two prompts of 10 + 15 new tokens need 2 * 6 = 12 blocks
    with pytest.raises(ValueError, match=r"need 12 blocks of 4 tokens, the cache has 8"):
        minivllm.generate(params, cache, [list(range(10)), list(range(10))], max_new_tokens=15)
    assert_untouched(cache, snapshot)


def test_cache_that_does_not_fit_the_params(params):
    wrong_dtype = minivllm.init_cache(params, num_blocks=8, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        minivllm.generate(params, wrong_dtype, [[1, 2]], max_new_tokens=2)
    wrong_device = minivllm.init_cache(params, num_blocks=8, device="meta")
    with pytest.raises(ValueError, match="meta"):
        minivllm.generate(params, wrong_device, [[1, 2]], max_new_tokens=2)
    other = minivllm.random_params(ModelConfig(**{**_asdict(CONFIG), "num_kv_heads": 4}))
    wrong_shape = minivllm.init_cache(other, num_blocks=8)
    with pytest.raises(ValueError, match="shape"):
        minivllm.generate(params, wrong_shape, [[1, 2]], max_new_tokens=2)
    too_few_layers = minivllm.KVCache(k=wrong_dtype.k[:1], v=wrong_dtype.v[:1])
    with pytest.raises(ValueError, match="1 layers"):
        minivllm.generate(params, too_few_layers, [[1, 2]], max_new_tokens=2)
    with pytest.raises(TypeError, match="KVCache"):
        minivllm.generate(params, {"k": 1}, [[1, 2]], max_new_tokens=2)


def test_cache_whose_layers_share_memory(params, cache):
    shared = minivllm.KVCache(k=(cache.k[0], cache.k[0]), v=cache.v)
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(ValueError, match=r"cache.k\[0\] and cache.k\[1\] share memory"):
        minivllm.generate(params, shared, [[1, 2]], max_new_tokens=2)
    k_is_v = minivllm.KVCache(k=cache.k, v=(cache.v[0], cache.k[1]))
    with pytest.raises(ValueError, match="share memory"):
        minivllm.generate(params, k_is_v, [[1, 2]], max_new_tokens=2)
    assert_untouched(cache, snapshot)
    # Disjoint slices of one allocation are separate buffers, and work.
    one = torch.zeros((4, *cache.k[0].shape), dtype=cache.dtype)
    sliced = minivllm.KVCache(k=(one[0], one[1]), v=(one[2], one[3]))
    own = minivllm.init_cache(params, num_blocks=8, block_size=4)
    expected, _ = minivllm.generate(params, own, [[1, 2]], max_new_tokens=3)
    assert minivllm.generate(params, sliced, [[1, 2]], max_new_tokens=3)[0] == expected


def _asdict(config):
    import attrs
    return attrs.asdict(config, recurse=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p"),
    (dict(max_new_tokens=2, top_k=0), "top_k"),
    (dict(max_new_tokens=2, backend="nonsense"), "nonsense"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=float("nan")), "temperature"),
    (dict(max_new_tokens=2, temperature=float("inf")), "temperature"),
    (dict(max_new_tokens=2, temperature=True), "temperature"),
    (dict(max_new_tokens=2, top_k=True), "top_k"),
    (dict(max_new_tokens=2, top_p="0.5"), "top_p"),
    (dict(max_new_tokens=2, eos_token_id=-5), "eos_token_id -5"),
    (dict(max_new_tokens=2, eos_token_id=[3, 60]), r"eos_token_id 60 is outside the vocabulary"),
])
def test_bad_generation_arguments(params, cache, kwargs, match):
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(ValueError, match=match):
        minivllm.generate(params, cache, [[1, 2]], **kwargs)
    assert_untouched(cache, snapshot)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seed="x"), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(eos_token_id=1.5), "eos_token_id"),
    (dict(eos_token_id="7"), "eos_token_id"),
    (dict(eos_token_id=[True]), "eos_token_id"),
    (dict(backend=3), "backend"),
])
def test_generation_arguments_of_the_wrong_type(params, cache, kwargs, match):
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(TypeError, match=match):
        minivllm.generate(params, cache, [[1, 2]], max_new_tokens=2, **kwargs)
    assert_untouched(cache, snapshot)


def test_init_cache_rejects_bools(params):
    with pytest.raises(ValueError, match="num_blocks"):
        minivllm.init_cache(params, num_blocks=True)
    with pytest.raises(ValueError, match="block_size"):
        minivllm.init_cache(params, num_blocks=4, block_size=True)


def test_unseeded_generate_leaves_torchs_global_generator_alone(params):
    def draw_after(generate: bool):
        torch.manual_seed(1234)
        if generate:
            cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
            minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=3, temperature=1.0)
        return torch.randn(4)
    assert torch.equal(draw_after(True), draw_after(False))


def test_the_position_limit_counts_only_positions_fed_back():
    """The last sampled token is never fed back: a prompt of L tokens and N new ones uses
    positions 0 .. L + N - 2, so L + N - 1 may equal max_position_embeddings."""
    small = minivllm.random_params(ModelConfig(**{**_asdict(CONFIG), "max_position_embeddings": 8}))
    cache = minivllm.init_cache(small, num_blocks=8, block_size=4)
    new, cache = minivllm.generate(small, cache, [[1, 2, 3, 4, 5]], max_new_tokens=4)
    assert len(new[0]) == 4
    with pytest.raises(ValueError, match="max_position_embeddings"):
        minivllm.generate(small, cache, [[1, 2, 3, 4, 5]], max_new_tokens=5)


def test_forward_rejects_a_cache_or_batch_not_made_for_it(params):
    batch = minivllm.make_batch([minivllm.SeqChunk([1, 2], 0, [0])], block_size=4)
    other = minivllm.random_params(ModelConfig(**{**_asdict(CONFIG), "num_kv_heads": 4}))
    with pytest.raises(ValueError, match="shape"):
        minivllm.forward(params, minivllm.init_cache(other, num_blocks=8, block_size=4), batch)
    with pytest.raises(ValueError, match="on meta"):
        minivllm.forward(params, minivllm.init_cache(params, num_blocks=8, block_size=4,
                                                     device="meta"), batch)
    # A cache in another float dtype is init_cache's to make and forward's to use.
    half = minivllm.init_cache(params, num_blocks=8, block_size=4, dtype=torch.float16)
    assert minivllm.forward(params, half, batch)[0].shape == (1, CONFIG.vocab_size)
    with pytest.raises(TypeError, match="Batch"):
        minivllm.forward(params, minivllm.init_cache(params, num_blocks=8, block_size=4),
                         [minivllm.SeqChunk([1, 2], 0, [0])])


def test_forward_refuses_a_batch_made_for_another_block_size(params):
    """Its slots and tables count in blocks of 8 where the cache's hold 16: run, it would write
    and read other tokens' K/V (it did, silently, before Batch carried its block size)."""
    table = [3, 1, 2, 0]
    cache = minivllm.init_cache(params, num_blocks=4, block_size=16)
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    batch = minivllm.make_batch([minivllm.SeqChunk(list(range(1, 20)), 0, table)], block_size=8)
    with pytest.raises(ValueError, match="blocks of 8 tokens, the cache holds blocks of 16"):
        minivllm.forward(params, cache, batch)
    assert_untouched(cache, snapshot)
    right = minivllm.make_batch([minivllm.SeqChunk(list(range(1, 20)), 0, table)], block_size=16)
    assert minivllm.forward(params, cache, right)[0].shape == (1, CONFIG.vocab_size)


def test_params_that_do_not_fit_their_config_are_refused(params, cache):
    """A hand-built or evolved Params: forward counts its layers, generate checks every weight
    (each case ran before, or failed deep inside a matmul)."""
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    one_layer = attrs.evolve(params, layers=params.layers[:1])
    batch = minivllm.make_batch([minivllm.SeqChunk([1, 2], 0, [0])], block_size=4)
    with pytest.raises(ValueError, match="params has 1 layers, its config 2"):
        minivllm.forward(one_layer, cache, batch)
    layer = params.layers[1]
    bad = {
        r"layers\[1\]\.qkv has shape \(32, 64\)": attrs.evolve(
            params, layers=(params.layers[0], attrs.evolve(layer, qkv=layer.qkv.T))),
        r"embed has dtype torch.int64": attrs.evolve(params, embed=params.embed.long()),
        r"layers\[1\]\.down is torch.float16": attrs.evolve(
            params, layers=(params.layers[0], attrs.evolve(layer, down=layer.down.half()))),
        "lm_head is None but the config's embeddings are untied": attrs.evolve(params, lm_head=None),
        "1 layers": one_layer,
    }
    for match, wrong in bad.items():
        with pytest.raises(ValueError, match=match):
            minivllm.generate(wrong, cache, [[1, 2]], max_new_tokens=2)
    assert_untouched(cache, snapshot)
    check_params(params)


def test_seeded_sampling_is_reproducible(params):
    def run(seed):
        cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
        return minivllm.generate(params, cache, [[1, 2, 3], [4]], max_new_tokens=12, temperature=1.0,
                                 top_k=20, top_p=0.9, seed=seed)[0]
    assert run(1) == run(1)
    assert run(1) != run(2)
    # prompt 0's stream does not depend on what it is batched with
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    alone = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=12, temperature=1.0,
                              top_k=20, top_p=0.9, seed=1)[0]
    assert alone[0] == run(1)[0]


def test_eos_stops_a_prompt(params):
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    greedy, _ = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=10)
    eos = greedy[0][3]
    cut = greedy[0].index(eos) + 1
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    stopped, _ = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=10, eos_token_id=eos)
    assert stopped[0] == greedy[0][:cut]


def test_numpy_and_sequence_arguments_are_taken_as_their_python_values(params):
    import numpy as np

    def run(**kwargs):
        cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
        return minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=6, temperature=1.0,
                                 seed=5, **kwargs)[0]
    plain = run(top_p=0.9, top_k=20, eos_token_id=[7, 8, 9])
    assert run(top_p=np.float32(0.9), top_k=np.int64(20), eos_token_id=range(7, 10)) == plain
    assert run(top_p=0.9, top_k=20, eos_token_id=np.array([7, 8, 9])) == plain
    assert run(top_p=0.9, top_k=20, eos_token_id=[np.int64(7), 8, 9]) == plain
    assert run(top_p=0.9, top_k=torch.tensor(20), eos_token_id=torch.tensor(7)) == run(
        top_p=0.9, top_k=20, eos_token_id=7)


def test_prompt_ids_and_counts_may_be_numpy_or_torch_integers(params):
    """The engine takes ids and counts from arrays; so does generate (torch 2.x tensors iterate
    as 0-d tensors, numpy arrays as numpy scalars)."""
    import numpy as np

    def run(tokens, **kwargs):
        cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
        return minivllm.generate(params, cache, tokens, temperature=1.0, **kwargs)[0]
    plain = run([[1, 2, 3]], max_new_tokens=5, seed=9)
    assert run([list(np.array([1, 2, 3]))], max_new_tokens=np.int64(5), seed=np.uint8(9)) == plain
    assert run([list(torch.tensor([1, 2, 3]))], max_new_tokens=torch.tensor(5),
               seed=torch.tensor(9)) == plain
    for bad in (torch.tensor([5]), np.bool_(True), torch.tensor(True), torch.tensor(5.0)):
        with pytest.raises(ValueError, match="max_new_tokens"):
            run([[1, 2, 3]], max_new_tokens=bad)
    with pytest.raises(TypeError, match="prompt 0 holds"):
        run([[1, torch.tensor([2]), 3]], max_new_tokens=2)
