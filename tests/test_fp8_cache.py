"""The fp8 KV cache (kv_cache_dtype="fp8": float8_e4m3fn, no scale): the kernels against the
reference backend on the same fp8 cache, the functional forward against an fp32 cache whose
cached entries were rounded to fp8 (what an fp8 cache means), and the engine's option, its
memory and its errors."""

from __future__ import annotations

import pytest
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.functional.attention import REFERENCE, reference_attention
from minivllm.kernels import select_backend
from minivllm.kernels.decode_attention import paged_decode_attention
from minivllm.kernels.launch import interpreting, triton_usable
from minivllm.kernels.prefill_attention import varlen_prefill_attention
from minivllm.kernels.store_kv import store_kvcache
from minivllm.kernels.testing import make_problem, rel_error
from minivllm.kernels.triton_backend import TRITON
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.config import parse_kv_cache_dtype

FP8 = torch.float8_e4m3fn
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# bf16 (the engine's case) on the GPU only: the interpreter computes bf16 arithmetic wrongly
DTYPES = [torch.float32, torch.float16,
          pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                reason="bf16 kernels: GPU only"))]
CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, dtype=torch.float32)

needs_triton = pytest.mark.skipif(not triton_usable(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
                                  reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def bytes_of(t):
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.fixture(autouse=True)
def exact_fp8_rounding_in_the_interpreter(monkeypatch):
    """Triton 3.7's interpreter rounds fp32/fp16 to fp8 without carrying into the exponent (7.9
    becomes 4.0, not 8.0) and rounds ties up. Under it, the kernels' fp8 stores round as torch
    (and the GPU's cvt.rn.satfinite) do, so that the CPU run checks the kernels, not that bug;
    on the GPU nothing is changed."""
    if not interpreting():
        return
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    convert = interpreter._convert_float
    sources = {tl.float32: np.float32, tl.float16: np.float16}

    def exact(values, src, dst, rounding_mode):
        if dst != tl.float8e4nv or src not in sources:
            return convert(values, src, dst, rounding_mode)
        x = torch.from_numpy(np.frombuffer(values.tobytes(), dtype=sources[src]).copy()).float()
        return x.clamp(-448, 448).to(FP8).view(torch.uint8).numpy().reshape(values.shape)

    monkeypatch.setattr(interpreter, "_convert_float", exact)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kvcache_writes_the_bytes_write_kv_writes(device, dtype):
    p = make_problem([7, 1, 12], [0, 5, 3], page=4, kv_heads=2, group=2, head_dim=16, dtype=dtype,
                     device=device, seed=1, skip=[2], cache_dtype=FP8)
    k_ref, v_ref = p.clean_cache()
    k_out, v_out = k_ref.clone(), v_ref.clone()
    k = p.k * 300  # some values past e4m3's 448: saturated
    REFERENCE(p.q, k, p.v, k_ref, v_ref, p.batch, p.scale)
    store_kvcache(k, p.v, k_out, v_out, p.batch.slot_mapping)
    assert k_ref.float().abs().max() == 448
    assert torch.equal(bytes_of(k_out), bytes_of(k_ref)) and torch.equal(bytes_of(v_out), bytes_of(v_ref))


@pytest.mark.parametrize("writer", ["write_kv", pytest.param("store_kvcache", marks=needs_triton)])
def test_fp8_writes_saturate_out_of_range_values_to_448(device, writer):
    """e4m3fn has no infinity: an fp8 cache stores +-1000 and +-inf as +-448, as the GPU's
    cvt.rn.satfinite does. torch's CUDA cast gives NaN there (its CPU cast saturates, so on the
    CPU this holds without write_kv's clamp; the suite's GPU run is where it can fail)."""
    from minivllm.functional.attention import write_kv
    big = torch.tensor([1000.0, -1000.0, float("inf"), -float("inf"), 448.0, -3.0], device=device)
    k = big.reshape(6, 1, 1).expand(6, 2, 16).contiguous()  # [T, kv_heads, head_dim]
    v = -k
    k_cache = torch.zeros(2, 4, 2, 16, dtype=FP8, device=device)  # [blocks, page, kv_heads, head_dim]
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 1, 2, 3, 5, 6], device=device)
    (write_kv if writer == "write_kv" else store_kvcache)(k, v, k_cache, v_cache, slots)
    expect = torch.tensor([448.0, -448.0, 448.0, -448.0, 448.0, -3.0], device=device)
    k_flat = k_cache.view(8, 2, 16).float()
    v_flat = v_cache.view(8, 2, 16).float()
    assert torch.equal(k_flat[slots], expect.reshape(6, 1, 1).expand(6, 2, 16))
    assert torch.equal(v_flat[slots], -expect.reshape(6, 1, 1).expand(6, 2, 16))
    assert not k_flat[[4, 7]].any() and not v_flat[[4, 7]].any()  # untouched slots stay 0


GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="inline PTX: GPU only")


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits, f16_dots, ptx_widen", [
    (1, False, None), (3, False, None), (3, True, None), (3, True, 0),
    pytest.param(3, True, 1, marks=GPU_ONLY), pytest.param(1, True, 2, marks=GPU_ONLY)])
def test_decode_reads_an_fp8_cache_as_the_reference_does(device, dtype, num_splits, f16_dots,
                                                         ptx_widen):
    """f16_dots (a config for the sweep): fp16 operands whatever q's dtype, fp32 accumulation.
    ptx_widen: 0 Triton's cast, 1 / 2 inline PTX for V / K and V (None: the default, 1 on the
    GPU with fp16 dots). Contexts end inside a tile, so masked rows are read too."""
    p = make_problem([1, 1, 1], [37, 5, 70], page=16, kv_heads=2, group=4, head_dim=32, dtype=dtype,
                     device=device, seed=2, cache_dtype=FP8)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    config = dict(f16_dots=f16_dots) | ({} if ptx_widen is None else dict(ptx_widen=ptx_widen))
    out = paged_decode_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.block_tables,
                                 p.batch.context_lens, p.scale, out=torch.full_like(p.q, float("nan")),
                                 num_splits=num_splits, config=config)
    assert rel_error(out, ref) <= max(TOL[dtype], TOL[torch.float16] if f16_dots else 0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_reads_an_fp8_prefix_as_the_reference_does(device, dtype):
    p = make_problem([9, 17, 4], [0, 21, 40], page=16, kv_heads=2, group=2, head_dim=16, dtype=dtype,
                     device=device, seed=3, cache_dtype=FP8)
    ref = reference_attention(p.q, p.k, p.v, *p.clean_cache(), p.batch, p.scale)
    out = varlen_prefill_attention(p.q, p.k, p.v, p.k_cache, p.v_cache, p.batch.cu_seqlens_q,
                                   p.batch.context_lens, p.batch.block_tables, p.scale,
                                   out=torch.full_like(p.q, float("nan")))
    assert rel_error(out, ref) <= TOL[dtype]


@needs_triton
def test_triton_backend_writes_and_attends_as_the_reference_backend(device):
    """Decode through the fused kernel (q/k norm, RoPE and the store in one), on an fp8 cache."""
    p = make_problem([1, 1], [30, 3], page=8, kv_heads=2, group=2, head_dim=16, device=device,
                     seed=4, cache_dtype=FP8)
    k_ref, v_ref = p.clean_cache()
    k_out, v_out = k_ref.clone(), v_ref.clone()
    ref = REFERENCE(p.q, p.k, p.v, k_ref, v_ref, p.batch, p.scale)
    out = TRITON(p.q, p.k, p.v, k_out, v_out, p.batch, p.scale)
    assert rel_error(out, ref) <= 1e-5
    assert torch.equal(bytes_of(k_out), bytes_of(k_ref)) and torch.equal(bytes_of(v_out), bytes_of(v_ref))


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_an_fp8_cache_is_an_fp32_cache_with_its_entries_rounded_to_fp8(device, backend_name):
    """A prompt in two chunks, each token reading every earlier one from the cache (its own
    chunk's too: written before attention) and its own K/V as computed, as a decode step does.
    With an fp8 cache its logits equal those of the same prompt decoded one token a step over
    an fp32 cache whose entries are rounded to fp8 after each step (the oracle: plain torch
    rounding, the reference backend): chunked prefill, a verification chunk and decoding give
    the same values. They differ from the unrounded fp32 cache's by fp8's rounding only."""
    if backend_name == "triton" and not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    params = minivllm.random_params(CONFIG, seed=0, std=0.3, device=device)
    backend = select_backend(device, backend_name)
    ids = torch.randint(0, CONFIG.vocab_size, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(6))

    def run(cache, attention=backend):
        first = make_batch([SeqChunk(ids[:15], 0, table)], block_size=4, device=device)
        _, cache = minivllm.forward(params, cache, first, attention)
        second = make_batch([SeqChunk(ids[15:], 15, table)], block_size=4, device=device)
        logits, cache = minivllm.forward(params, cache, second, attention)
        return logits

    def round_to_fp8(cache):
        for c in (*cache.k, *cache.v):
            c.copy_(c.clamp(-448, 448).to(FP8).float())
        return cache

    def decoded_with_rounding(cache):
        for pos, token in enumerate(ids):
            step = make_batch([SeqChunk([token], pos, table)], block_size=4, device=device)
            logits, cache = minivllm.forward(params, cache, step, REFERENCE)
            cache = round_to_fp8(cache)
        return logits

    got = run(minivllm.init_cache(params, num_blocks=8, block_size=4, dtype="fp8"))
    want = decoded_with_rounding(minivllm.init_cache(params, num_blocks=8, block_size=4))
    exact = run(minivllm.init_cache(params, num_blocks=8, block_size=4), attention=REFERENCE)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert 1e-4 < (got - exact).abs().max() < 0.2 * exact.abs().max()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from hf_tiny import make_hf_model, save_checkpoint

    return save_checkpoint(make_hf_model(), tmp_path_factory.mktemp("fp8") / "model")


def test_engine_option_memory_and_outputs(tiny_dir, device, monkeypatch):
    """kv_cache_dtype="fp8" holds 4x an fp32 model's tokens in the same memory and schedules
    decodes longest context first; the triton and reference backends give the same greedy
    tokens on it (chunked prefill and prefix hits included); and they stay near the fp32
    cache's."""
    if device.type == "cuda":
        pytest.skip("sizes the cache from the CPU budget")
    monkeypatch.setenv("MINIVLLM_CPU_KV_CACHE_SPACE", "0.002")  # under the cap of max_num_seqs full sequences
    kw = dict(device=device, block_size=8, max_num_batched_tokens=24, max_model_len=256)
    base = LLM(tiny_dir, **kw)
    fp8 = LLM(tiny_dir, kv_cache_dtype="fp8", **kw)
    assert fp8.engine.runner.cache.dtype == FP8 and base.engine.runner.cache.dtype == torch.float32
    assert fp8.engine.runner.num_blocks // 4 == base.engine.runner.num_blocks  # budget // block bytes
    # its latency-bound decode kernel measured faster with the longest contexts first
    assert fp8.engine.scheduler.longest_decodes_first and not base.engine.scheduler.longest_decodes_first
    prompts = [[5, 9, 2, 44, 7] * 5 + [3], [5, 9, 2, 44, 7] * 5 + [8, 1], [11, 12, 13]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)]

    got = tokens(fp8)
    assert fp8.stats.prompt_tokens_cached > 0
    if triton_usable(device):
        assert tokens(LLM(tiny_dir, kv_cache_dtype="fp8", attention_backend="triton", **kw)) == got
    want = tokens(base)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same >= 0.6 * sum(map(len, want))


def test_bad_kv_cache_dtypes_are_clear_errors(tiny_dir):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int8'"):
        LLM(tiny_dir, device="cpu", kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="cache is in the model's dtype .'auto'. or in fp8"):
        LLM(tiny_dir, device="cpu", kv_cache_dtype="float16")
    with pytest.raises(ValueError, match="'flash_attn' reads a KV cache in the model's dtype"):
        LLM(tiny_dir, device="cpu", kv_cache_dtype="fp8", attention_backend="flash_attn")
    with pytest.raises(TypeError, match="kv_cache_dtype must be a string or a torch.dtype, got int"):
        LLM(tiny_dir, device="cpu", kv_cache_dtype=8)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype torch.float8_e5m2"):
        parse_kv_cache_dtype(torch.float8_e5m2, torch.bfloat16)
    assert parse_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert parse_kv_cache_dtype("FP8_E4M3", torch.bfloat16) == FP8
    params = minivllm.random_params(CONFIG, seed=0)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype"):
        minivllm.init_cache(params, num_blocks=2, dtype="fp8_e5m2")


@needs_triton
@pytest.mark.parametrize("ptx_widen", [0, pytest.param(1, marks=GPU_ONLY)])
def test_the_opaque_launch_compiles_and_writes_what_the_direct_one_does(device, ptx_widen):
    """The kernel launched through its custom op (the default with ptx_widen, whose impure asm
    torch.compile cannot analyse): compiled without graph breaks, it writes the same output and
    cache bytes as the direct launch run eagerly, split or not (on the GPU: Dynamo cannot trace
    the interpreter's launch of the merge kernel, see tests/triton_trace.py)."""
    dtype = torch.float16
    for num_splits in (1, 3) if device.type == "cuda" else (1,):
        p = make_problem([1, 1, 1], [37, 5, 70], page=16, kv_heads=2, group=4, head_dim=32,
                         dtype=dtype, device=device, seed=3, cache_dtype=FP8)
        slots = p.batch.slot_mapping
        caches = [(p.k_cache.clone(), p.v_cache.clone()) for _ in range(2)]

        def run(k_cache, v_cache, opaque):
            return paged_decode_attention(
                p.q, p.k, p.v, k_cache, v_cache, p.batch.block_tables, p.batch.context_lens,
                p.scale, num_splits=num_splits, slot_mapping=slots,
                config=dict(f16_dots=True, ptx_widen=ptx_widen, opaque=opaque))

        torch._dynamo.reset()
        compiled = torch.compile(lambda kc, vc: run(kc, vc, True), fullgraph=True,
                                 backend="inductor" if device.type == "cuda" else "aot_eager")
        want = run(*caches[0], False)
        got = compiled(*caches[1])
        assert torch.equal(got, want)
        for a, b in zip(caches[0], caches[1]):
            assert torch.equal(bytes_of(a), bytes_of(b))
        assert not torch.equal(bytes_of(caches[1][0]), bytes_of(p.k_cache))  # the store happened
