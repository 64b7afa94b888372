"""Block-fp8 weights kept in fp8 (state/quant.Fp8BlockWeight) and multiplied by the Triton
block-fp8 GEMM (kernels/fp8_gemm.py), which dequantizes tile by tile.

The checkpoints are test_fp8_checkpoint.py's (tiny random Qwen3s written by transformers, their
decoder linears quantized there per 128 x 128 block by an independent quantizer), and the
reference is its block-by-block dequantization (dequantize_blocks): none of minivllm's fp8 code
computes it. They check:
  1. the kernel (under Triton's interpreter on a CPU) against an fp64 product of the dequantized
     weight, rounded to the activation dtype as the kernel rounds it: fp32 and fp16, M = 1 .. 70,
     split K, N and K not multiples of the tile or of the block (partial edge blocks), a tile
     spanning scale rows, a strided x; the 256-row switch to dequantize + torch; that
     torch.compile(fullgraph=True) traces it;
  2. loading: the quantized linears are Fp8BlockWeight holding the checkpoint's fp8 bytes (one
     byte an element) and scales; merged q/k/v or gate/up whose parts cut a block, and
     tensor-parallel slices that cut one, are dequantized at load (the fallback), as is
     everything with MINIVLLM_FP8_WEIGHTS=dequantize;
  3. logits (kernel and torch paths) equal the dequantized-at-load model's and transformers' on
     the dequantized weights; the engine's greedy tokens equal the dequantized model's; LoRA on
     an fp8 model; the compiled forward equals eager; TP=2 over gloo equals TP=1;
  4. the engine turns the dense-only kernels off;
  5. on a GPU only (skipped here): the kernel in bf16 / fp16 at real Qwen3 sizes, compiled and in
     a CUDA graph, and the engine's graphs against eager (benchmarks/gpu_checks.sh fp8w).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

import minivllm
from minivllm import LLM, SamplingParams, ShardSpec
from minivllm.state.quant import Fp8BlockWeight, dequantize_fp8_weight

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint
from test_awq import (PROMPTS, check_compiled_and_graphed, check_dequantize_switch, hf_logits, hf_tiny_device,
                      mv_logits)
from test_fp8_checkpoint import (ALIGNED, EDGE, LINEARS, dequantize_blocks, merged,
                                 write_fp8_checkpoint)
from tp_worker import _free_port, _worker

FIELDS = ("qkv", "o_proj", "gate_up", "down")


@pytest.fixture(autouse=True)
def fp8_weights_on(monkeypatch):
    """Every test here keeps fp8 weights whatever the environment says (one that means to
    dequantize sets the variable again)."""
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "fp8")


def test_fp8_weights_stay_fp8_by_default(monkeypatch):
    """Since benchmarks/gpu_checks.sh fp8w passed on a GPU (session 56), a block-fp8 checkpoint
    keeps its weights in fp8 unless asked to dequantize them (see DEFAULT_FP8_WEIGHTS)."""
    from minivllm.state.load import DEFAULT_FP8_WEIGHTS, fp8_weights_mode

    monkeypatch.delenv("MINIVLLM_FP8_WEIGHTS")
    assert DEFAULT_FP8_WEIGHTS == "fp8" == fp8_weights_mode()
    assert fp8_weights_mode("dequantize") == "dequantize"
# Every TP=2 boundary on a block: q/k/v 128 rows a rank (4 kv heads), the MLP 256.
TP_ALIGNED = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=64)


def random_fp8(n, k, block=(128, 128), seed=0):
    """An Fp8BlockWeight [n, k] of random e4m3 values and scales."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(n / block[0]), math.ceil(k / block[1]), generator=g) * 0.01 + 1e-3
    return Fp8BlockWeight(weight=w, scale_inv=s, block=block)


def to(w: Fp8BlockWeight, device) -> Fp8BlockWeight:
    return Fp8BlockWeight(weight=w.weight.to(device), scale_inv=w.scale_inv.to(device),
                          block=w.block)


def accumulation_error(x: torch.Tensor) -> float:
    """The relative error (of sum |x| |w|) that fp32 accumulation over x's K columns may make.
    On a GPU's tensor cores a 16-bit product accumulates with truncation, about an fp32 ulp for
    each 16-deep MMA step: on the H100 at K = 12288 in fp16 the kernel and cuBLAS's own product
    of the same dequantized weight were both 0.34 from fp64 at an output of 4,366 (an fp32
    matmul 0.002; session 56), past 1e-5. A factor 2 over that rate."""
    steps = x.shape[1] / 16 if x.is_cuda and x.dtype.itemsize == 2 else 0
    return max(1e-5, steps * 2.0**-22)


def check_product(out, x, w: Fp8BlockWeight):
    """out against x @ W.T in fp64, W (the independent dequantization) rounded to x's dtype as
    the kernel rounds it; bound: fp32 accumulation plus the output's own rounding."""
    assert out.shape == (x.shape[0], w.out_features) and out.dtype == x.dtype
    wd = dequantize_blocks(w.weight.cpu(), w.scale_inv.cpu(), w.block).to(x.dtype).double()
    x64 = x.cpu().double()
    ref = x64 @ wd.T
    half_ulp = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[x.dtype]
    bound = accumulation_error(x) * (x64.abs() @ wd.abs().T) + half_ulp * ref.abs()
    err = (out.cpu().double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


def triton_or_skip(device):
    from minivllm.kernels.launch import triton_usable

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the Triton block-fp8 GEMM's launches through functional.linear."""
    from minivllm.kernels import fp8_gemm

    calls = []
    real = fp8_gemm.fp8_linear
    monkeypatch.setattr(fp8_gemm, "fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# --- 1. the kernel -----------------------------------------------------------------------------

KERNEL_CASES = [  # (m, n, k, block)
    (1, 64, 384, (128, 128)),    # decode, split K
    (3, 200, 320, (128, 128)),   # odd M; N and K past whole blocks (partial edge blocks)
    (17, 130, 256, (128, 128)),  # past a 16-row tile; N not a multiple of the tile
    (70, 136, 200, (128, 128)),  # prefill tiles (64 x 128), K not a multiple of the K step
    (5, 100, 96, (48, 32)),      # tiles spanning scale rows (48-row blocks), 32-column blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,n,k,block", KERNEL_CASES)
def test_kernel_matches_the_dequantized_product(device, m, n, k, block, dtype):
    from minivllm.kernels.fp8_gemm import fp8_linear

    triton_or_skip(device)
    w = to(random_fp8(n, k, block, seed=m + k), device)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    check_product(fp8_linear(x, w), x, w)
    wide = torch.randn(m, k + 8, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    check_product(fp8_linear(wide[:, 8:], w), wide[:, 8:], w)  # x with a row stride


def test_kernel_partials_and_tiles(device):
    """The CPU heuristic reaches the paths the cases above are meant to test; the unsummed
    partials sum to the product."""
    from minivllm.kernels.fp8_gemm import fp8_config, fp8_linear

    triton_or_skip(device)
    if device.type == "cuda":
        pytest.skip("the interpreter's tiling")
    cfg = {case: fp8_config(case[0], case[1], case[2], case[3], torch.float32, device)
           for case in KERNEL_CASES}
    assert cfg[KERNEL_CASES[0]]["split"] > 1
    assert cfg[KERNEL_CASES[2]]["block_m"] == 32
    assert cfg[KERNEL_CASES[3]]["block_m"] == 64 and cfg[KERNEL_CASES[3]]["block_k"] == 32
    assert cfg[KERNEL_CASES[4]]["block_k"] == 32  # the block's columns
    # every key may be fixed by the caller (block_k was once refused: a TypeError)
    fixed = dict(block_m=32, block_n=32, block_k=32, split=2, num_warps=8, num_stages=1)
    assert fp8_config(2, 64, 384, (128, 128), torch.float32, device, **fixed) == fixed
    w = random_fp8(64, 384, seed=0)
    x = torch.randn(2, 384)
    parts = fp8_linear(x, w, partials=True)
    assert parts.dim() == 3 and parts.shape[0] > 1 and parts.dtype == torch.float32
    check_product(parts.sum(0), x, w)
    # a forced 64-row tile over 48-row scale blocks: each row takes its own scale
    w = random_fp8(100, 64, (48, 32), seed=1)
    check_product(fp8_linear(x[:, :64], w, config=dict(block_n=64)), x[:, :64], w)


def test_dequantize_fp8_weight_is_the_load_time_dequantization():
    """The torch path's dequantization (static shapes) equals the independent one, whole and
    partial blocks."""
    for n, k, block in ((256, 384, (128, 128)), (200, 320, (128, 128)), (100, 96, (48, 32))):
        w = random_fp8(n, k, block, seed=n)
        want = dequantize_blocks(w.weight, w.scale_inv, block)
        assert torch.equal(dequantize_fp8_weight(w, torch.float32), want)
        assert torch.equal(dequantize_fp8_weight(w, torch.bfloat16), want.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_steps_from_256_rows_dequantize_and_multiply(device, kernel_calls, dtype):
    """functional.linear's fp8_matmul: the kernel below DEQUANTIZE_ROWS rows, the
    dequantized weight times torch's matmul from there on; both give the product."""
    from minivllm.functional import linear

    triton_or_skip(device)
    w = to(random_fp8(48, 160, seed=3), device)
    check_dequantize_switch(linear.fp8_matmul, w, 160, check_product, kernel_calls, device, dtype)


TRACE_BODY = """
from minivllm.kernels.fp8_gemm import fp8_config, fp8_linear
from minivllm.state.quant import Fp8BlockWeight

w = Fp8BlockWeight(weight=torch.zeros(64, 384, dtype=torch.float8_e4m3fn),
                   scale_inv=torch.ones(1, 3), block=(128, 128))
assert fp8_config(2, 64, 384, (128, 128), torch.float32, torch.device("cpu"))["split"] > 1

def layer(h, w):
    return fp8_linear(h * 2, w) + 1

torch.set_grad_enabled(False)
trace(layer, torch.randn(2, 384), w)
"""


def test_kernel_traces_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces the kernel (split K: its launch and the torch sum)
    into one graph, an Fp8BlockWeight as input."""
    from triton_trace import kernel_launches_traced

    if device.type == "cuda":
        pytest.skip("test_gpu_compiled_and_graphed runs it on the GPU")
    assert kernel_launches_traced(TRACE_BODY) == {"dynamo": 1, "aot": 1}


# --- 2. loading --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def aligned(tmp_path_factory):
    """Every quantized dimension a multiple of 128 (so every merge keeps fp8); float32
    unquantized tensors, so that comparisons are at fp32 rounding."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8w") / "aligned", seed=4,
                                dtype=torch.float32, **ALIGNED)


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    """Partial edge blocks: q_proj 192 rows and gate 200 in 128-row blocks (their merges fall
    back to dense), o_proj [320, 192] and down [320, 200] stay fp8 with partial edges."""
    return write_fp8_checkpoint(tmp_path_factory.mktemp("fp8w") / "edge", seed=1,
                                dtype=torch.float32, **EDGE)


def dense(w, dtype):
    """A loaded weight as a dense tensor: an Fp8BlockWeight through the independent
    dequantization."""
    if isinstance(w, Fp8BlockWeight):
        return dequantize_blocks(w.weight.cpu(), w.scale_inv.cpu(), w.block).to(dtype)
    return w


def test_loaded_linears_hold_the_checkpoints_fp8_bytes(aligned):
    """Every decoder linear of the aligned checkpoint is an Fp8BlockWeight: the checkpoint's fp8
    tensors (one byte an element) and float32 scales, q/k/v and gate/up concatenated; its
    dequantization is the reference weight; the default dtype (bf16, the checkpoint's
    unquantized one) and fp32 alike. The dequantize mode holds dense tensors."""
    path, reference = aligned
    sd = load_file(os.path.join(path, "model.safetensors"))
    for dtype in ("float32", None):
        params = minivllm.load(path, dtype=dtype)
        minivllm.state.check_params(params)
        for n, lp in enumerate(params.layers):
            want = merged(reference, n)
            for field in FIELDS:
                got = getattr(lp, field)
                assert isinstance(got, Fp8BlockWeight), (n, field)
                assert got.weight.element_size() == 1 and got.scale_inv.dtype == torch.float32
                assert torch.equal(dense(got, torch.float32), want[field]), (n, field)
        p = "model.layers.1."
        qkv = params.layers[1].qkv
        assert torch.equal(qkv.weight[:256].view(torch.uint8),
                           sd[p + "self_attn.q_proj.weight"].view(torch.uint8))
        assert torch.equal(qkv.scale_inv[2:3], sd[p + "self_attn.k_proj.weight_scale_inv"])
    fp8_bytes = sum(t.numel() * t.element_size() for lp in params.layers for f in FIELDS
                    for t in (getattr(lp, f).weight,))
    old = minivllm.load(path, dtype="bfloat16", fp8_weights="dequantize")
    dense_bytes = sum(getattr(lp, f).numel() * 2 for lp in old.layers for f in FIELDS)
    assert all(isinstance(getattr(lp, f), torch.Tensor) for lp in old.layers for f in FIELDS)
    assert fp8_bytes * 2 == dense_bytes


def test_merged_parts_that_cut_a_block_are_dequantized(edge):
    """q_proj's 192 rows (and gate_proj's 200) end inside a 128-row block: their merged weights
    are dequantized at load (dense, the reference's values); o_proj and down, not merged, stay
    fp8 with their partial edge blocks."""
    path, reference = edge
    params = minivllm.load(path)
    minivllm.state.check_params(params)
    for n, lp in enumerate(params.layers):
        want = merged(reference, n)
        for field in ("qkv", "gate_up"):
            got = getattr(lp, field)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
            assert torch.equal(got, want[field])
        for field in ("o_proj", "down"):
            got = getattr(lp, field)
            assert isinstance(got, Fp8BlockWeight) and got.scale_inv.shape == (3, 2)
            assert torch.equal(dense(got, torch.float32), want[field])


def test_mode_is_checked_and_env_switches_it(aligned, monkeypatch):
    from minivllm.state.load import fp8_weights_mode

    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "dequantize")
    assert fp8_weights_mode() == "dequantize"
    params = minivllm.load(aligned[0])
    assert isinstance(params.layers[0].down, torch.Tensor)
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "fp4")
    with pytest.raises(ValueError, match="MINIVLLM_FP8_WEIGHTS.*'fp4'"):
        minivllm.load(aligned[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_keep_whole_blocks_and_dequantize_cut_ones(tmp_path_factory, world_size):
    """TP slices on block boundaries stay fp8 (TP=2 here: every boundary a multiple of 128);
    at TP=4 the attention's 64-row (o_proj: 64-column) slices cut a block and are dequantized at
    load, as before, while the MLP's 128 stay fp8. Each rank's weights equal the TP=1 weights'
    slices."""
    path, _ = write_fp8_checkpoint(tmp_path_factory.mktemp("fp8w") / f"tp{world_size}", seed=6,
                                   dtype=torch.float32, **TP_ALIGNED)
    full = minivllm.load(path)
    d, nq = TP_ALIGNED["head_dim"], TP_ALIGNED["num_attention_heads"]
    inter = TP_ALIGNED["intermediate_size"]
    for rank in range(world_size):
        part = minivllm.load(path, shard=ShardSpec(rank=rank, world_size=world_size))
        q = slice(rank * nq // world_size * d, (rank + 1) * nq // world_size * d)
        i = slice(rank * inter // world_size, (rank + 1) * inter // world_size)
        for layer, whole in zip(part.layers, full.layers):
            kept = {f: isinstance(getattr(layer, f), Fp8BlockWeight) for f in FIELDS}
            assert kept == dict(qkv=world_size == 2, o_proj=world_size == 2, gate_up=True,
                                down=True)
            wq, wk, wv = dense(whole.qkv, torch.float32).split([nq * d] * 3)
            assert torch.equal(dense(layer.qkv, torch.float32), torch.cat([wq[q], wk[q], wv[q]]))
            assert torch.equal(dense(layer.o_proj, torch.float32),
                               dense(whole.o_proj, torch.float32)[:, q])
            wg, wu = dense(whole.gate_up, torch.float32).split([inter, inter])
            assert torch.equal(dense(layer.gate_up, torch.float32), torch.cat([wg[i], wu[i]]))
            assert torch.equal(dense(layer.down, torch.float32),
                               dense(whole.down, torch.float32)[:, i])


# --- 3. logits and tokens ----------------------------------------------------------------------

def oracle(reference, tmp_path, seed, **dims):
    """transformers' Qwen3ForCausalLM in float32 holding the reference (dequantized) weights."""
    from transformers import Qwen3ForCausalLM

    hf = make_hf_model(seed=seed, **dims)
    hf.load_state_dict(reference)
    return Qwen3ForCausalLM.from_pretrained(save_checkpoint(hf, tmp_path / "dequantized"),
                                            dtype=torch.float32).eval()


@pytest.mark.parametrize("path_kind", ["kernel", "torch"])
def test_logits_equal_dequantized_load_and_transformers(aligned, edge, tmp_path, monkeypatch,
                                                        kernel_calls, path_kind):
    """Every position's logits (fp32) with fp8 weights equal those of the same checkpoint loaded
    dequantized, through the kernel (the interpreter here) and through the torch path, and
    transformers' on the dequantized weights within fp32 tolerance."""
    import minivllm.functional.linear as linear
    from minivllm.kernels.launch import triton_usable

    if path_kind == "torch":
        monkeypatch.setattr(linear, "_FP8_KERNEL", "torch")
    device = hf_tiny_device()
    for (path, reference), seed, dims in ((aligned, 4, ALIGNED), (edge, 1, EDGE)):
        kernel_calls.clear()
        got = mv_logits(minivllm.load(path, device=device), PROMPTS).float().cpu()
        want = mv_logits(minivllm.load(path, device=device, fp8_weights="dequantize"),
                         PROMPTS).float().cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        hf = oracle(reference, tmp_path / str(seed), seed, **dims)
        torch.testing.assert_close(got, hf_logits(hf, PROMPTS), rtol=1e-4, atol=1e-4)
        assert bool(kernel_calls) == (path_kind == "kernel" and triton_usable(device))


def test_fp16_logits_through_the_kernel(aligned, kernel_calls, device):
    """In fp16 (the kernel's 16-bit path under the interpreter) the fp8 model's logits are the
    dequantized model's up to fp16 rounding."""
    from minivllm.kernels.launch import triton_usable

    got = mv_logits(minivllm.load(aligned[0], dtype="float16", device=device), PROMPTS)
    want = mv_logits(minivllm.load(aligned[0], dtype="float16", device=device,
                                   fp8_weights="dequantize"), PROMPTS)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert bool(kernel_calls) == triton_usable(device)


def greedy(path, device, monkeypatch, mode, **kw):
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", mode)
    with make_llm(path, device, dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_greedy_equals_the_dequantized_engine(aligned, device, monkeypatch, kernel_calls):
    path, _ = aligned
    want = greedy(path, device, monkeypatch, "dequantize")
    assert not kernel_calls
    got = greedy(path, device, monkeypatch, "fp8")
    assert len({t for seq in got for t in seq}) > 3  # varied outputs: a real comparison
    assert got == want
    assert kernel_calls, "the fp8 kernel never ran"


def test_lora_on_an_fp8_model(aligned, device, monkeypatch, tmp_path):
    """LoRA's layer calls the same linears (functional/lora.py): an adapter's greedy tokens on
    the fp8 model equal those on the dequantized one, and differ from the base model's."""
    from minivllm import LoRARequest
    from test_lora import write_adapter

    path, _ = aligned
    write_adapter(tmp_path / "adapter", path, r=4, alpha=8, targets="all-linear", seed=0)
    request = LoRARequest("a", 1, str(tmp_path / "adapter"))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    sampling = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = {}
    for mode in ("dequantize", "fp8"):
        monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", mode)
        with make_llm(path, device, dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
            runs[mode] = [list(o.outputs[0].token_ids) for o in
                          llm.generate(prompts, sampling, lora_request=request, use_tqdm=False)]
            runs[mode + " base"] = [list(o.outputs[0].token_ids) for o in
                                    llm.generate(prompts, sampling, use_tqdm=False)]
    assert runs["fp8"] == runs["dequantize"]
    assert runs["fp8 base"] == runs["dequantize base"] != runs["fp8"]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_equals_eager(aligned, backend):
    """The engine's compiled forward (stem, layer, head, each fullgraph) on fp8 params equals the
    eager forward (there: the kernel; compiled on a CPU: the torch path)."""
    from minivllm.runtime.compiled import compiled_forward
    from minivllm.state import SeqChunk, make_batch

    params = minivllm.load(aligned[0], device=hf_tiny_device())
    want = mv_logits(params, PROMPTS)
    torch._dynamo.reset()
    fn = compiled_forward(backend)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(PROMPTS))]
    cache = minivllm.init_cache(params, num_blocks=8 * len(PROMPTS), block_size=4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(PROMPTS, tables)], block_size=4,
                       every_row=True, device=params.device)
    with torch.no_grad():
        got, _ = fn(params, cache, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tp2_equals_tp1(tmp_path):
    """TP=2 over gloo with every slice kept in fp8 (TP_ALIGNED): TP=1's logits, eager and
    compiled, and greedy tokens (tests/tp_worker.py)."""
    from tp_worker import _run

    path, _ = write_fp8_checkpoint(tmp_path / "fp8w", seed=5, dtype=torch.float32,
                                   **TP_ALIGNED)
    assert isinstance(minivllm.load(path, shard=ShardSpec(rank=1, world_size=2)).layers[0].qkv,
                      Fp8BlockWeight)
    ref_logits, ref_compiled, ref_tokens = _run(path, 0, 1)
    mp.start_processes(_worker, args=(2, _free_port(), str(tmp_path), ["fp8w"]), nprocs=2,
                       join=True, start_method="spawn")
    assert len(set(t for seq in ref_tokens for t in seq)) > 3
    for rank in range(2):
        got = torch.load(tmp_path / f"fp8w.rank{rank}.pt")
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["compiled_logits"], ref_compiled, rtol=1e-5, atol=1e-5)
        assert got["tokens"] == ref_tokens, f"rank {rank}"


# --- 4. the engine's dense-only kernels --------------------------------------------------------

def test_engine_turns_off_the_dense_only_kernels(aligned, monkeypatch):
    """The persistent decode kernel and the fused MLP multiply 16-bit dense weights: refused when
    asked for, never defaulted on for a model whose weights stay fp8; with
    MINIVLLM_FP8_WEIGHTS=dequantize the model is dense again."""
    from minivllm.runtime.config import EngineConfig, _quantized_linears
    from minivllm.state.params import has_quantized
    from minivllm.state import ModelConfig
    import json

    path = aligned[0]
    with pytest.raises(ValueError, match="persistent_decode runs 16-bit dense layers.*block fp8"):
        EngineConfig.create(path, device="cpu", persistent_decode=True)
    assert EngineConfig.create(path, device="cpu").persistent_decode is False
    assert has_quantized(minivllm.load(path))
    config_dict = json.load(open(os.path.join(path, "config.json")))
    model_config = ModelConfig.from_json(os.path.join(path, "config.json"))
    assert _quantized_linears(config_dict, model_config)
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "dequantize")
    assert _quantized_linears(config_dict, model_config) is None
    assert not has_quantized(minivllm.load(path))
    monkeypatch.setenv("MINIVLLM_FP8_WEIGHTS", "nope")
    with pytest.raises(ValueError, match="'nope'"):
        EngineConfig.create(path, device="cpu")


# --- 5. on a GPU (benchmarks/gpu_checks.sh fp8w) -----------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 255, 300])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 12288), (24576, 4096),
                                 (1000, 1000)])
def test_gpu_kernel_matches_the_dequantized_product(m, n, k, dtype):
    """Qwen3-8B's qkv, o_proj, down and gate_up (and partial blocks) at 1-300 rows."""
    from minivllm.kernels.fp8_gemm import fp8_linear

    w = to(random_fp8(n, k, seed=m), "cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
    check_product(fp8_linear(x, w), x, w)


@gpu
def test_gpu_compiled_and_graphed():
    """fp8_matmul under torch.compile(fullgraph=True, inductor) and replayed in a CUDA graph
    equals eager."""
    from minivllm.functional.linear import fp8_matmul

    check_compiled_and_graphed(fp8_matmul, to(random_fp8(4096, 4096, seed=0), "cuda"))


@gpu
def test_gpu_engine_graphs_equal_eager(tmp_path):
    """The engine on the GPU (bf16, the checkpoint's dtype) with its compiled decode graphs gives
    the greedy tokens of its eager run; the fp32 engine the dequantized fp32 engine's."""
    path, _ = write_fp8_checkpoint(tmp_path / "ckpt", seed=9, **ALIGNED)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for eager in (True, False):
        with LLM(path, device="cuda", enforce_eager=eager, max_num_seqs=4,
                 max_model_len=128, num_kv_blocks=64) as llm:
            runs[eager] = [list(o.outputs[0].token_ids)
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
    tokens = {}
    for mode in ("fp8", "dequantize"):
        os.environ["MINIVLLM_FP8_WEIGHTS"] = mode
        try:
            with LLM(path, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
                     num_kv_blocks=64) as llm:
                tokens[mode] = [list(o.outputs[0].token_ids)
                                for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            del os.environ["MINIVLLM_FP8_WEIGHTS"]
    assert tokens["fp8"] == tokens["dequantize"]
