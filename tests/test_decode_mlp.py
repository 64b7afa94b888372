"""kernels/decode_mlp.py: o_proj, the residual add, the post-attention RMSNorm, gate/up, SiLU * up
and down for 1-256 rows as one persistent kernel, against functional.layer.mlp_block after
o_proj's F.linear (down's output and the residual stream). On the CPU the interpreter runs one
launch a phase, or one launch of one program (whose barriers pass); a GPU runs the grid's
single cooperative launch too."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, strategies as st

from minivllm.functional.layer import mlp_block
from minivllm.functional.linear import sum_partials
from minivllm.kernels.decode_mlp import MAX_ROWS, decode_mlp, default_config
from minivllm.kernels.launch import num_sms, runs_ptx, triton_usable
from minivllm.state.params import LayerParams
from minivllm.state.shard import ShardSpec

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
EPS = 1e-6
# Qwen3-0.6B's proportions at a tenth (hidden 64 < attention width 128 < intermediate 192), and
# one with the attention width under the hidden size (Qwen3-4B's is over: 4096 against 2560)
SHAPES = {"0.6b": (64, 128, 192), "narrow": (96, 64, 160)}


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


def dtypes(device):
    # the interpreter computes bf16 arithmetic wrongly (the brief): fp32 and fp16 on the CPU
    return [torch.float32, torch.float16] + ([torch.bfloat16] if runs_ptx(device) else [])


def mlp_case(device, dtype, rows, shape="0.6b", seed=0):
    hidden, att, inter = SHAPES[shape]
    g = torch.Generator().manual_seed(seed)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g) * scale).to(device=device, dtype=dtype)

    weights = dict(o_proj=rand(hidden, att, scale=att ** -0.5),
                   post_norm=1.0 + rand(hidden, scale=0.1),
                   gate_up=rand(2 * inter, hidden, scale=hidden ** -0.5),
                   down=rand(hidden, inter, scale=inter ** -0.5))
    return rand(rows, att), rand(rows, hidden), weights


def reference(attn, residual, w):
    """functional.layer's o_proj (row_linear on one rank is F.linear) and mlp_block."""
    lp = LayerParams(input_norm=None, qkv=None, q_norm=None, k_norm=None, **w)
    return mlp_block(lp, F.linear(attn, w["o_proj"]), residual, ShardSpec(), EPS)


def check(got, want, dtype):
    """Each of got within TOL of want; down's fp32 split-K partials (decode_mlp's or, on a GPU
    at up to 16 rows, the skinny GEMM's in the reference) summed first."""
    for g, r in zip(got, want):
        g, r = sum_partials(g, torch.float32), sum_partials(r, torch.float32)
        assert g.shape == r.shape
        err = ((g.float() - r.float()).abs().max() / r.float().abs().max()).item()
        assert err < TOL[dtype], err


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("rows", [1, 5, 16, 37])
def test_decode_mlp_matches_mlp_block(device, shape, rows):
    for dtype in dtypes(device):
        attn, residual, w = mlp_case(device, dtype, rows, shape)
        got = decode_mlp(attn, residual, *w.values(), EPS)
        assert [t.dtype for t in got] == [dtype, dtype] and got[0].shape == residual.shape
        check(got, reference(attn, residual, w), dtype)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("phase_by_phase", [False, True])
def test_one_launch_with_barriers_equals_one_launch_a_phase(device, phase_by_phase, split):
    """The single launch runs the phases and barriers of the GPU path; under the interpreter with
    one program (its barriers then pass at once), on a GPU with the whole grid; split-K too."""
    attn, residual, w = mlp_case(device, torch.float32, 20)
    programs = num_sms(device) if runs_ptx(device) else 1
    counter = torch.zeros(1, device=device, dtype=torch.int64)
    config = dict(block_k=16, split_o=split, split_d=split)
    for _ in range(2):  # the counter only grows: a second launch waits for its own arrivals
        got = decode_mlp(attn, residual, *w.values(), EPS, programs=programs,
                         phase_by_phase=phase_by_phase, counter=counter, config=config)
        check(got, reference(attn, residual, w), torch.float32)
    if not phase_by_phase:
        assert counter.item() == 2 * 3 * programs  # two launches of three barriers


@given(rows=st.integers(1, 64), seed=st.integers(0, 2**16),
       tiles=st.sampled_from([(16, 16, 16, 16, 16), (32, 16, 32, 16, 32), (16, 32, 16, 32, 16)]),
       split_o=st.sampled_from([1, 2, 4]), split_d=st.sampled_from([1, 2, 4]),
       unsummed_ok=st.booleans())
def test_tile_configs_agree(device, rows, seed, tiles, split_o, split_d, unsummed_ok):
    """Any tiling and split-K that divide the shape give the reference's result (fp32 on the
    CPU); split down's output comes back as its fp32 partials where the caller takes them."""
    block_m, bn_o, bn_gu, bn_d, block_k = tiles
    attn, residual, w = mlp_case(device, torch.float32, rows, seed=seed)
    # a split that does not divide the 0.6b shape's columns is refused (bad input test)
    assume(128 % (split_o * block_k) == 0 and 192 % (split_d * block_k) == 0)
    config = dict(block_m=block_m, bn_o=bn_o, bn_gu=bn_gu, bn_d=bn_d, block_k=block_k,
                  split_o=split_o, split_d=split_d)
    out, r = decode_mlp(attn, residual, *w.values(), EPS, config=config, unsummed_ok=unsummed_ok)
    if unsummed_ok and split_d > 1:
        assert out.shape == (split_d, rows, residual.shape[1]) and out.dtype == torch.float32
        out = sum_partials(out, torch.float32)
    else:
        assert out.shape == residual.shape
    check((out, r), reference(attn, residual, w), torch.float32)


@pytest.mark.parametrize("gpu", [False, True])
def test_default_tiles_divide_every_shape(monkeypatch, gpu):
    """The default tiles (the GPU's chosen off the device, as on the H200) divide the tests'
    shapes and Qwen3's (0.6B: 1024 / 2048 / 3072; 4B: 2560 / 4096 / 9728)."""
    import minivllm.kernels.decode_mlp as dm

    monkeypatch.setattr(dm, "runs_ptx", lambda device: gpu)
    for hidden, att, inter in [*SHAPES.values(), (96, 64, 96), (1024, 2048, 3072),
                               (2560, 4096, 9728)]:
        for rows in (1, 16, 33, 64, 100, 128, 129, 256):
            cfg = dm.default_config(rows, torch.device("cpu"), hidden, att, inter)
            assert hidden % cfg["bn_o"] == hidden % cfg["bn_d"] == inter % cfg["bn_gu"] == 0
            assert hidden % cfg["block_k"] == att % cfg["block_k"] == 0
            assert inter % cfg["block_k"] == 0 and 16 <= cfg["block_m"] <= 128
            assert att % (cfg["split_o"] * cfg["block_k"]) == 0
            assert inter % (cfg["split_d"] * cfg["block_k"]) == 0


def test_bad_input_is_refused_before_any_launch(device):
    attn, residual, w = mlp_case(device, torch.float32, 4)
    with pytest.raises(ValueError, match="rows"):
        decode_mlp(attn.new_empty(MAX_ROWS + 1, attn.shape[1]), residual, *w.values(), EPS)
    with pytest.raises(ValueError, match="residual must be"):
        decode_mlp(attn, residual[:3], *w.values(), EPS)
    with pytest.raises(ValueError, match="gate_up must be"):
        decode_mlp(attn, residual, w["o_proj"], w["post_norm"], w["gate_up"][1:], w["down"], EPS)
    with pytest.raises(ValueError, match="one dtype"):
        decode_mlp(attn.half(), residual, *w.values(), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        decode_mlp(attn, residual, w["o_proj"].t().contiguous().t(), *list(w.values())[1:], EPS)
    with pytest.raises(ValueError, match="bn_gu=128 must divide 192"):
        decode_mlp(attn, residual, *w.values(), EPS, config=dict(bn_gu=128))
    with pytest.raises(ValueError, match="phases must name phases 0-3"):
        decode_mlp(attn, residual, *w.values(), EPS, phase_by_phase=True, phases=(4,))
    with pytest.raises(ValueError, match="phases must name"):
        decode_mlp(attn, residual, *w.values(), EPS, phase_by_phase=False, programs=1, phases=(0,))
    # (block_k given: the default differs between the GPU and the interpreter)
    with pytest.raises(ValueError, match="split_d=8 times block_k=16 must divide 192"):
        decode_mlp(attn, residual, *w.values(), EPS, config=dict(split_d=8, block_k=16))
    with pytest.raises(ValueError, match="unknown decode_mlp config keys"):
        decode_mlp(attn, residual, *w.values(), EPS, config=dict(block_n=32))
    with pytest.raises(ValueError, match="counter must be int64"):
        decode_mlp(attn, residual, *w.values(), EPS, counter=torch.zeros(2, device=device))
    if not runs_ptx(device):  # a barrier among programs run one after another never passes
        with pytest.raises(ValueError, match="needs a GPU"):
            decode_mlp(attn, residual, *w.values(), EPS, programs=2, phase_by_phase=False)


def test_the_probes_two_forms_agree(device):
    """benchmarks/mlp_block_probe.py's engine form (functional.layer's o_proj and mlp_block) and
    fused form (decode_mlp) compute the same thing from the same weights (the probe on the GPU
    compares them at Qwen3-0.6B's shape); its sweep's tilings all divide that shape."""
    from benchmarks import mlp_block_probe as probe

    attn, residual, w = mlp_case(device, torch.float32, 24)
    lp = LayerParams(input_norm=None, qkv=None, q_norm=None, k_norm=None, **w)
    counter = torch.zeros(1, device=device, dtype=torch.int64)
    # the probe compiles the engine's form whole (dynamo must trace it: no attrs class built in it)
    engine = torch.compile(probe.engine_form, fullgraph=True, dynamic=False, backend="eager")
    with torch.no_grad():
        check(probe.fused_form(lp, attn, residual, counter), engine(lp, attn, residual),
              torch.float32)
    for rows in (1, 16, 32, 48, 64, 100, 128, 256):
        for cfg in probe.sweep_configs(rows):
            assert set(cfg) == set(default_config(rows, device, 64, 128, 192))
            assert cfg["block_m"] & (cfg["block_m"] - 1) == 0  # tl.arange takes powers of two
            assert probe.HIDDEN % cfg["bn_o"] == probe.INTER % cfg["bn_gu"] == 0
            assert probe.HIDDEN % cfg["bn_d"] == 0
            assert probe.ATT % cfg["block_k"] == probe.HIDDEN % cfg["block_k"] == 0
            assert probe.INTER % cfg["block_k"] == 0 and cfg["block_m"] >= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_mlp_layer_equals_the_decoder_layer(device, dtype):
    """with_fused_mlp's layer (the engine's decode graphs under MINIVLLM_FUSED_MLP): attention_half
    and decode_mlp at decode steps of rows within its range, the layer it wraps elsewhere; the
    same output, residual stream and cache writes as functional.layer.decoder_layer."""
    from minivllm.functional.layer import attention_half, decoder_layer
    from minivllm.kernels import select_backend
    from minivllm.kernels.decode_mlp import with_fused_mlp
    from test_decode_layer import layer_case

    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, dtype, [9, 30, 2, 17, 5], first_layer=False)
    backend = select_backend(device, "reference")
    kw = dict(config=config, shard=ShardSpec(), backend=backend)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want = decoder_layer(lp, x, residual, cos, sin, k_want, v_want, batch, **kw)
    wrapped = []

    def layer(*args, **kwargs):
        wrapped.append(args[0])
        return decoder_layer(*args, **kwargs)

    counter = torch.zeros(1, device=device, dtype=torch.int64)
    for rows, fused in (((5, 5), True), ((1, 4), False), ((6, 256), False)):
        fn = with_fused_mlp(layer, attention_half, rows, counter)
        k_got, v_got = k_cache.clone(), v_cache.clone()
        wrapped.clear()
        got = fn(lp, x, residual, cos, sin, k_got, v_got, batch, **kw)
        assert (not wrapped) == fused
        check(got, want, dtype)
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    with pytest.raises(ValueError, match="fused MLP rows"):
        with_fused_mlp(layer, attention_half, (0, 8), counter)


def test_the_engine_flag_is_parsed_or_refused():
    from minivllm.runtime.runner import fused_mlp_rows

    from minivllm.runtime.runner import FUSED_MLP_ROWS, fused_mlp_measured

    # unset: the default rows where measured, none elsewhere; set: as given, wherever
    assert fused_mlp_rows(None) == FUSED_MLP_ROWS and fused_mlp_rows(None, measured=False) is None
    for off in ("", "0", "off", "OFF"):
        assert fused_mlp_rows(off) is None
    assert fused_mlp_rows("17-256") == fused_mlp_rows("17-256", measured=False) == (17, 256)
    # measured: the 0.6B shape in bf16 on a Hopper GPU only (the interpreter's CPU is none)
    cpu = torch.device("cpu")
    assert not fused_mlp_measured(1024, torch.bfloat16, cpu)
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        hopper = torch.cuda.get_device_capability(gpu)[0] == 9
        assert fused_mlp_measured(1024, torch.bfloat16, gpu) == hopper
        assert not fused_mlp_measured(1024, torch.float16, gpu)
        assert not fused_mlp_measured(2048, torch.bfloat16, gpu)
    for bad in ("17", "0-16", "17-300", "a-b", "64-32"):
        with pytest.raises(ValueError, match="MINIVLLM_FUSED_MLP must be LO-HI"):
            fused_mlp_rows(bad)


def test_the_engine_checks_the_flag_at_start(tmp_path, monkeypatch, caplog, device):
    """A malformed MINIVLLM_FUSED_MLP stops the engine's start; a well-formed one where no
    compiled decode graphs run (enforce_eager here) is ignored with a warning."""
    from hf_tiny import make_hf_model, save_checkpoint
    from minivllm import LLM

    path = save_checkpoint(make_hf_model(seed=1), tmp_path / "model")
    monkeypatch.setenv("MINIVLLM_FUSED_MLP", "256")
    with pytest.raises(ValueError, match="MINIVLLM_FUSED_MLP must be LO-HI"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    monkeypatch.setenv("MINIVLLM_FUSED_MLP", "17-256")
    with caplog.at_level("WARNING", logger="minivllm"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    assert "MINIVLLM_FUSED_MLP applies to the compiled decode graphs only" in caplog.text


@pytest.mark.parametrize("split", [1, 2])
def test_two_fused_layers_pass_down_partials_on(device, monkeypatch, split):
    """Split down's fp32 partials, left unsummed by with_fused_mlp's layer, are what the next
    layer (fused too) sums in its add + RMSNorm: two layers equal decoder_layer twice."""
    import minivllm.kernels.decode_mlp as dm
    from minivllm.functional.layer import attention_half, decoder_layer
    from minivllm.kernels import select_backend
    from test_decode_layer import layer_case

    # (block_k too: the GPU's default of 32 columns, twice, would not divide this shape's 96)
    monkeypatch.setattr(dm, "splits", lambda *a: dict(split_o=split, split_d=split, block_k=16))
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, torch.float32, [9, 30, 2, 17, 5], first_layer=False)
    kw = dict(config=config, shard=ShardSpec(), backend=select_backend(device, "reference"))
    counter = torch.zeros(1, device=device, dtype=torch.int64)
    fused = dm.with_fused_mlp(decoder_layer, attention_half, (1, 256), counter)
    want, got = (x, residual), (x, residual)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    for _ in range(2):
        want = decoder_layer(lp, *want, cos, sin, *caches[0], batch, **kw)
        got = fused(lp, *got, cos, sin, *caches[1], batch, **kw)
        assert got[0].dim() == (3 if split > 1 else 2)
    check(got, want, torch.float32)
    # the second layer's K/V come from the first's outputs, equal within fp32 rounding
    check(caches[1], caches[0], torch.float32)
