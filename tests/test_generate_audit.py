"""What mutating functional/generate.py let through (session 49): each test fails on its mutant.
The references are greedy generation and draws from a uniform distribution (a model whose LM head
is zero gives every id the same logit)."""

import attrs
import pytest
import torch

import minivllm
from minivllm.state import ModelConfig

CONFIG = ModelConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def params():
    return minivllm.random_params(CONFIG, seed=0, std=0.2)


@pytest.fixture(scope="module")
def flat(params):
    """The same model with a zero LM head: every step's logits are all 0, a uniform draw."""
    return attrs.evolve(params, lm_head=torch.zeros_like(params.lm_head))


def _generate(params, prompts, num_blocks=16, **kwargs):
    cache = minivllm.init_cache(params, num_blocks=num_blocks, block_size=4)
    return minivllm.generate(params, cache, prompts, **kwargs)[0]


def test_a_cache_that_exactly_fits_is_enough(params):
    """Two prompts of 5 tokens and 4 new ones use positions 0..7 each: 2 blocks of 4 apiece,
    4 blocks in all, so a cache of exactly 4 blocks serves them."""
    want = _generate(params, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], max_new_tokens=4)
    assert _generate(params, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], num_blocks=4,
                     max_new_tokens=4) == want
    with pytest.raises(ValueError, match="need 4 blocks of 4 tokens, the cache has 3"):
        _generate(params, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], num_blocks=3, max_new_tokens=4)


@pytest.mark.parametrize("kwargs", [dict(), dict(top_k=30)])  # the Gumbel and inverse-CDF paths
def test_each_step_draws_afresh(flat, kwargs):
    """Under a uniform distribution over 60 ids, 40 seeded draws are not one id repeated: each
    step draws new randomness (its step counter advances), whichever sampling path it takes."""
    out = _generate(flat, [[1, 2, 3]], max_new_tokens=40, temperature=1.0, seed=3, **kwargs)[0]
    assert len(out) == 40
    assert len(set(out)) >= 15, out  # 40 uniform draws from 60 ids: ~29 distinct


@pytest.mark.parametrize("kwargs", [dict(), dict(top_k=30)])
def test_prompts_of_one_call_draw_independent_streams(flat, kwargs):
    """Identical prompts in one seeded call sample independently (each prompt has its own
    stream): under a uniform distribution their 20 tokens are not the same sequence."""
    a, b = _generate(flat, [[1, 2, 3], [1, 2, 3]], max_new_tokens=20, temperature=1.0, seed=9,
                     **kwargs)
    assert sum(x == y for x, y in zip(a, b)) <= 5, (a, b)  # ~1/60 of them agree by chance


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_tokens(params, kwargs):
    """top_k=1 keeps only the most likely id, as does a top_p below the top id's mass: at
    temperature 1 the draw is then the greedy one, whatever the seed."""
    prompts = [[1, 2, 3], [7, 30, 11, 4]]
    greedy = _generate(params, prompts, max_new_tokens=12)
    sampled = _generate(params, prompts, max_new_tokens=12, temperature=1.0, seed=4, **kwargs)
    free = _generate(params, prompts, max_new_tokens=12, temperature=1.0, seed=4)
    assert free != greedy  # the reference: sampling at temperature 1 does stray here
    assert sampled == greedy
