"""kernels/moe_route.py (a MoE step's routing as one Triton kernel, the router's product by the
skinny GEMM for a few rows) against functional.moe.route, the torch form the grouped path and
transformers' router compute. On the CPU under TRITON_INTERPRET=1 in fp32 and fp16; bf16 on the
GPU (benchmarks/gpu_checks.sh moe_kernel runs this file)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minivllm.functional import moe
from minivllm.kernels import moe_route

# the MoE kernels' dtypes (bf16 on the GPU only) and their autouse skip without Triton
from test_fused_moe import DTYPES, _needs_triton  # noqa: F401


def router_case(tokens, experts, hidden, dtype, device, seed=0, tie_rows=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(experts, hidden, generator=g) / hidden ** 0.5
    if tie_rows:  # experts 1..tie_rows copy expert 0's row: exactly equal logits
        router[1:tie_rows + 1] = router[0]
    return h.to(device, dtype), router.to(device, dtype)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(1, 9), experts=st.sampled_from([1, 3, 8, 60, 128]),
       top_k=st.integers(1, 8), normalize=st.booleans(), tie_rows=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.float16]), seed=st.integers(0, 2**16))
def test_equals_route_on_the_same_logits(device, tokens, experts, top_k, normalize, tie_rows,
                                         dtype, seed):
    """Given F.linear's logits (S = 1), the kernel picks route's experts in route's order, ties
    (copied router rows) included, lower index first, and their weights to rounding."""
    top_k = min(top_k, experts)
    h, router = router_case(tokens, experts, 32, dtype, device, seed, min(tie_rows, experts - 1))
    got_w, got_e = moe_route.fused_route(h, router, top_k, normalize, skinny=False)
    want_w, want_e = moe.route(h, router, top_k, normalize)
    assert got_e.dtype == torch.int64 and got_w.dtype == dtype
    assert torch.equal(got_e, want_e), (got_e, want_e)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_skinny_partials_route_as_the_product(device, dtype, tokens, monkeypatch):
    """The router's product by the skinny GEMM (fp32 split-K partials, summed in the kernel):
    the chosen experts' logits are route's top logits (a sum in another order may swap experts
    whose logits differ by its rounding only) and the weights are route's. The CPU's launch
    choices are an H100's, so K is split as there."""
    from minivllm.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "num_sms", lambda device: 132)
    h, router = router_case(tokens, 128, 1024, dtype, device, seed=tokens)
    logits = torch.nn.functional.linear(h.float(), router.float())  # [T, E], the fp32 product
    splits = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear",
                        lambda *a, **k: (splits.append(len(out := real(*a, **k))), out)[1])
    got_w, got_e = moe_route.fused_route(h, router, 8, True, skinny=True)
    assert splits == [moe_route.ROUTER_SPLIT] and splits[0] > 1, splits  # partials summed here
    want_w, want_e = moe.route(h, router, 8, True)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(logits.gather(1, got_e), logits.gather(1, want_e), rtol=tol,
                               atol=tol)
    torch.testing.assert_close(got_w.float(), want_w.float(), rtol=tol * 4, atol=tol * 4)


def test_partials_are_summed_then_rounded(device):
    """S partials are summed in fp32 and the sum rounded once to the routing dtype, as F.linear's
    output is: sums [0.5, 0.5 + 2**-13, 2] round in fp16 to [0.5, 0.5, 2], a tie that the lower
    index takes: order [2, 0, 1] (unrounded it would be [2, 1, 0]; split 0 alone [0, 1, 2])."""
    parts = torch.tensor([[[0.25, 0.25 + 2**-13, 0.0]], [[0.25, 0.25, 2.0]]],
                         device=device)  # [S=2, T=1, E=3]
    w, e = moe_route.route_from_logits(parts, 3, False, torch.float16)
    assert e.tolist() == [[2, 0, 1]]
    p = torch.softmax(torch.tensor([2.0, 0.5, 0.5]), 0)
    torch.testing.assert_close(w.float().cpu(), p[None].to(torch.float16).float())


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter
def test_nan_logits_pick_experts_in_range(device):
    """A token whose logits are NaN (a hidden state gone NaN) still gets expert ids in [0, E):
    the expert GEMMs index their weights by them. The other tokens route as route does."""
    logits = torch.randn(1, 3, 6, device=device)
    logits[0, 1] = float("nan")
    logits[0, 2, 0] = float("nan")
    w, e = moe_route.route_from_logits(logits, 4, True, torch.float32)
    assert ((e >= 0) & (e < 6)).all(), e
    want_w, want_e = torch.softmax(logits[0, 0], 0).sort(descending=True, stable=True)
    assert e[0].tolist() == want_e[:4].tolist()
    torch.testing.assert_close(w[0], want_w[:4] / want_w[:4].sum())


def test_bad_input(device):
    logits = torch.zeros(1, 2, 4, device=device)
    with pytest.raises(ValueError, match="top_k"):
        moe_route.route_from_logits(logits, 5, True, torch.float32)
    with pytest.raises(ValueError, match="top_k"):
        moe_route.route_from_logits(logits, 0, True, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        moe_route.route_from_logits(logits, 2, True, torch.int32)


def test_moe_mlp_kernel_path_takes_it(device, monkeypatch):
    """moe_mlp's kernel path routes with the kernel (the skinny product where the linear layers
    take it), the grouped path with route."""
    from minivllm.functional import linear
    from minivllm.state import ShardSpec
    from test_fused_moe import config_for, moe_case

    calls = []
    real = moe_route.fused_route
    monkeypatch.setattr(moe_route, "fused_route",
                        lambda *a, **k: calls.append(k["skinny"]) or real(*a, **k))
    monkeypatch.setattr(linear, "skinny_applies", lambda x: x.shape[0] <= 16)
    config, shard = config_for(8, 2, 64, 32), ShardSpec()
    for tokens in (3, 20):
        args = moe_case(tokens, tokens, 8, 2, 64, 32, torch.float32, device)
        with torch.no_grad():  # the kernels have no backward: autograd takes the grouped path
            got = moe.moe_mlp(*args, config, shard, kernel="triton")
            want = moe.moe_mlp(*args, config, shard, kernel="grouped")
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert calls == [True, False]


COMPILE_BODY = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels import moe_route as mr

sig = dict(logits_ptr="*fp32", weights_ptr="*bf16", ids_ptr="*i64", E="i32", stride_ls="i32",
           stride_lt="i32")
out = []
for splits, experts, top_k in ((mr.ROUTER_SPLIT, 128, 8), (32, 128, 8), (1, 128, 8), (1, 60, 4)):
    consts = dict(SPLITS=splits, TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                  E_PAD=triton.next_power_of_2(experts), NORMALIZE=True)
    src = ASTSource(fn=mr._route_kernel, signature=dict(sig, **{c: "constexpr" for c in consts}),
                    constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    out.append(len(k.asm["sass"]) if "sass" in k.asm else len(k.asm["ptx"]))
print(json.dumps(out))
"""


def test_compiles_for_sm90(device):
    """The kernel at the 30B-A3B shape's launches (the skinny GEMM's ROUTER_SPLIT partials, 32,
    or one product; 128 experts, top-8) and at 60 experts (padded to 64) compiles to sm_90 on
    the CPU (Triton's bundled ptxas)."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    if device.type == "cuda":
        pytest.skip("the GPU's own tests compile it")
    bin_dir = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin")
    if not shutil.which("ptxas", path=bin_dir):
        pytest.skip("no bundled ptxas")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_BODY], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(n > 0 for n in json.loads(proc.stdout.strip().splitlines()[-1]))
