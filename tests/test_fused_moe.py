"""kernels/fused_moe.py (the MoE MLP's experts as Triton kernels, MINIVLLM_MOE_KERNEL=triton):
the pairs' layout by expert (align) by its invariants; the whole expert part against an fp64
loop over the pairs, against functional.moe's grouped-GEMM path and against transformers' eager
experts; tracing under torch.compile; the engine with the flag against transformers.

On CPU under TRITON_INTERPRET=1 (16 x 16 x 32 tiles: tiny shapes cover ragged N and K, several
tiles an expert, experts without pairs), fp32 and fp16; bf16 and the GPU's block sizes run in
benchmarks/gpu_checks.sh moe_kernel."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minivllm.functional import layer as layer_module, moe
from minivllm.kernels import fused_moe as fm
from minivllm.kernels.launch import triton_usable
from minivllm.state import ShardSpec

from triton_trace import kernel_launches_traced

ROOT = Path(__file__).resolve().parents[1]
TRITON_BIN = os.path.join(os.path.dirname(__import__("triton").__file__), "backends/nvidia/bin")

pytestmark = pytest.mark.filterwarnings("ignore:.*past_key_values.*:FutureWarning")

# fp32: accumulation error only; fp16: the activation's and the output's roundings on top
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.float16, id="float16"),
          pytest.param(torch.bfloat16, id="bfloat16", marks=pytest.mark.skipif(
              not torch.cuda.is_available(), reason="bf16: on the GPU (not the interpreter)"))]


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


# --- align ------------------------------------------------------------------------------------

def check_layout(pair_expert: torch.Tensor, num_experts: int, block_m: int, device,
                 block_p: int | None = None, count_from: int | None = None):
    sorted_ids, tile_expert, num_tiles = fm.align(pair_expert.to(device), num_experts, block_m,
                                                  block_p=block_p, count_from=count_from)
    ids, te, used = sorted_ids.cpu().tolist(), tile_expert.cpu().tolist(), num_tiles.item()
    pe = pair_expert.cpu().tolist()
    p = len(pe)
    tiles = fm.max_tiles(p, num_experts, block_m)
    assert len(ids) == tiles * block_m and len(te) == tiles and num_tiles.dtype == torch.int32
    counts = [pe.count(e) for e in range(num_experts)]
    assert used == sum(-(-c // block_m) for c in counts) <= tiles
    # every pair exactly once, padding P everywhere else
    real = [i for i in ids if i != p]
    assert sorted(real) == list(range(p)) and all(0 <= i <= p for i in ids)
    # tiles in use: one expert each, its pairs in pair order, the experts ascending, each
    # expert's run starting on a tile (its padding after its pairs, within its last tile)
    runs = []
    for t in range(used):
        tile = ids[t * block_m:(t + 1) * block_m]
        mine = [i for i in tile if i != p]
        assert mine, f"tile {t} holds no pair"
        assert all(pe[i] == te[t] for i in mine), (t, te[t], [pe[i] for i in mine])
        assert tile[:len(mine)] == mine  # padding only at a tile's end
        runs.append((te[t], mine))
    assert [e for e, _ in runs] == sorted(e for e, _ in runs)
    for e in range(num_experts):
        got = [i for x, mine in runs if x == e for i in mine]
        assert got == [i for i in range(p) if pe[i] == e]
        full = [mine for x, mine in runs if x == e][:-1]
        assert all(len(m) == block_m for m in full)  # only an expert's last tile is ragged
    # tiles past those in use: all padding (their experts are never read)
    assert all(i == p for i in ids[used * block_m:])
    assert all(0 <= e < num_experts for e in te)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), num_experts=st.integers(1, 12), tokens=st.integers(1, 40),
       block_m=st.sampled_from([16, 32]), block_p=st.sampled_from([4, 16, 32, None]),
       count_from=st.sampled_from([1, None, 10**9]))
def test_align_lays_out_every_pair_once_by_expert(device, data, num_experts, tokens, block_m,
                                                  block_p, count_from):
    """Any expert ids (empty experts, one expert taking every pair, more pairs and tiles than
    the kernels' chunk), routed as a token's distinct top-k or not; at chunks of 4 to 32 pairs
    and align_block_for's; counted by a kernel of a program a chunk (from 1 chunk on) or by the
    one program (never), and as by default."""
    top_k = data.draw(st.integers(1, min(num_experts, 8)))
    if data.draw(st.booleans()):  # distinct experts a token, as routing picks them
        perm = st.permutations(range(num_experts)).map(lambda x: x[:top_k])
        rows = data.draw(st.lists(perm, min_size=tokens, max_size=tokens))
        pair_expert = torch.tensor([e for r in rows for e in r])
    else:
        pair_expert = torch.tensor(data.draw(st.lists(st.integers(0, num_experts - 1),
                                                      min_size=tokens * top_k,
                                                      max_size=tokens * top_k)))
    check_layout(pair_expert, num_experts, block_m, device, block_p, count_from)


def test_align_edges(device):
    """One pair; 128 experts at top-8 (the 30B-A3B shape at one token: 8 tiles, not 128); every
    pair on the last expert; int32 ids; runs of exactly a tile and one past; strided ids."""
    check_layout(torch.tensor([3]), 4, 16, device)
    ids = torch.randperm(128, generator=torch.Generator().manual_seed(0))[:8]
    check_layout(ids, 128, 16, device)
    assert fm.max_tiles(8, 128, 16) == 8
    # 64 tokens at that shape: 152 tiles (10 chunks of them), 2,432 slots (5 chunks of the tail)
    routed = torch.rand(64, 128, generator=torch.Generator().manual_seed(1)).topk(8).indices
    assert fm.align_block_for(512, 128) == 16 and fm.align_block_for(513, 128) == 32
    assert fm.max_tiles(512, 128, 16) == 152 > 9 * 16
    assert 152 * 16 > 4 * fm.ALIGN_STORE_BLOCK
    for count_from in (None, 10**9):  # 32 chunks: a program each; one program
        check_layout(routed.reshape(-1), 128, 16, device, count_from=count_from)
    # 65 tokens: chunks of 32 pairs, block_m 32 on a GPU (block_m_for's next size)
    routed = torch.rand(65, 128, generator=torch.Generator().manual_seed(2)).topk(8).indices
    check_layout(routed.reshape(-1), 128, 32, device)
    check_layout(torch.full((70,), 5), 6, 16, device)
    check_layout(torch.tensor([1] * 16 + [0] * 17, dtype=torch.int32), 2, 16, device)
    strided = torch.tensor([[2, 1, 0], [0, 2, 1]])[:, :1].reshape(-1)  # route's top-1 ids
    assert strided.stride() == (3,)
    check_layout(strided, 3, 16, device)
    routed = torch.randn(9, 6).argsort(dim=-1)[:, :4]  # [T, k], a view of [T, experts]
    sorted_ids, _, _ = fm.align(routed.to(device), 6, 16)
    check_layout(routed.reshape(-1), 6, 16, device)
    assert torch.equal(sorted_ids, fm.align(routed.reshape(-1).to(device), 6, 16)[0])


# --- the expert part ----------------------------------------------------------------------------

def fp64_experts(h, weights, experts, gate_up, down):
    """sum_j weights[t, j] * down_e @ (silu(gate_e h) * up_e h), a pair at a time, in fp64."""
    inter = gate_up.shape[1] // 2
    out = torch.zeros(h.shape, dtype=torch.float64)
    for t in range(h.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j].item()
            gu = gate_up[e].double() @ h[t].double()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            out[t] += weights[t, j].double() * (down[e].double() @ act)
    return out


def moe_case(seed, tokens, num_experts, top_k, hidden, inter, dtype, device):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g)
    router = torch.randn(num_experts, hidden, generator=g) * 0.3
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    down = torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5
    return [x.to(device, dtype) for x in (h, router, gate_up, down)]


def config_for(num_experts, top_k, hidden, inter, norm=True):
    from test_moe import _moe_dict
    from minivllm.state import ModelConfig

    return ModelConfig.from_dict(_moe_dict(num_experts=num_experts, num_experts_per_tok=top_k,
                                           hidden_size=hidden, moe_intermediate_size=inter,
                                           norm_topk_prob=norm))


# (experts, top_k, hidden, moe_intermediate): the tiny MoE's; ragged hidden and intermediate at
# top-1 (hidden 70: K ragged for gate_up, N for down); every expert taken (top_k == experts)
SHAPES = [(8, 2, 64, 32), (6, 1, 70, 33), (4, 4, 48, 40)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 2, 5, 33])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
def test_kernel_path_equals_fp64_and_the_grouped_path(device, shape, tokens, dtype):
    """moe_mlp with kernel="triton" against a pair-by-pair fp64 loop on the same routing, and
    against kernel="grouped". One token leaves most experts empty; 33 at top_k == experts give
    each expert three tiles (the last ragged)."""
    num_experts, top_k, hidden, inter = shape
    config = config_for(*shape)
    h, router, gate_up, down = moe_case(tokens * 10 + hidden, tokens, *shape, dtype, device)
    with torch.no_grad():
        got = moe.moe_mlp(h, router, gate_up, down, config, ShardSpec(), kernel="triton")
        grouped = moe.moe_mlp(h, router, gate_up, down, config, ShardSpec(), kernel="grouped")
        weights, experts = moe.route(h, router, top_k, True)
    assert got.dtype == dtype and got.shape == h.shape
    want = fp64_experts(h.cpu(), weights.cpu(), experts.cpu(), gate_up.cpu(), down.cpu())
    scale = max(want.abs().max().item(), 1.0)
    assert (got.cpu().double() - want).abs().max().item() <= TOL[dtype] * scale
    assert (got.cpu().double() - grouped.cpu().double()).abs().max().item() <= \
        2 * TOL[dtype] * scale


@pytest.mark.parametrize("block_m, config", [(32, dict(block_n=32, block_k=16)),
                                             (16, dict(block_n=64, block_k=64))])
def test_other_tiles(device, block_m, config):
    """32-pair tiles (the GPU's at 4-16 pairs an expert), wider and narrower N and K tiles."""
    shape = (4, 3, 70, 33)
    h, router, gate_up, down = moe_case(7, 33, *shape, torch.float32, device)
    weights, experts = moe.route(h, router, 3, False)
    got = fm.fused_experts(h, weights, experts, gate_up, down, block_m=block_m, config=config)
    want = fp64_experts(h.cpu(), weights.cpu(), experts.cpu(), gate_up.cpu(), down.cpu())
    assert (got.cpu().double() - want).abs().max().item() <= TOL[torch.float32] * max(
        want.abs().max().item(), 1.0)


def test_deterministic(device):
    """The same inputs give the same bits (the per-token sum is a fixed-order reduction)."""
    shape = (8, 2, 64, 32)
    h, router, gate_up, down = moe_case(3, 5, *shape, torch.float32, device)
    weights, experts = moe.route(h, router, 2, True)
    a = fm.fused_experts(h, weights, experts, gate_up, down)
    b = fm.fused_experts(h, weights, experts, gate_up, down)
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "e{}k{}h{}i{}".format(*s))
def test_one_token_skips_align_for_its_own_layout_bit_for_bit(device, monkeypatch, shape, dtype):
    """At one token each pair is a tile of its own (takes_pair_tiles): no align launch, and the
    same bits as align's layout (routing's experts are distinct, so align puts each pair alone
    in its tile too); two tokens keep align."""
    num_experts, top_k, hidden, inter = shape
    assert fm.takes_pair_tiles(1) and not fm.takes_pair_tiles(2)
    for seed in range(3):
        h, router, gate_up, down = moe_case(seed, 1, *shape, dtype, device)
        weights, experts = moe.route(h, router, top_k, True)
        with_align = fm.fused_experts(h, weights, experts, gate_up, down, pair_tiles=False)
        real_align = fm.align
        monkeypatch.setattr(fm, "align", lambda *a, **k: pytest.fail("align ran at one token"))
        got = fm.fused_experts(h, weights, experts, gate_up, down)
        monkeypatch.setattr(fm, "align", real_align)
        assert torch.equal(got, with_align), seed
        want = fp64_experts(h.cpu(), weights.cpu(), experts.cpu(), gate_up.cpu(), down.cpu())
        assert (got.cpu().double() - want).abs().max().item() <= TOL[dtype] * max(
            want.abs().max().item(), 1.0)
    h, router, gate_up, down = moe_case(9, 2, *shape, dtype, device)
    calls = []
    monkeypatch.setattr(fm, "align", lambda *a, **k: calls.append(1) or real_align(*a, **k))
    fm.fused_experts(h, *moe.route(h, router, top_k, True), gate_up, down)
    assert calls == [1]


@settings(max_examples=15, deadline=None)
@given(data=st.data(), tokens=st.integers(1, 6))
def test_pair_tiles_compute_any_routing(device, data, tokens):
    """A tile a pair is right for any expert ids, not only one token's distinct ones: pairs
    sharing an expert, within a token or across tokens, strided ids (a view of [T, experts]),
    against the fp64 loop and against align's layout."""
    num_experts, top_k, hidden, inter = 4, 3, 48, 40
    h, router, gate_up, down = moe_case(tokens, tokens, num_experts, top_k, hidden, inter,
                                        torch.float32, device)
    ids = data.draw(st.lists(st.integers(0, num_experts - 1), min_size=tokens * top_k,
                             max_size=tokens * top_k))
    wide = torch.zeros(tokens, top_k + 2, dtype=torch.int64)
    wide[:, :top_k] = torch.tensor(ids).view(tokens, top_k)
    experts = wide.to(device)[:, :top_k]  # strided: [T, k] of [T, k + 2]
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(tokens)).to(device)
    got = fm.fused_experts(h, weights, experts, gate_up, down, pair_tiles=True)
    want = fp64_experts(h.cpu(), weights.cpu(), experts.cpu(), gate_up.cpu(), down.cpu())
    scale = max(want.abs().max().item(), 1.0)
    assert (got.cpu().double() - want).abs().max().item() <= TOL[torch.float32] * scale
    aligned = fm.fused_experts(h, weights, experts, gate_up, down, pair_tiles=False)
    assert (got - aligned).abs().max().item() <= TOL[torch.float32] * scale


@torch.no_grad()  # the kernel path has no backward: with autograd on, moe_mlp takes grouped
def test_unsummed_terms_are_the_summed_output(device, monkeypatch):
    """moe_mlp(unsummed_ok=True) where the skinny GEMM applies (patched in on the CPU, as on a
    GPU at <= 16 rows): the top_k weighted expert products, fp32 [top_k, T, hidden], which
    sum_partials sums to the summed output; past the skinny rows, with unsummed_ok False and on
    the grouped path: [T, hidden] as before."""
    from minivllm.functional import linear

    monkeypatch.setattr(linear, "skinny_applies", lambda x: x.shape[0] <= 4)
    shape = (8, 2, 64, 32)
    config = config_for(*shape)
    for tokens in (1, 3, 5):
        h, router, gate_up, down = moe_case(tokens, tokens, *shape, torch.float32, device)
        run = lambda **k: moe.moe_mlp(h, router, gate_up, down, config, ShardSpec(),  # noqa
                                      **k)
        summed = run(kernel="triton")
        assert summed.shape == (tokens, 64)
        got = run(kernel="triton", unsummed_ok=True)
        if tokens > 4:  # the skinny GEMM's rows: the summed form
            assert torch.equal(got, summed)
            continue
        assert got.shape == (2, tokens, 64) and got.dtype == torch.float32
        torch.testing.assert_close(linear.sum_partials(got, h.dtype), summed, rtol=1e-6,
                                   atol=1e-6)
        weights, experts = moe.route(h, router, 2, True)
        for j in range(2):  # term j: the weighted product of each token's j-th expert
            one = fm.fused_experts(h, weights[:, j:j + 1], experts[:, j:j + 1], gate_up, down)
            torch.testing.assert_close(got[j], one, rtol=1e-5, atol=1e-5)
        assert run(kernel="grouped", unsummed_ok=True).shape == (tokens, 64)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float16, 4e-3)],
                         ids=["float32", "float16"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_kernel_path_equals_transformers_block(device, dtype, tol, tokens):
    """transformers' eager experts (expert by expert, index_add_), as test_moe's oracle, norm
    on and off."""
    from test_moe import _block_pair

    for norm in (True, False):
        block, config = _block_pair(tokens, torch.float32, norm_topk_prob=norm)
        block = block.to(dtype)
        h = torch.randn(tokens, config.hidden_size,
                        generator=torch.Generator().manual_seed(tokens)).to(dtype)
        with torch.no_grad():
            want = block(h[None]).float()[0] if dtype == torch.float32 else \
                block.float()(h.float()[None])[0]
            got = moe.moe_mlp(h.to(device), block.gate.weight.to(device, dtype),
                              block.experts.gate_up_proj.to(device, dtype),
                              block.experts.down_proj.to(device, dtype), config, ShardSpec(),
                              kernel="triton")
        assert got.dtype == dtype
        scale = max(want.abs().max().item(), 1.0)
        assert (got.float().cpu() - want).abs().max().item() <= tol * scale, norm


def test_the_flag_picks_the_path(monkeypatch, device):
    """MINIVLLM_MOE_KERNEL (read at import into moe._MOE_KERNEL) picks the path; an explicit
    kernel= wins; autograd and steps past MAX_KERNEL_TOKENS keep the grouped GEMMs; a name
    outside MOE_KERNELS is refused with the choices named."""
    h = torch.zeros(3, 8, device=device)
    assert moe._MOE_KERNEL in moe.MOE_KERNELS
    monkeypatch.setattr(moe, "_MOE_KERNEL", "triton")
    with torch.no_grad():
        assert moe._takes_kernel(h, None) and not moe._takes_kernel(h, "grouped")
        assert moe._takes_kernel(torch.zeros(fm.MAX_KERNEL_TOKENS, 8, device=device), None)
        assert not moe._takes_kernel(torch.zeros(fm.MAX_KERNEL_TOKENS + 1, 8, device=device),
                                     None)
        assert not moe._takes_kernel(torch.zeros(0, 8, device=device), None)
    with torch.enable_grad():
        assert not moe._takes_kernel(h, None)
    monkeypatch.setattr(moe, "_MOE_KERNEL", "grouped")
    with torch.no_grad():
        assert not moe._takes_kernel(h, None) and moe._takes_kernel(h, "triton")
        # auto takes the kernels on a GPU only, never under the CPU's interpreter
        assert moe._takes_kernel(h, "auto") == (device.type == "cuda")
    monkeypatch.setattr(moe, "_MOE_KERNEL", "fused")
    with pytest.raises(ValueError, match="'fused' is not one of"):
        moe._takes_kernel(h, None)
    with torch.enable_grad(), pytest.raises(ValueError, match="MINIVLLM_MOE_KERNEL"):
        moe._takes_kernel(h, None)


def test_auto_takes_the_kernels_on_a_gpu_up_to_their_limit():
    """auto's rule, every case: the kernels at 1..MAX_KERNEL_TOKENS tokens on a GPU; never on the
    CPU, under autograd, at 0 tokens or past MAX_KERNEL_TOKENS. triton: wherever Triton runs and
    the step fits; grouped: never."""
    most = fm.MAX_KERNEL_TOKENS
    for tokens in (0, 1, 64, 65, most, most + 1):
        for on_gpu in (False, True):
            for grad in (False, True):
                fits = 1 <= tokens <= most
                got = moe.kernel_path("auto", tokens, on_gpu=on_gpu, triton_usable=True, grad=grad)
                assert got == (on_gpu and not grad and fits), (tokens, on_gpu, grad)
                assert moe.kernel_path("triton", tokens, on_gpu=on_gpu, triton_usable=True,
                                       grad=grad) == (fits and not grad)
                assert not moe.kernel_path("grouped", tokens, on_gpu=on_gpu, triton_usable=True,
                                           grad=grad)
    assert not moe.kernel_path("triton", 3, on_gpu=False, triton_usable=False)


# --- torch.compile ------------------------------------------------------------------------------

TRACE_BODY = """
from minivllm.functional import moe
from minivllm.kernels import launch
from minivllm.state import ModelConfig, ShardSpec

launch.triton_usable = lambda device: True  # the CPU, as if a GPU (see triton_trace)
from minivllm.functional import linear
linear.skinny_applies = lambda x: x.shape[0] <= 16  # the router's product too, as on a GPU
config = ModelConfig.from_dict(dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=101,
    hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True))
shard = ShardSpec()

def layer(h, router, gate_up, down):
    return moe.moe_mlp(h * 2, router, gate_up, down, config, shard, kernel="triton") + 1

torch.set_grad_enabled(False)
trace(layer, torch.randn(5, 64), torch.randn(8, 64), torch.randn(8, 64, 64),
      torch.randn(8, 64, 32))
"""


@pytest.mark.parametrize("counted", [False, True], ids=["one_program", "count_kernel"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_traces_without_graph_breaks(device, monkeypatch, dynamic, counted):
    """torch.compile(fullgraph=True) traces the kernel path's five kernels into one graph (the
    router's skinny GEMM, routing, align, two GEMMs; six where align counts the pairs in a
    kernel of its own, whose grid and table follow the token count); with the token count
    dynamic too (the engine's second compile of a layer makes the step's sizes symbolic: a
    launch choice taken from the exact count would make it specialize, which mark_dynamic
    turns into an error)."""
    count_from = 1 if counted else 10**9  # every step counted by the kernel, or none
    if device.type == "cuda":  # the real thing: compile, run, compare
        monkeypatch.setattr(fm, "ALIGN_COUNT_FROM", count_from)
        torch._dynamo.reset()
        config, shard = config_for(8, 2, 64, 32), ShardSpec()
        fn = lambda *a: moe.moe_mlp(*a, config, shard, kernel="triton")  # noqa: E731
        compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        for tokens in (5, 9):
            args = moe_case(tokens, tokens, 8, 2, 64, 32, torch.bfloat16, device)
            with torch.no_grad():
                got, want = compiled(*args), fn(*args)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
        return
    body = TRACE_BODY.replace("shard = ShardSpec()\n", "shard = ShardSpec()\n"
                              f"from minivllm.kernels import fused_moe\n"
                              f"fused_moe.ALIGN_COUNT_FROM = {count_from}\n")
    assert "ALIGN_COUNT_FROM" in body
    if dynamic:
        body = body.replace("trace(layer, torch.randn(5, 64),", "h = torch.randn(5, 64)\n"
                            "torch._dynamo.mark_dynamic(h, 0)\ntrace(layer, h,")
        assert "mark_dynamic" in body
    counts = kernel_launches_traced(body)  # on CPU: see tests/triton_trace.py
    want = 6 if counted else 5
    assert counts == {"dynamo": want, "aot": want}, counts


def test_one_token_traces_four_kernels(device):
    """A step of one token (the single stream's) traces without align: the router's skinny
    GEMM, routing and the two GEMMs on a tile a pair; on a GPU, compiled (dynamic, as the
    engine's second compile) against eager."""
    if device.type == "cuda":
        torch._dynamo.reset()
        config, shard = config_for(8, 2, 64, 32), ShardSpec()
        fn = lambda *a: moe.moe_mlp(*a, config, shard, kernel="triton")  # noqa: E731
        compiled = torch.compile(fn, fullgraph=True, dynamic=True)
        args = moe_case(1, 1, 8, 2, 64, 32, torch.bfloat16, device)
        with torch.no_grad():
            assert torch.equal(compiled(*args), fn(*args))
        return
    body = TRACE_BODY.replace("trace(layer, torch.randn(5, 64),",
                              "trace(layer, torch.randn(1, 64),")
    assert "randn(1, 64)" in body
    counts = kernel_launches_traced(body)  # on CPU: see tests/triton_trace.py
    assert counts == {"dynamo": 4, "aot": 4}, counts


# --- the engine ---------------------------------------------------------------------------------

@pytest.mark.parametrize("count_from, unsummed", [(None, False), (1, False), (None, True)],
                         ids=["default", "count_kernel", "unsummed"])
def test_engine_with_the_flag_equals_transformers(monkeypatch, tmp_path, device, count_from,
                                                  unsummed):
    """The engine (eager, fp32) with MINIVLLM_MOE_KERNEL=triton: its greedy tokens are
    transformers', and the kernel path ran (prompt chunks and decode steps, <= 8 tokens); with
    align's count kernel in every step too (its steps here are under 3 chunks); with the
    skinny GEMM applying as on a GPU (patched in), so that sparse layers hand their unsummed
    expert terms to the next layer's add + RMSNorm and to the final norm."""
    from minivllm import LLM, SamplingParams
    from hf_tiny import make_hf_moe_model, save_checkpoint
    from test_moe import PROMPTS, _greedy_reference

    model = make_hf_moe_model(seed=5, std=0.3, mlp_only_layers=[1])
    path = save_checkpoint(model, tmp_path / "moe")
    want = _greedy_reference(model, PROMPTS, 6)
    calls = []
    real = fm.fused_experts
    monkeypatch.setattr(fm, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(moe, "_MOE_KERNEL", "triton")
    if count_from is not None:
        monkeypatch.setattr(fm, "ALIGN_COUNT_FROM", count_from)
    if unsummed:
        from minivllm.functional import linear

        monkeypatch.setattr(linear, "skinny_applies", lambda x: x.shape[0] <= 16 and
                            not torch.is_grad_enabled())
        real_moe_mlp = moe.moe_mlp
        shapes = []
        monkeypatch.setattr(layer_module, "moe_mlp", lambda h, *a, **k: (
            lambda out: shapes.append((h.shape[0], out.dim())) or out)(real_moe_mlp(h, *a, **k)))
    with LLM(path, device=device, max_num_batched_tokens=8, max_num_seqs=4, num_kv_blocks=64,
             block_size=4, dtype="float32", enforce_eager=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert calls, "the kernel path never ran"
    if unsummed:  # every sparse layer's terms unsummed at the skinny GEMM's rows (on a GPU
        # the engine's warm-up also runs larger steps, which keep the summed form)
        assert shapes and all(dim == 3 for rows, dim in shapes if rows <= 16), shapes
        assert all(dim == 2 for rows, dim in shapes if rows > 16), shapes


# --- an offline sm_90 compile -------------------------------------------------------------------

COMPILE_BODY = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from minivllm.kernels import fused_moe as fm

fm.num_sms = lambda device: 132  # an H100's, for gemm_config without a GPU
dev, target = torch.device("cuda"), GPUTarget("cuda", 90, 32)
GEMM = ["a_ptr", "w_ptr", "out_ptr", "rw_ptr", "ids_ptr", "sorted_ptr", "tile_expert_ptr",
        "num_tiles_ptr", "P", "N", "K", "stride_am", "stride_we", "stride_wn", "stride_om",
        "stride_rt", "stride_rk", "stride_it", "stride_ik"]

def build(fn, types, consts, **options):
    sig = dict(types, **{c: "constexpr" for c in consts})
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                          options=options).metadata.shared

out = []
for tokens in (1, 64, 256):  # the 30B-A3B shape: 128 experts, top-8, hidden 2048, inter 768
    pairs = tokens * 8
    bm = fm.block_m_for(pairs, 128, dev)
    tiles = fm.max_tiles(pairs, 128, bm)
    block_p = fm.align_block_for(pairs, 128)
    counted = triton.cdiv(pairs, block_p) >= fm.ALIGN_COUNT_FROM
    pair_tiles = fm.takes_pair_tiles(tokens)  # no align at one token: a tile a pair
    if pair_tiles:
        tiles = pairs
    else:
        if counted:
            out.append(build(fm._align_count_kernel, dict(
                ids_ptr="*i64", chunk_counts_ptr="*i32", P="i32", stride_it="i32",
                stride_ik="i32"), dict(TOP_K=8, E_PAD=128, BLOCK_P=block_p), num_warps=4))
        out.append(build(fm._align_kernel, dict(
            ids_ptr="*i64", chunk_counts_ptr="*i32", sorted_ptr="*i32", tile_expert_ptr="*i32",
            num_tiles_ptr="*i32", P="i32", E="i32", SLOTS="i32", TILES="i32", stride_it="i32",
            stride_ik="i32"),
            dict(TOP_K=8, BLOCK_M=bm, E_PAD=128, BLOCK_P=block_p,
                 BLOCK_S=fm.ALIGN_STORE_BLOCK, COUNTED=counted, ROWS=fm.ALIGN_COUNT_ROWS),
            num_warps=4))
    for n, k, glu in ((768, 2048, True), (2048, 768, False)):
        cfg = fm.gemm_config(tiles, n, k, bm, torch.bfloat16, dev)
        types = ["*bf16", "*bf16", "*bf16" if glu else "*fp32", "*bf16", "*i64"] + \\
            ["*i32"] * 3 + ["i32"] * 11
        out.append(build(fm._moe_gemm_kernel, dict(zip(GEMM, types)), dict(
            A_DIV=8 if glu else 1, TOP_K=8, BLOCK_M=bm, BLOCK_N=cfg["block_n"],
            BLOCK_K=cfg["block_k"], EVEN_K=k % cfg["block_k"] == 0, GLU=glu, WEIGHTED=not glu,
            PAIR_TILES=pair_tiles, PRECISION="tf32"), num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"]))
print(json.dumps(out))
"""


@pytest.mark.skipif(not shutil.which("ptxas", path=TRITON_BIN), reason="no bundled ptxas")
def test_kernels_compile_for_sm90_within_shared_memory(device):
    """The kernels at the launch choices a Hopper GPU gets at the 30B-A3B shape (1, 64 and
    256 tokens: 16-, 32- and 64-pair tiles) compile to sm_90 cubins on the CPU (Triton's bundled
    ptxas), each within an H100's 227 KB of shared memory a block."""
    if device.type == "cuda":
        pytest.skip("the GPU's own tests compile them")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", COMPILE_BODY], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shared = json.loads(proc.stdout.strip().splitlines()[-1])
    # 1 token: a tile a pair, no align; 64 and 256: align and its count kernel; two GEMMs each
    assert len(shared) == 10 and all(0 <= s <= 227 * 1024 for s in shared), shared
