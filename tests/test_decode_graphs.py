"""The static, padded decode batches that CUDA graphs replay: padding rows must change nothing
(no cache write, real rows' logits unchanged). Checked here by running the padded batch eagerly,
on every backend available (reference; triton under the interpreter)."""

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.utils._pytree as pytree

import minivllm
from minivllm.kernels import available_backends, select_backend
from minivllm.runtime.graphs import PYTHON_SLOTS_MAX_ROWS, DecodeGraphs, decode_buckets
from minivllm.state import ModelConfig, SeqChunk, make_batch
from minivllm.state.batch import DecodeChunks

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.mark.parametrize("fine", [False, True])
@pytest.mark.parametrize("single", [False, True])
def test_buckets_cover_every_batch_size(single, fine):
    for n in (1, 3, 8, 17, 100, 256):
        buckets = decode_buckets(n, single=single, fine=fine)
        assert buckets[-1] == n and buckets == sorted(set(buckets))
        assert all(any(b >= k for b in buckets) for k in range(1, n + 1))
        assert (buckets[0] == 1) == (single or n == 1)
        # the most padding rows a batch of k can get (a mixture of experts reads their experts)
        pad = [min(b for b in buckets if b >= k) - k for k in range(2, n + 1)]
        if fine:  # none up to 8 rows, at most 7 up to 64, then at most 15
            assert all(p == 0 for p in pad[:7]) and all(p < 8 for p in pad[:63])
            assert set(decode_buckets(n, single=single)) <= set(buckets)
        elif n >= 5:  # 5 rows padded to 8
            assert max(pad[:7]) == 3
        assert all(p < 16 for p in pad)


@pytest.mark.parametrize("backend_name", available_backends("cpu"))
def test_padded_decode_equals_unpadded(backend_name):
    backend = select_backend("cpu", backend_name)
    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    bs = 4
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    tables = [[0, 1], [2], [3, 4]]
    caches = [minivllm.init_cache(params, num_blocks=8, block_size=bs) for _ in range(2)]
    for i in range(2):
        logits, caches[i] = minivllm.forward(params, caches[i], make_batch(
            [SeqChunk(p, 0, t) for p, t in zip(prompts, tables)], block_size=bs), backend)
    toks = logits.argmax(-1).tolist()
    # Unpadded decode step.
    expected, caches[0] = minivllm.forward(params, caches[0], make_batch(
        [SeqChunk([t], len(p), tab) for t, p, tab in zip(toks, prompts, tables)], block_size=bs), backend)
    # The same step through the static buffers, padded to the bucket of 4 rows.
    graphs = DecodeGraphs(params, caches[1], backend, max_num_seqs=6, max_blocks_per_seq=3,
                          compile_forward=False)
    before = [t.clone() for t in pytree.tree_leaves(caches[1])]
    padded = graphs.fill(DecodeChunks(toks, [len(p) for p in prompts], tables))
    assert padded == 4
    got, _ = minivllm.forward(params, caches[1], graphs.batch_view(padded), backend)
    torch.testing.assert_close(got[:3], expected, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(got).all()
    for a, b in zip(pytree.tree_leaves(caches[0]), pytree.tree_leaves(caches[1])):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # only the real rows were written
    changed = sum(int((a != b).any(dim=(1, 2, 3)).sum()) for a, b in zip(pytree.tree_leaves(caches[1]), before))
    assert changed > 0


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 4), st.data())
def test_fill_puts_each_step_in_its_bucket_views(max_num_seqs, width, data):
    """One packed copy per step: after each fill (the two stagings in turn, batch sizes going
    up and down), the bucket's views hold that step's rows (each slot and context length
    following from the row's position and table, as make_batch has them), then padding rows
    (id and position 0, slot -1, context length 1, a zero block table), whatever earlier steps
    left; with keep_ids, every field but the ids. With LoRA, each row's adapter slot too (-1:
    a base row, and every padding row)."""
    from minivllm.state.lora import init_lora

    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    lora = data.draw(st.booleans())
    if lora:
        params = attrs.evolve(params, lora=init_lora(CONFIG, max_loras=3, max_rank=2,
                                                     dtype=CONFIG.dtype))
    block_size = 4
    cache = minivllm.init_cache(params, num_blocks=8, block_size=block_size)
    graphs = DecodeGraphs(params, cache, None, max_num_seqs=max_num_seqs, max_blocks_per_seq=width,
                          compile_forward=False)
    for _ in range(data.draw(st.integers(1, 4))):
        b = data.draw(st.integers(1, max_num_seqs))
        ids = data.draw(st.lists(st.integers(0, 2 ** 40), min_size=b, max_size=b))
        tables = [data.draw(st.lists(st.integers(0, 2 ** 30), min_size=1, max_size=width))
                  for _ in range(b)]
        pos = [data.draw(st.integers(0, len(t) * block_size - 1)) for t in tables]
        keep_ids = data.draw(st.booleans())
        slots = data.draw(st.none() | st.lists(st.integers(-1, 2), min_size=b, max_size=b)) \
            if lora else None
        before = graphs.input_ids.tolist()
        chunks = DecodeChunks(ids, pos, tables)
        bs = graphs.fill(chunks, keep_ids=keep_ids, lora_slots=slots)
        assert bs == graphs.bucket(b)
        view = graphs.batch_view(bs)
        expected = make_batch(chunks, block_size=block_size, max_blocks=width)
        pad = bs - b
        # keep_ids: the device's ids stay as they were (the graph's greedy pick put them there)
        assert view.input_ids.tolist() == (before[:bs] if keep_ids else ids + [0] * pad)
        assert view.positions.tolist() == pos + [0] * pad
        assert view.slot_mapping.tolist() == expected.slot_mapping.tolist() + [-1] * pad
        assert view.context_lens.tolist() == expected.context_lens.tolist() + [1] * pad
        assert view.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables] + \
            [[0] * width] * pad
        if lora:
            assert view.lora_slots.tolist() == (slots or [-1] * b) + [-1] * pad
        else:
            assert view.lora_slots is None


@pytest.mark.parametrize("b", [1, PYTHON_SLOTS_MAX_ROWS, PYTHON_SLOTS_MAX_ROWS + 1, 70])
def test_fill_finds_each_slot_as_make_batch_does(b):
    """Slots and context lengths, found in Python for a few rows and with numpy for more: both
    as make_batch finds them."""
    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    graphs = DecodeGraphs(params, cache, None, max_num_seqs=80, max_blocks_per_seq=6,
                          compile_forward=False)
    g = torch.Generator().manual_seed(b)
    tables = [torch.randint(0, 2 ** 30, (int(torch.randint(1, 7, (), generator=g)),),
                            generator=g).tolist() for _ in range(b)]
    pos = [int(torch.randint(0, 4 * len(t), (), generator=g)) for t in tables]
    chunks = DecodeChunks(list(range(b)), pos, tables)
    view = graphs.batch_view(graphs.fill(chunks))
    expected = make_batch(chunks, block_size=4)
    assert view.slot_mapping[:b].tolist() == expected.slot_mapping.tolist()
    assert view.context_lens[:b].tolist() == expected.context_lens.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.data())
def test_fill_rewrites_every_table_that_changed(max_num_seqs, width, data):
    """fill skips a row whose staging holds the same table list at the same length: as the
    engine uses them (a table grows in place by appending, a freed one is replaced by a new
    list, rows change order as sequences come and go), the bucket's tables are still each
    step's, whatever the two stagings held before."""
    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    cache = minivllm.init_cache(params, num_blocks=8, block_size=4)
    graphs = DecodeGraphs(params, cache, None, max_num_seqs=max_num_seqs, max_blocks_per_seq=width,
                          compile_forward=False)
    block = st.integers(0, 2 ** 30)
    live = [data.draw(st.lists(block, min_size=1, max_size=width)) for _ in range(max_num_seqs)]
    for _ in range(data.draw(st.integers(1, 8))):
        for k, table in enumerate(live):
            change = data.draw(st.sampled_from(["keep", "grow", "new"]))
            if change == "grow" and len(table) < width:
                table.append(data.draw(block))  # in place, as BlockManager.allocate
            elif change == "new":  # freed and admitted again, or another sequence
                live[k] = data.draw(st.lists(block, min_size=1, max_size=width))
        b = data.draw(st.integers(1, max_num_seqs))
        tables = data.draw(st.permutations(live))[:b]
        bs = graphs.fill(DecodeChunks([0] * b, [0] * b, tables))
        assert graphs.batch_view(bs).block_tables.tolist() == \
            [t + [0] * (width - len(t)) for t in tables] + [[0] * width] * (bs - b)


def test_compiled_forward_recompiles_a_bounded_number_of_times_over_the_buckets():
    """The parts the graphs compile: for each, one static compile for the first bucket, then one
    with a dynamic batch serves the rest (and, for the decoder layer, all the layers), far under
    the recompile limit. The reference backend's broadcasts add one specialisation of the layer
    for the smallest bucket (dynamo guards B >= 3 there): 3 compiles of the layer, 2 of the stem,
    2 of the head."""
    from torch._dynamo.testing import CompileCounter

    from minivllm.runtime.compiled import compiled_forward

    torch._dynamo.reset()
    params = minivllm.random_params(CONFIG, seed=0)
    cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
    backend = select_backend("cpu", "reference")
    graphs = DecodeGraphs(params, cache, backend, max_num_seqs=256, max_blocks_per_seq=8,
                          compile_forward=False)
    counter = CompileCounter()
    fn = compiled_forward(counter)
    for bs in reversed(graphs.buckets):
        expected, _ = minivllm.forward(params, cache, graphs.batch_view(bs), backend)
        got, _ = fn(params, cache, graphs.batch_view(bs), backend)
        torch.testing.assert_close(got, expected)
    assert len(graphs.buckets) > 8
    assert counter.frame_count <= 7


def test_a_lora_engines_two_sets_of_graphs_share_one_compiled_forward():
    """A LoRA engine's graphs with adapters and its base model's graphs run one compiled
    forward (runner._compile_and_capture): every bucket of both, the LoRA set first as start-up
    captures them, compiles the LoRA layer, stem and head as the base set alone compiles its
    parts (3, 2, 2: see above), and the base set then only its own layer's 3: stem and head
    serve both. Each set's logits are the eager forward's over its batch."""
    from torch._dynamo.testing import CompileCounter

    from minivllm.runtime.compiled import compiled_forward
    from minivllm.state.lora import init_lora

    torch._dynamo.reset()
    params = minivllm.random_params(CONFIG, seed=0)
    params = attrs.evolve(params, lora=init_lora(CONFIG, max_loras=2, max_rank=4,
                                                 dtype=params.dtype, device=params.device,
                                                 shard=params.shard))
    cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
    backend = select_backend("cpu", "reference")
    counter = CompileCounter()
    fn = compiled_forward(counter)
    shape = dict(max_num_seqs=256, max_blocks_per_seq=8, fn=fn)
    with_slots = DecodeGraphs(params, cache, backend, adapters=True, **shape)
    base = DecodeGraphs(params, cache, backend, adapters=False, **shape)
    frames = []
    for graphs in (with_slots, base):
        for bs in reversed(graphs.buckets):
            view = graphs.batch_view(bs)
            assert (view.lora_slots is None) == (graphs is base)
            expected, _ = minivllm.forward(params, cache, view, backend)
            got, _ = graphs.fn(params, cache, view, backend)
            torch.testing.assert_close(got, expected)
        frames.append(counter.frame_count)
    assert frames[0] <= 7 and frames[1] - frames[0] <= 3
    with pytest.raises(ValueError, match="adapters=True"):
        DecodeGraphs(minivllm.random_params(CONFIG, seed=0), cache, backend, adapters=True,
                     **shape)


def test_compiled_layer_serves_prefill_and_mixed_steps_too():
    """Prefill and mixed steps run through the same compiled layer as decode (the default):
    its logits equal the eager forward's on steps of several shapes."""
    from minivllm.runtime.compiled import compiled_forward

    torch._dynamo.reset()
    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    backend = select_backend("cpu", "reference")
    fn = compiled_forward("aot_eager")
    for chunks in ([SeqChunk([1, 2, 3, 4, 5], 0, [0, 1])],
                   [SeqChunk([6, 7], 0, [2]), SeqChunk(list(range(9)), 0, [3, 4, 5])],
                   [SeqChunk([8], 4, [6, 7]), SeqChunk([1, 2, 3], 0, [8])]):
        caches = [minivllm.init_cache(params, num_blocks=12, block_size=4) for _ in range(2)]
        batch = make_batch(chunks, block_size=4)
        want, _ = minivllm.forward(params, caches[0], batch, backend)
        got, _ = fn(params, caches[1], batch, backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_engine_compiles_its_weights_with_static_sizes():
    """Two engines of different shapes in one process (a TP=2 engine after a TP=1 one): the
    second's compiled layer must not inherit the first's size history, or dynamo compiles its
    weights with symbolic sizes (slower code, and an Inductor crash on the H200). Each engine's
    first compile of each part is fully static and its second makes only the step's sizes
    dynamic."""
    from minivllm.runtime.compiled import compiled_forward

    wide = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                       num_heads=6, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    backend = select_backend("cpu", "reference")
    for config in (CONFIG, wide):
        symbolic = []  # per compile: the graph inputs with a symbolic size

        def record(gm, example_inputs):
            symbolic.append({n.target for n in gm.graph.nodes if n.op == "placeholder"
                             and isinstance(v := n.meta.get("example_value"), torch.Tensor)
                             and any(isinstance(d, torch.SymInt) for d in v.shape)})
            return gm.forward

        fn = compiled_forward(record)
        params = minivllm.random_params(config, seed=0, std=0.2)
        for chunks in ([SeqChunk([1, 2, 3], 0, [0])], [SeqChunk([1, 2, 3, 4, 5], 0, [0, 1])]):
            cache = minivllm.init_cache(params, num_blocks=4, block_size=4)
            batch = make_batch(chunks, block_size=4)
            want, _ = minivllm.forward(params, minivllm.init_cache(params, num_blocks=4, block_size=4),
                                       batch, backend)
            got, _ = fn(params, cache, batch, backend)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # stem, layer and head: static on the first step, then dynamic in the step's sizes only
        assert len(symbolic) == 6 and symbolic[:3] == [set()] * 3, symbolic
        assert all(symbolic[3:]), symbolic
        weights = [name for names in symbolic for name in names if "lp" in name or "params" in name]
        assert not weights, weights


@pytest.mark.parametrize("device, enforce_eager, runner, captures", [
    ("cuda", False, "generate", True),
    ("cuda", False, "pooling", False),  # never decodes
    ("cuda", True, "generate", False),
    ("cpu", False, "generate", False),
])
def test_a_pooling_engine_captures_no_decode_graphs(device, enforce_eager, runner, captures):
    from minivllm.runtime.runner import captures_decode_graphs

    assert captures_decode_graphs(torch.device(device), enforce_eager, runner) == captures


@pytest.mark.parametrize("runner, draft, lora", [("generate", False, False),
                                                 ("pooling", False, False),
                                                 ("generate", True, False),
                                                 ("generate", False, True)])
def test_start_up_builds_decode_graphs_for_a_generating_engine_only(runner, draft, lora,
                                                                     monkeypatch):
    """ModelRunner._compile_and_capture on a stand-in CUDA runner (the CPU captures nothing):
    a generating engine builds and captures DecodeGraphs and prefills through their compiled
    forward; a pooling one builds none, and its prompts still go through a compiled forward.
    With a draft model, the draft's DecodeGraphs are captured into the target's pool on its
    stream, with the persistent decode as draft_persistent_decode says (the target's as
    persistent_decode does), and its mirrored steps run their compiled forward, without a
    head. With LoRA, the graphs with adapters (no persistent decode, the base graphs' compiled
    forward) are captured first, into a pool of their own, and the base model's graphs (no
    slots, the persistent decode as persistent_decode says) into theirs."""
    from types import SimpleNamespace

    import minivllm.runtime.runner as runner_mod

    built = []

    class Graphs:  # DecodeGraphs' stand-in: records how it was built and captured
        def __init__(self, *args, **kwargs):
            self.fn, self.args, self.captured = (lambda *a, **kw: None), args, None
            self.kwargs = kwargs
            self.pool, self.stream = object(), object()
            built.append(self)

        def capture(self, pool=None, stream=None):
            self.captured = (pool, stream)

    compiled = object()
    monkeypatch.setattr(runner_mod, "DecodeGraphs", Graphs)
    monkeypatch.setattr(runner_mod, "compiled_forward", lambda **kw: compiled)
    monkeypatch.setattr(runner_mod, "fused_mlp_measured", lambda *a: False)
    for flag in ("MINIVLLM_COMPILE", "MINIVLLM_COMPILE_PREFILL", "MINIVLLM_FUSED_MLP"):
        monkeypatch.delenv(flag, raising=False)
    params = minivllm.random_params(CONFIG, seed=0)
    fake = SimpleNamespace(device=torch.device("cuda", 0), enforce_eager=False, params=params,
                           model_config=CONFIG, cache=None, backend=None, block_size=4,
                           graphs=None, lora_graphs=None, prefill_forward=minivllm.forward,
                           small_decode_forward=None, small_decode_rows=0,
                           draft_params=object() if draft else None, draft_cache=None,
                           draft_backend=None, draft_graphs=None, draft_forward=None)
    import minivllm.kernels.decode_layer as decode_layer  # the eager steps' persistent decode

    monkeypatch.setattr(decode_layer, "with_persistent_layers", lambda fn, *a: fn)
    for name in ("_decode_graph_sets", "_capture_decode_graphs"):
        setattr(fake, name, getattr(runner_mod.ModelRunner, name).__get__(fake))
    config = SimpleNamespace(runner=runner, enable_lora=lora, max_num_seqs=8, max_model_len=64,
                             persistent_decode=lora, draft_persistent_decode=True)
    runner_mod.ModelRunner._compile_and_capture(fake, config)
    if lora:
        base, with_slots = built
        assert fake.graphs is base and fake.lora_graphs is with_slots
        assert with_slots.captured == (None, None)
        assert base.captured == (with_slots.pool, with_slots.stream)
        assert not base.kwargs["adapters"] and base.kwargs["persistent_decode"]
        assert with_slots.kwargs["adapters"] and with_slots.kwargs["fn"] is base.fn
        assert not with_slots.kwargs.get("persistent_decode")
        assert fake.prefill_forward is base.fn and fake.draft_graphs is None
        return
    if runner == "generate":
        assert len(built) == 1 + draft and built[0].captured == (None, None)
        assert fake.graphs is built[0] and fake.prefill_forward is built[0].fn
        assert fake.lora_graphs is None
        if draft:
            target, graphs = built
            assert fake.draft_graphs is graphs and graphs.args[0] is fake.draft_params
            assert graphs.captured == (target.pool, target.stream)
            assert graphs.kwargs["persistent_decode"] and not target.kwargs["persistent_decode"]
            assert fake.draft_forward.func is graphs.fn
            assert fake.draft_forward.keywords == {"head": runner_mod._no_head}
        else:
            assert fake.draft_graphs is None and fake.draft_forward is None
    else:
        assert not built and fake.graphs is None and fake.prefill_forward is compiled


def test_a_moe_models_single_sequence_has_a_bucket_of_its_own():
    """A mixture of experts pads no single sequence to 2 rows (the padding row's experts would
    be read as well as the sequence's): its graphs have a bucket of 1, and finer buckets above
    it. The compiled forward over every bucket, 1 last as capture takes them, equals the eager
    forward, and the MoE buckets cost at most one compile more of each compiled part (the bucket
    of 1's) than the dense model's."""
    from torch._dynamo.testing import CompileCounter

    from minivllm.runtime.compiled import compiled_forward

    moe = attrs.evolve(CONFIG, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       sparse_layers=(1,))
    backend = select_backend("cpu", "reference")
    dense_params = minivllm.random_params(CONFIG, seed=0)
    dense = DecodeGraphs(dense_params, minivllm.init_cache(dense_params, num_blocks=64,
                                                           block_size=4),
                         backend, max_num_seqs=32, max_blocks_per_seq=8, compile_forward=False)
    assert dense.buckets[0] == 2
    torch._dynamo.reset()
    params = minivllm.random_params(moe, seed=0, std=0.2)
    cache = minivllm.init_cache(params, num_blocks=64, block_size=4)
    graphs = DecodeGraphs(params, cache, backend, max_num_seqs=32, max_blocks_per_seq=8,
                          compile_forward=False)
    # and finer ones (each padding row reads experts of its own)
    assert graphs.buckets == [1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32]
    assert set(dense.buckets) < set(graphs.buckets)
    frames = []
    for buckets in (dense.buckets, graphs.buckets):
        torch._dynamo.reset()
        counter = CompileCounter()
        fn = compiled_forward(counter)
        for bs in reversed(buckets):
            expected, _ = minivllm.forward(params, cache, graphs.batch_view(bs), backend)
            got, _ = fn(params, cache, graphs.batch_view(bs), backend)
            torch.testing.assert_close(got, expected)
        frames.append(counter.frame_count)
    # one static compile of each compiled part for the bucket of 1: the dense and the sparse
    # layer, the stem and the head
    assert frames[1] - frames[0] <= 4, frames
