"""kernels/decode_layer.py: one decoder layer at a decode step of 1-2 rows as one persistent
kernel, against functional.decoder_layer on the reference backend (its output, its residual
stream and the K/V it writes). On the CPU the interpreter runs it one launch per phase (a spin
barrier cannot run there); a GPU runs it as one launch with grid barriers as well."""

import pytest
import torch
from hypothesis import given, strategies as st

import minivllm
from minivllm.functional.rope import rope_cos_sin
from minivllm.kernels import select_backend
from minivllm.kernels.decode_layer import (CHUNK_WEIGHTS, HELD_WEIGHTS, LOADS_OFF, MAX_ROWS,
                                           MIN_COLUMNS, PHASES, chunk_columns, decode_layer,
                                           decode_stack, layer_table, load_columns,
                                           with_persistent_layers)
from minivllm.kernels.launch import num_sms, runs_ptx, triton_usable
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.shard import ShardSpec
from test_fp8_cache import exact_fp8_rounding_in_the_interpreter  # noqa: F401 (autouse fixture)

TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _needs_triton(device):
    if not triton_usable(device):
        pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1")


# Qwen3-0.6B/1.7B's proportions (2 query heads a KV head), and 4B/8B's (4 a KV head, with 4B's
# hidden size not a power of two and the attention width unequal to it).
SHAPES = {"gqa2": dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                       head_dim=16),
          "gqa4": dict(hidden_size=80, intermediate_size=112, num_heads=8, num_kv_heads=2,
                       head_dim=16)}


def layer_case(device, dtype, contexts, first_layer, seed=0, page=4, shape="gqa2"):
    config = ModelConfig(vocab_size=64, num_layers=1, dtype=dtype, **SHAPES[shape])
    params = minivllm.random_params(config, seed=seed, std=0.2, device=device)
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-c // page) for c in contexts]
    order = torch.randperm(sum(blocks) + 2, generator=g).tolist()
    chunks, at = [], 0
    for c, nb in zip(contexts, blocks):
        chunks.append(SeqChunk([7], c - 1, order[at:at + nb]))
        at += nb
    batch = make_batch(chunks, block_size=page, device=device)
    cache_shape = (sum(blocks) + 2, page, config.num_kv_heads, config.head_dim)
    k_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    v_cache = torch.randn(cache_shape, generator=g).to(device, dtype)
    m = len(contexts)
    x = (torch.randn(m, config.hidden_size, generator=g)).to(device, dtype)
    residual = None if first_layer else torch.randn(m, config.hidden_size, generator=g).to(
        device, dtype)
    cos, sin = rope_cos_sin(config, batch.positions)
    return config, params.layers[0], x, residual, cos, sin, k_cache, v_cache, batch


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@given(rows_log2=st.integers(0, 9), k=st.integers(1, 20000))
def test_chunk_columns_fill_the_register_budget(rows_log2, k):
    block_rows = 2 ** rows_log2
    got = chunk_columns(block_rows, k)
    padded = 1 << (k - 1).bit_length()
    assert got & (got - 1) == 0 and got <= padded  # a power of two, never past the padded row
    assert got >= min(MIN_COLUMNS, padded)
    # within the budget (or at the least width), and as wide as the budget or the row allows
    assert block_rows * got <= CHUNK_WEIGHTS or got == MIN_COLUMNS
    assert got == padded or block_rows * got * 2 > CHUNK_WEIGHTS or got == MIN_COLUMNS


def _row_blocks(shape: str, programs: int = 132) -> tuple:
    """(bn_qkv, bn_h, bn_i, hidden, att, inter): decode_stack's row blocks at a shape, as on an
    H100, and the GEMVs' input widths."""
    from minivllm.kernels.launch import next_pow2
    from minivllm.state.config import SHAPES

    c = SHAPES[shape]
    hidden, heads, d, inter = c["hidden_size"], c["num_heads"], c["head_dim"], \
        c["intermediate_size"]
    qkv = (heads + 2 * c["num_kv_heads"]) * d
    return (next_pow2(-(-qkv // programs)), next_pow2(-(-hidden // programs)),
            next_pow2(-(-inter // programs)), hidden, heads * d, inter)


@given(logs=st.tuples(*[st.integers(0, 10)] * 3), widths=st.tuples(*[st.integers(1, 30000)] * 3))
def test_load_columns_never_narrow_a_load_past_the_least(logs, widths):
    """Any row blocks and widths: each load a power of two within its padded row, never
    halved below MIN_COLUMNS; the hold within HELD_WEIGHTS unless both shared loads are at
    their least."""
    bn_qkv, bn_h, bn_i = (2 ** x for x in logs)
    hidden, att, inter = widths
    got = load_columns(bn_qkv, bn_h, bn_i, hidden, att, inter)
    for key, k in (("BK_H", hidden), ("BK_ATT", att), ("BK_I", inter)):
        padded = 1 << (k - 1).bit_length()
        bk = got[key]
        assert bk & (bk - 1) == 0 and min(MIN_COLUMNS, padded) <= bk <= padded, (key, bk)
    assert bn_h * got["BK_ATT"] + 2 * bn_i * got["BK_H"] <= HELD_WEIGHTS or \
        max(got["BK_H"], got["BK_ATT"]) <= MIN_COLUMNS


@pytest.mark.parametrize("shape", ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"])
def test_load_columns_hold_what_the_merge_phase_can(shape):
    """Qwen3-0.6B's loads are the measured ones (a row block a load, sessions 16-19); at every
    width o_proj's, gate's and up's first loads, held together from the merge phase on, stay
    within HELD_WEIGHTS, and each load within CHUNK_WEIGHTS (session 74: at Qwen3-1.7B's width
    the earlier rule's spilled, benchmarks/stack_spills.py)."""
    bn_qkv, bn_h, bn_i, hidden, att, inter = _row_blocks(shape)
    got = load_columns(bn_qkv, bn_h, bn_i, hidden, att, inter)
    if shape == "qwen3-0.6b":
        assert got == dict(BK_H=1024, BK_ATT=2048, BK_I=4096)
    assert bn_h * got["BK_ATT"] + 2 * bn_i * got["BK_H"] <= HELD_WEIGHTS
    for bn, bk in ((bn_qkv, got["BK_H"]), (bn_i, got["BK_H"]), (bn_h, got["BK_ATT"]),
                   (bn_h, got["BK_I"])):
        assert bn * bk <= CHUNK_WEIGHTS and bk >= MIN_COLUMNS
    # as wide as that allows: doubling either shared load would break the hold
    assert bn_h * 2 * got["BK_ATT"] + 2 * bn_i * got["BK_H"] > HELD_WEIGHTS or \
        got["BK_ATT"] == chunk_columns(bn_h, att)
    assert bn_h * got["BK_ATT"] + 4 * bn_i * got["BK_H"] > HELD_WEIGHTS or \
        got["BK_H"] == min(chunk_columns(bn_qkv, hidden), chunk_columns(bn_i, hidden))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("contexts,first_layer,block_k,shape", [
    ([9], False, 1024, "gqa2"), ([1], True, 16, "gqa2"), ([13, 30], False, 32, "gqa2"),
    ([30, 2], True, None, "gqa2"), ([21, 5], False, 32, "gqa4")])
def test_decode_layer_matches_the_functional_layer(device, dtype, contexts, first_layer, block_k,
                                                   shape):
    """block_k: GEMV columns a load; 16 and 32 split every GEMV of this shape into chunks, the
    first of which the single launch loads before the barrier ahead of its phase (None:
    chunk_columns' choice, whole rows at this shape)."""
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, dtype, contexts, first_layer, shape=shape)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    want_out, want_res = minivllm.functional.decoder_layer(
        lp, x, residual, cos, sin, k_want, v_want, batch, config=config, shard=ShardSpec(),
        backend=select_backend(device, "reference"))
    # Phase by phase; one launch (on the CPU with one program, whose barriers the interpreter
    # can pass: the single launch's code path, barriers and prefetches included).
    runs = [dict(phase_by_phase=True), dict(phase_by_phase=False, programs=1),
            dict(phase_by_phase=False, programs=1, **LOADS_OFF),
            dict(phase_by_phase=False, programs=1, kv_early=True)]
    if runs_ptx(device):
        runs += [dict(phase_by_phase=False), dict(phase_by_phase=False, **LOADS_OFF),
                 dict(phase_by_phase=False, kv_early=True)]
    for run in runs:
        k_got, v_got = k_cache.clone(), v_cache.clone()
        out, res = decode_layer(lp, x, residual, cos, sin, k_got, v_got, batch, config=config,
                                block_k=block_k, **run)
        # The residual stream is x plus o_proj's output: within about one rounding of dtype
        # (fp16 on the H200: 6.6e-4, the reference's cuBLAS reductions included).
        assert rel(res, want_res) <= TOL[dtype] / 4, (run, rel(res, want_res))
        assert rel(out, want_out) <= TOL[dtype], rel(out, want_out)
        slots = batch.slot_mapping.long()
        flat = lambda c: c.reshape(-1, *c.shape[2:])  # noqa: E731
        for got, want in ((k_got, k_want), (v_got, v_want)):  # qkv's sums run in another order
            torch.testing.assert_close(flat(got)[slots], flat(want)[slots], rtol=TOL[dtype],
                                       atol=TOL[dtype])
        keep = torch.ones(flat(k_got).shape[0], dtype=torch.bool, device=device)
        keep[slots] = False
        assert torch.equal(flat(k_got)[keep], flat(k_cache)[keep])  # nothing else written


def test_decode_layer_refuses_what_it_does_not_run(device):
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, torch.float32, [5] * (MAX_ROWS + 1), False)
    with pytest.raises(ValueError, match="at most"):
        decode_layer(lp, x, residual, cos, sin, k_cache, v_cache, batch, config=config)
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, torch.float32, [5, 9], False)
    table = layer_table([lp], [k_cache], [v_cache])
    run = dict(config=config, dtype=torch.float32)
    for bad_x, bad_res in ((x.half(), residual), (x, residual.t().contiguous().t())):
        with pytest.raises(ValueError, match="contiguous"):
            decode_stack(table, bad_x, bad_res, cos, sin, k_cache, batch, **run)
    for counter in (torch.zeros(1, dtype=torch.int32, device=device),
                    torch.zeros(2, dtype=torch.int64, device=device)):
        with pytest.raises(ValueError, match="counter must be"):
            decode_stack(table, x, residual, cos, sin, k_cache, batch, counter=counter, **run)


def test_stack_reads_its_inputs_in_place_and_shares_a_counter(device):
    """Launches that share one barrier counter (with_persistent_layers keeps one) give the
    outputs of launches with a fresh counter each, and each adds one arrival a program a phase
    of each layer; the stack only reads x and residual (layer 0 takes them where they are)."""
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, torch.float32, [5, 9], False)
    table = layer_table([lp] * 3, [k_cache] * 3, [v_cache] * 3)
    programs = 1 if not runs_ptx(device) else None
    run = dict(config=config, dtype=torch.float32, programs=programs, phase_by_phase=False)
    x0, residual0 = x.clone(), residual.clone()
    want = decode_stack(table, x, residual, cos, sin, k_cache.clone(), batch, **run)
    counter = torch.zeros(1, dtype=torch.int64, device=device)
    for launch in range(1, 4):
        got = decode_stack(table, x, residual, cos, sin, k_cache.clone(), batch, counter=counter,
                           **run)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert counter.item() == launch * 3 * PHASES * (programs or num_sms(device))
    assert torch.equal(x, x0) and torch.equal(residual, residual0)


def test_stack_timeline_records_each_barrier_or_is_refused(device):
    """The probe's timeline: refused where there is no single GPU launch; on a GPU each
    program's stamps run forward, nobody leaves a barrier before everyone has arrived, and the
    outputs are the untimed run's, bit for bit."""
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, torch.float16, [9, 4], False)
    layers = 2
    table = layer_table([lp] * layers, [k_cache] * layers, [v_cache] * layers)
    run = dict(config=config, dtype=x.dtype, programs=4)
    timeline = torch.zeros(1 + layers * 2 * PHASES, 4, dtype=torch.int64, device=device)
    if not runs_ptx(device):
        with pytest.raises(ValueError, match="single launch on a CUDA GPU"):
            decode_stack(table, x, residual, cos, sin, k_cache, batch, timeline=timeline, **run)
        return
    with pytest.raises(ValueError, match="timeline must be int64"):
        decode_stack(table, x, residual, cos, sin, k_cache, batch, timeline=timeline[1:], **run)
    want = decode_stack(table, x, residual, cos, sin, k_cache.clone(), batch, **run)
    got = decode_stack(table, x, residual, cos, sin, k_cache.clone(), batch, timeline=timeline,
                       **run)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    stamps = timeline.cpu()
    assert (stamps > 0).all() and (stamps.diff(dim=0) >= 0).all()
    arrivals, departures = stamps[1::2], stamps[2::2]
    assert (departures.min(dim=1).values >= arrivals.max(dim=1).values).all()


def three_layer_case(device, dtype, contexts):
    """A 3-layer model, two caches each holding the same prefill of every sequence but its last
    token, and the decode step of those last tokens. The functional forward runs the step over
    the first cache. Returns (config, params, backend, the second cache, step, its logits, the
    first cache as the step left it)."""
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=16, dtype=dtype)
    params = minivllm.random_params(config, seed=1, std=0.2, device=device)
    backend = select_backend(device, "reference")
    page, g = 4, torch.Generator().manual_seed(2)
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(contexts))]
    prompts = [torch.randint(0, 64, (c - 1,), generator=g).tolist() for c in contexts]
    caches = []
    for _ in range(2):
        cache = minivllm.init_cache(params, num_blocks=8 * len(contexts), block_size=page)
        prefill = make_batch([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)],
                             block_size=page, device=device)
        _, cache = minivllm.forward(params, cache, prefill, backend)
        caches.append(cache)
    step = make_batch([SeqChunk([5], c - 1, t) for c, t in zip(contexts, tables)],
                      block_size=page, device=device)
    want, _ = minivllm.forward(params, caches[0], step, backend)
    return config, params, backend, caches[1], step, want, caches[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("contexts", [[6], [11, 3]])
def test_persistent_layers_give_the_forward_logits(device, dtype, contexts):
    """with_persistent_layers(forward, ...): every layer of a 3-layer model through decode_stack
    (one launch on a GPU; ping-pong buffers between layers), the logits and the cache the
    functional layers give. The cache's earlier tokens come from a prefill."""
    config, params, backend, cache, step, want, cache_want = three_layer_case(
        device, dtype, contexts)
    got, _ = with_persistent_layers(minivllm.forward, params, cache)(params, cache, step, backend)
    assert rel(got, want) <= TOL[dtype]
    # Each layer's K/V (a later layer's from inputs that already differ by rounding: a norm)
    for a, b in zip(cache.k + cache.v, cache_want.k + cache_want.v):
        assert rel(a, b) <= TOL[dtype]


LOADS = {"off": LOADS_OFF, "default": {}} | {
    flag: LOADS_OFF | {flag: True} for flag in LOADS_OFF} | {
    "default+kv_early": dict(kv_early=True)}


@pytest.mark.parametrize("loads", LOADS.values(), ids=LOADS.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_weight_load_placement_gives_the_forward_logits(device, dtype, loads):
    """Every layer in one launch of one program (the CPU can pass its barriers), with each
    phase's weights loaded where decode_stack's flags put them: the functional forward's
    logits."""
    config, params, _, cache, step, want, _ = three_layer_case(device, dtype, [11, 3])
    x, residual, cos, sin = minivllm.functional.model.stem(params, step)
    table = layer_table(params.layers, cache.k, cache.v)
    out, res = decode_stack(table, x, residual, cos, sin, cache.k[0], step, config=config,
                            dtype=dtype, programs=1, phase_by_phase=False, **loads)
    hidden = minivllm.functional.model.final_hidden(params, out, res)
    got = minivllm.functional.embedding.lm_head(hidden, params.head_weight, config,
                                                params.shard).float()
    assert rel(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_layer_over_an_fp8_cache(device, dtype):
    """An fp8 (e4m3) cache: the layer reads the cached tokens widened and stores the new one
    rounded to e4m3, as the functional layer over the same cache does."""
    config, lp, x, residual, cos, sin, k_cache, v_cache, batch = layer_case(
        device, dtype, [13, 30], False)
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    k_want, v_want = k8.clone(), v8.clone()
    want_out, want_res = minivllm.functional.decoder_layer(
        lp, x, residual, cos, sin, k_want, v_want, batch, config=config, shard=ShardSpec(),
        backend=select_backend(device, "reference"))
    k_got, v_got = k8.clone(), v8.clone()
    out, res = decode_layer(lp, x, residual, cos, sin, k_got, v_got, batch, config=config)
    assert rel(out, want_out) <= 2e-2 and rel(res, want_res) <= 2e-3
    slots = batch.slot_mapping.long()
    for got, want in ((k_got, k_want), (v_got, v_want)):  # e4m3: 3 mantissa bits
        got, want = got.reshape(-1, *got.shape[2:])[slots], want.reshape(-1, *want.shape[2:])[slots]
        torch.testing.assert_close(got.float(), want.float(), rtol=0.07, atol=1e-2)
