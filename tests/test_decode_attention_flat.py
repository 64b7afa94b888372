"""kernels/decode_attention_flat.py (the batch's tiles as one list, an equal share a program)
against the pure-PyTorch reference: shares that split a sequence's tiles between programs, and
more programs than tiles. Under TRITON_INTERPRET=1 on the CPU (fp32, fp16), as test_kernels.py."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minivllm.functional.attention import reference_attention
from minivllm.kernels.decode_attention_flat import flat_decode_attention, tile_map
from minivllm.kernels.launch import triton_usable
from minivllm.kernels.testing import make_problem, rel_error

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@st.composite
def flat_cases(draw):
    b = draw(st.integers(1, 4))
    # contexts of 1 (no cached prefix: one empty tile), tile multiples and off-by-ones, ragged
    ctx = draw(st.lists(st.one_of(st.just(1), st.sampled_from([16, 17, 33, 64, 65]),
                                  st.integers(1, 300)), min_size=b, max_size=b))
    return dict(q_lens=[1] * b, cached=[c - 1 for c in ctx],
                page=draw(st.sampled_from([4, 16, 48])),
                kv_heads=draw(st.sampled_from([1, 2])), group=draw(st.sampled_from([1, 2, 4])),
                head_dim=draw(st.sampled_from([16, 24])),
                dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                seed=draw(st.integers(0, 2**16)))


@given(case=flat_cases(), programs=st.sampled_from([1, 2, 3, 5, 64]))
def test_flat_decode_matches_reference(device, case, programs):
    """Every share of a sequence's tiles, merged, gives the reference's attention; with 64
    programs most small batches leave programs without tiles."""
    p = make_problem(**case, device=device)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = flat_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                p.batch.context_lens, p.scale, programs=programs,
                                out=torch.full_like(p.q, float("nan")))
    err = rel_error(out, ref)
    assert err <= TOL[case["dtype"]], f"relative error {err:.3g}"


@given(contexts=st.lists(st.integers(1, 200), min_size=1, max_size=5),
       kv_heads=st.sampled_from([1, 3]), block_n=st.sampled_from([16, 128]))
def test_tile_map_lists_each_units_tiles_in_order(contexts, kv_heads, block_n):
    """Unit b * kv_heads + h owns max(1, ceil((context - 1) / block_n)) consecutive tiles, in
    sequence order."""
    tile_unit, tile_j, unit_first, total = tile_map(torch.tensor(contexts, dtype=torch.int32),
                                                    kv_heads, block_n)
    want = [(b * kv_heads + h, j) for b, c in enumerate(contexts) for h in range(kv_heads)
            for j in range(max(1, -(-(c - 1) // block_n)))]
    assert list(zip(tile_unit.tolist(), tile_j.tolist())) == want
    assert total.tolist() == [len(want)]
    assert unit_first.tolist() == [want.index((u, 0)) for u in range(len(contexts) * kv_heads)]


def test_flat_decode_refuses_what_it_does_not_take(device):
    p = make_problem([1, 1], [5, 40], page=16, kv_heads=2, group=2, head_dim=16,
                     dtype=torch.float32, seed=0, device=device)
    with pytest.raises(ValueError, match="cache of q's dtype"):
        flat_decode_attention(p.q.half(), p.k.half(), p.v.half(), p.k_cache, p.v_cache,
                              p.batch.block_tables, p.batch.context_lens, p.scale)
    with pytest.raises(ValueError, match="KV heads"):
        flat_decode_attention(p.q, p.k[:, :1], p.v, p.k_cache, p.v_cache,
                              p.batch.block_tables, p.batch.context_lens, p.scale)


@given(case=flat_cases(), programs=st.sampled_from([1, 3, 64]), skip=st.booleans())
def test_flat_decode_in_the_engines_form_matches_paged_decode(device, case, programs, skip):
    """norm_rope and slot_mapping given (q and k raw from the qkv projection, the new K/V
    stored): the output of paged_decode_attention's engine form, and the very same cache (the
    new K/V where store_kvcache would put them, -1 rows writing nothing, nothing else moved)."""
    from minivllm.functional.rope import rope_cos_sin
    from minivllm.kernels.decode_attention import paged_decode_attention
    from minivllm.state import ModelConfig

    if case["head_dim"] % 2:
        case["head_dim"] += 1
    p = make_problem(**case, device=device)
    d, dtype = case["head_dim"], case["dtype"]
    g = torch.Generator().manual_seed(case["seed"] + 1)
    q_weight, k_weight = (1 + 0.3 * torch.randn(2, d, generator=g)).to(device, dtype)
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=d, rope_theta=1000.0)
    cos, sin = rope_cos_sin(config, (p.batch.context_lens - 1).long())
    norm_rope = (q_weight, k_weight, cos, sin, 1e-6)
    slots = p.batch.slot_mapping.clone()
    if skip:
        slots[0] = -1  # a padding row
    q_in, k_in = 3 * p.q, 3 * p.k  # off unit scale, so that the norm matters
    k_want, v_want = p.k_cache.clone(), p.v_cache.clone()
    want = paged_decode_attention(q_in, k_in, p.v, k_want, v_want, p.batch.block_tables,
                                  p.batch.context_lens, p.scale, slot_mapping=slots,
                                  norm_rope=norm_rope)
    got = flat_decode_attention(q_in, k_in, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                p.batch.context_lens, p.scale, programs=programs,
                                out=torch.full_like(p.q, float("nan")), slot_mapping=slots,
                                norm_rope=norm_rope)
    err = rel_error(got, want)
    assert err <= TOL[dtype], f"relative error {err:.3g}"
    torch.testing.assert_close(p.k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(p.v_cache, v_want, rtol=0, atol=0, equal_nan=True)
