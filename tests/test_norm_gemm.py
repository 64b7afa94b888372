"""norm_gemm (add + RMSNorm + GEMM in one decode kernel, kernels/norm_gemm.py) against the PyTorch
path it replaces: functional.norm.add_rms_norm, then the product in fp64 (and silu(gate) * up).

On CPU under TRITON_INTERPRET=1, fp32 and fp16 (bf16 arithmetic is wrong in the interpreter);
on the GPU bf16 too.
The new residual must equal add_rms_norm's exactly (up to the partials' fp32 summation order);
the product agrees to the rounding of its 16-bit operands."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minivllm.functional.norm import add_rms_norm
from minivllm.kernels.launch import triton_usable
from minivllm.kernels.norm_gemm import norm_gemm
from triton_trace import ROOT, kernel_launches_traced

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


SMEM_SCRIPT = """
import json, torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import minivllm.kernels.launch as launch
launch._cuda_sms = lambda index: 132  # an H200, for the tile choice
from minivllm.kernels import norm_gemm as ng

fn = ng._norm_gemm_kernel
ALIGNED = {"stride_xs", "stride_xm", "stride_rm", "stride_wn", "stride_om", "stride_hm", "K", "N"}
out = []
# (parts, glu, N, K): Qwen3-0.6B's qkv and gate_up after o_proj's/down's 4 partials or plain x,
# and Qwen3-8B's with 2 and 8 partials
for parts, glu, n, k in [(4, False, 4096, 1024), (4, True, 3072, 1024), (0, False, 4096, 1024),
                         (2, True, 12288, 4096), (8, True, 12288, 4096)]:
    cfg = ng.norm_gemm_config(1, n, k, parts, glu, torch.bfloat16, torch.device("cuda", 0))
    consts = dict(PARTS=parts, M_PAD=ng.M_PAD, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                  EVEN_K=k % cfg["block_k"] == 0, GLU=glu, PRECISION="tf32")
    ptrs = {"x_ptr": "*fp32" if parts else "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16",
            "w_ptr": "*bf16", "out_ptr": "*bf16", "res_out_ptr": "*bf16"}
    sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a == "eps" else "i32")
           for a in fn.arg_names}
    # 16-byte alignment, as a launch on the GPU specializes it: without it no load is staged
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a in ptrs or a in ALIGNED}
    kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))
    model = (cfg["num_stages"] - 1) * ng.stage_bytes(parts, glu, cfg["block_n"], cfg["block_k"], 2)
    out.append(dict(case=[parts, glu, n, k], shared=kernel.metadata.shared, model=model,
                    staged=kernel.asm["ptx"].count("cp.async") > 0, config=cfg))
print(json.dumps(out))
"""


def test_pipeline_buffers_fit_two_programs_per_sm():
    """Triton stages every load of the K loop, x's fp32 partials at M_PAD rows included: at the
    skinny GEMM's 4 stages of 256-wide chunks, gate_up after 4 partials would ask 272 KB of shared
    memory, more than an SM has (227 KB), and fail to launch. Compiled ahead of time for sm_90
    (no GPU needed; a process without TRITON_INTERPRET), every engine shape's kernel must stage
    its loads (the weight stream pipelined) within SMEM_BUDGET, as stage_bytes models."""
    from minivllm.kernels.norm_gemm import SMEM_BUDGET

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", SMEM_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case in json.loads(proc.stdout.strip().splitlines()[-1]):
        assert case["staged"], case  # (beyond the buffers: ~16 KB of layout conversions)
        assert case["shared"] <= min(case["model"], SMEM_BUDGET) + 16384, case
