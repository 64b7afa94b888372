"""The static, padded prefill step that runtime/prefill_graph.py replays from a CUDA graph: the
padding (sequences without tokens, tokens without a sequence, logits rows past the real ones)
must change nothing: the real rows' logits and every cache slot equal the unpadded step's. Run
eagerly here, with the model's dtype and fp8 in the cache, on every backend available (the
runner gives the graph to triton's only; here under the interpreter), and through an engine
whose runner takes the padded buffers for its full steps; the graph's capture and replay are
checked on the GPU (tests/test_gpu_graphs.py)."""

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.kernels import available_backends, select_backend
from minivllm.runtime.prefill_graph import (PrefillGraph, logits_rows, prefill_graph_sizes,
                                            verify_graph_shapes)
from minivllm.runtime.step_inputs import batch_layout, packed_offsets, packed_views
from minivllm.state import ModelConfig, SeqChunk, make_batch

from hf_tiny import make_hf_model, save_checkpoint

CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=8, dtype=torch.float32)
PAGE = 4


@st.composite
def steps(draw, max_seqs: int, max_tokens: int, spec: bool = False):
    """A step's chunks: prompts, prompt chunks after a cached prefix, and decode rows, on
    disjoint blocks; some chunks want no logits (a chunk of a prompt that goes on). spec: chunks
    that want logits may want them at several rows (a speculative step's verification)."""
    chunks, next_block, tokens = [], 0, 0
    for _ in range(draw(st.integers(1, max_seqs))):
        new = draw(st.integers(1, max(1, min(9, max_tokens - tokens))))
        if tokens + new > max_tokens:
            break
        cached = draw(st.sampled_from([0, 0, 3, 8]))
        blocks = -(-(cached + new) // PAGE) + draw(st.integers(0, 1))
        table = list(range(next_block, next_block + blocks))
        next_block += blocks
        ids = draw(st.lists(st.integers(0, CONFIG.vocab_size - 1), min_size=new, max_size=new))
        want = draw(st.booleans()) or new == 1
        rows = draw(st.integers(1, new)) if spec and want else 1
        chunks.append(SeqChunk(ids, cached, table, want_logits=want, num_logits=rows))
        tokens += new
    return chunks, next_block


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["model_dtype", "fp8"])
@pytest.mark.parametrize("backend_name", available_backends("cpu"))
@pytest.mark.parametrize("kind", ["prefill", "verify"])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_padded_prefill_equals_unpadded(backend_name, cache_dtype, kind, data):
    """kind "verify": a verification graph's shape (a logits row for every token, any step of at
    most its tokens) and steps whose chunks want logits at several rows."""
    backend = select_backend("cpu", backend_name, cache_dtype)
    params = minivllm.random_params(CONFIG, seed=0, std=0.2)
    max_seqs, max_blocks = 5, 6
    verify = kind == "verify"
    chunks, blocks_used = data.draw(steps(max_seqs, 36, spec=verify))
    tokens = sum(len(c.token_ids) for c in chunks)
    num_tokens = data.draw(st.integers(max(tokens, max_seqs + 1), 2 * tokens + max_seqs + 1))
    shape = dict(num_logits=num_tokens, min_tokens=1) if verify else {}
    graph = PrefillGraph(params, None, backend, minivllm.forward, num_tokens=num_tokens,
                         max_num_seqs=max_seqs, max_blocks_per_seq=max_blocks, block_size=PAGE,
                         **shape)
    if tokens < num_tokens // 2 and not verify or logits_rows(chunks) > graph.num_logits:
        assert not graph.fits(chunks)
        return
    assert graph.fits(chunks)
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 16)))
    cache = minivllm.init_cache(params, num_blocks=blocks_used + 2, block_size=PAGE,
                                dtype=cache_dtype)
    cache = minivllm.KVCache(k=tuple(torch.randn(c.shape, generator=g).to(c.dtype) for c in cache.k),
                             v=tuple(torch.randn(c.shape, generator=g).to(c.dtype) for c in cache.v))
    # fp8's rounding of a K/V value can land on either side when the GEMMs' rounding varies:
    # up to one e4m3 step (3 mantissa bits) in the cache, a little in the logits
    tol = 1e-5 if cache_dtype is None else 0.07
    kv_tol = dict(rtol=1e-5, atol=1e-5) if cache_dtype is None else dict(rtol=0.125, atol=2 ** -6)
    caches = [minivllm.KVCache(k=tuple(c.clone() for c in cache.k),
                               v=tuple(c.clone() for c in cache.v)) for _ in range(2)]
    # A step filled before, of other sizes: what it leaves in the buffers must not matter.
    other, _ = data.draw(steps(max_seqs, num_tokens, spec=verify))
    if graph.fits(other):
        graph.fill(other)
    want, caches[0] = minivllm.forward(params, caches[0], make_batch(chunks, block_size=PAGE),
                                       backend)
    n = graph.fill(chunks)
    assert n == len(want) == logits_rows(chunks)
    got, caches[1] = minivllm.forward(params, caches[1], graph.batch, backend)
    assert got.shape[0] == graph.num_logits
    torch.testing.assert_close(got[:n], want, rtol=tol, atol=tol)
    # The real tokens' slots hold the same K/V (within the GEMMs' rounding, which varies with
    # the row count); every other slot is as it was: the padding wrote nothing.
    written = torch.zeros(cache.k[0].shape[:2], dtype=torch.bool).view(-1)
    written[make_batch(chunks, block_size=PAGE).slot_mapping] = True
    for a, b, before in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v,
                            cache.k + cache.v):
        a, b, before = (x.reshape(-1, *x.shape[2:]) for x in (a, b, before))
        torch.testing.assert_close(b[written].float(), a[written].float(), **kv_tol)
        assert torch.equal(b[~written].view(torch.uint8), before[~written].view(torch.uint8))


def test_fill_pads_every_field_and_rejects_what_does_not_fit():
    params = minivllm.random_params(CONFIG, seed=0)
    graph = PrefillGraph(params, None, None, None, num_tokens=12, max_num_seqs=3,
                         max_blocks_per_seq=2, block_size=PAGE)
    chunks = [SeqChunk([5, 6, 7], 2, [4, 1]), SeqChunk([9], 6, [0, 3], want_logits=True),
              SeqChunk([1, 2], 0, [2], want_logits=False)]
    assert graph.fill(chunks) == 2
    b = graph.batch
    assert b.input_ids.tolist() == [5, 6, 7, 9, 1, 2] + [0] * 6
    assert b.positions.tolist() == [2, 3, 4, 6, 0, 1] + [0] * 6
    assert b.slot_mapping.tolist() == [18, 19, 4, 14, 8, 9] + [-1] * 6
    assert b.cu_seqlens_q.tolist() == [0, 3, 4, 6]
    assert b.context_lens.tolist() == [5, 7, 2]
    assert b.block_tables.tolist() == [[4, 1], [0, 3], [2, 0]]
    assert b.logits_indices.tolist() == [2, 3, 0]
    assert graph.fill(chunks[:1] + [SeqChunk([3, 3, 3], 0, [2])]) == 2
    assert b.cu_seqlens_q.tolist() == [0, 3, 6, 6] and b.context_lens.tolist() == [5, 3, 0]
    assert b.block_tables.tolist() == [[4, 1], [2, 0], [0, 0]]
    assert b.slot_mapping.tolist() == [18, 19, 4, 8, 9, 10] + [-1] * 6
    assert b.logits_indices.tolist() == [2, 5, 0]
    assert graph.fill([]) == 0 and b.cu_seqlens_q.tolist() == [0, 0, 0, 0]
    assert b.slot_mapping.tolist() == [-1] * 12
    for bad in ([SeqChunk([1] * 5, 0, [0, 1])],  # under half of the tokens
                [SeqChunk([1] * 13, 0, [0, 1, 2, 3])],  # more tokens than the graph
                [SeqChunk([1] * 2, 0, [0])] * 4,  # more sequences
                [SeqChunk([1] * 6, 0, [0, 1, 2])]):  # a wider block table
        assert not graph.fits(bad)
        with pytest.raises(ValueError, match="does not fit the prefill graph"):
            graph.fill(bad)
    with pytest.raises(ValueError, match="more tokens than sequences"):
        PrefillGraph(params, None, None, None, num_tokens=4, max_num_seqs=4,
                     max_blocks_per_seq=2, block_size=PAGE)


def test_a_graph_with_adapters_fills_each_tokens_lora_slot():
    """A LoRA engine's prefill graph with slots: each chunk's slot over its tokens, -1 for the
    padding tokens (and for every token of a step given none); a graph without adapters
    refuses slots, and one with them needs LoRA slot weights and buffers of its own."""
    from minivllm.state.lora import init_lora

    params = minivllm.random_params(CONFIG, seed=0)
    lora = attrs.evolve(params, lora=init_lora(CONFIG, max_loras=2, max_rank=2,
                                               dtype=params.dtype, device=params.device,
                                               shard=params.shard))
    shape = dict(num_tokens=12, max_num_seqs=3, max_blocks_per_seq=2, block_size=PAGE)
    graph = PrefillGraph(lora, None, None, None, adapters=True, **shape)
    chunks = [SeqChunk([5, 6, 7], 2, [4, 1]), SeqChunk([9], 6, [0, 3]),
              SeqChunk([1, 2], 0, [2])]
    assert graph.fill(chunks, lora_slots=[1, -1, 0]) == 3
    assert graph.batch.lora_slots.tolist() == [1, 1, 1, -1, 0, 0] + [-1] * 6
    assert graph.fill(chunks[:1] + [SeqChunk([3, 3, 3], 0, [2])]) == 2
    assert graph.batch.lora_slots.tolist() == [-1] * 12
    with pytest.raises(ValueError, match="2 LoRA slots for 3 chunks"):
        graph.fill(chunks, lora_slots=[0, 1])
    plain = PrefillGraph(lora, None, None, None, **shape)
    assert plain.batch.lora_slots is None
    with pytest.raises(ValueError, match="captured without adapters"):
        plain.fill(chunks, lora_slots=[0, 0, 0])
    with pytest.raises(ValueError, match="LoRA slot weights"):
        PrefillGraph(params, None, None, None, adapters=True, **shape)
    with pytest.raises(ValueError, match="inputs of its own"):
        PrefillGraph(lora, None, None, None, adapters=True, inputs=plain.inputs, **shape)


def test_a_verification_graphs_fill_and_its_mirror_over_the_same_buffers():
    """A verification graph's shape (runtime/runner.py: a logits row for every token, any number
    of tokens up to its own): each chunk's last num_logits rows are its logits rows, padded with
    row 0; a graph made over its inputs (a draft model's mirror) reads what it filled."""
    params = minivllm.random_params(CONFIG, seed=0)
    graph = PrefillGraph(params, None, None, None, num_tokens=8, max_num_seqs=2, num_logits=8,
                         min_tokens=1, max_blocks_per_seq=2, block_size=PAGE)
    mirror = PrefillGraph(params, None, None, None, num_tokens=8, max_num_seqs=2, num_logits=8,
                          min_tokens=1, max_blocks_per_seq=2, block_size=PAGE,
                          inputs=graph.inputs)
    chunks = [SeqChunk([5, 6, 7, 8], 3, [4, 1], True, 4), SeqChunk([9, 1], 6, [0, 3], True, 2)]
    assert graph.fill(chunks) == 6
    b = graph.batch
    assert b.logits_indices.tolist() == [0, 1, 2, 3, 4, 5, 0, 0]
    assert b.slot_mapping.tolist() == [19, 4, 5, 6, 14, 15, -1, -1]
    assert graph.fill(chunks[1:]) == 2 and b.logits_indices.tolist() == [0, 1] + [0] * 6
    assert graph.fill([SeqChunk([3], 0, [2])]) == 1  # one token: under any prefill graph's half
    for name, field in mirror.inputs.views.items():
        assert getattr(mirror.batch, name).data_ptr() == getattr(b, name).data_ptr(), name
    for bad in ([SeqChunk([1] * 5, 0, [0, 1], True, 5)] * 2,  # 10 tokens
                [SeqChunk([1] * 2, 0, [0], True, 2)] * 3):  # 3 sequences
        assert not graph.fits(bad)
    narrow = PrefillGraph(params, None, None, None, num_tokens=8, max_num_seqs=2, num_logits=3,
                          min_tokens=1, max_blocks_per_seq=2, block_size=PAGE)
    assert narrow.fits([SeqChunk([1] * 4, 0, [0], True, 3)])
    assert not narrow.fits([SeqChunk([1] * 4, 0, [0], True, 4)])
    with pytest.raises(ValueError, match="4 logits rows does not fit .* 3 logits rows"):
        narrow.fill([SeqChunk([1] * 4, 0, [0], True, 4)])


@pytest.mark.parametrize("k,seqs,tokens,shapes", [
    (4, 256, 8192, [(5, 1), (10, 2), (20, 4), (40, 8), (80, 16), (160, 32), (320, 64), (640, 128),
                    (1280, 256)]),
    (4, 256, 512, [(5, 1), (10, 2), (20, 4), (40, 8), (80, 16), (160, 32), (320, 64)]),
    (3, 8, 8192, [(4, 1), (8, 2), (16, 4), (32, 8)]), (1, 3, 100, [(2, 1), (4, 2), (6, 3)]),
    (4, 1, 8192, [(5, 1)]), (511, 4, 512, [(512, 1)]), (600, 4, 512, [])])
def test_verify_graph_shapes_double_the_sequences_within_the_step_tokens(k, seqs, tokens, shapes):
    assert verify_graph_shapes(k, seqs, tokens) == shapes


@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 7))
def test_packed_fields_are_aligned_and_disjoint(tokens, seqs, width):
    layout = batch_layout(tokens, seqs, width)
    buffer = torch.zeros(packed_offsets(layout)[1], dtype=torch.uint8)
    views = packed_views(buffer, layout)
    spans = []
    for name, view in views.items():
        dtype, shape = layout[name]
        assert view.dtype == dtype and tuple(view.shape) == shape
        start = view.data_ptr() - buffer.data_ptr()
        assert start % 16 == 0
        spans.append((start, start + view.numel() * view.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] <= buffer.numel()


def test_an_engine_whose_full_steps_take_the_padded_buffers_gives_the_same_tokens(tmp_path):
    """The runner's prefill-graph path (fill, feed-back of pending tokens into the buffers, the
    real logits rows, sampling) with the graph's replay stood in for by the eager forward over
    its buffers (the CPU has no graphs): greedy tokens equal a plain engine's, with chunked
    prompts, prefix-cache hits and decode rows in the padded steps."""
    ckpt = save_checkpoint(make_hf_model(seed=3, std=0.3), tmp_path / "model")
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 101, (12,), generator=g).tolist()
    prompts = [{"prompt_token_ids": torch.randint(0, 101, (n,), generator=g).tolist()}
               for n in (50, 3, 21, 9, 30)]
    prompts += [{"prompt_token_ids": shared + [1, 2]}, {"prompt_token_ids": shared + [5]}]
    lone = [{"prompt_token_ids": torch.randint(0, 101, (9,), generator=g).tolist()}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", num_kv_blocks=128, max_num_seqs=4, max_num_batched_tokens=24,
              block_size=4)
    plain = LLM(ckpt, **kw)
    want = [[o.outputs[0].token_ids for o in plain.generate(batch, params, use_tqdm=False)]
            for batch in (prompts, lone)]
    llm = LLM(ckpt, **kw)
    runner = llm.engine.runner
    replays = []

    def stand_in(tokens):
        graph = PrefillGraph(runner.params, runner.cache, runner.backend, runner.prefill_forward,
                             num_tokens=tokens, max_num_seqs=4,
                             max_blocks_per_seq=-(-llm.config.max_model_len // 4), block_size=4)

        def replay(n):  # what the captured graph would run
            replays.append((tokens, n))
            logits, runner.cache = minivllm.forward(runner.params, runner.cache, graph.batch,
                                                    runner.backend)
            return logits[:n]

        graph.replay = replay
        return graph

    runner.prefill_graphs = [stand_in(24), stand_in(12)]  # as the runner keeps them: largest first
    got = [[o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
           for batch in (prompts, lone)]
    assert got == want
    # Steps of 12-24 tokens took the larger graph, of 6-11 (the lone prompt's) the smaller: the
    # smallest that fits.
    assert {t for t, _ in replays} == {12, 24} and (12, 1) in replays, replays


@pytest.mark.parametrize("tokens,seqs,sizes", [
    (8192, 256, [8192, 4096, 2048, 1024, 512]), (8192, 1024, [8192, 4096, 2048]),
    (1000, 16, [1000]), (1024, 16, [1024, 512]), (300, 16, [300]), (256, 256, []), (128, 16, [128])])
def test_prefill_graph_sizes_halve_down_to_512_tokens_above_the_sequences(tokens, seqs, sizes):
    assert prefill_graph_sizes(tokens, seqs) == sizes


@pytest.mark.parametrize("flag", [None, "0", "1"])
@pytest.mark.parametrize("setting,applies", [
    ({}, True), ({"device": torch.device("cpu")}, False), ({"enforce_eager": True}, False),
    ({"backend": "reference"}, False), ({"world_size": 2}, False), ({"tokens": 256}, False),
    ({"runner": "pooling"}, False)])
def test_prefill_graphs_are_on_by_default_where_they_apply(setting, applies, flag, monkeypatch,
                                                           caplog):
    """The rule the runner applies before it sizes the KV cache (runner._wants_prefill_graphs):
    one CUDA GPU, the triton backend, not under enforce_eager, more batched tokens than
    sequences, a generating engine (a pooling one's prompts end in a pooled step, which no graph
    runs); MINIVLLM_PREFILL_GRAPH=0 turns them off, and =1 where they cannot apply warns."""
    from types import SimpleNamespace

    from minivllm.runtime.runner import ModelRunner

    s = {"device": torch.device("cuda", 0), "enforce_eager": False, "backend": "triton",
         "world_size": 1, "tokens": 8192, "runner": "generate"} | setting
    runner = SimpleNamespace(device=s["device"], enforce_eager=s["enforce_eager"],
                             backend=SimpleNamespace(name=s["backend"]),
                             params=SimpleNamespace(shard=SimpleNamespace(world_size=s["world_size"])))
    config = SimpleNamespace(max_num_batched_tokens=s["tokens"], max_num_seqs=256,
                             runner=s["runner"])
    if flag is None:
        monkeypatch.delenv("MINIVLLM_PREFILL_GRAPH", raising=False)
    else:
        monkeypatch.setenv("MINIVLLM_PREFILL_GRAPH", flag)
    with caplog.at_level("WARNING", logger="minivllm"):
        got = ModelRunner._wants_prefill_graphs(runner, config)
    assert got == (applies and flag != "0")
    assert ("MINIVLLM_PREFILL_GRAPH=1 needs" in caplog.text) == (not applies and flag == "1")
