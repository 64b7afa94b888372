"""Audit (session 76) of quantized checkpoint handling: block-fp8 and AWQ weights against an
independent dequantization written here (fp8: each [bn, bk] block of the weight, partial at the
edges, times its own scale_inv, in float64; AWQ: each int32's nibble i is column 8 j + [0, 2, 4,
6, 1, 3, 5, 7][i] of its group of 8, (q - z) * s per group of input rows), and against what vLLM
does with a checkpoint (vllm/model_executor/models/qwen3.py, layers/quantization/fp8.py, awq.py).

  1. The Triton GEMMs compute a weight given as views: an Fp8BlockWeight or AwqWeight whose
     tensors are views (a column slice, a transpose) passes check() and the torch path computes
     it right, but the kernels indexed them as contiguous and computed another weight's product
     without a word (a research caller composing layers by hand, functional.linear at decode);
     the wrappers now hand the kernels contiguous tensors (a copy of a view only).
  2. A short scale grid, short zero points or scales, or int8 words: dequantize_fp8_weight and
     dequantize_awq broadcast the short tensor over every block row / group, and the kernels read
     past its end, without a word; each is now a ValueError naming the tensor.
  3. A tied model whose checkpoint holds a quantized lm_head
     (lm_head.weight in fp8 with its lm_head.weight_scale_inv): vLLM's Qwen3ForCausalLM skips
     every "lm_head." tensor of a tied model (AutoWeightsLoader(skip_prefixes=["lm_head."])), and
     load skipped only lm_head.weight, refusing the scale as unexpected; it now skips the prefix.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import minivllm
from minivllm.functional.linear import column_linear
from minivllm.state.quant import (AwqWeight, Fp8BlockWeight, dequantize_awq,
                                  dequantize_fp8_weight, pack_awq)

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def triton_or_skip(device):
    from minivllm.kernels.launch import triton_usable

    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


# --- the independent references ----------------------------------------------------------------

def fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """float64 [out, in]: block (i, j) of the weight (partial at the edges) times its
    scale_inv[i, j]."""
    bn, bk = block
    w = weight.cpu().double()
    s = scale_inv.cpu().double()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= s[i, j]
    return w


def np_unpack(packed: torch.Tensor) -> np.ndarray:
    """int32 [rows, n] -> int64 [rows, 8 n]: nibble i of word j is column 8 j + ORDER[i]."""
    p = packed.cpu().contiguous().numpy().view(np.uint32)
    out = np.zeros((p.shape[0], p.shape[1] * 8), dtype=np.int64)
    for j in range(p.shape[1]):
        for i in range(8):
            out[:, 8 * j + ORDER[i]] = (p[:, j] >> np.uint32(4 * i)) & np.uint32(15)
    return out


def awq_reference(qweight, qzeros, scales) -> torch.Tensor:
    """float64 [in, out] (x @ it): (q - z) * s, each input row with its group's z and s."""
    q, z = np_unpack(qweight), np_unpack(qzeros)
    s = scales.cpu().double().numpy()
    rows = np.arange(q.shape[0]) // (q.shape[0] // z.shape[0])
    return torch.from_numpy((q - z[rows]) * s[rows])


def assert_product(out: torch.Tensor, x: torch.Tensor, w64: torch.Tensor):
    """out (x's fp32) against x @ w64 in float64, to fp32 accumulation over K."""
    ref = x.double() @ w64
    bound = 1e-5 * (x.double().abs() @ w64.abs()) + 1e-6
    err = (out.double() - ref).abs()
    assert bool((err <= bound).all()), f"max error {err.max():.3g} (bound {bound.max():.3g})"


# --- 1. the kernels read the tensors through their strides -------------------------------------

def _fp8_parts(n, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(math.ceil(n / block[0]), math.ceil(k / block[1]), generator=g) + 0.1
    return w, s


def test_fp8_kernel_reads_a_strided_weight_and_scales(device):
    """Weights [40, 80] in [16, 32] blocks (3 x 3 scale grid, partial edge blocks): as the
    left columns of a wider tensor (rows strided), and as the transpose of an [80, 40] one
    (columns strided); the scales transposed. The kernel read them as contiguous: another
    matrix's product (errors of thousands)."""
    triton_or_skip(device)
    n, k, block = 40, 80, (16, 32)
    w, s = _fp8_parts(n, k, block)
    wide = torch.cat([w, _fp8_parts(n, 48, block, seed=1)[0]], dim=1)
    views = {"column slice": wide[:, :k], "transpose": w.t().contiguous().t()}
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    want = fp8_reference(w, s, block).T
    for what, view in views.items():
        assert not view.is_contiguous() and torch.equal(view.float(), w.float())
        for scale in (s, s.t().contiguous().t()):
            weight = Fp8BlockWeight(weight=view.to(device), scale_inv=scale.to(device),
                                    block=block)
            weight.check()
            with torch.no_grad():  # functional.linear's kernel path (fewer than 256 rows)
                got = column_linear(x.to(device), weight).cpu()
            assert_product(got, x, want)
            torch_path = x @ dequantize_fp8_weight(weight, torch.float32).cpu().T
            assert_product(torch_path, x, want)


def test_fp8_kernel_split_k_with_a_strided_weight(device):
    """The split-K partials walk a strided weight too (each split starts at its own column)."""
    from minivllm.kernels.fp8_gemm import fp8_linear

    triton_or_skip(device)
    n, k, block = 24, 128, (16, 32)
    w, s = _fp8_parts(n, k, block, seed=3)
    wide = torch.cat([w, w], dim=1)[:, :k]
    weight = Fp8BlockWeight(weight=wide.to(device), scale_inv=s.to(device), block=block)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    got = fp8_linear(x.to(device), weight, config=dict(split=4, block_k=32, block_n=16))
    assert_product(got.cpu(), x, fp8_reference(w, s, block).T)


def _awq_parts(k, n, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=g)
    z = torch.randint(0, 16, (k // group, n), generator=g)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.001).half()
    return pack_awq(q), pack_awq(z), s


def test_awq_kernel_reads_strided_tensors(device):
    """qweight, qzeros and scales as the left columns of wider tensors (a column-parallel
    slice taken by hand: rows strided), qweight also as a transpose's transpose (columns
    strided): the kernel read them as contiguous."""
    triton_or_skip(device)
    k, n, group = 64, 32, 32
    qw, qz, s = _awq_parts(k, n, group)
    qw2, qz2, s2 = _awq_parts(k, 2 * n, group, seed=1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    want = awq_reference(qw, qz, s)
    cases = {
        "column slices": (torch.cat([qw, qw2], 1)[:, :n // 8], torch.cat([qz, qz2], 1)[:, :n // 8],
                          torch.cat([s, s2], 1)[:, :n]),
        "transposed qweight": (qw.t().contiguous().t(), qz, s.t().contiguous().t()),
    }
    for what, (a, b, c) in cases.items():
        assert torch.equal(a, qw) and torch.equal(b, qz) and torch.equal(c, s), what
        weight = AwqWeight(qweight=a.to(device), qzeros=b.to(device), scales=c.to(device),
                           group_size=group)
        weight.check()
        with torch.no_grad():
            got = column_linear(x.to(device), weight).cpu()
        assert_product(got, x, want)
        assert_product(x @ dequantize_awq(weight, torch.float32).cpu(), x, want)


# --- 2. short grids and wrong dtypes are refused, not broadcast or read past ---------------------

def test_short_fp8_scale_grid_is_refused():
    """A [64, 64] weight in [32, 32] blocks has a 2 x 2 grid: a 1 x 2 one broadcast over both
    block rows in dequantize_fp8_weight (the top row's scales for the bottom rows), and the kernel
    read past its end."""
    from minivllm.kernels.fp8_gemm import fp8_linear

    w, s = _fp8_parts(64, 64, (32, 32))
    weight = Fp8BlockWeight(weight=w, scale_inv=s[:1], block=(32, 32))
    with pytest.raises(ValueError, match=r"scale_inv has shape \(1, 2\), expected \(2, 2\)"):
        dequantize_fp8_weight(weight, torch.float32)
    with pytest.raises(ValueError, match=r"scale_inv has shape \(1, 2\), expected \(2, 2\)"):
        fp8_linear(torch.randn(2, 64), weight)
    e5m2 = Fp8BlockWeight(weight=w.float().to(torch.float8_e5m2), scale_inv=s, block=(32, 32))
    with pytest.raises(ValueError, match="weight is torch.float8_e5m2"):
        dequantize_fp8_weight(e5m2, torch.float32)


@pytest.mark.parametrize("broken", ["short qzeros", "short scales", "int8 qweight"])
def test_short_or_mistyped_awq_tensors_are_refused(broken):
    """Two groups of 32 rows: one row of zero points or scales broadcast over both groups in
    dequantize_awq (and the kernel read past it); int8 words unpacked as other nibbles."""
    from minivllm.kernels.awq_gemm import awq_linear

    qw, qz, s = _awq_parts(64, 32, 32)
    parts = dict(qweight=qw, qzeros=qz, scales=s)
    field, message = {
        "short qzeros": ("qzeros", r"qzeros has shape \(1, 4\), expected \(2, 4\)"),
        "short scales": ("scales", r"scales has shape \(1, 32\), expected \(2, 32\)"),
        "int8 qweight": ("qweight", r"qweight is torch.int8 .*not a 2-D int32"),
    }[broken]
    parts[field] = parts[field].to(torch.int8) if broken == "int8 qweight" else parts[field][:1]
    weight = AwqWeight(**parts, group_size=32)
    with pytest.raises(ValueError, match=message):
        dequantize_awq(weight, torch.float32)
    with pytest.raises(ValueError, match=message):
        awq_linear(torch.randn(2, 64), weight)


# --- 3. a tied model's quantized lm_head tensors -------------------------------------------------

def test_tied_model_skips_a_quantized_lm_head(tmp_path):
    from test_fp8_checkpoint import quantize_blocks, write_fp8_checkpoint

    path, reference = write_fp8_checkpoint(tmp_path / "tied", seed=2, hidden_size=64,
                                           intermediate_size=96, num_attention_heads=2,
                                           num_key_value_heads=1, head_dim=32)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["tie_word_embeddings"] = True
    json.dump(cfg, open(cfg_path, "w"))
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    sd["lm_head.weight"], sd["lm_head.weight_scale_inv"] = quantize_blocks(sd["lm_head.weight"])
    save_file(sd, file, metadata={"format": "pt"})
    params = minivllm.load(path)
    assert params.lm_head is None
    vocab = reference["model.embed_tokens.weight"].shape[0]
    assert torch.equal(params.embed[:vocab],
                       reference["model.embed_tokens.weight"].to(params.dtype))
