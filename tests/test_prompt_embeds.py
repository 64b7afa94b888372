"""Prompt embeddings as input (vLLM's LLM(enable_prompt_embeds=True) and
generate({"prompt_embeds": tensor [T, hidden]})): a prompt given as the model's own embedding rows
of some ids completes exactly as the ids do, under chunked prefill, preemption and in a batch with
token prompts; arbitrary embeddings complete as transformers' inputs_embeds forward does; such a
prompt never shares prefix-cache blocks; what cannot run is refused before any work."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.functional.layer import decoder_layer
from minivllm.functional.model import forward
from minivllm.state.batch import SeqChunk, make_batch
from minivllm.state.cache import init_cache
from minivllm.state.load import load

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

LENGTHS = (1, 2, 5, 17, 30)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_model():
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("embeds") / "model")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in LENGTHS]


def rows_of(hf_model, ids):
    """The model's own embedding rows of `ids`: [len(ids), hidden] fp32."""
    return hf_model.model.embed_tokens.weight[torch.tensor(ids)].detach().clone()


def as_embeds(hf_model, prompts):
    return [{"prompt_embeds": rows_of(hf_model, p)} for p in prompts]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


# (engine arguments, whether the run must preempt): one step per prompt; chunks of at most 7
# tokens; 14 blocks of 4 for prompts of up to 30 tokens and 12 new ones (preemption).
CONFIGS = {
    "whole": (dict(), False),
    "chunked": (dict(block_size=4, max_num_batched_tokens=7), False),
    "preempted-async": (dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=9), True),
    "preempted-sync": (dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=9,
                            async_scheduling=False), True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_embedding_rows_complete_as_their_ids(tiny_dir, device, hf_model, prompts, name):
    """Each prompt as its ids and as their embedding rows, interleaved in one batch: the same
    greedy tokens, and no prompt_token_ids for the embeddings' outputs (vLLM's None)."""
    kw, preempts = CONFIGS[name]
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True, **kw)
    want = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                               use_tqdm=False))
    mixed = [x for pair in zip([{"prompt_token_ids": p} for p in prompts[::-1]],
                               as_embeds(hf_model, prompts[::-1])) for x in pair]
    before = llm.stats.preemptions
    outs = llm.generate(mixed, GREEDY, use_tqdm=False)
    assert tokens(outs[0::2])[::-1] == want  # the token prompts, batched with embeddings
    assert tokens(outs[1::2])[::-1] == want
    assert all(o.prompt_token_ids is None for o in outs[1::2])
    assert [o.prompt_token_ids for o in outs[0::2]] == prompts[::-1]
    if preempts:
        assert llm.stats.preemptions > before


def test_sampled_and_truncated_embeddings_match_ids(tiny_dir, device, hf_model, prompts):
    """Seeded sampling with n=2 (each completion's counter-keyed draws), and
    truncate_prompt_tokens keeping the last rows as it keeps the last ids."""
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True, block_size=4)
    params = SamplingParams(temperature=1.0, n=2, seed=7, max_tokens=10, ignore_eos=True,
                            truncate_prompt_tokens=9)
    want = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = llm.generate(as_embeds(hf_model, prompts), params, use_tqdm=False)
    assert tokens(got) == tokens(want)


def test_embeddings_share_no_prefix_cache_blocks(tiny_dir, device, hf_model, prompts):
    """Two prompts of embeddings of one length (placeholder ids alike) after each other, prefix
    caching on: the second computes its own prompt (no cached tokens) and completes as its ids;
    a token prompt after them still hits the cache of its own earlier run."""
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True, block_size=4)
    a, b = prompts[4], prompts[4][::-1]  # 30 tokens each
    want = tokens(llm.generate([{"prompt_token_ids": b}], GREEDY, use_tqdm=False))
    llm.generate(as_embeds(hf_model, [a]), GREEDY, use_tqdm=False)
    got = llm.generate(as_embeds(hf_model, [b]), GREEDY, use_tqdm=False)[0]
    assert tokens([got]) == want and got.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": b}], GREEDY, use_tqdm=False)[0]
    assert tokens([again]) == want and again.num_cached_tokens == 28  # 7 full blocks of 4


def hf_greedy(hf_model, embeds, n):
    """transformers' greedy completion of `embeds` [T, hidden]: the whole inputs_embeds forward
    each step, each new token's embedding row appended (the oracle: no cache, no paging)."""
    x, out = embeds[None], []
    with torch.no_grad():
        for _ in range(n):
            tok = int(hf_model(inputs_embeds=x).logits[0, -1].argmax())
            out.append(tok)
            x = torch.cat([x, hf_model.model.embed_tokens.weight[tok][None, None]], dim=1)
    return out


@pytest.mark.parametrize("kw", [dict(), dict(block_size=4, max_num_batched_tokens=7)])
def test_arbitrary_embeddings_against_transformers(tiny_dir, device, hf_model, kw):
    """Embeddings that are no row of the table (drawn at the table's scale), in fp32: the
    greedy tokens of transformers' inputs_embeds forward."""
    g = torch.Generator().manual_seed(11)
    embeds = [0.3 * torch.randn(n, 64, generator=g) for n in (1, 6, 23)]
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True, **kw)
    outs = llm.generate([{"prompt_embeds": e} for e in embeds], GREEDY, use_tqdm=False)
    for out, e in zip(outs, embeds):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf_model, e, 12)


def test_forward_takes_input_embeds_at_masked_rows(tiny_dir):
    """The functional forward: rows flagged by embeds_mask take input_embeds (here arbitrary
    rows for sequence 0's first two tokens); the logits are those of transformers' forward of
    the same inputs_embeds; a batch's mismatched input_embeds are refused."""
    params = load(tiny_dir, dtype=torch.float32)
    cache = init_cache(params, num_blocks=8, block_size=4)
    chunks = [SeqChunk([3, 4, 5], 0, [0]), SeqChunk([7, 8], 0, [1])]
    rows = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    batch = make_batch(chunks, block_size=4, embeds=[(0, rows)], hidden_size=64,
                       embeds_dtype=torch.float32)
    assert batch.embeds_mask.tolist() == [True, True, False, False, False]
    logits, cache = forward(params, cache, batch)
    hf = make_hf_model(seed=0, std=0.3)
    with torch.no_grad():
        e = torch.cat([rows, hf.model.embed_tokens.weight[torch.tensor([5])]])
        want0 = hf(inputs_embeds=e[None]).logits[0, -1]
        want1 = hf(torch.tensor([[7, 8]])).logits[0, -1]
    torch.testing.assert_close(logits, torch.stack([want0, want1]), atol=1e-4, rtol=1e-4)
    # The layers take the batch less its embeddings (a compiled layer: one graph for steps
    # with and without them).
    seen = []

    def spy_layer(lp, x, residual, cos, sin, k, v, b, **kw):
        seen.append((b.input_embeds, b.embeds_mask))
        return decoder_layer(lp, x, residual, cos, sin, k, v, b, **kw)
    again, _ = forward(params, init_cache(params, num_blocks=8, block_size=4), batch,
                       layer=spy_layer)
    assert seen == [(None, None)] * 2 and torch.equal(again, logits)
    bad = make_batch(chunks, block_size=4)
    bad = type(bad)(**{**{k: getattr(bad, k) for k in (
        "input_ids", "positions", "slot_mapping", "cu_seqlens_q", "context_lens",
        "block_tables", "logits_indices")}, "block_size": 4,
        "input_embeds": torch.zeros(5, 63), "embeds_mask": torch.ones(5, dtype=torch.bool)})
    with pytest.raises(ValueError, match="input_embeds"):
        forward(params, cache, bad)


@pytest.fixture(scope="module")
def llm_on(tiny_dir, device):
    return make_llm(tiny_dir, device, enable_prompt_embeds=True, max_model_len=64)


@pytest.mark.parametrize("prompt, params, error, match", [
    ({"prompt_embeds": [[0.0] * 64]}, GREEDY, TypeError, "torch.Tensor"),
    ({"prompt_embeds": torch.zeros(3, 64, dtype=torch.int64)}, GREEDY, TypeError,
     "floating-point"),
    ({"prompt_embeds": torch.zeros(3, 32)}, GREEDY, ValueError, "hidden_size=64"),
    ({"prompt_embeds": torch.zeros(64)}, GREEDY, ValueError, "hidden_size=64"),
    ({"prompt_embeds": torch.zeros(1, 3, 64)}, GREEDY, ValueError, "hidden_size=64"),
    ({"prompt_embeds": torch.zeros(0, 64)}, GREEDY, ValueError, "empty"),
    ({"prompt_embeds": torch.full((2, 64), float("nan"))}, GREEDY, ValueError, "non-finite"),
    ({"prompt_embeds": torch.zeros(64, 64)}, GREEDY, ValueError, "max_model_len"),
    ({"prompt_embeds": torch.zeros(2, 64), "prompt": "x"}, GREEDY, ValueError, "'prompt'"),
    ({"prompt_embeds": torch.zeros(2, 64)}, SamplingParams(prompt_logprobs=1), ValueError,
     "prompt_logprobs"),
    # No data to read (meta), or not a dense tensor: named, not a torch error from the copy.
    ({"prompt_embeds": torch.empty(2, 64, device="meta")}, GREEDY, ValueError, "meta"),
    ({"prompt_embeds": torch.zeros(2, 64).to_sparse()}, GREEDY, TypeError, "dense"),
])
def test_bad_embeddings_are_refused_before_any_work(llm_on, prompt, params, error, match):
    good = {"prompt_embeds": torch.zeros(2, 64)}
    with pytest.raises(error, match=match):
        llm_on.generate([good, prompt], params, use_tqdm=False)
    assert not llm_on.engine.requests and not llm_on.engine.scheduler.has_unfinished()


def test_the_engine_keeps_its_own_copy_of_the_embeddings(tiny_dir, device, hf_model, prompts):
    """A request's embeddings are copied when it is checked (as vLLM's engine takes them): a
    caller refilling its tensor (one buffer for many requests, or NaN written after the check)
    changes no queued request, whatever the tensor's dtype and device already were."""
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True)
    engine, pair = llm.engine, prompts[2:4]
    want = tokens(llm.generate([{"prompt_token_ids": p} for p in pair], GREEDY, use_tqdm=False))
    buf = torch.empty(len(pair[0]), 64, dtype=engine.config.dtype)
    ids = []
    for p in pair:
        buf = buf.new_empty(len(p), 64) if len(p) != buf.shape[0] else buf
        buf.copy_(rows_of(hf_model, p))
        ids.append(engine.add_request({"prompt_embeds": buf}, GREEDY))
        buf.fill_(float("nan"))
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = [c.token_ids for c in out.outputs]
    assert [got[i] for i in ids] == want


def test_embeddings_need_the_flag_and_generate(tiny_dir, device, llm_on):
    from minivllm import BeamSearchParams

    llm = make_llm(tiny_dir, device)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        llm.generate({"prompt_embeds": torch.zeros(2, 64)}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="beam_search"):
        llm_on.beam_search([{"prompt_embeds": torch.zeros(2, 64)}],
                           BeamSearchParams(beam_width=2, max_tokens=3))
    assert llm.stats.steps == 0 and not llm_on.engine.requests


def test_embeddings_with_a_lora_adapter(tiny_dir, hf_model, prompts, tmp_path):
    """LoRA composes with embeddings (the adapters change the layers, not the stem): an
    adapter's completion of the embedding rows is its completion of the ids, in a batch with the
    base model's, and differs from the base model's."""
    from minivllm import LoRARequest
    from test_lora import write_adapter

    write_adapter(tmp_path / "a", tiny_dir, r=4, alpha=8, targets="all-linear", seed=1)
    lora = LoRARequest("a", 1, str(tmp_path / "a"))
    llm = make_llm(tiny_dir, torch.device("cpu"), enable_prompt_embeds=True, enable_lora=True,
                   max_lora_rank=8, block_size=4, max_num_batched_tokens=7)
    ids = [{"prompt_token_ids": p} for p in prompts]
    with_lora = tokens(llm.generate(ids, GREEDY, use_tqdm=False, lora_request=lora))
    base = tokens(llm.generate(ids, GREEDY, use_tqdm=False))
    got = llm.generate(as_embeds(hf_model, prompts) * 2, GREEDY, use_tqdm=False,
                       lora_request=[lora] * len(prompts) + [None] * len(prompts))
    assert tokens(got) == with_lora + base and with_lora != base


def test_one_row_alone_is_a_decode_shaped_step(tiny_dir, device, hf_model, prompts):
    """A prompt of one embedding row, alone: its first step has a decode step's shape (one token
    a sequence, each sampled: the engine's column form, the decode graphs' path on a GPU) and
    must still take the row."""
    llm = make_llm(tiny_dir, device, enable_prompt_embeds=True)
    for p in ([9], [42]):
        want = tokens(llm.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False))
        assert tokens(llm.generate(as_embeds(hf_model, [p]), GREEDY, use_tqdm=False)) == want


def test_pooling_engines_refuse_the_flag(tiny_dir):
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        make_llm(tiny_dir, torch.device("cpu"), enable_prompt_embeds=True, runner="pooling")


def test_stream_and_speculation_take_embeddings(tiny_dir, hf_model, prompts):
    """stream() takes them (its deltas add up to generate's tokens), and n-gram speculative
    decoding (whose lookup reads the generated ids only) leaves the greedy tokens unchanged."""
    llm = make_llm(tiny_dir, torch.device("cpu"), enable_prompt_embeds=True, block_size=4,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    want = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                               use_tqdm=False))
    drafted = llm.stats.spec_draft_tokens
    assert tokens(llm.generate(as_embeds(hf_model, prompts), GREEDY, use_tqdm=False)) == want
    assert llm.stats.spec_draft_tokens > drafted  # the embeddings' sequences did speculate
    streamed = {}
    for delta in llm.stream(as_embeds(hf_model, prompts), GREEDY):
        assert delta.prompt_token_ids is None
        for c in delta.outputs:
            streamed.setdefault(delta.request_id, []).extend(c.token_ids)
    assert [[t] for t in streamed.values()] == want


def test_tensor_parallel_embeddings_complete_as_their_ids(tiny_dir, hf_model, prompts):
    """tensor_parallel_size=2 on CPU (gloo): the step's embeddings reach the worker rank (in the
    pickled StepInput) and each rank's stem takes them after its vocab-parallel lookup's
    all-reduce; chunked prefill of 16-token steps."""
    from minivllm import LLM

    with LLM(tiny_dir, tensor_parallel_size=2, enable_prompt_embeds=True, device="cpu",
             attention_backend="reference", num_kv_blocks=64,
             max_num_batched_tokens=16) as llm:
        want = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                   use_tqdm=False))
        got = tokens(llm.generate(as_embeds(hf_model, prompts), GREEDY, use_tqdm=False))
    assert got == want


# -- the functional API: generate(params, cache, tokens, prompt_embeds=...) --------------------


def test_functional_generate_takes_embedding_rows_as_their_ids(tiny_dir, hf_model, prompts):
    """Prompts given as their ids' embedding rows, batched with id prompts (tokens None where
    embeddings stand): the same tokens as all ids, greedy and seeded sampling."""
    from minivllm.functional.generate import generate

    params = load(tiny_dir, dtype=torch.float32)
    as_rows = [i % 2 == 0 for i in range(len(prompts))]
    tokens_in = [None if e else p for p, e in zip(prompts, as_rows)]
    embeds = [rows_of(hf_model, p) if e else None for p, e in zip(prompts, as_rows)]
    for kw in (dict(), dict(temperature=1.0, seed=3)):
        want, _ = generate(params, init_cache(params, num_blocks=64, block_size=4), prompts,
                           max_new_tokens=10, **kw)
        got, _ = generate(params, init_cache(params, num_blocks=64, block_size=4), tokens_in,
                          max_new_tokens=10, prompt_embeds=embeds, **kw)
        assert got == want


def test_functional_generate_of_arbitrary_embeddings_is_transformers(tiny_dir, hf_model):
    """Embeddings that are no row of the table, beside an id prompt: transformers' greedy
    inputs_embeds completion (hf_greedy), and the id prompt's own greedy completion."""
    from minivllm.functional.generate import generate

    params = load(tiny_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(13)
    embeds = [0.3 * torch.randn(n, 64, generator=g) for n in (1, 9, 20)]
    ids = [4, 8, 15, 16, 23, 42]
    got, _ = generate(params, init_cache(params, num_blocks=64, block_size=4),
                      [None, ids, None, None], max_new_tokens=12,
                      prompt_embeds=[embeds[0], None, embeds[1], embeds[2]])
    assert [got[0], got[2], got[3]] == [hf_greedy(hf_model, e, 12) for e in embeds]
    assert got[1] == hf_greedy(hf_model, rows_of(hf_model, ids), 12)


@pytest.mark.parametrize("tokens, embeds, error, match", [
    ([[1, 2]], [torch.zeros(2, 64)], ValueError, "must be None"),
    ([None, [1]], [torch.zeros(2, 64)], ValueError, "one entry a prompt"),
    ([None], torch.zeros(1, 2, 64), TypeError, "a list"),
    ([None], [torch.zeros(2, 32)], ValueError, "hidden_size=64"),
    ([None], [torch.zeros(0, 64)], ValueError, "tokens >= 1"),
    ([None], [torch.zeros(2, 64, dtype=torch.int64)], TypeError, "floating-point"),
    ([None], [torch.full((2, 64), float("inf"))], ValueError, "non-finite"),
    ([None], None, TypeError, "list of token ids"),
])
def test_functional_generate_refuses_bad_embeddings(tiny_dir, tokens, embeds, error, match):
    from minivllm.functional.generate import generate

    params = load(tiny_dir, dtype=torch.float32)
    with pytest.raises(error, match=match):
        generate(params, init_cache(params, num_blocks=8, block_size=4), tokens,
                 max_new_tokens=2, prompt_embeds=embeds)


def test_tensor_parallel_steps_send_only_their_chunks_embeddings(tiny_dir, hf_model, monkeypatch):
    """A chunk's embeddings are a slice of its prompt's: pickled as they are, each step's
    StepInput would carry the whole prompt's rows (a view pickles its whole storage) to every
    rank, once per chunk. Each step sends about its own chunk's rows."""
    import pickle

    from minivllm import LLM
    from minivllm.runtime import executor

    sent, real = [], executor.broadcast_step

    def recording(step, groups):
        if getattr(step, "embeds", None):
            sent.append((sum(len(e) for _, e in step.embeds), len(pickle.dumps(step))))
        return real(step, groups)

    monkeypatch.setattr(executor, "broadcast_step", recording)
    ids = torch.randint(0, 101, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    with LLM(tiny_dir, tensor_parallel_size=2, enable_prompt_embeds=True, device="cpu",
             attention_backend="reference", num_kv_blocks=64,
             max_num_batched_tokens=16) as llm:
        want = tokens(llm.generate([{"prompt_token_ids": ids}], GREEDY, use_tqdm=False))
        got = tokens(llm.generate(as_embeds(hf_model, [ids]), GREEDY, use_tqdm=False))
    assert got == want and len(sent) == 120 // 16 + 1
    row = 64 * 4  # fp32 rows of hidden 64
    assert all(size < rows * row + 4096 for rows, size in sent), sent
