"""Regressions from an audit of the kernels and the attention backends' choice."""

import pytest
import torch
import triton
import triton.language as tl

import minivllm
from minivllm.kernels import backends, select_backend
from minivllm.kernels.decode_attention import _first_tile
from minivllm.kernels.flash_attn_backend import FLASH_ATTN
from minivllm.state import ModelConfig

FP8 = torch.float8_e4m3fn


def test_generate_leaves_flash_attn_out_for_an_fp8_cache(monkeypatch):
    """generate() chose its backend without the cache's dtype: on a GPU with flash-attn-4
    installed it took flash_attn, which reads no fp8 cache, for an fp8 cache."""
    config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0)
    cache = minivllm.init_cache(params, num_blocks=4, block_size=4, dtype="fp8")
    available = backends.available_backends
    monkeypatch.setattr(backends, "available_backends",
                        lambda device: ["flash_attn"] + available(device))  # flash-attn installed
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    made = []
    make = backends._make
    monkeypatch.setattr(backends, "_make", lambda name: (made.append(name), make(name))[1])
    out, _ = minivllm.generate(params, cache, [[1, 2, 3]], max_new_tokens=2)
    assert made == ["reference"] and len(out[0]) == 2


def test_a_flash_attn_backend_object_is_refused_for_an_fp8_cache():
    with pytest.raises(ValueError, match="fp8"):
        select_backend("cpu", FLASH_ATTN, FP8)


def test_triton_is_left_out_for_head_dims_it_does_not_compile_for_on_a_gpu(monkeypatch):
    """On the GPU the Triton kernels failed to compile at head_dim 8 (tl.dot's K below 16) and
    the decode kernel ran out of shared memory at 512: a ValueError naming head_dim when triton
    is asked for, left out when choosing. Under the interpreter every head_dim runs."""
    monkeypatch.setattr(backends, "available_backends", lambda device: ["triton", "reference"])
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    assert select_backend("cpu", "triton", head_dim=8).name == "triton"  # the interpreter
    monkeypatch.setattr(backends, "runs_ptx", lambda device: True)  # as on a GPU
    for bad in (8, 512):
        with pytest.raises(ValueError, match=f"head_dim 16-256 on a GPU, got {bad}"):
            select_backend("cpu", "triton", head_dim=bad)
        assert select_backend("cpu", None, head_dim=bad).name == "reference"
    for good in (16, 128, 256):
        assert select_backend("cpu", None, head_dim=good).name == "triton"


@triton.jit
def _first_tiles(k_cache, v_cache, tables, context, out, SPLITS: tl.constexpr, KV: tl.constexpr,
                 D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each split's first tile of sequence 0, KV head 0, as the persistent layer loads it."""
    split = tl.program_id(0)
    k, v = _first_tile(0, 0, split, k_cache, v_cache, tables, context, 0, SPLITS, tl.float32,
                       KV, D, D, PAGE, BLOCK_N, 0, False)
    tl.store(out + split, tl.sum(tl.sum(k + v, 1), 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="records the interpreter's loads")
def test_an_empty_splits_first_tile_reads_no_block_id_past_the_table(monkeypatch):
    """The persistent layer's first tile (decode_attention._first_tile) read the block id at its
    split's start unmasked where pages are whole tiles: a split past the context (1 row, 16
    splits, pages of 64, a context of 1,026 tokens in 17 blocks) read entries 18-30 of a table
    of 17. Every address a load touches is recorded; none may lie past the table."""
    import triton.runtime.interpreter as interpreter

    touched = []
    load = interpreter.InterpreterBuilder.create_masked_load

    def recording(self, ptrs, mask, other, *args):
        touched.append(ptrs.data[mask.data.astype(bool)].copy())
        return load(self, ptrs, mask, other, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", recording)
    page, kv_heads, head_dim, splits, context = 64, 8, 16, 16, 1026
    blocks = -(-context // page)
    memory = torch.zeros(blocks + 64, dtype=torch.int32)  # the table, then what follows it
    table = memory[:blocks].view(1, blocks)
    table.copy_(torch.arange(blocks, dtype=torch.int32))
    k_cache, v_cache = (torch.randn(blocks, page, kv_heads, head_dim) for _ in range(2))
    out = torch.empty(splits)
    _first_tiles[(splits,)](k_cache, v_cache, table, torch.tensor([context], dtype=torch.int32),
                            out, splits, kv_heads, head_dim, page, page)
    end = table.data_ptr() + 4 * blocks
    past = [a for t in touched for a in t.ravel().tolist() if end <= a < end + 4 * 64]
    assert touched and not past


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's fp8 rounding")
def test_an_fp8_cache_through_the_interpreters_triton_is_warned_of(monkeypatch, caplog):
    """Triton 3.7's interpreter rounds to fp8 wrongly (test_fp8_cache.py mends it for the
    tests): a user who runs the triton backend with an fp8 cache on the CPU is told, once."""
    monkeypatch.setattr(backends, "_logged", set())
    with caplog.at_level("WARNING", logger="minivllm"):
        for dtype in (FP8, FP8, torch.float32):
            select_backend("cpu", "triton", dtype)
        select_backend("cpu", "reference", FP8)
    assert [r.message.count("rounds to fp8 wrongly") for r in caplog.records] == [1]


@pytest.mark.parametrize("name", ["num_sms", "cuda_capability"])
def test_compiled_code_reads_the_gpus_properties_without_dynamos_lru_cache_warning(name,
                                                                                    monkeypatch):
    """num_sms and cuda_capability inside a compiled forward (the decode head's and the
    sampler's launches) on a GPU: Dynamo ignores an lru_cache wrapper with a UserWarning, which
    every engine start printed (session 67). Traced, they read the property themselves, to the
    same constant; eagerly they keep the cache. CUDA's calls are stood in for, so that this
    runs on the CPU (and the interpreter, which would make cuda_capability (0, 0), is off)."""
    import collections
    import warnings

    from minivllm.kernels import launch

    props = collections.namedtuple("Props", "multi_processor_count")(132)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    read, cached = getattr(launch, name), {"num_sms": launch._cuda_sms,
                                           "cuda_capability": launch._cuda_capability}[name]
    want = {"num_sms": 132, "cuda_capability": (9, 0)}[name]
    cached.cache_clear()
    try:
        torch._dynamo.reset()
        torch._dynamo.utils.warn_once_cache.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn = torch.compile(lambda x: x * torch.tensor(read(torch.device("cuda"))),
                               fullgraph=True, backend="eager")  # Inductor reads the GPU too
            assert fn(torch.ones(())).tolist() == torch.tensor(want).float().tolist()
        assert not [w for w in caught if "lru_cache" in str(w.message)]
        assert read(torch.device("cuda", 0)) == want
        assert cached.cache_info().currsize == 1  # the eager call's
    finally:
        cached.cache_clear()
        torch._dynamo.reset()
