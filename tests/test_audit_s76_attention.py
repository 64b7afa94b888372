"""Session 76: the reference attention (the CPU path and every backend's oracle) keeps a
non-finite value where it is masked out of every row that does not attend it. Masked scores get
probability 0, but 0 * nan is nan: a freed block's stale nan past a sequence's context, or
another sequence's overflowed token in the same step, spoiled every row of the batch.

The oracle is the same call with those values finite: the rows that do not attend them must not
change."""

from __future__ import annotations

import torch

from minivllm import functional as fn
from minivllm.state import SeqChunk, make_batch

HKV, GROUP, D, BS = 2, 2, 8, 4


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(4, BS, HKV, D, generator=gen)
    v_cache = torch.randn(4, BS, HKV, D, generator=gen)
    # sequence 0: 1 cached token in block 0, 1 new (slot 1); sequence 1: 5 cached in blocks
    # 1-2, 2 new (slots 9-10)
    batch = make_batch([SeqChunk([0], 1, [0]), SeqChunk([0, 0], 5, [1, 2])], block_size=BS)
    q = torch.randn(3, HKV * GROUP, D, generator=gen)
    k = torch.randn(3, HKV, D, generator=gen)
    v = torch.randn(3, HKV, D, generator=gen)
    return q, k, v, k_cache, v_cache, batch


def _attend(q, k, v, k_cache, v_cache, batch):
    return fn.REFERENCE(q, k, v, k_cache.clone(), v_cache.clone(), batch, D ** -0.5)


def test_a_stale_nan_past_the_context_reads_nothing():
    """Slots 2-3 of sequence 0's block and 11 of sequence 1's last block lie past their
    contexts: a freed block's nan there changes no row."""
    q, k, v, k_cache, v_cache, batch = _inputs()
    want = _attend(q, k, v, k_cache, v_cache, batch)
    for cache in (k_cache, v_cache):
        cache[0, 2:] = float("nan")
        cache[2, 3] = float("inf")
    got = _attend(q, k, v, k_cache, v_cache, batch)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_another_sequences_non_finite_token_stays_in_its_own_rows():
    """Sequence 1's first new token overflowed (its V holds inf and nan): sequence 0's row is
    as before, and sequence 1's rows that attend it are nan, as their own attention is."""
    q, k, v, k_cache, v_cache, batch = _inputs()
    want = _attend(q, k, v, k_cache, v_cache, batch)
    v = v.clone()
    v[1, 0, 0], v[1, 1, 3] = float("inf"), float("nan")
    got = _attend(q, k, v, k_cache, v_cache, batch)
    torch.testing.assert_close(got[0], want[0])
    assert torch.isnan(got[1:]).all()


def test_a_finite_batch_is_unchanged_and_still_differentiable():
    """The masking changes nothing where every value is finite (equal to dense attention in
    test_functional), and gradients still flow to q, k and v."""
    q, k, v, k_cache, v_cache, batch = _inputs(seed=1)
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = _attend(q, k, v, k_cache, v_cache, batch)
    out.square().sum().backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
               for x in (q, k, v))
