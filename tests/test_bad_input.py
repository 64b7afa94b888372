"""Bad input to the functional API: a clear ValueError/TypeError before any work, cache untouched."""

import pytest
import torch
import torch.utils._pytree as pytree

import minivllm
from minivllm.state import ModelConfig

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


def _asdict(config):
    import attrs
    return attrs.asdict(config, recurse=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2, temperature=-1.0), "temperature"),
    (dict(max_new_tokens=2, top_p=0.0), "top_p"),
    (dict(max_new_tokens=2, top_k=0), "top_k"),
    (dict(max_new_tokens=2, backend="nonsense"), "nonsense"),
])
def test_bad_generation_arguments(params, cache, kwargs, match):
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(ValueError, match=match):
        minivllm.generate(params, cache, [[1, 2]], **kwargs)
    assert_untouched(cache, snapshot)


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
