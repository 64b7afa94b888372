"""Audit of the functional API (session 76): purity, generate against transformers, torch.func,
and bad input at the public entry points. Each test names what it guards."""

import pytest
import torch
import torch.utils._pytree as pytree

import minivllm
from minivllm.functional import hidden_states, pool_last_token
from minivllm.state import ModelConfig, SeqChunk, make_batch

CONFIG = ModelConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture(scope="module")
def params():
    return minivllm.random_params(CONFIG, seed=0, std=0.2)


def _batch():
    return make_batch([SeqChunk([1, 2, 3, 4, 5], 0, [0, 1]), SeqChunk([7, 8], 0, [2])],
                      block_size=4)


@pytest.mark.parametrize("entry", ["forward", "hidden_states", "pool_last_token"])
@pytest.mark.parametrize("name", ["reference", None])
def test_entry_points_take_a_backend_name_as_generate_does(params, entry, name):
    """generate(backend="reference") works; forward(..., "reference") (or None) raised
    "'str' object is not callable" from inside layer 0. Now the name is resolved as generate
    resolves it (on the CPU both name the reference backend): the same output."""
    fn = {"forward": lambda *a: minivllm.forward(*a)[0], "hidden_states": hidden_states,
          "pool_last_token": pool_last_token}[entry]
    want = fn(params, minivllm.init_cache(params, num_blocks=4, block_size=4), _batch())
    got = fn(params, minivllm.init_cache(params, num_blocks=4, block_size=4), _batch(), name)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_forward_names_a_backend_that_is_not_one(params):
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    with pytest.raises(TypeError, match="backend must be an attention backend"):
        minivllm.forward(params, cache, _batch(), 3)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        minivllm.forward(params, cache, _batch(), "nope")
    for a, b in zip(pytree.tree_leaves(cache), snapshot):
        assert torch.equal(a, b)


def _every_row_batch():
    return make_batch([SeqChunk([1, 2, 3, 4, 5], 0, [0, 1]), SeqChunk([7, 8, 9], 0, [2])],
                      block_size=4, every_row=True)


def test_jvp_and_vjp_of_the_forward_wrt_params_match_finite_differences(params):
    """Not covered before (grad only): forward-mode through the in-place cache write, and vjp
    against grad of the cotangent's dot product; finite differences in float64 weights (the
    logits come back in fp32, hence the step and tolerance)."""
    p64 = pytree.tree_map(lambda t: t.double(), params)
    batch = _every_row_batch()

    def f(p):
        return minivllm.forward(p, minivllm.init_cache(p, num_blocks=3, block_size=4), batch)[0]

    gen = torch.Generator().manual_seed(0)
    tangent = pytree.tree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype), p64)
    _, jout = torch.func.jvp(f, (p64,), (tangent,))
    eps = 1e-4
    fd = (f(pytree.tree_map(lambda a, b: a + eps * b, p64, tangent))
          - f(pytree.tree_map(lambda a, b: a - eps * b, p64, tangent))) / (2 * eps)
    torch.testing.assert_close(jout, fd, rtol=5e-3, atol=5e-3)
    out, vjp = torch.func.vjp(f, p64)
    ct = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    g = torch.func.grad(lambda p: (f(p) * ct).sum())(p64)
    for a, b in zip(pytree.tree_leaves(vjp(ct)[0]), pytree.tree_leaves(g)):
        torch.testing.assert_close(a, b)
    # <jvp(t), ct> = <t, vjp(ct)>: forward and reverse mode agree
    dot = sum((a * b).sum() for a, b in zip(pytree.tree_leaves(g), pytree.tree_leaves(tangent)))
    torch.testing.assert_close((jout.double() * ct).sum(), dot.double(), rtol=1e-5, atol=1e-5)


def test_vmap_over_params_runs_with_a_cache_vmapped_alongside(params):
    """vmap of the prefill over an ensemble of params: each member needs its own cache (the
    cache is written in place), so the caches are stacked too; member i equals its own call."""
    batch = _every_row_batch()
    scales = (1.0, 1.05)
    stacked = pytree.tree_map(lambda t: torch.stack([t * s for s in scales]), params)
    caches = pytree.tree_map(lambda t: torch.stack([t, t]),
                             minivllm.init_cache(params, num_blocks=3, block_size=4))
    out = torch.func.vmap(lambda p, c: minivllm.forward(p, c, batch)[0])(stacked, caches)
    for i, s in enumerate(scales):
        p = pytree.tree_map(lambda t: t * s, params)
        want = minivllm.forward(p, minivllm.init_cache(p, num_blocks=3, block_size=4), batch)[0]
        torch.testing.assert_close(out[i], want, rtol=1e-5, atol=1e-5)
