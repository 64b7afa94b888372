"""Triton kernels and backends against the pure-PyTorch reference, on random shapes.

On CPU these run under TRITON_INTERPRET=1 (set by conftest) in fp32 and fp16 on small shapes; on a
GPU in the same dtypes (benchmarks/gpu_kernel_check.py adds bf16 and long contexts there). Every
case poisons what the kernel must not read (cache slots outside the contexts hold NaN, table
padding is -1) and what it must write (the output buffer starts as NaN)."""

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given
from hypothesis import strategies as st

from minivllm.functional.attention import REFERENCE, reference_attention, write_kv
from minivllm.kernels import BACKEND_NAMES, available_backends, select_backend
from minivllm.kernels import decode_attention, launch
from minivllm.kernels.decode_attention import (FP8_UNSPLIT_TILES, _split_range, decode_config,
                                               decode_splits, paged_decode_attention)
from minivllm.kernels.launch import triton_usable
from minivllm.kernels.prefill_attention import varlen_prefill_attention
from minivllm.kernels.store_kv import store_kvcache
from minivllm.kernels.testing import make_problem, rel_error
from minivllm.kernels.triton_backend import TRITON

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = st.sampled_from([torch.float32, torch.float16])
GROUPS = st.sampled_from([1, 2, 4, 8])
# 16 and 256 are the engine's page sizes; 4 makes tiles straddle many pages on small shapes.
PAGES = st.sampled_from([4, 16, 256])
HEAD_DIMS = st.sampled_from([16, 32, 24])  # 24: not a power of two, masked along head_dim


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def nan_like(x):
    return torch.full_like(x, float("nan"))


def check(out, ref, dtype):
    err = rel_error(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:g}"


# --- store_kvcache --------------------------------------------------------------------------------

@given(t=st.integers(1, 40), kv_heads=st.sampled_from([1, 2, 3]), head_dim=HEAD_DIMS, page=PAGES,
       dtype=DTYPES, seed=st.integers(0, 2**16), strided=st.booleans())
def test_store_kvcache_matches_reference(device, t, kv_heads, head_dim, page, dtype, seed, strided):
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-t // page) + 2
    slots = torch.randperm(num_blocks * page, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1  # skipped rows
    slots = slots.to(device)
    # k and v as views into a fused qkv output: rows strided, like the model's.
    qkv = torch.randn(t, 3 if strided else 2, kv_heads, head_dim, generator=g).to(device, dtype)
    k, v = qkv[:, 0], qkv[:, 1]
    cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    k_ref, v_ref, k_out, v_out = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    write_kv(k, v, k_ref, v_ref, slots)
    store_kvcache(k, v, k_out, v_out, slots)
    # Bit-exact, and untouched slots still NaN.
    torch.testing.assert_close(k_out, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_out, v_ref, rtol=0, atol=0, equal_nan=True)


# --- decode ---------------------------------------------------------------------------------------

@st.composite
def decode_cases(draw, max_batch=4, max_ctx=600):
    b = draw(st.integers(1, max_batch))
    # Contexts of 1 (nothing cached), page-size multiples and off-by-ones, ragged.
    ctx = draw(st.lists(st.one_of(st.just(1), st.sampled_from([16, 17, 255, 256, 257]),
                                  st.integers(1, max_ctx)), min_size=b, max_size=b))
    return dict(q_lens=[1] * b, cached=[c - 1 for c in ctx], page=draw(PAGES),
                kv_heads=draw(st.sampled_from([1, 2])), group=draw(GROUPS),
                head_dim=draw(HEAD_DIMS), dtype=draw(DTYPES), seed=draw(st.integers(0, 2**16)))


@given(case=decode_cases(), num_splits=st.sampled_from([None, 1, 2, 3, 8]), peel=st.booleans())
def test_paged_decode_matches_reference(device, case, num_splits, peel):
    """peel: whole tiles in an unmasked loop, then the partial one (the default for 16-bit
    caches past two rows), or every tile masked."""
    p = make_problem(**case, device=device)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = paged_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                 p.batch.context_lens, p.scale, out=nan_like(p.q),
                                 num_splits=num_splits, config=dict(peel=peel))
    check(out, ref, case["dtype"])


@triton.jit
def _split_ranges_kernel(out_ptr, ctx_ptr, num_splits, BLOCK_N: tl.constexpr):
    b, split = tl.program_id(0), tl.program_id(1)
    start, end = _split_range(b, split, ctx_ptr, num_splits, BLOCK_N)
    tl.store(out_ptr + (b * num_splits + split) * 2, start)
    tl.store(out_ptr + (b * num_splits + split) * 2 + 1, end)


@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=3),
       num_splits=st.integers(1, 16), block_n=st.sampled_from([16, 64]))
def test_decode_splits_cover_each_cached_token_once(device, contexts, num_splits, block_n):
    """_split_range, which the split kernel and the persistent layers' early tile loads both
    use: a sequence's splits, in order, cover its cached prefix (the context less the new token)
    exactly once, each starting on a tile boundary."""
    ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
    out = torch.full((len(contexts), num_splits, 2), -7, dtype=torch.int32, device=device)
    _split_ranges_kernel[(len(contexts), num_splits)](out, ctx, num_splits, block_n)
    for c, ranges in zip(contexts, out.cpu().tolist()):
        covered = [t for start, end in ranges for t in range(start, end)]
        assert covered == list(range(c - 1)), (c, ranges)
        assert all(start % block_n == 0 for start, end in ranges if end > start)


@given(case=decode_cases(), num_splits=st.sampled_from([None, 1, 3]), skip=st.booleans(),
       heads_fastest=st.booleans())
def test_paged_decode_writes_the_new_kv_where_store_kvcache_would(device, case, num_splits, skip,
                                                                 heads_fastest):
    """slot_mapping given: the decode kernel also stores the new K/V (a store kernel fewer per
    layer), bit-exactly as store_kvcache does, nothing else in the cache changes (poisoned slots
    stay NaN), -1 rows write nothing, and the output is unchanged; in either grid order."""
    p = make_problem(**case, device=device)
    slots = p.batch.slot_mapping.clone()
    if skip:
        slots[0] = -1  # a padding row
    k_want, v_want = p.k_cache.clone(), p.v_cache.clone()
    store_kvcache(p.k, p.v, k_want, v_want, slots)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = paged_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                 p.batch.context_lens, p.scale, out=nan_like(p.q),
                                 num_splits=num_splits, slot_mapping=slots,
                                 config=dict(heads_fastest=heads_fastest))
    check(out, ref, case["dtype"])
    torch.testing.assert_close(p.k_cache, k_want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(p.v_cache, v_want, rtol=0, atol=0, equal_nan=True)


@given(case=decode_cases(), num_splits=st.sampled_from([None, 1, 3]))
def test_paged_decode_norms_and_rotates_q_and_k_as_the_layer_does(device, case, num_splits):
    """norm_rope given: q and k arrive unnormed and unrotated, and the kernel gives the output and
    the stored K of functional.layer.qk_norm_rope followed by the plain kernel."""
    from minivllm.functional.layer import qk_norm_rope
    from minivllm.functional.rope import rope_cos_sin
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
    eps = 1e-6
    slots = p.batch.slot_mapping
    k_want, v_want = p.k_cache.clone(), p.v_cache.clone()
    q_in, k_in = 3 * p.q, 3 * p.k  # off unit scale, so that the norm matters
    q, k = qk_norm_rope(q_in, k_in, q_weight, k_weight, cos, sin, eps)
    want = paged_decode_attention(q, k, p.v, k_want, v_want, p.batch.block_tables,
                                  p.batch.context_lens, p.scale, num_splits=num_splits,
                                  slot_mapping=slots)
    got = paged_decode_attention(q_in, k_in, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                 p.batch.context_lens, p.scale, out=nan_like(p.q),
                                 num_splits=num_splits, slot_mapping=slots,
                                 norm_rope=(q_weight, k_weight, cos, sin, eps))
    check(got, want, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(p.k_cache, k_want, equal_nan=True, **tol)
    torch.testing.assert_close(p.v_cache, v_want, rtol=0, atol=0, equal_nan=True)


def test_decode_splits_fill_the_gpu_from_shapes():
    cpu = torch.device("cpu")  # 4 "SMs" under the interpreter
    assert decode_splits(256, 8, 2048, cpu) == 1
    assert decode_splits(1, 2, 100, cpu) == 1  # too short to split
    assert decode_splits(1, 2, 4096, cpu) == 16  # 16 programs per "SM" at most
    assert decode_splits(4, 2, 4096, cpu, waves=4) == 2
    assert decode_splits(1, 1, 10**6, cpu, waves=1000) == 64  # capped


def test_decode_splits_on_the_gpu(monkeypatch):
    """The H200's split rule (the rule only): over a 16-bit cache at contexts up to 4096, about
    4 programs an SM, and none from about two; longer contexts and an fp8 or fp32 cache keep 16
    waves, and an explicit `waves` is used as given."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # runs_ptx(cuda) then holds
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    gpu, fp8 = torch.device("cuda"), torch.float8_e4m3fn
    splits = lambda b, context=4096, **kw: decode_splits(b, 8, context, gpu, **kw)  # noqa: E731
    assert [splits(b) for b in (1, 2, 4, 8, 12, 16, 20, 24, 31)] == [16, 16, 16, 8, 5, 4, 3, 2, 2]
    assert [splits(b) for b in (32, 48, 96, 128, 256)] == [1, 1, 1, 1, 1]
    assert splits(32, cache_dtype=torch.bfloat16) == 1
    assert splits(32, cache_dtype=torch.float16) == 1
    for other in (fp8, torch.float32):
        assert [splits(b, cache_dtype=other) for b in (8, 32, 48, 96, 128)] == [16, 8, 5, 2, 2]
    assert [splits(b, 8192) for b in (8, 32, 128)] == [32, 8, 2]
    assert splits(32, waves=16) == 8
    assert decode_splits(64, 4, 4096, gpu) == 1  # a tensor-parallel rank's 4 KV heads
    assert decode_splits(48, 4, 4096, gpu) == 2


def test_decode_tiles_on_the_gpu(monkeypatch):
    """The H200's tile choices (the rule only: this machine has no GPU to run them)."""
    monkeypatch.setattr(launch, "interpreting", lambda: False)  # runs_ptx(cuda) then holds
    gpu, bf16 = torch.device("cuda"), torch.bfloat16
    tile = lambda *a: decode_config(gpu, bf16, 128, *a)["block_n"]  # noqa: E731
    assert tile(1, 4096, 1) == 128                   # one split reads a whole context
    assert tile(16, 4096, 1) == tile(16, 4096, 2) == 64  # the single stream's few sequences
    assert tile(16, 4096, 3) == tile(16, 4096, 64) == 64  # a few dozen sequences
    assert decode_config(gpu, bf16, 128, 16, 4096, 64)["num_stages"] == 2
    assert tile(16, 4096, 65) == tile(16, 4096) == 128
    assert tile(4, 8192, 256) == 64                  # many splits of long contexts
    assert decode_config(gpu, torch.float32, 128, 16, 4096, 1)["block_n"] == 32
    fp8 = torch.float8_e4m3fn  # unsplit over an fp8 cache: its own tiles; split, as bf16
    assert decode_config(gpu, bf16, 128, 1, 4096, 256, fp8) == FP8_UNSPLIT_TILES
    assert decode_config(gpu, bf16, 128, 1, 4096, 256, bf16)["block_n"] == 128
    assert decode_config(gpu, bf16, 128, 16, 4096, 2, fp8) == decode_config(gpu, bf16, 128, 16, 4096, 2)


# --- prefill --------------------------------------------------------------------------------------

@st.composite
def prefill_cases(draw, max_batch=3, max_q=40, max_cached=70):
    b = draw(st.integers(1, max_batch))
    q_lens = draw(st.lists(st.integers(1, max_q), min_size=b, max_size=b))
    cached = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_cached)), min_size=b, max_size=b))
    return dict(q_lens=q_lens, cached=cached, page=draw(PAGES),
                kv_heads=draw(st.sampled_from([1, 2])), group=draw(GROUPS),
                head_dim=draw(HEAD_DIMS), dtype=draw(DTYPES), seed=draw(st.integers(0, 2**16)))


@given(case=prefill_cases(), pack=st.booleans())
def test_varlen_prefill_matches_reference(device, case, pack):
    """pack: a program covers a whole GQA group (rows are (token, head) pairs) or one head."""
    p = make_problem(**case, device=device)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = varlen_prefill_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.cu_seqlens_q,
                                   p.batch.context_lens, p.batch.block_tables, p.scale,
                                   out=nan_like(p.q), config=dict(pack=pack))
    check(out, ref, case["dtype"])


@pytest.mark.parametrize("block_m,block_n,group,pack", [
    (16, 16, 2, False), (32, 16, 2, False), (32, 32, 2, True), (32, 16, 4, True), (16, 16, 8, True)])
def test_prefill_tiles_straddling_sequences(device, block_m, block_n, group, pack):
    """Sequences that start mid-tile, lengths around tile multiples, a one-token row among them
    (a decode row inside a mixed batch): every tile-to-sequence mapping path, including packed
    tiles of fewer tokens than a key tile (16 rows / 8 heads = 2 tokens against 16 keys)."""
    p = make_problem([block_m - 1, 1, block_m + 1, 2 * block_m, 5], [0, 9, block_n, 3, 2 * block_n + 1],
                     page=16, kv_heads=2, group=group, head_dim=16, device=device, seed=3)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = varlen_prefill_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.cu_seqlens_q,
                                   p.batch.context_lens, p.batch.block_tables, p.scale,
                                   out=nan_like(p.q),
                                   config=dict(block_m=block_m, block_n=block_n, pack=pack))
    check(out, ref, torch.float32)


# --- the backend: write, then attend --------------------------------------------------------------

@given(case=st.one_of(decode_cases(max_ctx=120), prefill_cases(max_q=24, max_cached=40)),
       skip_seed=st.integers(0, 2**16))
def test_triton_backend_matches_reference_backend(device, case, skip_seed):
    """Cache writes (bit-exact, skipped rows untouched, poison kept) and outputs, decode or not."""
    t = sum(case["q_lens"])
    g = torch.Generator().manual_seed(skip_seed)
    skip = torch.nonzero(torch.rand(t, generator=g) < 0.15).flatten().tolist()
    p = make_problem(**case, device=device, skip=skip)
    k_ref, v_ref = p.clean_cache()
    ref = REFERENCE(p.q, p.k, p.v, k_ref, v_ref, p.batch, p.scale)
    k_out, v_out = p.k_cache.clone(), p.v_cache.clone()
    out = TRITON(p.q, p.k, p.v, k_out, v_out, p.batch, p.scale)
    check(out, ref, case["dtype"])
    for got, want in ((k_out, k_ref), (v_out, v_ref)):
        want = want.clone()
        want[p.poison] = float("nan")
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


# --- selection ------------------------------------------------------------------------------------

def test_triton_backend_is_selectable(device, monkeypatch):
    assert "triton" in available_backends(device) and "reference" in available_backends(device)
    assert select_backend(device, "triton").name == "triton"
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "triton")
    assert select_backend(device).name == "triton"
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    assert select_backend(device).name == "reference"
    assert set(available_backends(device)) <= set(BACKEND_NAMES)


def test_unavailable_or_unknown_backend_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="not available on cpu"):
        select_backend("cpu", "flash_attn")
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "xformers")
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        select_backend("cpu")
