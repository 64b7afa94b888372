"""skinny_linear (x: [M, K] @ weight: [N, K].T for M <= 16) against an fp64 matmul.

On CPU under TRITON_INTERPRET=1 (num_sms = 4, so small shapes take the split-K path too), fp32
and fp16; bf16 is checked on the GPU (benchmarks/bench_linear.py). Elementwise bounds: fp32
accumulation error is bounded by ACC_TOL * (|x| @ |w|.T), fp16 adds the output's own rounding.
glu=True (x = [gate, up]) is checked against silu(gate) * up in fp64, the bound widened by one
rounding of the activation to fp16 (the kernel rounds it once before the dot)."""

import pytest
import torch

from minivllm.kernels.launch import triton_usable
from minivllm.kernels.skinny_gemm import MAX_SKINNY_ROWS, skinny_config, skinny_linear
from triton_trace import kernel_launches_traced

ACC_TOL = 1e-5
ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11}  # half an ulp, relative
ROWS = (1, 2, 3, 7, 16)
# (N, K): ragged N and K; ragged N with whole K chunks; split-K with a ragged and a whole K.
SHAPES = ((200, 70), (257, 128), (24, 600), (48, 1024))


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def check(out, x, w, glu=False):
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == x.dtype
    x64, w64 = x.double(), w.double()
    act_rounding = 0.0
    if glu:  # the activation, rounded once to x.dtype in the kernel: relative ROUNDING each
        gate, up = x64.chunk(2, dim=-1)
        x64, act_rounding = torch.nn.functional.silu(gate) * up, ROUNDING[x.dtype]
    ref = x64 @ w64.T
    bound = (ACC_TOL + act_rounding) * (x64.abs() @ w64.abs().T) + ROUNDING[x.dtype] * ref.abs()
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"


def rand(*shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_matches_fp64(device, m, n, k, dtype):
    x = rand(m, k, dtype=dtype, device=device, seed=m * 1000 + n)
    w = rand(n, k, dtype=dtype, device=device, seed=k)
    check(skinny_linear(x, w), x, w)


def test_small_shapes_cover_the_paths(device):
    """The shapes above must reach what they are meant to test, under the CPU heuristic."""
    if device.type == "cuda":
        pytest.skip("the split choices depend on the SM count")
    cfg = {nk: skinny_config(2, *nk, torch.float32, device) for nk in SHAPES}
    assert cfg[(200, 70)]["split"] == 1 and 70 % cfg[(200, 70)]["block_k"] != 0
    assert cfg[(257, 128)]["split"] == 1 and 257 % cfg[(257, 128)]["block_n"] != 0
    assert cfg[(24, 600)]["split"] > 1 and cfg[(48, 1024)]["split"] > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", [(200, 70), (24, 600)])
def test_strided_rows(device, n, k, dtype):
    """x as views: columns of a wider tensor (row stride > K), and every other row of one."""
    wide = rand(16, k + 13, dtype=dtype, device=device, seed=1)
    w = rand(n, k, dtype=dtype, device=device, seed=2)
    for x in (wide[:5, 7:7 + k], wide[::2, :k]):
        assert not x.is_contiguous()
        check(skinny_linear(x, w), x, w)


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("n,k", SHAPES)
def test_partials_sum_to_the_product(device, n, k, glu):
    """partials=True: fp32 partial products [split, M, N], one per K range of the config's
    split (1 when unsplit), which sum to what skinny_linear returns before its rounding."""
    dtype = torch.float32
    w = rand(n, k, dtype=dtype, device=device, seed=k)
    x = rand(3, 2 * k if glu else k, dtype=dtype, device=device, seed=n)
    parts = skinny_linear(x, w, glu=glu, partials=True)
    split = skinny_config(3, n, k, dtype, x.device)["split"]
    assert parts.shape == (split, 3, n) and parts.dtype == torch.float32
    check(parts.sum(0), x, w, glu=glu)
    # the kernel and torch's sum add the partials in different orders: a few fp32 ulps apart
    # (2.9e-6 at K=1024 on the H200)
    torch.testing.assert_close(parts.sum(0), skinny_linear(x, w, glu=glu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", (1, 3, 16))
def test_glu_matches_fp64(device, m, n, k, dtype):
    """glu=True: x = [gate, up] of width 2K, silu(gate) * up folded into the load of x; SHAPES
    cover ragged and whole K, unsplit and split-K (test_small_shapes_cover_the_paths)."""
    x = rand(m, 2 * k, dtype=dtype, device=device, seed=m * 1000 + n + 7)
    w = rand(n, k, dtype=dtype, device=device, seed=k + 7)
    check(skinny_linear(x, w, glu=True), x, w, glu=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_glu_strided(device, dtype):
    """glu=True on views: columns of a wider tensor (row stride > 2K), every other row, and a
    transposed x (column stride != 1); split-K with a ragged K (24, 600) and unsplit (200, 70)."""
    for n, k in ((24, 600), (200, 70)):
        wide = rand(16, 2 * k + 13, dtype=dtype, device=device, seed=8)
        w = rand(n, k, dtype=dtype, device=device, seed=9)
        xt = rand(2 * k, 3, dtype=dtype, device=device, seed=10).T
        for x in (wide[:5, 7:7 + 2 * k], wide[::2, :2 * k], xt):
            assert not x.is_contiguous()
            check(skinny_linear(x, w, glu=True), x, w, glu=True)


def test_glu_width_checked(device):
    with pytest.raises(AssertionError):
        skinny_linear(torch.zeros(2, 32, device=device), torch.zeros(16, 32, device=device),
                      glu=True)  # x must be [M, 2K]


def test_config_override(device):
    """Forced tiles and splits (what the benchmark sweeps) give the same result."""
    x = rand(3, 300, dtype=torch.float32, device=device, seed=3)
    w = rand(40, 300, dtype=torch.float32, device=device, seed=4)
    for cfg in (dict(block_n=32, block_k=64, split=3), dict(block_n=64, split=1), dict(split=5)):
        check(skinny_linear(x, w, config=cfg), x, w)


def test_no_rows(device):
    with pytest.raises(ValueError):
        skinny_linear(torch.zeros(0, 32, device=device), torch.zeros(16, 32, device=device))


@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("m,m_pad", [(17, None), (40, 16), (70, 32), (130, None)])
def test_more_rows_in_m_tiles(device, m, m_pad, glu):
    """Past MAX_SKINNY_ROWS the kernel tiles M (m_pad rows a program, ragged last tile), plain
    and with the SiLU folded in, split-K (24, 600) and not (200, 70), partials included."""
    assert m > MAX_SKINNY_ROWS
    for n, k in ((24, 600), (200, 70)):
        x = rand(m, 2 * k if glu else k, dtype=torch.float32, device=device, seed=m + n)
        w = rand(n, k, dtype=torch.float32, device=device, seed=k)
        cfg = dict(m_pad=m_pad) if m_pad else None
        check(skinny_linear(x, w, glu=glu, config=cfg), x, w, glu=glu)
        check(skinny_linear(x, w, glu=glu, partials=True, config=cfg).sum(0), x, w, glu=glu)


TRACE_BODY = """
from minivllm.kernels.skinny_gemm import skinny_config, skinny_linear

def layer(h, w):  # h: [M, >= K], sliced like a fused projection's output
    return skinny_linear(h[:, : w.shape[1]] * 2, w) + 1

h, w = torch.randn(2, 640), torch.randn(24, 600)
assert skinny_config(2, 24, 600, torch.float32, h.device)["split"] > 1  # both kernels
trace(layer, h, w)
"""


def test_traces_without_graph_breaks(device):
    """torch.compile(fullgraph=True) traces skinny_linear (split-K: both kernels) into one graph."""
    if device.type == "cuda":  # the real thing: compile, run, compare
        torch._dynamo.reset()
        layer = torch.compile(lambda h, w: skinny_linear(h[:, :600] * 2, w) + 1,
                              fullgraph=True, backend="aot_eager")
        h = rand(2, 640, dtype=torch.float32, device=device, seed=5)
        w = rand(24, 600, dtype=torch.float32, device=device, seed=6)
        check(layer(h, w) - 1, h[:, :600] * 2, w)
        return
    counts = kernel_launches_traced(TRACE_BODY)  # on CPU: see tests/triton_trace.py
    assert counts == {"dynamo": 2, "aot": 2}, counts


def tiny_model_case(device):
    """A 2-layer fp32 model, a batch of 2 sequences (3 + 1 new tokens) and a function running the
    forward on a fresh cache: (config, run(**forward_kwargs) -> logits)."""
    import minivllm
    from minivllm.kernels import select_backend
    from minivllm.state import ModelConfig, SeqChunk, make_batch

    config = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    params = minivllm.random_params(config, seed=0, std=0.2, device=device)
    backend = select_backend(device, "reference")
    batch = make_batch([SeqChunk([1, 2, 3], 0, [0]), SeqChunk([5], 0, [1])], block_size=4,
                       device=device)

    def run(**kwargs):
        cache = minivllm.init_cache(params, num_blocks=2, block_size=4)
        return minivllm.forward(params, cache, batch, backend, **kwargs)[0]

    return config, run


def test_decoder_wiring_equals_cublas_path(device, monkeypatch):
    """The functional layers' skinny dispatch (the row-parallel layers, the SiLU folded into
    down, o_proj's and down's partials handed unsummed to the add + RMSNorm after them and to the
    final norm) gives the forward's logits of the F.linear path. On the CPU the dispatch is
    forced on, since it otherwise takes the skinny path on CUDA only."""
    import minivllm
    import minivllm.functional.linear as linear

    config, run = tiny_model_case(device)
    want = run()
    calls = []

    def forced(x):
        calls.append(x.shape)
        return x.shape[0] <= MAX_SKINNY_ROWS

    monkeypatch.setattr(linear, "skinny_applies", forced)
    inputs = []  # each layer's x: [T, hidden], or the previous layer's partials [split, T, hidden]

    def layer(lp, x, *args, **kwargs):
        inputs.append(x.shape)
        return minivllm.functional.decoder_layer(lp, x, *args, **kwargs)

    got = run(layer=layer)
    assert len(calls) == 2 * config.num_layers  # the row-parallel o_proj and down (with the SiLU)
    assert len(inputs[0]) == 2 and all(len(shape) == 3 for shape in inputs[1:]), inputs
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sum_partials_compiled_equals_eager():
    """sum_partials under torch.compile (additions in split order, so that Inductor fuses them
    into the consumer) sums the skinny GEMM's 16 fp32 partials as the eager .sum(0) does, for a
    dynamic row count, and passes a summed [T, out] through."""
    from minivllm.functional.linear import sum_partials

    compiled = torch.compile(sum_partials, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 5):
        x = torch.randn(16, rows, 40, generator=gen)
        for dtype in (torch.float32, torch.bfloat16):
            torch.testing.assert_close(compiled(x, dtype), x.sum(0).to(dtype), rtol=1e-6, atol=1e-6)
    y = torch.randn(4, 40, generator=gen)
    assert torch.equal(compiled(y, torch.float32), y)
