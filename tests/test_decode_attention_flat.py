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
    with pytest.raises(ValueError, match="programs must be at least 1"):
        flat_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                              p.batch.context_lens, p.scale, programs=0)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        flat_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                              p.batch.context_lens, p.scale, slot_mapping=p.batch.slot_mapping[:1])


@given(case=flat_cases(), programs=st.sampled_from([1, 3, 64]), skip=st.booleans())
def test_flat_decode_in_the_engines_form_matches_paged_decode(device, case, programs, skip):
    """norm_rope and slot_mapping given (q and k raw from the qkv projection, the new K/V
    stored): the output of paged_decode_attention's engine form, and the very same cache (the
    new K/V where store_kvcache would put them, -1 rows writing nothing, nothing else moved)."""
    from minivllm.kernels.decode_attention import paged_decode_attention
    from minivllm.kernels.testing import decode_norm_rope

    if case["head_dim"] % 2:
        case["head_dim"] += 1
    p = make_problem(**case, device=device)
    dtype = case["dtype"]
    norm_rope = decode_norm_rope(p.batch.context_lens, case["head_dim"], dtype, case["seed"] + 1,
                                 device)
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


@given(contexts=st.lists(st.integers(1, 200), min_size=1, max_size=5),
       kv_heads=st.sampled_from([1, 3]), block_n=st.sampled_from([16, 128]))
def test_the_device_tile_map_is_tile_maps_list(contexts, kv_heads, block_n):
    """device_tile_map (static shapes, for a CUDA graph) holds tile_map's list in its first
    `total` entries."""
    from minivllm.kernels.decode_attention_flat import device_tile_map

    ctx = torch.tensor(contexts, dtype=torch.int32)
    want = tile_map(ctx, kv_heads, block_n)
    got = device_tile_map(ctx, kv_heads, block_n, max_unit_tiles=-(-200 // block_n))
    n = int(want[3])
    assert got[0].shape == got[1].shape == (len(contexts) * kv_heads * -(-200 // block_n),)
    assert torch.equal(got[0][:n], want[0]) and torch.equal(got[1][:n], want[1])
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])


@pytest.mark.parametrize("compiled", [False, True])
def test_forward_with_the_flat_kernel_equals_forward(device, monkeypatch, compiled):
    """A padded decode step (the decode graphs' static buffers) through forward with
    runtime.compiled.layers_with_decode_tiles, the triton backend running the flat kernel in
    every layer, gives forward's logits and cache (padding rows writing nothing); compiled: then
    through compiled_forward(flat_attention=True) too, its parts traced by dynamo whole (after
    the eager run, which has the interpreter rewrite the kernels: dynamo cannot trace that)."""
    import functools

    import torch.utils._pytree as pytree

    import minivllm
    from minivllm.functional.layer import decoder_layer
    import minivllm.kernels.triton_backend as tb
    from minivllm.kernels import select_backend
    from minivllm.runtime.compiled import compiled_forward, layers_with_decode_tiles
    from minivllm.runtime.graphs import DecodeGraphs
    from minivllm.state import ModelConfig, SeqChunk, make_batch

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    backend = select_backend(device, "triton")
    params = minivllm.random_params(config, seed=0, std=0.2, device=device)
    page = 4
    prompts = [list(range(1, 40)), [6, 7], list(range(3, 20))]
    tables = [list(range(0, 10)), [10], list(range(11, 16))]
    cache = minivllm.init_cache(params, num_blocks=24, block_size=page)
    logits, cache = minivllm.forward(params, cache, make_batch(
        [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], block_size=page), backend)
    toks = logits.argmax(-1).tolist()
    graphs = DecodeGraphs(params, cache, backend, max_num_seqs=6, max_blocks_per_seq=12,
                          compile_forward=False)
    padded = graphs.fill(toks, [len(p) for p in prompts],
                         [tab[len(p) // page] * page + len(p) % page
                          for p, tab in zip(prompts, tables)],
                         [len(p) + 1 for p in prompts], tables)
    batch = graphs.batch_view(padded)
    caches = [pytree.tree_map(torch.clone, cache) for _ in range(3)]
    want, caches[0] = minivllm.forward(params, caches[0], batch, backend)
    calls = []
    monkeypatch.setattr(tb, "flat_decode_attention",
                        lambda *a, **k: calls.append(1) or flat_decode_attention(*a, **k))
    got, caches[1] = minivllm.forward(
        params, caches[1], batch, backend,
        layers=functools.partial(layers_with_decode_tiles, layer=decoder_layer))
    assert len(calls) == config.num_layers
    outputs = [(got, caches[1])]
    if compiled:
        outputs.append(compiled_forward("eager", flat_attention=True)(params, caches[2], batch,
                                                                      backend))
    for got, got_cache in outputs:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for a, b in zip(pytree.tree_leaves(caches[0]), pytree.tree_leaves(got_cache)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, equal_nan=True)


def test_the_engine_flag_is_parsed_or_refused():
    from minivllm.runtime.runner import flat_attention

    assert flat_attention("1") and flat_attention(" 1 ")
    assert not any(flat_attention(f) for f in (None, "", "0"))
    for bad in ("2", "on", "yes"):
        with pytest.raises(ValueError, match="MINIVLLM_FLAT_ATTENTION must be 0 or 1"):
            flat_attention(bad)


def test_the_engine_checks_the_flag_at_start(tmp_path, monkeypatch, caplog, device):
    """A malformed MINIVLLM_FLAT_ATTENTION stops the engine's start; a well-formed one where no
    compiled decode graphs run (enforce_eager here) is ignored with a warning."""
    from hf_tiny import make_hf_model, save_checkpoint
    from minivllm import LLM

    path = save_checkpoint(make_hf_model(seed=1), tmp_path / "model")
    monkeypatch.setenv("MINIVLLM_FLAT_ATTENTION", "on")
    with pytest.raises(ValueError, match="MINIVLLM_FLAT_ATTENTION must be 0 or 1"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    monkeypatch.setenv("MINIVLLM_FLAT_ATTENTION", "1")
    with caplog.at_level("WARNING", logger="minivllm"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    assert "MINIVLLM_FLAT_ATTENTION applies to the compiled decode graphs" in caplog.text
