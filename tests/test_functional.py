"""Each pure function against a first-principles reference."""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

import minivllm
from minivllm import functional as fn
from minivllm.state import ModelConfig, SeqChunk, ShardSpec, make_batch

torch.manual_seed(0)


def cfg(**kw):
    base = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                num_kv_heads=2, head_dim=8, dtype=torch.float32)
    base.update(kw)
    return ModelConfig(**base)


def test_rms_norm_definition():
    x, w = torch.randn(5, 16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    expected = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 16 + 1e-5) * w
    # statistics are taken in fp32 whatever the input dtype (as the reference model does)
    torch.testing.assert_close(fn.rms_norm(x, w, 1e-5), expected, rtol=1e-6, atol=1e-6)
    xb = x.to(torch.bfloat16)
    expected_b = w.to(torch.bfloat16) * (xb.float() / torch.sqrt(xb.float().pow(2).mean(-1, keepdim=True) + 1e-5)
                                         ).to(torch.bfloat16)
    assert torch.equal(fn.rms_norm(xb, w.to(torch.bfloat16), 1e-5), expected_b)


def test_add_rms_norm_returns_sum_as_residual():
    x, r, w = torch.randn(3, 8), torch.randn(3, 8), torch.randn(8)
    normed, residual = fn.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(residual, x + r)
    torch.testing.assert_close(normed, fn.rms_norm(x + r, w, 1e-6))
    normed0, residual0 = fn.add_rms_norm(x, None, w, 1e-6)
    assert residual0 is x


def test_rope_is_rotation_of_half_pairs():
    """Rotate-half RoPE rotates the pair (x[i], x[i + d/2]) by position * theta^(-2i/d)."""
    config = cfg(rope_theta=100.0)
    t, d = 6, config.head_dim
    x = torch.randn(t, 3, d, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 7, 30, 100])
    cos, sin = fn.rope_cos_sin(config, positions)
    out = fn.apply_rope(x, cos.double(), sin.double())
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angle = positions[:, None].double() * (100.0 ** (-torch.arange(half).double() * 2 / d))
    expected = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
    torch.testing.assert_close(out, torch.cat([expected.real, expected.imag], -1), rtol=1e-5, atol=1e-5)
    # rotation keeps the norm, and q.k depends only on the distance
    q, k = torch.randn(1, 1, d, dtype=torch.float64), torch.randn(1, 1, d, dtype=torch.float64)
    def rot(v, p):
        c, s = fn.rope_cos_sin(config, torch.tensor([p]))
        return fn.apply_rope(v, c.double(), s.double())
    a = (rot(q, 5) * rot(k, 2)).sum()
    b = (rot(q, 13) * rot(k, 10)).sum()
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_llama3_scaling_bands():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    from minivllm.state.config import _freeze
    base = fn.rope_inv_freq(cfg(head_dim=32, rope_theta=10000.0))
    scaled = fn.rope_inv_freq(cfg(head_dim=32, rope_theta=10000.0, rope_scaling=_freeze(scaling)))
    wavelen = 2 * math.pi / base
    high = wavelen < 64 / 4  # short wavelengths untouched
    low = wavelen > 64 / 1  # long wavelengths divided by the factor
    torch.testing.assert_close(scaled[high], base[high])
    torch.testing.assert_close(scaled[low], base[low] / 8)
    mid = ~high & ~low
    assert mid.any()
    assert torch.all(scaled[mid] < base[mid]) and torch.all(scaled[mid] > base[mid] / 8)


def test_silu_and_mul():
    x = torch.randn(4, 10)
    gate, up = x[:, :5], x[:, 5:]
    torch.testing.assert_close(fn.silu_and_mul(x), gate / (1 + torch.exp(-gate)) * up)


def test_linear_layers_at_world_size_one():
    config = cfg()
    shard = ShardSpec()
    x = torch.randn(3, 32)
    w = torch.randn(config.num_heads * 8 + 2 * 2 * 8, 32)
    q, k, v = fn.qkv_linear(x, w, config, shard)
    full = x @ w.T
    assert q.shape == (3, 4, 8) and k.shape == (3, 2, 8)
    torch.testing.assert_close(q.reshape(3, -1), full[:, :32])
    torch.testing.assert_close(v.reshape(3, -1), full[:, 48:])
    wr = torch.randn(32, 16)
    torch.testing.assert_close(fn.row_linear(torch.randn(3, 16).requires_grad_(False), wr, shard).shape,
                               torch.Size([3, 32]))
    a, b = fn.merged_column_linear(x, torch.randn(20, 32), 2)
    assert a.shape == b.shape == (3, 10)


def test_embedding_and_head():
    config = cfg()
    w = torch.randn(50, 32)
    ids = torch.tensor([0, 7, 49])
    torch.testing.assert_close(fn.embed(ids, w, config, ShardSpec()), w[ids])
    x = torch.randn(2, 32)
    torch.testing.assert_close(fn.lm_head(x, w, config, ShardSpec()), x @ w.T)


def dense_attention(q, k, v, scale):
    """One sequence, causal, every key present: [t, hq, d] x [t, hkv, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale)
    return out.transpose(0, 1)


@given(lens=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 9)), min_size=1, max_size=4),
       group=st.sampled_from([1, 2, 4]), block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 99))
def test_reference_attention_equals_dense_causal(lens, group, block_size, seed):
    """Sequences with `cached` tokens already in the paged cache (random blocks) and `new` tokens:
    the output for the new tokens equals dense causal attention over the whole sequence."""
    gen = torch.Generator().manual_seed(seed)
    hkv, d = 2, 8
    hq = hkv * group
    num_blocks = sum(-(-(c + n) // block_size) for c, n in lens) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen)
    chunks, full, used = [], [], 0
    for cached, new in lens:
        total = cached + new
        table = perm[used: used + -(-total // block_size)]
        used += len(table)
        q = torch.randn(total, hq, d, generator=gen)
        k = torch.randn(total, hkv, d, generator=gen)
        v = torch.randn(total, hkv, d, generator=gen)
        for pos in range(cached):  # the prefix is already in the cache
            blk, off = table[pos // block_size], pos % block_size
            k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
        chunks.append(SeqChunk(list(range(new)), cached, table))
        full.append((q, k, v, cached))
    batch = make_batch(chunks, block_size=block_size)
    q_new = torch.cat([q[c:] for q, _, _, c in full])
    k_new = torch.cat([k[c:] for _, k, _, c in full])
    v_new = torch.cat([v[c:] for _, _, v, c in full])
    out = fn.REFERENCE(q_new, k_new, v_new, k_cache, v_cache, batch, d ** -0.5)
    expected = torch.cat([dense_attention(q, k, v, d ** -0.5)[c:] for q, k, v, c in full])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # and the new tokens' K/V are now in their slots
    flat_k = k_cache.view(-1, hkv, d)
    torch.testing.assert_close(flat_k[batch.slot_mapping], k_new)


def test_write_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    k = torch.arange(1, 7, dtype=torch.float32).view(3, 1, 2)
    fn.write_kv(k, -k, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(8, 1, 2)
    torch.testing.assert_close(flat[5], k[0])
    torch.testing.assert_close(flat[0], k[2])
    assert flat[[1, 2, 3, 4, 6, 7]].abs().sum() == 0
    torch.testing.assert_close(v_cache.view(8, 1, 2)[5], -k[0])
    before = k_cache.clone()
    fn.write_kv(k, k, k_cache, v_cache, torch.tensor([-1, -1, -1]))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("slots", [[0, -1], [3, 0, -1, -1], [-1, 0, -1]])
def test_write_kv_keeps_a_write_to_slot_0_beside_skipped_rows(slots):
    """A skipped row (slot -1, padding) must not write back over slot 0's new K/V, in any
    order of the rows."""
    k, v = torch.randn(len(slots), 2, 4), torch.randn(len(slots), 2, 4)
    k_cache, v_cache = torch.zeros(2, 4, 2, 4), torch.zeros(2, 4, 2, 4)
    fn.write_kv(k, v, k_cache, v_cache, torch.tensor(slots))
    want_k, want_v = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    for row, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot], want_v[slot] = k[row], v[row]
    assert torch.equal(k_cache.view(8, 2, 4), want_k) and torch.equal(v_cache.view(8, 2, 4), want_v)


def test_a_padded_block_table_entry_reads_nothing_not_even_nan():
    """-1 entries of a block table (padding) must not reach the output: the cache's last block
    holds NaN here (a cache is allocated uninitialised), and 0 weight times NaN is NaN."""
    k_cache, v_cache = torch.randn(3, 4, 1, 8), torch.randn(3, 4, 1, 8)
    k_cache[-1] = v_cache[-1] = float("nan")
    q, k, v = torch.randn(1, 1, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    batch = make_batch([SeqChunk([1], 3, [0])], block_size=4, max_blocks=3)
    assert batch.block_tables.tolist() == [[0, -1, -1]]
    out = fn.reference_attention(q, k, v, k_cache, v_cache, batch, 0.3)
    assert torch.isfinite(out).all()


def test_make_batch_refuses_a_negative_num_cached():
    with pytest.raises(ValueError, match="num_cached must be an integer >= 0, got -1"):
        make_batch([SeqChunk([1], -1, [0])], block_size=4)


def test_make_batch_takes_integer_scalars_as_num_cached_and_refuses_the_rest():
    import numpy as np
    plain = make_batch([SeqChunk([1], 3, [0])], block_size=4)
    for n in (np.int64(3), torch.tensor(3)):
        batch = make_batch([SeqChunk([1], n, [0])], block_size=4)
        assert batch.positions.tolist() == plain.positions.tolist() == [3]
    for bad in (True, np.bool_(True), torch.tensor([3]), 3.0):
        with pytest.raises(ValueError, match="num_cached must be an integer"):
            make_batch([SeqChunk([1], bad, [0])], block_size=4)
