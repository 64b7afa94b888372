"""Audit of the functional API's guards (session 77): LoRA slots past max_loras, token ids and
blocks past the params' vocabulary and the cache, checked on the host where the batch is still
Python values (make_batch's max_loras, functional.batch_for), and torch.func.grad over forward
with the cache passed as an argument (forward's documented form). Each test names what it
guards."""

import textwrap

import attrs
import pytest
import torch
import torch.utils._pytree as pytree

import minivllm
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.lora import init_lora

CONFIG = ModelConfig(vocab_size=60, hidden_size=32, intermediate_size=48, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
MAX_LORAS = 2


@pytest.fixture(scope="module")
def params():
    return minivllm.random_params(CONFIG, seed=0, std=0.2)


@pytest.fixture(scope="module")
def lora_params(params):
    """params with MAX_LORAS slots of random (nonzero) LoRA weights: a slot's rows differ from
    the base model's."""
    gen = torch.Generator().manual_seed(1)
    lora = init_lora(CONFIG, max_loras=MAX_LORAS, max_rank=4, dtype=torch.float32)
    lora = pytree.tree_map(lambda t: 0.3 * torch.randn(t.shape, generator=gen), lora)
    return attrs.evolve(params, lora=lora)


def _cache(params, num_blocks=4):
    return minivllm.init_cache(params, num_blocks=num_blocks, block_size=4)


CHUNKS = [SeqChunk([1, 2, 3, 4, 5], 0, [0, 1]), SeqChunk([7, 8], 0, [2])]


def _logits(params, batch):
    return minivllm.forward(params, _cache(params), batch)[0]


def test_a_slot_past_max_loras_runs_the_base_model_on_the_device(lora_params, params):
    """Why the host check is needed (the gap, as the forward has it): a row whose slot is
    max_loras matches no slot's mask column and gets the base model's logits, bit for bit, with
    no error; slot 0 does change them. Documented in forward's and Batch's docstrings."""
    base = _logits(params, make_batch(CHUNKS, block_size=4))
    for slot, same in ((0, False), (MAX_LORAS, True)):
        got = _logits(lora_params, make_batch(CHUNKS, block_size=4, lora_slots=[slot, -1],
                                              check=False))
        assert torch.equal(got[0], base[0]) is same
        assert torch.equal(got[1], base[1])  # the base row, whatever the other's slot
    assert "max_loras" in minivllm.forward.__doc__


@pytest.mark.parametrize("slots, match", [
    ([MAX_LORAS, -1], rf"chunk 0's LoRA slot {MAX_LORAS} .*max_loras \({MAX_LORAS}\)"),
    ([0, 5], rf"chunk 1's LoRA slot 5 .*max_loras \({MAX_LORAS}\)"),
    ([-2, 0], r"chunk 0's LoRA slot -2 is out of range: -1 \(the base model\)"),
])
def test_make_batch_refuses_a_slot_outside_minus_one_to_max_loras(slots, match):
    """make_batch(max_loras=...) names the slot and the limit (before: no such argument, and a
    slot >= max_loras packed as it was); -2, never a slot, is refused even without max_loras."""
    with pytest.raises(ValueError, match=match):
        make_batch(CHUNKS, block_size=4, lora_slots=slots, max_loras=MAX_LORAS)
    if slots[0] == -2:
        with pytest.raises(ValueError, match=match):
            make_batch(CHUNKS, block_size=4, lora_slots=slots)
    good = make_batch(CHUNKS, block_size=4, lora_slots=[MAX_LORAS - 1, -1],
                      max_loras=MAX_LORAS)
    assert good.lora_slots.tolist() == [MAX_LORAS - 1] * 5 + [-1] * 2


def test_make_batch_refuses_a_slot_that_is_not_an_int():
    """A float slot was truncated by np.asarray(dtype=int64) (1.7 ran slot 1)."""
    with pytest.raises(TypeError, match=r"chunk 0's LoRA slot must be an int, got 1.7"):
        make_batch(CHUNKS, block_size=4, lora_slots=[1.7, -1], max_loras=MAX_LORAS)


def test_batch_for_takes_the_bounds_from_params_and_cache(lora_params, params):
    """batch_for(params, cache, chunks): the vocabulary, the cache's blocks and max_loras are
    the params' and the cache's; a bad value is a ValueError naming it and the bound, before
    any K/V is written. A hand-built batch of the same values fails inside forward (IndexError
    on the CPU) or, for the slot, silently runs the base model (test above)."""
    from minivllm.functional import batch_for

    cache = _cache(lora_params)
    snapshot = [t.clone() for t in pytree.tree_leaves(cache)]
    bad_id = [SeqChunk([1, 2, CONFIG.vocab_size], 0, [0])]
    bad_block = [SeqChunk([1, 2, 3], 0, [cache.num_blocks])]
    with pytest.raises(ValueError, match=rf"holds {CONFIG.vocab_size}, not below the "
                                         rf"vocabulary size \({CONFIG.vocab_size}\)"):
        batch_for(lora_params, cache, bad_id)
    with pytest.raises(ValueError, match=rf"holds {cache.num_blocks}, not below the cache's "
                                         rf"num_blocks \({cache.num_blocks}\)"):
        batch_for(lora_params, cache, bad_block)
    with pytest.raises(ValueError, match=rf"slot {MAX_LORAS} .*max_loras \({MAX_LORAS}\)"):
        batch_for(lora_params, cache, CHUNKS, lora_slots=[MAX_LORAS, 0])
    with pytest.raises(ValueError, match=r"slot 0 .*max_loras \(0\)"):  # params hold no LoRA
        batch_for(params, _cache(params), CHUNKS, lora_slots=[0, -1])
    for a, b in zip(pytree.tree_leaves(cache), snapshot):
        assert torch.equal(a, b)
    for chunks in (bad_id, bad_block):  # what the host check spares the user
        with pytest.raises(IndexError):
            minivllm.forward(lora_params, _cache(lora_params), make_batch(chunks, block_size=4))

    # A good step: the batch make_batch packs given the same bounds, and the same logits.
    got = batch_for(lora_params, cache, CHUNKS, every_row=True, lora_slots=[1, -1])
    want = make_batch(CHUNKS, block_size=4, every_row=True, lora_slots=[1, -1],
                      num_blocks=cache.num_blocks, vocab_size=CONFIG.vocab_size,
                      max_loras=MAX_LORAS)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
        assert torch.equal(a, b)
    assert got.block_size == cache.block_size
    torch.testing.assert_close(_logits(lora_params, got), _logits(lora_params, want),
                               rtol=0, atol=0)


def _documented_grad_example() -> str:
    """The indented code lines of forward's docstring's torch.func paragraph."""
    doc = minivllm.forward.__doc__
    assert "torch.func" in doc, "forward's docstring has no torch.func paragraph"
    tail = doc[doc.index("torch.func:"):]
    lines = [line for line in tail.splitlines()[1:] if line.startswith("        ")]
    assert lines, "forward's torch.func paragraph shows no example"
    return textwrap.dedent("\n".join(lines))


def test_grad_over_forward_with_the_cache_as_an_argument_is_autograds(params):
    """forward's documented torch.func form, run as the docstring spells it, on a cache made
    outside the function: grad wrt params equals torch.autograd's of the same loss, and a
    directional finite difference (float64 weights; the logits come back fp32). The captured
    form raises what the docstring and README quote."""
    p64 = pytree.tree_map(lambda t: t.double(), params)
    batch = make_batch(CHUNKS, block_size=4, every_row=True)
    cache = _cache(p64)
    with pytest.raises(RuntimeError, match="mutate a captured Tensor"):
        torch.func.grad(lambda p: minivllm.forward(p, cache, batch)[0].logsumexp(-1).sum())(p64)
    assert "mutate a captured Tensor" in minivllm.forward.__doc__

    namespace = dict(torch=torch, forward=minivllm.forward, params=p64, cache=cache, batch=batch)
    exec(_documented_grad_example(), namespace)
    grads, loss = namespace["grads"], namespace["loss"]

    leaves = [t.detach().clone().requires_grad_(True) for t in pytree.tree_leaves(p64)]
    p_ag = pytree.tree_unflatten(leaves, pytree.tree_structure(p64))
    loss(p_ag, _cache(p64)).backward()
    for g, leaf in zip(pytree.tree_leaves(grads), leaves):
        torch.testing.assert_close(g, leaf.grad, rtol=1e-6, atol=1e-8)

    gen = torch.Generator().manual_seed(0)
    d = pytree.tree_map(lambda t: torch.randn(t.shape, generator=gen, dtype=t.dtype), p64)
    # The loss is fp32 (forward's logits, ~28): at 1e-4 the difference is rounding, at 1e-2
    # curvature; 3e-4 is ~0.2% off either way.
    eps = 3e-4
    fd = (loss(pytree.tree_map(lambda a, b: a + eps * b, p64, d), _cache(p64))
          - loss(pytree.tree_map(lambda a, b: a - eps * b, p64, d), _cache(p64))) / (2 * eps)
    dot = sum((g * v).sum() for g, v in zip(pytree.tree_leaves(grads), pytree.tree_leaves(d)))
    torch.testing.assert_close(dot, fd.double(), rtol=1e-2, atol=1e-3)
