"""Every Triton kernel the CPU suite launched, compiled for a Hopper GPU (tests/kernel_launches.py
says why: the interpreter runs code the compiler rejects). Last in the suite (pytest runs the
files in name order), so it sees the launches of every test before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import kernel_launches

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run compiles them")


@triton.jit
def _two_typed_loop_variable_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Session 64's mistake in small: `x` a scalar before the loop and a block in it."""
    x = tl.load(x_ptr)
    acc = tl.zeros([BLOCK], tl.float32) + x
    for off in range(BLOCK, n, BLOCK):
        x = tl.load(x_ptr + off + tl.arange(0, BLOCK))
        acc += x
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


def _compile(launches: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """tests/kernel_launches.py in a child process without the interpreter."""
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(TESTS / "kernel_launches.py"), str(path)], env=env,
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)


def test_a_kernel_the_interpreter_runs_and_the_compiler_rejects_is_reported(tmp_path):
    before = set(kernel_launches.LAUNCHES)
    x = torch.arange(64, dtype=torch.float32)
    out = torch.empty(16)
    _two_typed_loop_variable_kernel[(1,)](x, out, 64, BLOCK=16)
    assert torch.equal(out, x[0] + x[16:].view(3, 16).sum(0))  # the interpreter's answer
    mine = [kernel_launches.LAUNCHES.pop(k) for k in set(kernel_launches.LAUNCHES) - before]
    assert [launch["name"] for launch in mine] == ["_two_typed_loop_variable_kernel"]
    assert mine[0]["signature"]["x_ptr"] == "*fp32" and mine[0]["constexprs"] == {"BLOCK": 16}
    proc = _compile(mine, tmp_path)
    assert proc.returncode == 1 and "Loop-carried variable x" in proc.stdout, proc.stdout[-3000:]


def test_the_gpu_variants_of_the_main_paths_compile_for_hopper(tmp_path, monkeypatch):
    """What only a GPU launches (inline PTX, cooperative grids, the GPU's tiles), chosen as on an
    H100 (kernel_launches.as_on_a_gpu) and compiled, not run: the Qwen3-0.6B shape's forward
    (two layers) with the Triton backend, prefill and decode, its persistent decode layers, over
    a bf16 cache and an fp8 one; its decode head, decode MLP and decode GEMMs (skinny, block
    fp8, AWQ); an MoE layer's experts; and sample() at Qwen3's vocabulary with each kind of
    row."""
    from minivllm import random_params
    from minivllm.functional.model import forward
    from minivllm.functional.sampling import SamplingRow, make_sampling_batch, sample
    from minivllm.kernels.backends import select_backend
    from minivllm.kernels.decode_head import picking_head
    from minivllm.kernels.decode_layer import with_persistent_layers
    from minivllm.kernels.awq_gemm import awq_linear
    from minivllm.kernels.decode_mlp import decode_mlp
    from minivllm.kernels.fp8_gemm import fp8_linear
    from minivllm.kernels.fused_moe import fused_experts
    from minivllm.kernels.skinny_gemm import skinny_linear
    from minivllm.kernels.top_candidates import top_candidates
    from minivllm.state.batch import SeqChunk, make_batch
    from minivllm.state.cache import init_cache
    from minivllm.state.config import SHAPES, ModelConfig
    from minivllm.state.quant import AwqWeight, Fp8BlockWeight

    before = set(kernel_launches.LAUNCHES)
    config = ModelConfig(**{**SHAPES["qwen3-0.6b"], "num_layers": 2})
    params = random_params(config, dtype=torch.bfloat16)
    caches = [init_cache(params, num_blocks=64, block_size=16, dtype=d) for d in (None, "fp8")]
    kernel_launches.as_on_a_gpu(monkeypatch)
    backend = select_backend("cpu", "triton")
    tables = [list(range(4 * s, 4 * s + 4)) for s in range(8)]
    prefill = make_batch([SeqChunk([1] * 40, 0, t) for t in tables[:2]], block_size=16)
    for cache in caches:
        for batch in (prefill, *(make_batch([SeqChunk([1], 40, t) for t in tables[:n]],
                                            block_size=16) for n in (1, 8))):
            forward(params, cache, batch, backend)
            if batch.is_decode:
                with_persistent_layers(forward, params, cache)(params, cache, batch, backend)
    hidden, inter, bf16 = config.hidden_size, config.intermediate_size, torch.bfloat16
    fp8 = Fp8BlockWeight(torch.zeros(inter, hidden).to(torch.float8_e4m3fn),
                         torch.ones(inter // 128, hidden // 128), (128, 128))
    awq = AwqWeight(torch.zeros(hidden, inter // 8, dtype=torch.int32),
                    torch.zeros(hidden // 128, inter // 8, dtype=torch.int32),
                    torch.ones(hidden // 128, inter, dtype=torch.float16), 128)
    experts = 8
    for rows in (1, 8, 64):
        x = torch.zeros(rows, hidden, dtype=bf16)
        if rows <= 8:
            picking_head(params, x, x, torch.arange(rows))
            skinny_linear(x, torch.zeros(inter, hidden, dtype=bf16))
            fp8_linear(x, fp8)
            awq_linear(x.half(), awq)
            layer = params.layers[0]
            attn = torch.zeros(rows, config.num_heads * config.head_dim, dtype=bf16)
            decode_mlp(attn, x, layer.o_proj, layer.post_norm, layer.gate_up, layer.down, 1e-6)
        top = torch.stack([torch.arange(rows) % experts, (torch.arange(rows) + 1) % experts], 1)
        fused_experts(x, torch.ones(rows, 2, dtype=bf16), top,
                      torch.zeros(experts, 2 * 768, hidden, dtype=bf16),
                      torch.zeros(experts, hidden, 768, dtype=bf16))
    vocab = config.vocab_size
    kinds = [dict(), dict(temperature=0.0), dict(top_k=20, top_p=0.95), dict(min_p=0.05),
             dict(top_k=50, top_p=0.9, presence_penalty=0.5, output_ids=(1, 2))]
    for rows in (1, 256):
        logits = torch.zeros(rows, vocab)
        for kind in kinds:
            sb = make_sampling_batch([SamplingRow(**{"temperature": 0.6, **kind})] * rows,
                                     vocab_size=vocab)
            sample(logits, sb, kernel=True)  # a GPU's default
        top_candidates(logits, 20, kernel=True)
    mine = [kernel_launches.LAUNCHES.pop(k) for k in set(kernel_launches.LAUNCHES) - before]
    names = {launch["name"] for launch in mine}
    assert {"_decode_stack_kernel", "_decode_head_kernel", "_skinny_kernel", "_fp8_gemm_kernel",
            "_awq_gemm_kernel", "_decode_mlp_kernel", "_moe_gemm_kernel",
            "_cut_partial_argmax_kernel", "_chunk_top_kernel"} <= names
    fp8 = [launch for launch in mine if launch["constexprs"].get("FP8_CACHE")]
    assert {launch["name"] for launch in fp8} >= {"_decode_kernel", "_decode_stack_kernel"}
    proc = _compile(mine, tmp_path)
    assert proc.returncode == 0, f"{len(mine)} launches; failures:\n{proc.stdout[-8000:]}" \
                                 f"\n{proc.stderr[-2000:]}"


def test_every_kernel_the_suite_launched_compiles_for_hopper(tmp_path):
    launches = list(kernel_launches.LAUNCHES.values())
    if not launches:
        pytest.skip("no kernel launched earlier in this run")
    proc = _compile(launches, tmp_path)
    assert proc.returncode == 0, f"{len(launches)} launches; failures:\n{proc.stdout[-8000:]}" \
                                 f"\n{proc.stderr[-2000:]}"
