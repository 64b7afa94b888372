"""Embeddings (LLM(model, runner="pooling").embed, vLLM's pooling runner) against transformers:
each prompt's last-token, final-normed hidden state (Qwen3Model's last_hidden_state), cut to
`dimensions` and L2-normalised, through the engine's batched, chunked, prefix-cached prefill, for
checkpoints in the Qwen3ForCausalLM layout and in Qwen3-Embedding's (backbone tensors without
the "model." prefix, no lm_head, a sentence-transformers config)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import minivllm
from minivllm import LLM, PoolingParams, SamplingParams
from minivllm.functional.pooling import last_token_rows, pool_last_token, pooled_embedding
from minivllm.runtime.demo import build_tokenizer
from minivllm.runtime.pooling import EmbeddingRequestOutput, sentence_transformers_pooling

from engine_helpers import make_llm
from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

LENGTHS = (1, 3, 7, 16, 17, 31, 40, 100)
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 both sides: observed differences are ~2e-7


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_model(tok):
    return make_hf_model(seed=0, std=0.1, vocab_size=len(tok))


@pytest.fixture(scope="module")
def causal_dir(hf_model, tok, tmp_path_factory):
    """The Qwen3ForCausalLM layout: model.-prefixed tensors and an untied lm_head."""
    path = save_checkpoint(hf_model, tmp_path_factory.mktemp("causal") / "model")
    tok.save_pretrained(path)
    return path


def write_st_config(path, pooling_mode="pooling_mode_lasttoken", normalize=True):
    """A sentence-transformers config as Qwen3-Embedding's: modules.json, 1_Pooling/config.json."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = {m: m == pooling_mode for m in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                            "pooling_mode_max_tokens", "pooling_mode_lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, **modes, "include_prompt": True}, f)


def write_embedding_layout(hf_model, tok, path, *, architecture="Qwen3ForCausalLM", st=True,
                           **st_kwargs) -> str:
    """The Qwen3-Embedding layout: the backbone's tensors without the "model." prefix and no
    lm_head.weight, though config.json names Qwen3ForCausalLM with untied embeddings (as
    Qwen3-Embedding-8B's does), and a sentence-transformers config."""
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in hf_model.model.state_dict().items()
               if not k.endswith("inv_freq")}
    assert "embed_tokens.weight" in tensors and not any(k.startswith("model.") for k in tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    config = hf_model.config.to_dict()
    config["architectures"] = [architecture]
    config["dtype"] = "float32"  # as save_pretrained writes it for this fp32 model
    assert config["tie_word_embeddings"] is False
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    tok.save_pretrained(path)
    if st:
        write_st_config(path, **st_kwargs)
    return os.fspath(path)


@pytest.fixture(scope="module")
def embed_dir(hf_model, tok, tmp_path_factory):
    return write_embedding_layout(hf_model, tok, tmp_path_factory.mktemp("embedding") / "model")


@pytest.fixture(scope="module")
def prompts(tok):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in LENGTHS]


def hf_hidden(model, ids) -> torch.Tensor:
    """transformers' final-normed hidden state at the last token of `ids` (one sequence, no
    padding), fp32."""
    with torch.no_grad():
        return model.model(torch.tensor([ids])).last_hidden_state[0, -1].float()


def hf_embedding(model, ids, dimensions=None, normalize=True) -> torch.Tensor:
    h = hf_hidden(model, ids)
    if dimensions is not None:
        h = h[:dimensions]
    return torch.nn.functional.normalize(h, p=2, dim=-1) if normalize else h


def vec(out) -> torch.Tensor:
    return torch.tensor(out.outputs.embedding)


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def pooling_llm(path, device, **kw):
    kw.setdefault("runner", "pooling")
    return make_llm(path, device, **kw)


# -- against transformers --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["embedding", "causal"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_embed_matches_transformers(layout, async_scheduling, embed_dir, causal_dir, hf_model,
                                    prompts, device):
    """Prompts of many lengths in one call, the longest over max_num_batched_tokens (prefilled in
    chunks, next to other prompts' chunks): each embedding is transformers' last-token hidden
    state, normalised, in input order."""
    path = embed_dir if layout == "embedding" else causal_dir
    llm = pooling_llm(path, device, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    outs = llm.embed(token_prompts(prompts), use_tqdm=False)
    assert len(outs) == len(prompts)
    assert len({o.request_id for o in outs}) == len(outs)
    for p, out in zip(prompts, outs):
        assert isinstance(out, EmbeddingRequestOutput) and out.finished
        assert out.prompt_token_ids == p
        assert out.outputs.hidden_size == hf_model.config.hidden_size
        torch.testing.assert_close(vec(out), hf_embedding(hf_model, p), **TOL)
        assert abs(float(vec(out).norm()) - 1.0) < 1e-5
    s = llm.stats
    assert s.prompt_tokens_computed == sum(LENGTHS) and s.generation_tokens == 0
    assert s.max_step_tokens == 32 and s.max_step_seqs > 1  # chunked, and batched
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks  # every block given back


def test_text_prompts_are_tokenized_as_vllm_does(embed_dir, hf_model, tok, device):
    llm = pooling_llm(embed_dir, device)
    texts = ["The quick brown fox jumps over the lazy dog.", "Hello", "A journey of a thousand"]
    outs = llm.embed(texts + [{"prompt": texts[0]}], use_tqdm=False)
    for text, out in zip(texts + texts[:1], outs):
        ids = tok.encode(text)
        assert out.prompt_token_ids == ids
        torch.testing.assert_close(vec(out), hf_embedding(hf_model, ids), **TOL)
    # A single prompt, not in a list: a list of one output.
    (one,) = llm.embed(texts[1], use_tqdm=False)
    torch.testing.assert_close(vec(one), vec(outs[1]), **TOL)


def test_prefix_cache_hit_gives_the_same_embedding(embed_dir, hf_model, tok, device):
    """A prompt that shares 3 full blocks with an earlier one reads them from the prefix cache,
    and pools the same vector as without a cache (and as transformers)."""
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, len(tok), (48,), generator=g).tolist()
    a, b = prefix + [5, 6, 7], prefix + [9] * 20
    llm = pooling_llm(embed_dir, device, max_num_batched_tokens=32)
    (first,) = llm.embed([{"prompt_token_ids": a}], use_tqdm=False)
    second, third = llm.embed(token_prompts([b, a]), use_tqdm=False)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48 and third.num_cached_tokens == 48
    assert llm.stats.prompt_tokens_cached == 96
    torch.testing.assert_close(vec(first), hf_embedding(hf_model, a), **TOL)
    torch.testing.assert_close(vec(second), hf_embedding(hf_model, b), **TOL)
    torch.testing.assert_close(vec(third), vec(first), **TOL)
    uncached = pooling_llm(embed_dir, device, enable_prefix_caching=False)
    (again,) = uncached.embed([{"prompt_token_ids": b}], use_tqdm=False)
    assert again.num_cached_tokens == 0
    torch.testing.assert_close(vec(again), vec(second), **TOL)


def test_a_prompt_that_is_whole_blocks_is_pooled_not_skipped(embed_dir, hf_model, prompts, device):
    """A prompt of exactly two blocks, embedded twice: the second takes one block from the cache
    and computes the other, whose last token it pools (a hit never covers the last token)."""
    p = prompts[-1][:32]
    llm = pooling_llm(embed_dir, device)
    outs = llm.embed(token_prompts([p]), use_tqdm=False) + llm.embed(token_prompts([p]),
                                                                       use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 16]
    for out in outs:
        torch.testing.assert_close(vec(out), hf_embedding(hf_model, p), **TOL)


def test_dimensions_and_normalize(embed_dir, hf_model, prompts, device):
    """dimensions keeps the first features and then normalises (Matryoshka); normalize=False
    (or vLLM's newer use_activation=False) returns the hidden state as it is. Requests of
    different parameters share a batch."""
    llm = pooling_llm(embed_dir, device)
    cases = [PoolingParams(), PoolingParams(dimensions=16), PoolingParams(normalize=False),
             PoolingParams(dimensions=8, normalize=False), PoolingParams(use_activation=False),
             PoolingParams(dimensions=64), PoolingParams(dimensions=1)]
    ps = [prompts[i % len(prompts)] for i in range(len(cases))]
    outs = llm.embed(token_prompts(ps), cases, use_tqdm=False)
    for p, params, out in zip(ps, cases, outs):
        want = hf_embedding(hf_model, p, params.dimensions, params.normalizes(True))
        assert out.outputs.hidden_size == (params.dimensions or 64)
        torch.testing.assert_close(vec(out), want, **TOL)
    full, cut = hf_hidden(hf_model, ps[1]), vec(outs[1])
    assert abs(float(cut.norm()) - 1.0) < 1e-5  # normalised after the cut, not before
    assert not torch.allclose(cut, full[:16], atol=1e-3)
    assert abs(float(vec(outs[2]).norm()) - float(hf_hidden(hf_model, ps[2]).norm())) < 1e-4
    assert vec(outs[6]).tolist() in ([1.0], [-1.0])


def test_sentence_transformers_normalize_sets_the_default(hf_model, tok, tmp_path, prompts, device):
    """As vLLM: a sentence-transformers config without a Normalize module makes normalize=False
    the default; PoolingParams(normalize=True) still normalises."""
    path = write_embedding_layout(hf_model, tok, tmp_path / "m", normalize=False)
    assert sentence_transformers_pooling(path) == {"pooling": "LAST", "normalize": False}
    llm = make_llm(path, device)  # runner="auto": pooling, from modules.json
    assert llm.config.runner == "pooling"
    raw, unit = llm.embed(token_prompts(prompts[2:4]),
                          [PoolingParams(), PoolingParams(normalize=True)], use_tqdm=False)
    torch.testing.assert_close(vec(raw), hf_embedding(hf_model, prompts[2], normalize=False), **TOL)
    torch.testing.assert_close(vec(unit), hf_embedding(hf_model, prompts[3]), **TOL)


def test_truncate_prompt_tokens_keeps_the_last_tokens(embed_dir, hf_model, prompts, device):
    llm = pooling_llm(embed_dir, device, max_model_len=64)
    p = prompts[-1]  # 100 tokens: over max_model_len unless truncated
    five, whole = llm.embed(token_prompts([p, p]), [PoolingParams(truncate_prompt_tokens=5),
                                                    PoolingParams(truncate_prompt_tokens=-1)],
                            use_tqdm=False)
    assert five.prompt_token_ids == p[-5:] and whole.prompt_token_ids == p[-64:]
    torch.testing.assert_close(vec(five), hf_embedding(hf_model, p[-5:]), **TOL)
    torch.testing.assert_close(vec(whole), hf_embedding(hf_model, p[-64:]), **TOL)
    # embed's own argument is set over every request's, as vLLM's.
    (three,) = llm.embed(token_prompts([p]), PoolingParams(truncate_prompt_tokens=9),
                         truncate_prompt_tokens=3, use_tqdm=False)
    assert three.prompt_token_ids == p[-3:]
    # A prompt may fill max_model_len: nothing is generated after it.
    (full,) = llm.embed(token_prompts([p[:64]]), use_tqdm=False)
    torch.testing.assert_close(vec(full), hf_embedding(hf_model, p[:64]), **TOL)


def test_the_pure_pooling_function(causal_dir, hf_model, prompts, device):
    """functional.pooling on its own: a batch of whole prompts pools each one's last token."""
    params = minivllm.load(causal_dir, device=device)
    cache = minivllm.init_cache(params, num_blocks=32, block_size=16)
    chunks, table = [], 0
    for p in prompts[:5]:
        blocks = -(-len(p) // 16)
        chunks.append(minivllm.SeqChunk(p, 0, list(range(table, table + blocks))))
        table += blocks
    batch = minivllm.make_batch(chunks, block_size=16, device=device)
    assert last_token_rows(batch).tolist() == [sum(len(p) for p in prompts[:k + 1]) - 1
                                               for k in range(5)]
    got = pooled_embedding(pool_last_token(params, cache, batch), dimensions=32).cpu()
    want = torch.stack([hf_embedding(hf_model, p, 32) for p in prompts[:5]])
    torch.testing.assert_close(got, want, **TOL)
    h = torch.tensor([[3.0, 4.0, 12.0]], dtype=torch.bfloat16)
    assert pooled_embedding(h).dtype == torch.float32
    torch.testing.assert_close(pooled_embedding(h), torch.tensor([[3 / 13, 4 / 13, 12 / 13]]))
    torch.testing.assert_close(pooled_embedding(h, 2), torch.tensor([[0.6, 0.8]]))
    assert pooled_embedding(h, 2, False).tolist() == [[3, 4]]


# -- runners, layouts and what each LLM refuses ---------------------------------------------------


def test_runner_auto_reads_the_checkpoint(hf_model, tok, embed_dir, causal_dir, tmp_path, prompts,
                                          device):
    """runner="auto" (the default), as vLLM: pooling for a sentence-transformers checkpoint (a
    Qwen3ForCausalLM config notwithstanding) and for a bare Qwen3Model; generate otherwise.
    task="embed" is vLLM's older runner="pooling"."""
    assert make_llm(embed_dir, device).config.runner == "pooling"
    assert make_llm(causal_dir, device).config.runner == "generate"
    assert make_llm(causal_dir, device, task="embed").config.runner == "pooling"
    assert make_llm(causal_dir, device, runner="generate", task="generate").config.runner == \
        "generate"
    bare = write_embedding_layout(hf_model, tok, tmp_path / "bare", architecture="Qwen3Model",
                                  st=False)
    llm = make_llm(bare, device)
    assert llm.config.runner == "pooling"
    (out,) = llm.embed(token_prompts(prompts[3:4]), use_tqdm=False)
    torch.testing.assert_close(vec(out), hf_embedding(hf_model, prompts[3]), **TOL)


def test_a_generating_llm_does_not_embed_and_a_pooling_one_does_not_generate(
        embed_dir, causal_dir, device):
    gen = make_llm(causal_dir, device, runner="generate")
    with pytest.raises(ValueError, match="Embedding API is not supported by this model"):
        gen.embed(["Hello"], use_tqdm=False)
    pool = pooling_llm(causal_dir, device)
    message = r"LLM.generate\(\) is only supported for generative models"
    with pytest.raises(ValueError, match=message):
        pool.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        pool.chat([{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=2),
                  use_tqdm=False)
    with pytest.raises(ValueError, match=message):
        next(pool.stream(["Hello"], SamplingParams(max_tokens=2)))
    with pytest.raises(ValueError, match=message):
        pool.beam_search(["Hello"], minivllm.BeamSearchParams(beam_width=2, max_tokens=2))
    assert pool.stats.steps == 0 and not pool.engine.requests
    assert gen.stats.steps == 0 and not gen.engine.requests


@pytest.mark.parametrize("kwargs, error", [
    (dict(runner="embed"), "runner must be one of"),
    (dict(task="reward"), "task must be one of"),
    (dict(task="embed", runner="generate"), "task='embed' means runner='pooling'"),
])
def test_bad_runner_arguments(kwargs, error, causal_dir, device):
    with pytest.raises(ValueError, match=error):
        make_llm(causal_dir, device, **kwargs)


def test_checkpoints_a_runner_cannot_serve(hf_model, tok, tmp_path, device):
    bare = write_embedding_layout(hf_model, tok, tmp_path / "bare", architecture="Qwen3Model",
                                  st=False)
    with pytest.raises(ValueError, match="Qwen3Model checkpoint .* cannot generate"):
        make_llm(bare, device, runner="generate")
    mean = write_embedding_layout(hf_model, tok, tmp_path / "mean",
                                  pooling_mode="pooling_mode_mean_tokens")
    with pytest.raises(ValueError, match="pools MEAN; minivllm pools the last token"):
        make_llm(mean, device)
    # Generating from the Qwen3-Embedding layout: its config says untied, and it has no head.
    with pytest.raises(ValueError, match="lm_head.weight"):
        make_llm(write_embedding_layout(hf_model, tok, tmp_path / "st"), device,
                 runner="generate")


@pytest.mark.parametrize("kwargs", [dict(dimensions=0), dict(dimensions=-3), dict(dimensions=1.5),
                                    dict(dimensions="8"), dict(dimensions=True),
                                    dict(normalize="yes"), dict(normalize=1),
                                    dict(use_activation=0),
                                    dict(normalize=True, use_activation=False),
                                    dict(truncate_prompt_tokens=0),
                                    dict(truncate_prompt_tokens=-2),
                                    dict(truncate_prompt_tokens=2.0)])
def test_bad_pooling_params(kwargs):
    with pytest.raises(ValueError, match="PoolingParams: "):
        PoolingParams(**kwargs)


def test_pooling_params_take_numpy_integers():
    import numpy as np

    p = PoolingParams(dimensions=np.int64(8), truncate_prompt_tokens=torch.tensor(4))
    assert p.dimensions == 8 and type(p.dimensions) is int and p.truncate_prompt_tokens == 4


@pytest.fixture(scope="module")
def shared_pool(embed_dir):
    return pooling_llm(embed_dir, torch.device("cpu"), max_model_len=128)


@pytest.mark.parametrize("call, error, exc", [
    (lambda llm, ok: llm.embed([ok, {"prompt_token_ids": []}]), "empty", ValueError),
    (lambda llm, ok: llm.embed([ok, ""]), "empty", ValueError),
    (lambda llm, ok: llm.embed([]), "no prompts", ValueError),
    (lambda llm, ok: llm.embed(None), "prompts is None", ValueError),
    (lambda llm, ok: llm.embed([ok, 7]), "a prompt is a string", ValueError),
    (lambda llm, ok: llm.embed([ok, {"prompt_token_ids": [1, 10_000]}]), "outside the vocabulary",
     ValueError),
    (lambda llm, ok: llm.embed([ok, {"prompt_token_ids": [1] * 129}]),
     "more than max_model_len=128", ValueError),
    (lambda llm, ok: llm.embed([ok], PoolingParams(dimensions=65)),
     "dimensions=65 exceeds the model's hidden_size", ValueError),
    (lambda llm, ok: llm.embed([ok, ok], [PoolingParams()]), "2 prompts but 1 pooling params",
     ValueError),
    (lambda llm, ok: llm.embed([ok], {"dimensions": 8}), "pooling_params must be a PoolingParams",
     TypeError),
    (lambda llm, ok: llm.embed([ok, ok], [PoolingParams(), SamplingParams()]),
     "pooling params must be a PoolingParams", TypeError),
    (lambda llm, ok: llm.embed([ok], truncate_prompt_tokens=0), "truncate_prompt_tokens",
     ValueError),
    (lambda llm, ok: llm.embed([ok], truncate_prompt_tokens=129),
     "truncate_prompt_tokens=129 exceeds max_model_len=128", ValueError),
])
def test_bad_input_is_refused_before_any_work(shared_pool, call, error, exc):
    """Every request is checked before any is queued: a bad one among good ones queues none and
    runs no step; the LLM goes on embedding."""
    llm, ok = shared_pool, {"prompt_token_ids": [1, 2, 3]}
    steps = llm.stats.steps
    with pytest.raises(exc, match=error):
        call(llm, ok)
    assert llm.stats.steps == steps and not llm.engine.requests
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.embed([ok], use_tqdm=False)
    assert out.outputs.hidden_size == 64


def test_a_prompt_that_can_never_fit_the_cache(embed_dir, device):
    llm = pooling_llm(embed_dir, device, num_kv_blocks=2, max_model_len=64)
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        llm.embed([{"prompt_token_ids": [1] * 33}], use_tqdm=False)
    (out,) = llm.embed([{"prompt_token_ids": [1] * 32}], use_tqdm=False)
    assert out.outputs.hidden_size == 64


# -- generation and embeddings in one engine ------------------------------------------------------


def drive(engine) -> dict:
    """Step the engine until nothing is left to read; the finished outputs by request id (each
    request's finished output once)."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            # An embedding has no partial output (as vLLM): only its finished one comes.
            assert out.finished or not isinstance(out, EmbeddingRequestOutput)
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_generation_and_embeddings_share_steps_and_the_cache(causal_dir, hf_model, tok, device,
                                                             async_scheduling):
    """The engine under a generating LLM takes embedding requests too (LLM.embed is vLLM's
    pooling-only API; the engine is not): mixed in the same steps, sharing prompt prefixes
    through the prefix cache, neither kind changes the other's results, and a generation run
    alone afterwards gives the same tokens (no K/V was overwritten)."""
    g = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, len(tok), (40,), generator=g).tolist()
    gen_prompts = [prefix + [7, 8], torch.randint(0, len(tok), (25,), generator=g).tolist(),
                   prefix[:33]]
    emb_prompts = [prefix + [9], prefix[:20],
                   torch.randint(0, len(tok), (70,), generator=g).tolist(), gen_prompts[1] + [3]]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(causal_dir, device, runner="generate", max_num_batched_tokens=24,
                   async_scheduling=async_scheduling)
    engine = llm.engine
    # Interleaved arrivals: an embedding first (its prefix blocks cached for the generations),
    # then the rest mixed.
    first = engine.add_pooling_requests(token_prompts(emb_prompts[:1]), [PoolingParams()])
    early = [out for _ in range(2) for out in engine.step()]
    gen_ids = engine.add_requests(token_prompts(gen_prompts), [greedy] * len(gen_prompts))
    emb_ids = first + engine.add_pooling_requests(
        token_prompts(emb_prompts[1:]), [PoolingParams(), PoolingParams(dimensions=16),
                                         PoolingParams(normalize=False)])
    done = drive(engine)
    done.update((out.request_id, out) for out in early if out.finished)
    assert set(done) == set(gen_ids) | set(emb_ids)
    assert engine.stats.max_step_seqs > 1 and engine.stats.prompt_tokens_cached > 0
    want_gen = [hf_greedy(hf_model, p, 6) for p in gen_prompts]
    assert [done[i].outputs[0].token_ids for i in gen_ids] == want_gen
    for i, p, params in zip(emb_ids, emb_prompts, [PoolingParams(), PoolingParams(),
                                                    PoolingParams(dimensions=16),
                                                    PoolingParams(normalize=False)]):
        assert isinstance(done[i], EmbeddingRequestOutput)
        torch.testing.assert_close(vec(done[i]), hf_embedding(hf_model, p, params.dimensions,
                                                              params.normalizes(True)), **TOL)
    assert done[gen_ids[0]].num_cached_tokens == 32  # two blocks of the first embedding's prompt
    assert not engine.requests and engine.block_manager.num_free == engine.num_blocks
    # The cache afterwards: generation alone, through the blocks both kinds left cached.
    again = llm.generate(token_prompts(gen_prompts), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want_gen
    assert all(o.num_cached_tokens > 0 for o in again)


def test_decodes_preempt_an_embedding_prompt_which_is_prefilled_again(causal_dir, hf_model, tok,
                                                                     device):
    """Generations that grow into a small cache preempt the newest sequence, an embedding's
    prompt half prefilled: it waits, is prefilled again, and pools transformers' vector."""
    g = torch.Generator().manual_seed(2)
    gen_prompts = [torch.randint(0, len(tok), (20,), generator=g).tolist() for _ in range(2)]
    emb_prompts = [torch.randint(0, len(tok), (70,), generator=g).tolist() for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = make_llm(causal_dir, device, runner="generate", num_kv_blocks=8,
                   max_num_batched_tokens=32)
    engine = llm.engine
    gen_ids = engine.add_requests(token_prompts(gen_prompts), [greedy] * 2)
    emb_ids = engine.add_pooling_requests(token_prompts(emb_prompts), [PoolingParams()] * 2)
    emb_seqs = [engine.requests[i].seqs[0] for i in emb_ids]
    done = drive(engine)
    assert engine.stats.preemptions > 0 and any(s.num_preemptions for s in emb_seqs)
    assert [done[i].outputs[0].token_ids for i in gen_ids] == \
        [hf_greedy(hf_model, p, 40) for p in gen_prompts]
    for i, p in zip(emb_ids, emb_prompts):
        torch.testing.assert_close(vec(done[i]), hf_embedding(hf_model, p), **TOL)
    assert engine.block_manager.num_free == engine.num_blocks


def test_a_step_samples_scores_and_pools_together(causal_dir, hf_model, prompts, device):
    """The runner on its own: one step that samples a sequence (with logprobs), scores its prompt
    (prompt_logprobs) and pools another's last token returns each, in its place."""
    from minivllm.functional.sampling import SamplingRow
    from minivllm.runtime.runner import PromptScores, StepInput

    llm = make_llm(causal_dir, device, runner="generate")
    a, b = prompts[3], prompts[4]  # 16 and 17 tokens
    step = StepInput(chunks=[minivllm.SeqChunk(a, 0, [0]), minivllm.SeqChunk(b, 0, [1, 2], False)],
                     rows=[SamplingRow(temperature=0.0, logprobs=2)],
                     scored=PromptScores(rows=(0, 1, 2), targets=tuple(a[1:4]), n=1),
                     pooled=(len(a) + len(b) - 1,))
    result = llm.engine.runner.execute(step)
    with torch.no_grad():
        logp = torch.log_softmax(hf_model(torch.tensor([a])).logits[0].float(), -1)
    assert result.token_ids == [int(logp[-1].argmax())]
    assert abs(result.logprobs[0].logprob - float(logp[-1].max())) < 1e-4
    for k, score in enumerate(result.scores):
        assert abs(score.logprob - float(logp[k, a[k + 1]])) < 1e-4
    assert result.pooled.shape == (1, 64) and result.pooled.dtype == torch.float32
    torch.testing.assert_close(result.pooled[0].cpu(), hf_hidden(hf_model, b), **TOL)


def test_an_embedding_survives_an_abort_in_its_step(causal_dir, hf_model, tok, device):
    """A generation aborted while the step that pools an embedding's last token runs (the engine
    then drops the aborted sequence's row from the step's results): the embedding is kept."""
    g = torch.Generator().manual_seed(4)
    gp, ep = [torch.randint(0, len(tok), (n,), generator=g).tolist() for n in (5, 30)]
    llm = make_llm(causal_dir, device, runner="generate", max_num_batched_tokens=32,
                   async_scheduling=True)
    engine = llm.engine
    (gen,) = engine.add_requests(token_prompts([gp]), [SamplingParams(max_tokens=20, logprobs=1)])
    (emb,) = engine.add_pooling_requests(token_prompts([ep]), [PoolingParams()])
    assert engine.step() == []  # launches both prompts' first tokens: 5 + 27
    engine.step()  # launches the generation's decode and the embedding's last 3 tokens
    engine.abort_request(gen)
    done = drive(engine)
    assert list(done) == [emb]
    torch.testing.assert_close(vec(done[emb]), hf_embedding(hf_model, ep), **TOL)


def test_an_aborted_embedding_frees_its_blocks(embed_dir, prompts, device):
    llm = pooling_llm(embed_dir, device, max_num_batched_tokens=16)
    engine = llm.engine
    (rid,) = engine.add_pooling_requests(token_prompts(prompts[-1:]), [PoolingParams()])
    engine.step()  # one chunk of 100 tokens
    engine.abort_request(rid)
    assert drive(engine) == {}
    assert not engine.requests and engine.block_manager.num_free == engine.num_blocks
    (out,) = llm.embed(token_prompts(prompts[-1:]), use_tqdm=False)
    assert out.outputs.hidden_size == 64


def test_tensor_parallel_embeddings(embed_dir, hf_model, prompts):
    """LLM(runner="pooling", tensor_parallel_size=2) on CPU (gloo): the spawned rank computes its
    shard of every step, rank 0's hidden states are pooled, and they are transformers'."""
    with LLM(embed_dir, runner="pooling", tensor_parallel_size=2, device="cpu", num_kv_blocks=64,
             attention_backend="reference", max_num_batched_tokens=16) as llm:
        outs = llm.embed(token_prompts(prompts[1:4] + prompts[-1:]), PoolingParams(dimensions=32),
                         use_tqdm=False)
    for p, out in zip(prompts[1:4] + prompts[-1:], outs):
        torch.testing.assert_close(vec(out), hf_embedding(hf_model, p, 32), **TOL)


# -- /v1/embeddings (a pooling LLM's server) ---------------------------------------------------


def test_the_server_answers_embeddings_as_openai(embed_dir, hf_model, prompts, device, tok):
    """OpenAI's /v1/embeddings over the LLM's embed: token and text inputs, dimensions, float and
    base64 (float32 little-endian) vectors, usage; a pooling server serves no completions, and a
    generating one no embeddings (vLLM's routes)."""
    import base64
    import struct
    import threading

    from minivllm.runtime.server import OpenAIServer
    from test_server import post

    srv = OpenAIServer(pooling_llm(embed_dir, device), port=0, model_name="emb")
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        status, body = post(srv, "/v1/embeddings", {"model": "emb", "input": prompts[:3],
                                                    "dimensions": 16})
        assert status == 200 and body["object"] == "list" and body["model"] == "emb"
        assert [d["index"] for d in body["data"]] == [0, 1, 2]
        for d, p in zip(body["data"], prompts[:3]):
            assert d["object"] == "embedding"
            torch.testing.assert_close(torch.tensor(d["embedding"]),
                                       hf_embedding(hf_model, p, dimensions=16),
                                       atol=1e-5, rtol=1e-4)
        assert body["usage"] == {"prompt_tokens": sum(map(len, prompts[:3])),
                                 "total_tokens": sum(map(len, prompts[:3]))}
        _, b64 = post(srv, "/v1/embeddings", {"input": "Hello", "encoding_format": "base64"})
        raw = base64.b64decode(b64["data"][0]["embedding"])
        got = torch.tensor(struct.unpack(f"<{len(raw) // 4}f", raw))
        torch.testing.assert_close(got, hf_embedding(hf_model, tok.encode("Hello")),
                                   atol=1e-5, rtol=1e-4)
        _, raw = post(srv, "/v1/embeddings", {"input": prompts[:1], "use_activation": False})
        torch.testing.assert_close(torch.tensor(raw["data"][0]["embedding"]),
                                   hf_embedding(hf_model, prompts[0], normalize=False),
                                   atol=1e-5, rtol=1e-4)  # vLLM's newer name for normalize
        for bad, match in (({"input": []}, "'input' must be"), ({"input": "x", "dimensions": 0},
                                                                  "dimensions"),
                           ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
                           ({"input": "x", "stream": True}, "unknown fields")):
            status, err = post(srv, "/v1/embeddings", bad)
            assert status == 400 and match in err["error"]["message"], err
        status, err = post(srv, "/v1/completions", {"prompt": "x"})
        assert status == 404 and "no route" in err["error"]["message"]
    finally:
        srv.shutdown()
        thread.join(timeout=10)


# -- what the audit found (dbg/s52/embed_audit/report.md) --------------------------------------


def test_a_sentence_transformers_module_minivllm_does_not_apply_is_refused(hf_model, tok, tmp_path):
    """A Dense projection after the pooling (a fine-tune's) changes the embedding: refused by
    name rather than ignored."""
    from minivllm.runtime.pooling import sentence_transformers_pooling

    path = write_embedding_layout(hf_model, tok, tmp_path / "model")
    with open(os.path.join(path, "modules.json")) as f:
        modules = json.load(f)
    assert sentence_transformers_pooling(path) == {"pooling": "LAST", "normalize": True}
    modules.insert(2, {"idx": 9, "name": "2", "path": "2_Dense",
                       "type": "sentence_transformers.models.Dense"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    with pytest.raises(ValueError, match="Dense"):
        sentence_transformers_pooling(path)


def test_an_empty_text_is_what_the_tokenizer_makes_of_it(embed_dir, hf_model, device):
    """Text is tokenized before it is judged empty (Qwen3-Embedding's tokenizer appends its EOS,
    so "" is one token): only an empty list of ids is refused."""
    llm = pooling_llm(embed_dir, device)
    tok = llm.get_tokenizer()
    assert tok.encode("") == []  # the demo tokenizer's: refused
    with pytest.raises(ValueError, match="empty"):
        llm.embed([""], use_tqdm=False)
    # A tokenizer that makes "" one token: the demo tokenizer with an EOS appended.
    real = tok.encode
    tok.encode = lambda text, **kw: real(text, **kw) + [tok.eos_token_id]
    try:
        out = llm.embed([""], use_tqdm=False)[0]
        assert out.prompt_token_ids == [tok.eos_token_id]
        torch.testing.assert_close(vec(out), hf_embedding(hf_model, [tok.eos_token_id]),
                                   atol=1e-5, rtol=1e-4)
    finally:
        tok.encode = real
