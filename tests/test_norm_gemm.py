"""norm_gemm (add + RMSNorm + GEMM in one decode kernel, kernels/norm_gemm.py) against the PyTorch
path it replaces: functional.norm.add_rms_norm, then the product in fp64 (and silu(gate) * up).

On CPU under TRITON_INTERPRET=1, fp32 and fp16 (bf16 arithmetic is wrong in the interpreter);
on the GPU bf16 too.
The new residual must equal add_rms_norm's exactly (up to the partials' fp32 summation order);
the product agrees to the rounding of its 16-bit operands."""

import pytest
import torch
import torch.nn.functional as F

from minivllm.functional.norm import add_rms_norm
from minivllm.kernels.launch import triton_usable
from minivllm.kernels.norm_gemm import norm_gemm
from triton_trace import kernel_launches_traced

EPS = 1e-6
# max |out - ref| / max |ref|: fp32 accumulation; fp16 operands are rounded once more than the
# reference rounds them (h * g before the dot), plus the output's own rounding.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def rand(*shape, dtype, device, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def reference(x, residual, norm_weight, weight, glu):
    normed, h = add_rms_norm(x, residual, norm_weight, EPS)
    out = normed.double() @ weight.double().T
    if glu:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("parts", [0, 1, 3])
@pytest.mark.parametrize("n,k,glu", [(24, 70, False), (100, 256, False), (40, 96, True),
                                     (16, 300, True)])
def test_matches_add_rms_norm_then_linear(device, dtype, m, parts, n, k, glu):
    """Ragged and whole K chunks, ragged N, 1/3/16 rows, x plain or as split-K partials."""
    if dtype == torch.bfloat16 and device.type != "cuda":
        pytest.skip("the interpreter computes bf16 wrongly: bf16 runs on the GPU")
    seed = m * 1000 + parts * 100 + k
    residual = rand(m, k, dtype=dtype, device=device, seed=seed)
    if parts:  # a row-parallel GEMM's fp32 partial sums
        x = rand(parts, m, k, dtype=torch.float32, device=device, seed=seed + 1, scale=0.5)
    else:
        x = rand(m, k, dtype=dtype, device=device, seed=seed + 1)
    norm_weight = rand(k, dtype=dtype, device=device, seed=seed + 2, scale=0.3) + 1
    weight = rand(2 * n if glu else n, k, dtype=dtype, device=device, seed=seed + 3, scale=k ** -0.5)
    out, h = norm_gemm(x, residual, norm_weight, weight, EPS, glu=glu)
    ref, h_ref = reference(x, residual, norm_weight, weight, glu)
    assert out.shape == (m, n) and out.dtype == dtype and h.dtype == dtype
    exact = 0 if parts <= 1 else 1e-6  # partials summed in another order: fp32 rounding of h
    torch.testing.assert_close(h, h_ref, rtol=exact, atol=exact)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err <= TOL[dtype], f"relative error {err:.3g}"


def test_bad_shapes_are_value_errors(device):
    r = torch.zeros(2, 32, device=device)
    w = torch.zeros(16, 32, device=device)
    g = torch.ones(32, device=device)
    with pytest.raises(ValueError, match="rows"):
        norm_gemm(torch.zeros(17, 32, device=device), torch.zeros(17, 32, device=device), g, w, EPS)
    with pytest.raises(ValueError, match="does not fit residual"):
        norm_gemm(torch.zeros(2, 31, device=device), r, g, w, EPS)
    with pytest.raises(ValueError, match="do not fit"):
        norm_gemm(torch.zeros(2, 32, device=device), r, g, torch.zeros(15, 32, device=device), EPS,
                  glu=True)
    with pytest.raises(ValueError, match="does not fit residual"):  # partials must be fp32
        norm_gemm(torch.zeros(2, 2, 32, device=device, dtype=torch.float16),
                  r.half(), g.half(), w.half(), EPS)


TRACE_BODY = """
from minivllm.kernels.norm_gemm import norm_gemm

def block(parts, residual, g, w):
    out, h = norm_gemm(parts, residual, g, w, 1e-6, glu=True)
    return out + 1, h

trace(block, torch.randn(3, 2, 64), torch.randn(2, 64), torch.ones(64), torch.randn(48, 64))
"""


def test_traces_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces norm_gemm into one graph, as the compiled layer needs."""
    if device.type == "cuda":
        torch._dynamo.reset()
        fn = torch.compile(lambda *a: norm_gemm(*a, 1e-6, glu=True), fullgraph=True,
                           backend="aot_eager")
        args = (rand(3, 2, 64, dtype=torch.float32, device=device, seed=1),
                rand(2, 64, dtype=torch.float32, device=device, seed=2),
                torch.ones(64, device=device), rand(48, 64, dtype=torch.float32, device=device, seed=3))
        out, h = fn(*args)
        ref, h_ref = reference(*args, glu=True)
        torch.testing.assert_close(h, h_ref)
        assert ((out.double() - ref).abs().max() / ref.abs().max()) <= TOL[torch.float32]
        return
    counts = kernel_launches_traced(TRACE_BODY)  # on CPU: see tests/triton_trace.py
    assert counts == {"dynamo": 1, "aot": 1}, counts
