"""The compiled parts round as eager PyTorch does (runtime.compiled.compile_part): the residual
add after a GEMM stays an add fused into the norm's kernel (not an addmm, which rounds once
where eager rounds twice and costs cuBLAS a copy of the residual), and Inductor's fused kernels
round each 16-bit result as eager does. Inductor calls the same GEMM as eager, so the residual
stream equals eager's bit for bit, and the normed output all but bit for bit: a fused kernel may
sum the variance in another order, or take another rsqrt, than eager's kernels (on this
repository's CPU machine, torch 2.13: no element differs). Without the emulation a quarter of
the normed outputs differ by an ulp. The tests run where the engine compiles: on the GPU when
there is one. (On the GPU machine's CPU, torch 2.11, the normed outputs differed from eager's
by an ulp in many elements: its CPU code generator evidently does not apply the emulation.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

import minivllm.functional as fn
from minivllm.runtime.compiled import compile_part


def gemm_then_add_norm(a, w, residual, g):
    """o_proj (or down) and the next block's add + RMSNorm, as the decoder layer calls them."""
    return fn.add_rms_norm(F.linear(a, w), residual, g, 1e-6)


def _inputs(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(64, 256, generator=gen).to(dtype)
    w = (torch.randn(128, 256, generator=gen) * 0.05).to(dtype)
    residual = (torch.randn(64, 128, generator=gen) * 4).to(dtype)
    g = (1 + 0.1 * torch.randn(128, generator=gen)).to(dtype)
    return tuple(t.to(device) for t in (a, w, residual, g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_gemm_add_norm_rounds_as_eager(dtype, device):
    torch._dynamo.reset()
    ulp = torch.finfo(dtype).eps  # relative spacing at 1; values here are O(1)
    for seed in range(3):
        args = _inputs(dtype, device, seed)
        want_h, want_r = gemm_then_add_norm(*args)
        got_h, got_r = compile_part(gemm_then_add_norm)(*args)
        assert torch.equal(got_r, want_r), "the residual stream rounds differently from eager"
        differ = got_h != want_h
        assert differ.float().mean() <= 0.01, \
            f"the norm rounds differently from eager in {differ.float().mean():.1%} of its outputs"
        assert ((got_h.float() - want_h.float()).abs() <= ulp * want_h.float().abs()).all()


def test_the_residual_add_is_not_rewritten_into_an_addmm(device):
    """Inductor's post-grad pass turns `mm + residual` into addmm (on the GPU: a copy of the
    residual into the output, then a beta = 1 GEMM); the fp32 add in add_rms_norm does not match
    that pattern, so the add fuses into the norm's kernel."""
    torch._dynamo.reset()
    _, code = run_and_get_code(compile_part(gemm_then_add_norm), *_inputs(torch.bfloat16, device))
    source = "\n".join(code)
    assert "extern_kernels.mm(" in source
    assert "addmm" not in source
