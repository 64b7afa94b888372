"""AWQ 4-bit checkpoints in the layout of Qwen's Qwen3-*-AWQ (AutoAWQ's GEMM packing; config.json's
quantization_config {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
"version": "gemm"}; each quantized linear X stored as X.qweight int32 [in, out / 8], X.qzeros
int32 [in / G, out / 8], X.scales fp16 [in / G, out], the 8 nibbles of an int32 holding the
columns [0, 2, 4, 6, 1, 3, 5, 7] of their group of 8).

The checkpoints are tiny random Qwen3s written by transformers whose linear weights this file
quantizes and packs itself, from the format's description (quantize: asymmetric min/max per group
of input rows, round, clamp to 0..15; np_pack / np_unpack: plain integer loops over the nibble
order, in numpy). The oracle is transformers in float32 with every linear's weight replaced by
the weight np_unpack dequantizes: none of minivllm's AWQ code computes it. They check:
  1. packing: minivllm's pack_awq / unpack_awq / dequantize_awq against the numpy reference
     (hypothesis: random nibbles and groups);
  2. the Triton AWQ GEMM (kernels/awq_gemm.py, under the interpreter on a CPU) against an fp64
     product of the dequantized weight: fp32 and fp16 activations, M = 1, odd M, M past a tile,
     K not a multiple of the K step (a whole-input group), split K, unsummed partials; and that
     torch.compile(fullgraph=True) traces it;
  3. the loaded params (AwqWeight pytrees, q/k/v and gate/up merged along the packed output)
     and the logits of the forward, kernel and torch paths, against transformers; the engine's
     greedy tokens against transformers';
  4. modules_to_not_convert, group_size -1, the default dtype (config.json's float16), bf16;
  5. tensor parallelism: each rank's slices; TP=2 over gloo equals TP=1; a shard that cuts a
     group is refused before any weight is read;
  6. the compiled forward (fullgraph) equals eager;
  7. unsupported configs and broken tensors refused with errors naming them;
  8. on a GPU only (skipped here): the kernel in bf16 / fp16 at real sizes, compiled and in a
     CUDA graph, and the engine's graphs against eager (benchmarks/gpu_checks.sh awq).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import minivllm
from minivllm import CheckpointError, LLM, SamplingParams, ShardSpec
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.quant import AwqWeight, dequantize_awq, pack_awq, unpack_awq

from engine_helpers import make_llm
from hf_tiny import hf_greedy, make_hf_model, save_checkpoint
from test_fp8_checkpoint import _rewrite, _set_quant
from test_load_audit import _count_reads
from awq_tp_worker import run as tp_run
from awq_tp_worker import worker as tp_worker
from tp_worker import _free_port

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# q/o: 128 x 128, k/v: 64 x 128, gate/up: 256 x 128, down: 128 x 256; at TP=2 o_proj's input
# splits at 64 and down's at 128 (whole groups of 32 and 64, not of 128).
DIMS = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32)


def awq_config(group=64, **extra):
    return dict({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": None}, **extra)


# --- the independent quantizer, packer and dequantizer (numpy) --------------------------------

def np_pack(q: np.ndarray) -> np.ndarray:
    """[rows, cols] values 0..15 -> int32 [rows, cols / 8]: nibble i of packed column j holds
    column 8 j + ORDER[i]."""
    rows, cols = q.shape
    out = np.zeros((rows, cols // 8), dtype=np.uint32)
    for j in range(cols // 8):
        for i in range(8):
            out[:, j] |= q[:, 8 * j + ORDER[i]].astype(np.uint32) << np.uint32(4 * i)
    return out.view(np.int32)


def np_unpack(packed: np.ndarray) -> np.ndarray:
    """np_pack's inverse: int32 [rows, n] -> int64 [rows, 8 n]."""
    p = packed.view(np.uint32)
    out = np.zeros((p.shape[0], p.shape[1] * 8), dtype=np.int64)
    for j in range(p.shape[1]):
        for i in range(8):
            out[:, 8 * j + ORDER[i]] = (p[:, j] >> np.uint32(4 * i)) & np.uint32(15)
    return out


def quantize(w: torch.Tensor, group: int):
    """nn.Linear weight [out, in] -> (qweight, qzeros, scales fp16) for groups of `group` input
    rows (-1: all): per group and output column, scale = (max - min) / 15, zero = round(-min /
    scale), q = clamp(round(w / scale) + zero, 0, 15)."""
    wt = w.detach().double().numpy().T  # [in, out]
    k, n = wt.shape
    g = k if group == -1 else group
    grouped = wt.reshape(k // g, g, n)
    lo, hi = grouped.min(1), grouped.max(1)
    scale = np.maximum(hi - lo, 1e-5) / 15
    scale = scale.astype(np.float16).astype(np.float64)  # as stored
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(grouped / scale[:, None]) + zero[:, None], 0, 15).reshape(k, n)
    return (torch.from_numpy(np_pack(q.astype(np.int64))).contiguous(),
            torch.from_numpy(np_pack(zero.astype(np.int64))),
            torch.from_numpy(np.ascontiguousarray(scale.astype(np.float16))))


def dequantize(qweight, qzeros, scales) -> torch.Tensor:
    """The nn.Linear weight [out, in] (float32) the three tensors stand for."""
    q, z = np_unpack(qweight.numpy()), np_unpack(qzeros.numpy())
    s = scales.double().numpy()
    g = q.shape[0] // z.shape[0]
    rows = np.arange(q.shape[0]) // g
    return torch.from_numpy(((q - z[rows]) * s[rows]).T.astype(np.float32)).contiguous()


def write_awq_checkpoint(path, *, seed=0, group=64, dtype=torch.float32, skip=(),
                         quant_config=None, **dims):
    """A tiny random Qwen3 (untied head) saved by transformers, its decoder linears (but those
    whose module name starts with an entry of `skip`) rewritten as AWQ, the other tensors as
    `dtype`. Returns (path, reference: tensor name -> the float32 weight it stands for)."""
    dims = dict(DIMS, **dims)
    path = save_checkpoint(make_hf_model(seed=seed, std=0.1, **dims), path)
    file = os.path.join(path, "model.safetensors")
    out, reference = {}, {}
    for name, t in load_file(file).items():
        module = name.removesuffix(".weight")
        if module.endswith(LINEARS) and not module.startswith(tuple(skip)):
            qweight, qzeros, scales = quantize(t, group)
            out[module + ".qweight"], out[module + ".qzeros"] = qweight, qzeros
            out[module + ".scales"] = scales
            reference[name] = dequantize(qweight, qzeros, scales)
        else:
            out[name] = t.to(dtype)
            reference[name] = out[name].float()
    save_file(out, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["dtype"] = str(dtype).removeprefix("torch.")
    cfg["quantization_config"] = awq_config(group) if quant_config is None else quant_config
    json.dump(cfg, open(cfg_path, "w"), indent=2)
    return path, reference


def oracle(reference, tmp_path, seed=0, **dims):
    """transformers' Qwen3ForCausalLM in float32 holding the reference (dequantized) weights."""
    from transformers import Qwen3ForCausalLM

    hf = make_hf_model(seed=seed, **dict(DIMS, **dims))
    hf.load_state_dict(reference)
    return Qwen3ForCausalLM.from_pretrained(save_checkpoint(hf, tmp_path / "dequantized"),
                                            dtype=torch.float32).eval()


PROMPTS = [[3, 17, 25, 4, 99, 60, 12, 8, 41], [7, 1, 55], [90, 34, 2, 2, 18, 76, 43, 21, 9, 10, 5]]


def hf_logits(model, prompts):
    """Every position's logits of each prompt, concatenated: [tokens, vocab]."""
    with torch.no_grad():
        return torch.cat([model(torch.tensor([p])).logits[0] for p in prompts])


def mv_logits(params, prompts, **forward_kwargs):
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
    cache = minivllm.init_cache(params, num_blocks=8 * len(prompts), block_size=4)
    batch = make_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], block_size=4,
                       every_row=True, device=params.device)
    with torch.no_grad():
        return minivllm.forward(params, cache, batch, **forward_kwargs)[0]


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    """Groups of 64, float32 unquantized tensors (so that the comparison is at fp32 rounding)."""
    root = tmp_path_factory.mktemp("awq")
    path, reference = write_awq_checkpoint(root / "g64", seed=1, group=64)
    return path, reference, oracle(reference, root, seed=1)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the Triton AWQ GEMM's launches through functional.linear."""
    from minivllm.kernels import awq_gemm

    calls = []
    real = awq_gemm.awq_linear
    monkeypatch.setattr(awq_gemm, "awq_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


# --- 1. packing --------------------------------------------------------------------------------

@given(rows=st.integers(1, 9), packed=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pack_and_unpack_match_the_numpy_reference(rows, packed, seed):
    q = np.random.default_rng(seed).integers(0, 16, size=(rows, 8 * packed))
    got = pack_awq(torch.from_numpy(q))
    assert got.dtype == torch.int32 and np.array_equal(got.numpy(), np_pack(q))
    assert np.array_equal(unpack_awq(got).numpy(), q)
    assert np.array_equal(np_unpack(got.numpy()), q)


@given(groups=st.integers(1, 3), group=st.sampled_from([1, 2, 4, 32]), packed=st.integers(1, 3),
       seed=st.integers(0, 2**31 - 1))
def test_dequantize_matches_the_numpy_reference(groups, group, packed, seed):
    rng = np.random.default_rng(seed)
    k, n = groups * group, 8 * packed
    qweight = torch.from_numpy(np_pack(rng.integers(0, 16, size=(k, n))))
    qzeros = torch.from_numpy(np_pack(rng.integers(0, 16, size=(groups, n))))
    scales = torch.from_numpy(rng.uniform(1e-3, 1, size=(groups, n)).astype(np.float16))
    w = AwqWeight(qweight=qweight, qzeros=qzeros, scales=scales, group_size=group)
    want = dequantize(qweight, qzeros, scales).T
    assert torch.equal(dequantize_awq(w, torch.float32), want)
    assert torch.equal(dequantize_awq(w, torch.bfloat16), want.bfloat16())


# --- 2. the kernel -----------------------------------------------------------------------------

def random_awq(k, n, group, seed):
    g = torch.Generator().manual_seed(seed)
    gs = k if group == -1 else group
    return AwqWeight(qweight=pack_awq(torch.randint(0, 16, (k, n), generator=g)),
                     qzeros=pack_awq(torch.randint(0, 16, (k // gs, n), generator=g)),
                     scales=(torch.rand(k // gs, n, generator=g) * 0.05 + 0.005).half(),
                     group_size=gs)


def check_product(out, x, w: AwqWeight):
    """out against x @ W in fp64, W rounded to x's dtype as the kernel rounds it; bound: fp32
    accumulation of the products plus the output's own rounding."""
    assert out.shape == (x.shape[0], w.out_features) and out.dtype == x.dtype
    wd = dequantize(w.qweight.cpu(), w.qzeros.cpu(), w.scales.cpu()).T.to(x.dtype).double()
    x64 = x.cpu().double()
    ref = x64 @ wd
    half_ulp = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[x.dtype]
    bound = 1e-5 * (x64.abs() @ wd.abs()) + half_ulp * ref.abs()
    err = (out.cpu().double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max():.3g}"


KERNEL_CASES = [  # (m, k, n, group)
    (1, 256, 64, 64),     # decode, split K
    (3, 128, 40, 32),     # odd M, N not a multiple of the tile
    (17, 256, 48, 128),   # past a 16-row tile
    (70, 128, 136, 64),   # prefill tiles (64 x 128)
    (5, 96, 32, -1),      # one group: K = 96, not a multiple of the 64 step
    (2, 256, 136, 64),    # decode's 128-column tiles, the last one 17 - 16 ints wide
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("m,k,n,group", KERNEL_CASES)
def test_kernel_matches_the_dequantized_product(device, m, k, n, group, dtype):
    from minivllm.kernels.awq_gemm import awq_linear
    from minivllm.kernels.launch import triton_usable

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    w = random_awq(k, n, group, seed=m + k)
    w = AwqWeight(w.qweight.to(device), w.qzeros.to(device), w.scales.to(device), w.group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
    check_product(awq_linear(x, w), x, w)
    # x with a row stride (a slice of a wider tensor)
    wide = torch.randn(m, k + 8, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    check_product(awq_linear(wide[:, 8:], w), wide[:, 8:], w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_steps_from_256_rows_dequantize_and_multiply(device, kernel_calls, dtype):
    """functional.linear's awq_matmul: the kernel below DEQUANTIZE_ROWS rows, the dequantized
    weight times torch's matmul from there on (vLLM's choice at 256 tokens); both give the
    product."""
    from minivllm.functional import linear
    from minivllm.kernels.launch import triton_usable

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")
    w = random_awq(64, 32, 32, seed=3)
    w = AwqWeight(w.qweight.to(device), w.qzeros.to(device), w.scales.to(device), w.group_size)
    check_dequantize_switch(linear.awq_matmul, w, 64, check_product, kernel_calls, device, dtype)


def check_dequantize_switch(matmul, w, k, check, kernel_calls, device, dtype):
    """matmul(x, w) for x: [m, k] launches the Triton kernel (counted in kernel_calls) below
    functional.linear.DEQUANTIZE_ROWS rows and not from there on, and `check` passes on both
    sides (test_fp8_weights.py's test too)."""
    from minivllm.functional import linear

    rows = linear.DEQUANTIZE_ROWS
    assert rows == 256
    for m, kernel in ((1, True), (rows - 1, True), (rows, False), (rows + 44, False)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
        kernel_calls.clear()
        with torch.no_grad():
            out = matmul(x, w)
        assert bool(kernel_calls) == kernel, m
        check(out, x, w)


def test_kernel_partials_and_tiles(device):
    """The CPU heuristic reaches the paths the cases above are meant to test; the unsummed
    partials sum to the product."""
    from minivllm.kernels.awq_gemm import awq_config, awq_linear
    from minivllm.kernels.launch import triton_usable

    if not triton_usable(device) or device.type == "cuda":
        pytest.skip("the interpreter's tiling (4 SMs)")
    cfg = {case: awq_config(case[0], case[2], case[1], case[1] if case[3] == -1 else case[3],
                            torch.float32, device) for case in KERNEL_CASES}
    assert cfg[KERNEL_CASES[0]]["split"] > 1
    assert cfg[KERNEL_CASES[2]]["block_m"] == 32
    assert cfg[KERNEL_CASES[3]]["block_m"] == 64 and cfg[KERNEL_CASES[3]]["block_n"] == 128
    assert cfg[KERNEL_CASES[4]]["block_k"] == 64  # 96 = 64 + a masked 32
    assert cfg[KERNEL_CASES[1]]["block_k"] == 32  # the group
    assert cfg[KERNEL_CASES[5]]["block_n"] == 128 and cfg[KERNEL_CASES[0]]["block_n"] == 32
    # every key may be fixed by the caller (block_k was once refused: a TypeError)
    fixed = dict(block_m=32, block_n=32, block_k=32, split=2, num_warps=8, num_stages=1)
    assert awq_config(2, 64, 256, 64, torch.float32, device, **fixed) == fixed
    w = random_awq(256, 64, 64, seed=0)
    x = torch.randn(2, 256)
    parts = awq_linear(x, w, partials=True)
    assert parts.dim() == 3 and parts.shape[0] > 1 and parts.dtype == torch.float32
    check_product(parts.sum(0), x, w)


TRACE_BODY = """
from minivllm.kernels.awq_gemm import awq_config, awq_linear
from minivllm.state.quant import AwqWeight

w = AwqWeight(qweight=torch.zeros(256, 8, dtype=torch.int32),
              qzeros=torch.zeros(4, 8, dtype=torch.int32), scales=torch.ones(4, 64).half(),
              group_size=64)
assert awq_config(2, 64, 256, 64, torch.float32, torch.device("cpu"))["split"] > 1

def layer(h, w):
    return awq_linear(h * 2, w) + 1

torch.set_grad_enabled(False)
trace(layer, torch.randn(2, 256), w)
"""


def test_kernel_traces_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces the kernel (split K: its launch and the torch sum)
    into one graph, an AwqWeight as input."""
    from triton_trace import kernel_launches_traced

    if device.type == "cuda":
        pytest.skip("test_gpu_compiled_and_graphed runs it on the GPU")
    assert kernel_launches_traced(TRACE_BODY) == {"dynamo": 1, "aot": 1}


# --- 3. the loaded params and the forward against transformers ---------------------------------

def test_checkpoint_is_in_the_awq_layout(ckpt64):
    path, reference, _ = ckpt64
    sd = load_file(os.path.join(path, "model.safetensors"))
    p = "model.layers.0.mlp.gate_proj."
    assert sd[p + "qweight"].dtype == torch.int32 and sd[p + "qweight"].shape == (128, 32)
    assert sd[p + "qzeros"].shape == (2, 32) and sd[p + "scales"].shape == (2, 256)
    assert sd[p + "scales"].dtype == torch.float16 and p + "weight" not in sd
    original = make_hf_model(seed=1, **DIMS).state_dict()[p + "weight"]
    err = (reference[p + "weight"] - original).abs().max()
    assert 0 < err <= (original.max() - original.min()) / 15  # 4 bits' worth


def test_loaded_params_are_the_packed_tensors(ckpt64):
    """q/k/v and gate/up concatenated along the packed output columns; each AwqWeight
    dequantizes to the reference's [out, in] weight (merged as the dense ones are)."""
    path, reference, _ = ckpt64
    params = minivllm.load(path)
    minivllm.state.check_params(params)
    assert params.dtype == torch.float32
    p = "model.layers.1."
    r = {k.removeprefix(p): v for k, v in reference.items() if k.startswith(p)}
    lp = params.layers[1]
    want = {"qkv": torch.cat([r["self_attn.q_proj.weight"], r["self_attn.k_proj.weight"],
                              r["self_attn.v_proj.weight"]]),
            "o_proj": r["self_attn.o_proj.weight"],
            "gate_up": torch.cat([r["mlp.gate_proj.weight"], r["mlp.up_proj.weight"]]),
            "down": r["mlp.down_proj.weight"]}
    for field, w in want.items():
        got = getattr(lp, field)
        assert isinstance(got, AwqWeight) and got.group_size == 64 and got.shape == w.shape
        assert got.scales.dtype == torch.float16
        assert torch.equal(dequantize_awq(got, torch.float32).T, w), field
    sd = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(lp.qkv.qweight[:, :16], sd[p + "self_attn.q_proj.qweight"])
    assert torch.equal(lp.gate_up.scales[:, 256:], sd[p + "mlp.up_proj.scales"])


@pytest.mark.parametrize("path_kind", ["kernel", "torch"])
def test_logits_equal_transformers(ckpt64, monkeypatch, kernel_calls, path_kind):
    """Every position's logits within fp32 tolerance of transformers' on the dequantized
    weights: through the Triton kernel (the interpreter here) and through the torch path."""
    import minivllm.functional.linear as linear

    path, _, hf = ckpt64
    if path_kind == "torch":
        monkeypatch.setattr(linear, "_AWQ_KERNEL", "torch")
    params = minivllm.load(path, device=hf_tiny_device())
    got = mv_logits(params, PROMPTS).float().cpu()
    want = hf_logits(hf, PROMPTS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        runs_kernel = linear._awq_kernel(torch.empty(1, 1, device=params.device))
    assert bool(kernel_calls) == runs_kernel
    from minivllm.kernels.launch import triton_usable

    assert runs_kernel == (path_kind == "kernel" and triton_usable(params.device))


def hf_tiny_device():
    from hf_tiny import DEVICE

    return DEVICE


def test_engine_greedy_equals_transformers(ckpt64, device, kernel_calls):
    path, _, hf = ckpt64
    with make_llm(path, device, dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    assert len({t for seq in tokens for t in seq}) > 3  # varied outputs: a real comparison
    assert tokens == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert kernel_calls, "the AWQ kernel never ran"


# --- 4. variants -------------------------------------------------------------------------------

def test_modules_to_not_convert_stay_unquantized(tmp_path):
    """Listed modules are stored as X.weight and load dense; a merged weight whose parts mix
    the two (k_proj kept, q/v quantized) is dequantized into one dense weight."""
    config = awq_config(32, modules_to_not_convert=["model.layers.1.mlp", "self_attn.k_proj"])
    path, reference = write_awq_checkpoint(
        tmp_path / "ckpt", seed=2, group=32, quant_config=config,
        skip=("model.layers.1.mlp", "model.layers.0.self_attn.k_proj",
              "model.layers.1.self_attn.k_proj"))
    params = minivllm.load(path)
    l0, l1 = params.layers
    assert isinstance(l0.gate_up, AwqWeight) and isinstance(l0.o_proj, AwqWeight)
    assert isinstance(l1.gate_up, torch.Tensor) and isinstance(l1.down, torch.Tensor)
    assert isinstance(l0.qkv, torch.Tensor)  # the mix, dequantized
    assert torch.equal(l1.down, reference["model.layers.1.mlp.down_proj.weight"])
    hf = oracle(reference, tmp_path, seed=2)
    torch.testing.assert_close(mv_logits(params, PROMPTS), hf_logits(hf, PROMPTS),
                               rtol=1e-4, atol=1e-4)


def test_whole_input_groups(tmp_path):
    """group_size -1: one group of every input row (scales [1, out])."""
    path, reference = write_awq_checkpoint(tmp_path / "ckpt", seed=3, group=-1)
    assert load_file(os.path.join(path, "model.safetensors"))[
        "model.layers.0.mlp.down_proj.scales"].shape == (1, 128)
    params = minivllm.load(path)
    assert params.layers[0].down.group_size == 256
    hf = oracle(reference, tmp_path, seed=3)
    torch.testing.assert_close(mv_logits(params, PROMPTS), hf_logits(hf, PROMPTS),
                               rtol=1e-4, atol=1e-4)


def test_default_dtype_is_the_checkpoints_float16_and_bf16_runs(tmp_path):
    """An AWQ checkpoint's unquantized tensors are fp16 and config.json says so: minivllm's
    default dtype (LLM's too); bf16 activations take the fp16 scales too. Both within their
    rounding of the fp32 oracle's logits."""
    from minivllm.runtime.config import EngineConfig

    path, reference = write_awq_checkpoint(tmp_path / "ckpt", seed=4, dtype=torch.float16)
    assert EngineConfig.create(path, device="cpu").dtype == torch.float16
    want = hf_logits(oracle(reference, tmp_path, seed=4), PROMPTS[:1])
    for dtype, tol in ((None, 2e-2), ("bfloat16", 1e-1)):
        params = minivllm.load(path, dtype=dtype)
        assert params.dtype == (torch.float16 if dtype is None else torch.bfloat16)
        assert params.layers[0].qkv.scales.dtype == torch.float16
        got = mv_logits(params, PROMPTS[:1]).float()
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_engine_turns_off_the_dense_only_kernels(ckpt64, caplog):
    """The persistent decode kernel and the fused MLP multiply 16-bit dense weights: refused
    when asked for, never defaulted on for an AWQ model."""
    from minivllm.runtime.config import EngineConfig
    from minivllm.runtime.runner import fused_mlp_rows
    from minivllm.state.params import has_awq

    path = ckpt64[0]
    with pytest.raises(ValueError, match="persistent_decode runs 16-bit dense layers.*AWQ"):
        EngineConfig.create(path, device="cpu", persistent_decode=True)
    assert EngineConfig.create(path, device="cpu").persistent_decode is False
    assert has_awq(minivllm.load(path))
    assert fused_mlp_rows("32-64") is not None  # what the runner then drops for AWQ
    params = minivllm.random_params(ModelConfig.from_json(path))
    assert not has_awq(params)


# --- 5. tensor parallelism ---------------------------------------------------------------------

@pytest.mark.parametrize("group", [32, -1])
def test_shards_are_slices_of_the_whole(tmp_path, group):
    """Rank r's AwqWeights: its packed output columns (q heads, replicated-or-split kv heads,
    intermediate rows) and its input rows and groups (o_proj, down), exactly; a whole-input
    group's zero points and scales are every rank's."""
    path, _ = write_awq_checkpoint(tmp_path / "ckpt", seed=6, group=group)
    full = minivllm.load(path)
    d, nq, nkv, inter = 32, 4, 2, 256
    for world in (2, 4):
        for rank in range(world):
            part = minivllm.load(path, shard=ShardSpec(rank=rank, world_size=world))
            kvh = max(1, nkv // world)
            k0 = (rank * kvh if nkv >= world else rank * nkv // world) * d
            q = slice(rank * nq // world * d, (rank + 1) * nq // world * d)
            i = slice(rank * inter // world, (rank + 1) * inter // world)
            for lp, whole in zip(part.layers, full.layers):
                wq, wk, wv = dequantize_awq(whole.qkv, torch.float32).T.split([nq * d, nkv * d,
                                                                               nkv * d])
                want = torch.cat([wq[q], wk[k0:k0 + kvh * d], wv[k0:k0 + kvh * d]])
                assert torch.equal(dequantize_awq(lp.qkv, torch.float32).T, want)
                o = dequantize_awq(whole.o_proj, torch.float32)[q]
                assert torch.equal(dequantize_awq(lp.o_proj, torch.float32), o)
                wg, wu = dequantize_awq(whole.gate_up, torch.float32).T.split([inter, inter])
                assert torch.equal(dequantize_awq(lp.gate_up, torch.float32).T,
                                   torch.cat([wg[i], wu[i]]))
                assert torch.equal(dequantize_awq(lp.down, torch.float32),
                                   dequantize_awq(whole.down, torch.float32)[i])
                if group == -1:
                    assert torch.equal(lp.down.scales, whole.down.scales)
                    assert lp.down.group_size == inter // world
                else:
                    assert lp.down.scales.shape[0] == (inter // world) // group


def test_tp2_equals_tp1(tmp_path):
    """TP=2 over gloo (groups of 32: o_proj's 64 input rows a rank are 2 groups): TP=1's logits
    and greedy tokens (tests/awq_tp_worker.py; the compiled forward at TP=2 is the engine's
    usual one, test_tensor_parallel.py's)."""
    write_awq_checkpoint(tmp_path / "g32", seed=5, group=32)
    ref_logits, ref_tokens = tp_run(str(tmp_path / "g32"), 0, 1)
    mp.start_processes(tp_worker, args=(2, _free_port(), str(tmp_path), ["g32"]),
                       nprocs=2, join=True, start_method="spawn")
    assert len({t for seq in ref_tokens for t in seq}) > 3
    for rank in range(2):
        got = torch.load(tmp_path / f"g32.rank{rank}.pt")
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-5, atol=1e-5)
        assert got["tokens"] == ref_tokens, rank


@pytest.mark.parametrize("group,world,what", [
    (128, 4, r"down_proj: tensor-parallel rank 0 of 4 takes input columns \[0, 64\), which "
             r"cuts an AWQ group of 128"),
    (64, 4, r"o_proj: tensor-parallel rank 0 of 4 takes input columns \[0, 32\), which cuts "
            r"an AWQ group of 64"),
])
def test_shard_cutting_a_group_is_refused_before_reading(tmp_path, monkeypatch, group, world,
                                                         what):
    path, _ = write_awq_checkpoint(tmp_path / "ckpt", seed=7, group=group)
    minivllm.load(path, shard=ShardSpec(rank=0, world_size=2))  # whole groups at 2 ranks
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=what):
        minivllm.load(path, shard=ShardSpec(rank=0, world_size=world))
    assert reads == []


def test_shard_cutting_a_packed_int32_is_refused(tmp_path, monkeypatch):
    """head_dim 12: at TP=2 the q rows split at 24 and k/v's at 12, inside a packed int32."""
    path, _ = write_awq_checkpoint(tmp_path / "ckpt", seed=8, group=-1, head_dim=12,
                                   num_attention_heads=4, num_key_value_heads=2)
    minivllm.load(path)
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=r"k_proj: tensor-parallel rank 0 of 2 takes output "
                                              r"rows \[0, 12\), which cuts a packed int32"):
        minivllm.load(path, shard=ShardSpec(rank=0, world_size=2))
    assert reads == []


# --- 6. compiled ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_forward_equals_eager(ckpt64, backend):
    """The engine's compiled forward (stem, layer, head, each fullgraph) on AWQ params equals the
    eager forward (there: the kernel; compiled on a CPU: the torch path)."""
    from minivllm.runtime.compiled import compiled_forward

    params = minivllm.load(ckpt64[0], device=hf_tiny_device())
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


# --- 7. refused ----------------------------------------------------------------------------------

UNSUPPORTED = [
    (awq_config(bits=8), "bits 8"),
    (dict(awq_config(), bits=None, w_bit=3), "w_bit 3"),
    (awq_config(zero_point=False), "zero_point False"),
    (awq_config(version="gemv"), "version 'gemv'"),
    (awq_config(version="gemv_fast"), "version 'gemv_fast'"),
    (dict(awq_config(), format="exllama"), "format 'exllama'"),
    (awq_config(backend="llm-awq"), "backend 'llm-awq'"),
    (awq_config(256), "group_size 256"),
    (awq_config(0), "group_size 0"),
    (awq_config(modules_to_not_convert="lm_head"), "modules_to_not_convert 'lm_head'"),
    (dict(awq_config(), quant_method="awq_marlin"), "quant_method 'awq_marlin'"),
]


@pytest.fixture
def broken(ckpt64, tmp_path):
    return shutil.copytree(ckpt64[0], tmp_path / "ckpt")


@pytest.mark.parametrize("quant,message", UNSUPPORTED, ids=[m for _, m in UNSUPPORTED])
def test_unsupported_awq_configs_are_refused(broken, monkeypatch, quant, message):
    if quant.get("bits", 0) is None:
        del quant["bits"]
    _set_quant(broken, quant)
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"quantization_config {message}.*not supported"):
        minivllm.load(broken)
    assert reads == []
    with pytest.raises(ValueError, match=rf"quantization_config {message}.*not supported"):
        LLM(str(broken), device="cpu")


def test_awq_moe_is_refused(tmp_path):
    from hf_tiny import make_hf_moe_model

    path = save_checkpoint(make_hf_moe_model(seed=0), tmp_path / "moe")
    _set_quant(path, awq_config(32))
    with pytest.raises(CheckpointError, match="AWQ checkpoints of mixture-of-experts"):
        minivllm.load(path)


def test_missing_qzeros_is_named(broken, monkeypatch):
    name = "model.layers.1.mlp.down_proj.qzeros"
    _rewrite(broken, lambda sd: sd.pop(name))
    reads = _count_reads(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {name}: the AWQ tensors"):
        minivllm.load(broken)
    assert reads == []


def test_misshaped_and_mistyped_tensors_are_named(broken):
    name = "model.layers.0.self_attn.o_proj.scales"
    _rewrite(broken, lambda sd: sd.__setitem__(name, torch.ones(4, 128).half()))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(4, 128\), expected \(2, 128\)"):
        minivllm.load(broken)
    _rewrite(broken, lambda sd: sd.__setitem__(name, torch.ones(2, 128, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=rf"{name} is stored as I32; an AWQ scales is"):
        minivllm.load(broken)
    _rewrite(broken, lambda sd: sd.__setitem__(name, torch.ones(2, 128).half()))
    q = "model.layers.0.mlp.up_proj.qweight"
    _rewrite(broken, lambda sd: sd.__setitem__(q, sd[q].float()))
    with pytest.raises(CheckpointError, match=rf"{q} is stored as F32; an AWQ qweight is I32"):
        minivllm.load(broken)


def test_dense_weight_where_awq_is_expected_is_named(broken):
    """A module stored dense (X.weight) that the config quantizes: its AWQ tensors are missing
    and the dense weight is unexpected; the error names them and modules_to_not_convert."""
    m = "model.layers.0.mlp.gate_proj"

    def edit(sd):
        for k in ("qweight", "qzeros", "scales"):
            sd.pop(f"{m}.{k}")
        sd[m + ".weight"] = torch.zeros(256, 128)

    _rewrite(broken, edit)
    with pytest.raises(CheckpointError, match=rf"missing tensor\(s\) {m}.qweight.*"
                                              rf"modules_to_not_convert"):
        minivllm.load(broken)


def test_awq_tensors_without_the_config_are_refused(broken):
    _set_quant(broken, None)
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\) .*proj.weight.*AWQ tensors "
                                              r".*no AWQ quantization_config"):
        minivllm.load(broken)


# --- 8. on a GPU (benchmarks/gpu_checks.sh awq) ------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("k,n,group", [(4096, 6144, 128), (4096, 4096, 128), (12288, 4096, 64),
                                       (2048, 1024, -1)])
def test_gpu_kernel_matches_torch_path(m, k, n, group, dtype):
    from minivllm.kernels.awq_gemm import awq_linear

    w = random_awq(k, n, group, seed=m)
    w = AwqWeight(w.qweight.cuda(), w.qzeros.cuda(), w.scales.cuda(), w.group_size)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to("cuda", dtype)
    check_product(awq_linear(x, w), x, w)


def check_compiled_and_graphed(matmul, w):
    """matmul(x, w) (a quantized weight's) under torch.compile(fullgraph=True, inductor) and
    replayed in a CUDA graph equals eager: test_fp8_weights.py's GPU test shares it."""
    fn = torch.compile(lambda x, w: matmul(x * 2, w) + 1, fullgraph=True)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        want = matmul(x * 2, w) + 1
        torch.testing.assert_close(fn(x, w), want, rtol=1e-2, atol=1e-2)
        static = x.clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn(static, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn(static, w)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, want, rtol=1e-2, atol=1e-2)


@gpu
def test_gpu_compiled_and_graphed():
    """awq_matmul under torch.compile(fullgraph=True, inductor) and replayed in a CUDA graph
    equals eager."""
    from minivllm.functional.linear import awq_matmul

    w = random_awq(4096, 4096, 128, seed=0)
    w = AwqWeight(w.qweight.cuda(), w.qzeros.cuda(), w.scales.cuda(), w.group_size)
    check_compiled_and_graphed(awq_matmul, w)


@gpu
def test_gpu_engine_graphs_equal_eager(tmp_path):
    """The engine on the GPU (fp16, the checkpoint's dtype) with its compiled decode graphs
    gives the greedy tokens of its eager run, and the fp32 engine transformers' on the dequantized
    weights."""
    path, reference = write_awq_checkpoint(tmp_path / "ckpt", seed=9, dtype=torch.float16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    runs = {}
    for eager in (True, False):
        with LLM(path, device="cuda", enforce_eager=eager, max_num_seqs=4,
                 max_model_len=128, num_kv_blocks=64) as llm:
            runs[eager] = [list(o.outputs[0].token_ids)
                           for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runs[True] == runs[False]
    hf = oracle(reference, tmp_path, seed=9)
    with LLM(path, device="cuda", dtype="float32", max_num_seqs=4, max_model_len=128,
             num_kv_blocks=64) as llm:
        tokens = [list(o.outputs[0].token_ids)
                  for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [hf_greedy(hf, p, 8) for p in PROMPTS]
