"""kernels.norm_rope_store (a prefill step's q/k norm and RoPE with the K/V store) against the torch
form it replaces: functional.layer.qk_norm_rope, then store_kvcache; and the triton backend's
prefill_with_norm_rope against qk_norm_rope followed by the reference backend. On CPU under
TRITON_INTERPRET=1 (conftest), in fp32 and fp16; and the sm_90 code of the kernels that share its
norm and rotation, compiled without a GPU, for where the reference rounds in bf16."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.compile_decode_kernel import TRITON_BIN
from minivllm.functional.attention import REFERENCE
from minivllm.functional.layer import qk_norm_rope
from minivllm.functional.rope import rope_cos_sin
from minivllm.kernels.launch import triton_usable
from minivllm.kernels.norm_rope_store import norm_rope_store
from minivllm.kernels.store_kv import store_kvcache
from minivllm.kernels.testing import make_problem, rel_error
from minivllm.kernels.triton_backend import TRITON
from minivllm.state import ModelConfig

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
DTYPES = st.sampled_from([torch.float32, torch.float16])
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def _norm_inputs(head_dim: int, positions: torch.Tensor, dtype, device, seed: int):
    """(q_weight, k_weight, cos, sin, eps) as the layer passes them, at these positions."""
    g = torch.Generator().manual_seed(seed)
    q_weight, k_weight = (1 + 0.3 * torch.randn(2, head_dim, generator=g)).to(device, dtype)
    config = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=1000.0)
    cos, sin = rope_cos_sin(config, positions.to(device))
    return q_weight, k_weight, cos, sin, 1e-6


@given(t=st.integers(1, 30), kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 2, 3]),
       head_dim=st.sampled_from([16, 24, 32]), page=st.sampled_from([4, 16]), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_norm_rope_store_equals_the_layers_norm_rope_then_the_store(device, t, kv_heads, group,
                                                                     head_dim, page, dtype, seed):
    """q and k as views of one qkv projection (strided rows), some rows' slots -1 (skipped):
    q_out and k_out are qk_norm_rope's, the cache holds what store_kvcache writes of them, and
    every other slot keeps its poison."""
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    qkv = (3 * torch.randn(t, heads + 2 * kv_heads, head_dim, generator=g)).to(device, dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    num_blocks = -(-t // page) + 2
    slots = torch.randperm(num_blocks * page, generator=g)[:t]
    slots[torch.rand(t, generator=g) < 0.2] = -1
    slots = slots.to(device)
    norm_rope = _norm_inputs(head_dim, torch.randint(0, 500, (t,), generator=g), dtype, device,
                             seed + 1)
    poison = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype,
                        device=device)
    q_want, k_want = qk_norm_rope(q, k, *norm_rope)
    k_cache_want, v_cache_want = poison.clone(), poison.clone()
    store_kvcache(k_want, v, k_cache_want, v_cache_want, slots)

    k_cache, v_cache = poison.clone(), poison.clone()
    q_out, k_out = norm_rope_store(q, k, v, k_cache, v_cache, slots, norm_rope)
    torch.testing.assert_close(q_out, q_want, **TOL[dtype])
    torch.testing.assert_close(k_out, k_want, **TOL[dtype])
    torch.testing.assert_close(k_cache, k_cache_want, equal_nan=True, **TOL[dtype])
    torch.testing.assert_close(v_cache, v_cache_want, rtol=0, atol=0, equal_nan=True)


@given(q_lens=st.lists(st.integers(1, 20), min_size=1, max_size=3), data=st.data(),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_triton_prefill_with_norm_rope_equals_norm_rope_then_the_reference(device, q_lens, data,
                                                                            dtype, seed):
    """A prefill or mixed step (cached prefixes, one-token rows) from raw q and k: the backend's
    output and cache writes against qk_norm_rope followed by the reference backend."""
    cached = data.draw(st.lists(st.integers(0, 40), min_size=len(q_lens), max_size=len(q_lens)))
    p = make_problem(q_lens, cached, page=16, kv_heads=2, group=2, head_dim=16, dtype=dtype,
                     device=device, seed=seed)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, q_lens)])
    norm_rope = _norm_inputs(16, positions, dtype, device, seed + 1)
    q_in, k_in = 3 * p.q, 3 * p.k  # off unit scale, so that the norm matters
    q, k = qk_norm_rope(q_in, k_in, *norm_rope)
    k_want, v_want = p.clean_cache()
    want = REFERENCE(q, k, p.v, k_want, v_want, p.batch, p.scale)
    k_got, v_got = p.clean_cache()
    got = TRITON.prefill_with_norm_rope(q_in, k_in, p.v, k_got, v_got, p.batch, p.scale, norm_rope)
    err = rel_error(got, want)
    assert err <= {torch.float32: 1e-5, torch.float16: 3e-3}[dtype], err
    torch.testing.assert_close(k_got, k_want, **TOL[dtype])
    torch.testing.assert_close(v_got, v_want, rtol=0, atol=0)


TRACE_BODY = """
import minivllm
from minivllm.functional.layer import decoder_layer
from minivllm.functional.model import stem
from minivllm.kernels.triton_backend import TRITON
from minivllm.state import ModelConfig, SeqChunk, make_batch

config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                     num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
params = minivllm.random_params(config, seed=0)
cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
# a mixed step: a prompt and a one-token row with a cached prefix
batch = make_batch([SeqChunk([1, 2, 3], 0, [0]), SeqChunk([5], 2, [1])], block_size=4)
x, residual, cos, sin = stem(params, batch)

def layer(x, residual, cos, sin, k_cache, v_cache):
    return decoder_layer(params.layers[0], x, residual, cos, sin, k_cache, v_cache, batch,
                         config=config, shard=params.shard, backend=TRITON)

trace(layer, x, residual, cos, sin, cache.k[0], cache.v[0])
"""


def test_the_compiled_layer_traces_the_prefill_kernels_whole(device):
    """torch.compile(fullgraph=True) of a decoder layer over a mixed step with the triton backend
    traces norm_rope_store and the prefill kernel into one graph (on a GPU the engine's own
    compiled steps do so; on CPU see tests/triton_trace.py)."""
    if device.type == "cuda":
        pytest.skip("on a GPU the engine's compiled prefill steps cover this")
    from triton_trace import kernel_launches_traced

    assert kernel_launches_traced(TRACE_BODY) == {"dynamo": 2, "aot": 2}


PTX_BODY = """
import json, re, tempfile
from benchmarks.compile_decode_kernel import compile_for, signature_and_constants
from minivllm.kernels.decode_attention import _decode_kernel
from minivllm.kernels.norm_rope_store import _norm_rope_store_kernel

def ptx(fn, sig, consts):
    with tempfile.TemporaryDirectory() as workdir:
        return compile_for(fn, sig, consts, dict(num_warps=4), 90, workdir)[0].asm["ptx"]

# the engine's launches at the 0.6B shape: bf16 q/k/v and cache, fp32 cos/sin
store_types = ["*bf16"] * 5 + ["*fp32", "*fp32", "*i64"] + ["*bf16"] * 4 + ["fp32"] + ["i32"] * 7
store_consts = dict(HEADS=16, KV_HEADS=8, HEAD_DIM=128, BLOCK_H=16, BLOCK_KV=8, BLOCK_D=128)
names = [a for a in _norm_rope_store_kernel.arg_names if a not in store_consts]
store_sig = dict(zip(names, store_types)) | dict.fromkeys(store_consts, "constexpr")
decode_sig, decode_consts = signature_and_constants("bf16", 128, 16)
decode_sig |= dict(cos_ptr="*fp32", sin_ptr="*fp32")
texts = {"norm_rope_store": ptx(_norm_rope_store_kernel, store_sig, store_consts),
         "decode": ptx(_decode_kernel, decode_sig, decode_consts)}
# scalar or paired (bf16x2, where the launch's aligned pointers let loads and math go two wide)
ops = {"fma": r"fma\\.rn\\.bf16(x2)?\\s", "add": r"add(\\.rn)?\\.bf16(x2)?\\s"}
print(json.dumps({k: {op: len(re.findall(pat, t)) for op, pat in ops.items()} for k, t in texts.items()}))
"""


@pytest.mark.skipif(not shutil.which("ptxas", path=TRITON_BIN),
                    reason="this Triton has no bundled ptxas")
def test_the_rotation_rounds_each_product_before_the_sum_in_the_gpu_code():
    """Compiled for sm_90 (a child process without the interpreter; no GPU needed), neither kernel
    that norms and rotates q/k fuses a product of the rotation into its sum: LLVM had made the
    products 16-bit multiplies and one an fma.rn.bf16 with the add, one rounding fewer than
    functional.rope.apply_rope (a fifth of the values an ulp off on the H200, session 26)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", PTX_BODY], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    for kernel, ops in counts.items():
        assert ops["fma"] == 0, (kernel, ops)
        assert ops["add"] > 0, (kernel, ops)  # the sum of the two rounded products
