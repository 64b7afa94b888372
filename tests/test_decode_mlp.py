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
    entry = next_layer_entry(device, torch.float32, residual.shape[1], 256)
    with pytest.raises(ValueError, match="phases must name phases 0-5"):
        decode_mlp(attn, residual, *w.values(), EPS, phase_by_phase=True, phases=(6,),
                   next_entry=entry)
    with pytest.raises(ValueError, match="next_entry's qkv must be"):
        decode_mlp(attn, residual, *w.values(), EPS, next_entry=(entry[0], entry[1][:, 1:]))
    with pytest.raises(ValueError, match="bn_q=16 must divide 200"):
        decode_mlp(attn, residual, *w.values(), EPS, next_entry=(entry[0], entry[1][:200]),
                   config=dict(bn_q=16))
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
    # --entry's forms: both through the next layer's entry (the layer's own weights here)
    lp = LayerParams(q_norm=None, k_norm=None, **w, **next_layer_entry_params(device, 64, 256))
    engine_entry = torch.compile(probe.engine_entry_form, fullgraph=True, dynamic=False,
                                 backend="eager")
    with torch.no_grad():
        check(probe.fused_entry_form(lp, attn, residual, counter),
              engine_entry(lp, attn, residual), torch.float32)
    for rows in (1, 16, 32, 48, 64, 100, 128, 256):
        for cfg in probe.sweep_configs(rows) + probe.deep_configs(rows):
            # every key but the next layer's qkv tiles (the probe times no entry), and the grid
            assert set(cfg) - {"programs"} == set(default_config(rows, device, 64, 128, 192)) - \
                {"bn_q"}
            assert cfg["block_m"] & (cfg["block_m"] - 1) == 0  # tl.arange takes powers of two
            assert probe.HIDDEN % cfg["bn_o"] == probe.INTER % cfg["bn_gu"] == 0
            assert probe.HIDDEN % cfg["bn_d"] == 0
            assert probe.ATT % cfg["block_k"] == probe.HIDDEN % cfg["block_k"] == 0
            assert probe.INTER % cfg["block_k"] == 0 and cfg["block_m"] >= 16


def next_layer_entry(device, dtype, hidden, qkv_width, seed=1):
    """A next layer's input_norm and qkv weights (functional.layer.norm_qkv's)."""
    g = torch.Generator().manual_seed(seed)
    norm = 1.0 + torch.randn(hidden, generator=g) * 0.1
    qkv = torch.randn(qkv_width, hidden, generator=g) * hidden ** -0.5
    return norm.to(device=device, dtype=dtype), qkv.to(device=device, dtype=dtype)


def next_layer_entry_params(device, hidden, qkv_width):
    norm, qkv = next_layer_entry(device, torch.float32, hidden, qkv_width)
    return dict(input_norm=norm, qkv=qkv)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_next_entry_gives_the_next_layers_qkv(device, rows, split):
    """With next_entry the launch goes on through the next layer's add + RMSNorm and qkv
    projection: functional.layer.norm_qkv of mlp_block's output and residual stream, down's
    split-K partials summed in the add (split 2) or its rounded output read (split 1); one launch
    a phase and, under the interpreter with one program, the single launch with its barriers."""
    from minivllm.functional.layer import norm_qkv

    for dtype in dtypes(device):
        attn, residual, w = mlp_case(device, dtype, rows)
        in_norm, qkv_w = next_layer_entry(device, dtype, residual.shape[1], 256)
        x, r = reference(attn, residual, w)
        nxt = LayerParams(input_norm=in_norm, qkv=qkv_w, q_norm=None, k_norm=None, o_proj=None,
                          post_norm=None, gate_up=None, down=None)
        want = norm_qkv(nxt, x, r, EPS)
        counter = torch.zeros(1, device=device, dtype=torch.int64)
        for phase_by_phase in (True, False):
            programs = None if phase_by_phase or runs_ptx(device) else 1
            got = decode_mlp(attn, residual, *w.values(), EPS, next_entry=(in_norm, qkv_w),
                             config=dict(split_o=split, split_d=split, block_k=16),
                             phase_by_phase=phase_by_phase, programs=programs, counter=counter)
            assert got[0].shape == (rows, 256) and got[0].dtype == dtype
            check(got, want, dtype)
        if runs_ptx(device):  # five barriers a launch
            assert counter.item() == 5 * num_sms(device)


@pytest.mark.parametrize("fuse_entry", [False, True])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_mlp_stack_gives_the_forward_logits(device, monkeypatch, dtype, split, fuse_entry):
    """fused_mlp_stack as forward's layer stack (the engine's decode graphs of 3-128 rows): a
    3-layer model's decode step as each layer's attention and decode_mlp (with fuse_entry, each
    launch also the next layer's entry, the layer after attending from that qkv): the logits and
    cache writes of the functional forward; split down's fp32 partials passed on between the
    layers. Outside its rows and at prefill, the loop over the layer it was given."""
    import minivllm
    import minivllm.kernels.decode_mlp as dm
    from minivllm.functional.layer import attention_half, attention_output, decoder_layer
    from test_decode_layer import TOL as LAYER_TOL, rel, three_layer_case

    monkeypatch.setattr(dm, "splits", lambda *a: dict(split_o=split, split_d=split, block_k=16))
    config, params, backend, cache, step, want, cache_want = three_layer_case(
        device, dtype, [11, 3])
    looped = []

    def layer(*args, **kwargs):
        looped.append(args[0])
        return decoder_layer(*args, **kwargs)

    counter = torch.zeros(1, device=device, dtype=torch.int64)
    stack = dm.fused_mlp_stack(layer, attention_half, attention_output, (2, 256), counter,
                               fuse_entry)
    got, _ = minivllm.forward(params, cache, step, backend, layers=stack)
    assert not looped and rel(got, want) <= LAYER_TOL[dtype]
    for a, b in zip(cache.k + cache.v, cache_want.k + cache_want.v):
        assert rel(a, b) <= LAYER_TOL[dtype]
    # two rows outside 3-256: the loop over `layer`, one call a layer
    _, _, _, cache, step, want, _ = three_layer_case(device, dtype, [11, 3])
    stack = dm.fused_mlp_stack(layer, attention_half, attention_output, (3, 256), counter,
                               fuse_entry)
    got, _ = minivllm.forward(params, cache, step, backend, layers=stack)
    assert len(looped) == config.num_layers and rel(got, want) <= LAYER_TOL[dtype]
    with pytest.raises(ValueError, match="fused MLP rows"):
        dm.fused_mlp_stack(layer, attention_half, attention_output, (0, 8), counter)


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
    from minivllm.runtime.runner import fused_entry

    assert fused_entry("1") and not any(fused_entry(f) for f in (None, "", "0"))
    for bad in ("yes", "2", "on"):
        with pytest.raises(ValueError, match="MINIVLLM_FUSED_ENTRY must be 0 or 1"):
            fused_entry(bad)


def test_the_engine_checks_the_flag_at_start(tmp_path, monkeypatch, caplog, device):
    """A malformed MINIVLLM_FUSED_MLP or MINIVLLM_FUSED_ENTRY stops the engine's start; a
    well-formed one where no compiled decode graphs run (enforce_eager here) is ignored with a
    warning."""
    from hf_tiny import make_hf_model, save_checkpoint
    from minivllm import LLM

    path = save_checkpoint(make_hf_model(seed=1), tmp_path / "model")
    monkeypatch.setenv("MINIVLLM_FUSED_MLP", "256")
    with pytest.raises(ValueError, match="MINIVLLM_FUSED_MLP must be LO-HI"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    monkeypatch.setenv("MINIVLLM_FUSED_MLP", "17-256")
    monkeypatch.setenv("MINIVLLM_FUSED_ENTRY", "yes")
    with pytest.raises(ValueError, match="MINIVLLM_FUSED_ENTRY must be 0 or 1"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    monkeypatch.setenv("MINIVLLM_FUSED_ENTRY", "1")
    with caplog.at_level("WARNING", logger="minivllm"):
        LLM(path, device=device, num_kv_blocks=64, enforce_eager=True)
    assert "MINIVLLM_FUSED_MLP applies to the compiled decode graphs only" in caplog.text


@pytest.mark.parametrize("fuse_entry", [False, True])
def test_compiled_forward_runs_the_fused_stack(device, fuse_entry):
    """runtime.compiled.compiled_forward with fused rows (as the engine's decode graphs build it):
    its parts traced whole by dynamo (attention_half and attention_output each one graph), the
    functional forward's logits."""
    from minivllm.runtime.compiled import compiled_forward
    from test_decode_layer import TOL as LAYER_TOL, rel, three_layer_case

    _, params, backend, cache, step, want, _ = three_layer_case(device, torch.float32, [11, 3, 7])
    fn = compiled_forward("eager", fused_mlp_rows=(1, 256), device=device, fuse_entry=fuse_entry)
    assert fn.keywords["layers"] is not None
    with torch.no_grad():
        got, _ = fn(params, cache, step, backend)
    assert rel(got, want) <= LAYER_TOL[torch.float32]
