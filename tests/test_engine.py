"""The engine end to end on tiny checkpoints, against independent references: transformers'
greedy decoding, minivllm.generate, and the engine itself under other batchings (prefix-cache
hits, preemption, chunked prefill and batch composition must not change any output)."""

from __future__ import annotations

import itertools
import json
import os
import shutil

import pytest
import torch

import minivllm
from minivllm import LLM, SamplingParams
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import cpu_reference, make_llm
from hf_tiny import make_hf_model, save_checkpoint

MAX_TOKENS = 12
LENGTHS = (1, 3, 7, 16, 17, 31, 40, 5)


@pytest.fixture(scope="module")
def hf_model():
    # std 0.3: next-token margins well above rounding, so that paths which compute the same
    # logits differently (prefix hits, chunks, preemption, the GPU) pick the same greedy tokens
    return make_hf_model(seed=0, std=0.3)


@pytest.fixture(scope="module")
def tiny_dir(hf_model, tmp_path_factory):
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 101, (n,), generator=g).tolist() for n in LENGTHS]


def hf_greedy(model, prompt, n):
    """Greedy decoding by transformers, recomputing the whole sequence every step."""
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            tok = int(logits.argmax())
            out.append(tok)
            logprobs.append(torch.log_softmax(logits, -1))
            ids.append(tok)
    return out, logprobs


@pytest.fixture(scope="module")
def reference(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_TOKENS)[0] for p in prompts]


def token_prompts(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(token_prompts(prompts), params, use_tqdm=False)]


def test_greedy_matches_generate_and_transformers(tiny_dir, device, prompts, reference):
    params = minivllm.load(tiny_dir, device=device)
    cache = minivllm.init_cache(params, num_blocks=64, block_size=16)
    functional, _ = minivllm.generate(params, cache, prompts, max_new_tokens=MAX_TOKENS,
                                      backend=cpu_reference(device))
    assert functional == reference
    llm = make_llm(tiny_dir, device, enforce_eager=False)  # on CUDA: compiled, graphs captured
    outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert llm.stats.generation_tokens == MAX_TOKENS * len(prompts)
    assert llm.stats.prompt_tokens_computed == sum(LENGTHS)


def test_prefix_cache_hit_same_outputs_fewer_prefill_tokens(tiny_dir, device, hf_model):
    shared = list(range(3, 43))  # 40 tokens: two full blocks of 16 can be shared
    prompts = [shared + [50 + i, 60 + i, 70 + i] for i in range(4)]
    want = [hf_greedy(hf_model, p, MAX_TOKENS)[0] for p in prompts]

    cold = make_llm(tiny_dir, device, enable_prefix_caching=False)
    assert run(cold, prompts) == want
    assert cold.stats.prompt_tokens_computed == 4 * 43

    warm = make_llm(tiny_dir, device)
    assert run(warm, prompts[:1]) == want[:1]
    assert warm.stats.prompt_tokens_computed == 43
    outs = warm.generate(token_prompts(prompts[1:]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want[1:]
    assert [o.num_cached_tokens for o in outs] == [32, 32, 32]
    assert warm.stats.prompt_tokens_computed == 43 + 3 * (43 - 32)
    assert warm.stats.prompt_tokens_cached == 3 * 32

    # Admitted in the same step, two prompts with one prefix share it.
    same = make_llm(tiny_dir, device)
    assert run(same, prompts[:2]) == want[:2]
    assert same.stats.prompt_tokens_computed == 43 + (43 - 32)

    # A prompt entirely cached (32 tokens: two full blocks) still computes its last block.
    again = make_llm(tiny_dir, device)
    full = shared[:32]
    first = run(again, [full])
    computed = again.stats.prompt_tokens_computed
    assert run(again, [full]) == first == [hf_greedy(hf_model, full, MAX_TOKENS)[0]]
    assert again.stats.prompt_tokens_computed - computed == 16


def test_preemption_gives_identical_outputs(tiny_dir, device, prompts, reference):
    # 14 blocks of 4 tokens: the longest request alone needs 13, so the 8 must take turns.
    small = make_llm(tiny_dir, device, num_kv_blocks=14, block_size=4)
    assert run(small, prompts) == reference
    assert small.stats.preemptions > 0
    assert small.stats.tokens_recomputed > 0
    # Seeded sampling continues the same random stream after a recompute.
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True)
    big = make_llm(tiny_dir, device, num_kv_blocks=200)
    small = make_llm(tiny_dir, device, num_kv_blocks=14, block_size=4)
    assert run(small, prompts, sampled) == run(big, prompts, sampled)
    assert small.stats.preemptions > 0


def test_chunked_prefill_gives_identical_outputs(tiny_dir, device, prompts, reference):
    llm = make_llm(tiny_dir, device, max_num_batched_tokens=5)
    steps = []
    launch = llm.engine.runner.launch
    llm.engine.runner.launch = lambda step: steps.append(step) or launch(step)
    assert run(llm, prompts) == reference
    assert max(sum(len(c.token_ids) for c in s.chunks) for s in steps) <= 5
    # Some step decodes one sequence and prefills a chunk of another that is not done yet.
    assert any(any(len(c.token_ids) == 1 and c.num_cached > 0 and c.want_logits for c in s.chunks)
               and any(len(c.token_ids) > 1 and not c.want_logits for c in s.chunks) for s in steps)


def test_triton_backend_gives_identical_outputs(tiny_dir, device, prompts, reference):
    from minivllm.kernels import available_backends

    if "triton" not in available_backends(device):
        pytest.skip("no Triton on this device")
    # Chunked prefill, prefix-cache hits and decode through the paged Triton kernels.
    llm = make_llm(tiny_dir, device, num_kv_blocks=32, block_size=8, max_num_batched_tokens=24,
                   attention_backend="triton")
    shared = prompts[6][:20]
    picked = [prompts[4], shared + [1, 2], shared + [3]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    want = run(make_llm(tiny_dir, device), picked, params)
    assert run(llm, picked, params) == want
    assert llm.stats.prompt_tokens_cached == 16


def test_persistent_decode_gives_identical_outputs(tiny_dir, device, prompts, reference):
    """persistent_decode: decode steps of 1-2 sequences run each layer as one persistent kernel
    (kernels/decode_layer.py; phase by phase under the CPU interpreter). Greedy outputs equal
    the default engine's, for one and two sequences and for three (whose steps of three rows
    take the usual layer until one finishes)."""
    from minivllm.kernels import available_backends

    if "triton" not in available_backends(device):
        pytest.skip("no Triton on this device")
    llm = make_llm(tiny_dir, device, num_kv_blocks=32, block_size=8, attention_backend="triton",
                   persistent_decode=True)
    base = make_llm(tiny_dir, device, persistent_decode=False)
    for picked, params in (([prompts[4]], GREEDY),
                           ([prompts[1], prompts[5]], GREEDY),
                           (prompts[:3], [SamplingParams(temperature=0.0, max_tokens=n,
                                                         ignore_eos=True) for n in (3, 6, 9)])):
        assert run(llm, picked, params) == run(base, picked, params)


def test_persistent_decode_is_refused_where_it_cannot_run(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(tiny_dir, device="cpu", tensor_parallel_size=2, persistent_decode=True)


def test_persistent_decode_is_on_by_default_only_where_it_runs(tiny_dir, monkeypatch):
    from minivllm.kernels import backends
    from minivllm.kernels.launch import triton_usable
    from minivllm.runtime.config import EngineConfig, persistent_decode_default

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def default(*args, hidden_size=1024):  # Qwen3-0.6B's width unless given
        return persistent_decode_default(*args, hidden_size=hidden_size)

    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    # What a GPU without flash-attn-4 offers (this test runs on any machine).
    monkeypatch.setattr(backends, "available_backends", lambda device: ["triton", "reference"])
    assert default(cuda, 1, None, True, 128)
    assert default(cuda, 1, "triton", True, 128)
    assert not default(cuda, 2, None, True, 128)  # one rank only
    assert not default(cuda, 1, "reference", True, 128)  # another backend asked for
    assert not default(cuda, 1, None, False, 128)  # no Triton
    assert not default(cpu, 1, None, True, 128)  # the interpreter: slow, explicit
    assert not default(cuda, 1, None, True, 8)  # tl.dot needs head_dim >= 16
    assert not default(cuda, 1, None, True, 512)  # shared memory overflows
    # Measured slower from Qwen3-1.7B's width on (session 56: 212 tok/s against 496).
    assert not default(cuda, 1, None, True, 128, hidden_size=2048)
    # The backend the engine will run, however it is chosen: the environment's choice, and
    # flash-attn-4 when installed (but not for an fp8 cache, which it cannot read).
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    assert not default(cuda, 1, None, True, 128)
    assert default(cuda, 1, "triton", True, 128)
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND")
    monkeypatch.setattr(backends, "available_backends",
                        lambda device: ["flash_attn", "triton", "reference"])
    assert not default(cuda, 1, None, True, 128)
    assert default(cuda, 1, None, True, 128, torch.float8_e4m3fn)
    assert not EngineConfig.create(tiny_dir, device="cpu").persistent_decode
    with pytest.raises(TypeError, match="persistent_decode must be"):
        EngineConfig.create(tiny_dir, device="cpu", persistent_decode="no")
    if triton_usable(cpu):  # under the interpreter (this suite on a CPU-only machine)
        assert EngineConfig.create(tiny_dir, device="cpu", attention_backend="triton",
                                   persistent_decode=True).persistent_decode


def test_async_scheduling_gives_identical_outputs(tiny_dir, device, prompts, reference):
    """Scheduling a step before the previous one's tokens are read changes no output: a mixed
    workload (stop tokens, n > 1, seeds, top-p, logprobs, penalties, a stop by max_model_len)
    under preemption and chunked prefill, against synchronous steps."""
    stop_tok = reference[1][3]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=1.0, seed=7, max_tokens=9, ignore_eos=True, n=2),
              SamplingParams(temperature=0.8, top_p=0.8, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.2, seed=1,
                             max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=11, min_tokens=3, max_tokens=MAX_TOKENS)]

    def outputs(**kw):
        llm = make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_num_batched_tokens=12,
                       max_model_len=48, **kw)
        assert llm.engine.async_scheduling == kw["async_scheduling"]
        outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
        assert llm.engine.block_manager.num_free == llm.engine.num_blocks
        return llm.stats, [[(c.token_ids, c.finish_reason, c.stop_reason,
                             [{i: (round(l.logprob, 3), l.rank) for i, l in e.items()} for e in c.logprobs]
                             if c.logprobs is not None else None) for c in o.outputs] for o in outs]

    sync_stats, sync = outputs(async_scheduling=False)
    async_stats, got = outputs(async_scheduling=True)
    assert got == sync
    assert sync[1][0][0][-1] == stop_tok and sync[1][0][1] == "stop"
    assert sync[6][0][1] == "length" and len(prompts[6]) + len(sync[6][0][0]) == 48
    assert async_stats.preemptions > 0 and async_stats.generation_tokens == sync_stats.generation_tokens


def test_seeded_sampling_is_independent_of_batch_composition(tiny_dir, device, prompts):
    target = SamplingParams(temperature=1.0, top_k=40, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
    others = [SamplingParams(temperature=0.0, max_tokens=3),
              SamplingParams(temperature=0.7, presence_penalty=1.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.3, top_p=0.5, min_p=0.1, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, logprobs=2)]
    alone = run(make_llm(tiny_dir, device), [prompts[5]], target)[0]
    llm = make_llm(tiny_dir, device, max_num_batched_tokens=24)
    mixed = llm.generate(token_prompts(prompts[:4] + [prompts[5]]), others + [target], use_tqdm=False)
    assert mixed[-1].outputs[0].token_ids == alone
    reordered = make_llm(tiny_dir, device, max_num_seqs=2).generate(
        token_prompts([prompts[5]] + prompts[:4]), [target] + others, use_tqdm=False)
    assert reordered[0].outputs[0].token_ids == alone
    # A different seed gives a different sample (otherwise the seed would not matter).
    other_seed = SamplingParams(temperature=1.0, top_k=40, seed=99, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(make_llm(tiny_dir, device), [prompts[5]], other_seed)[0] != alone


def test_unseeded_requests_follow_the_engine_seed(tiny_dir, device, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a = run(make_llm(tiny_dir, device, seed=3), prompts[:3], params)
    assert a == run(make_llm(tiny_dir, device, seed=3), prompts[:3], params)
    assert a != run(make_llm(tiny_dir, device, seed=4), prompts[:3], params)


def test_top_k_1_equals_greedy(tiny_dir, device, prompts, reference):
    params = SamplingParams(temperature=1.5, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(make_llm(tiny_dir, device), prompts, params) == reference


def test_n_completions(tiny_dir, device, prompts, reference):
    llm = make_llm(tiny_dir, device)
    outs = llm.generate(token_prompts(prompts[:2]), SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True), use_tqdm=False)
    for out, want in zip(outs, reference[:2]):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in out.outputs)
    sampled = llm.generate(token_prompts(prompts[3:4]), SamplingParams(n=3, temperature=1.0, seed=0,
                                                                        max_tokens=MAX_TOKENS), use_tqdm=False)
    texts = [tuple(c.token_ids) for c in sampled[0].outputs]
    assert len(set(texts)) == 3


def test_logprobs_match_transformers(tiny_dir, device, hf_model, prompts):
    llm = make_llm(tiny_dir, device)
    out = llm.generate(token_prompts(prompts[2:3]), SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    c = out.outputs[0]
    want_ids, want_lps = hf_greedy(hf_model, prompts[2], 6)
    assert c.token_ids == want_ids
    assert len(c.logprobs) == 6
    total = 0.0
    for tok, entry, ref in zip(c.token_ids, c.logprobs, want_lps):
        top = ref.topk(3)
        assert set(entry) == set(top.indices.tolist())  # greedy: the sampled token is the top one
        for i, lp in entry.items():
            assert lp.logprob == pytest.approx(ref[i].item(), abs=1e-4)
            assert lp.rank == int((ref > ref[i]).sum()) + 1
        assert entry[tok].rank == 1
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_stop_on_eos_and_stop_token_ids(tiny_dir, device, hf_model, prompts, reference, tmp_path):
    out_ref = reference[6]
    eos = out_ref[4]
    first = out_ref.index(eos)
    eos_dir = str(tmp_path / "eos")
    shutil.copytree(tiny_dir, eos_dir)
    cfg_path = os.path.join(eos_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    llm = make_llm(eos_dir, device)
    stop = llm.generate(token_prompts([prompts[6]]), SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)[0].outputs[0]
    assert stop.token_ids == out_ref[:first + 1]
    assert (stop.finish_reason, stop.stop_reason) == ("stop", None)
    ignored = run(llm, [prompts[6]])[0]
    assert ignored == out_ref
    # min_tokens masks EOS out: the output must differ from the reference where EOS was.
    late = llm.generate(token_prompts([prompts[6]]), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                     min_tokens=first + 1),
                        use_tqdm=False)[0].outputs[0]
    assert late.token_ids[:first] == out_ref[:first] and late.token_ids[first] != eos
    assert eos not in late.token_ids[:first + 1]

    tiny = make_llm(tiny_dir, device)
    by_id = tiny.generate(token_prompts([prompts[6]]), SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                       stop_token_ids=[eos]),
                          use_tqdm=False)[0].outputs[0]
    assert by_id.token_ids == out_ref[:first + 1]
    assert (by_id.finish_reason, by_id.stop_reason) == ("stop", eos)


def test_stop_at_max_model_len(tiny_dir, device, prompts, reference):
    llm = make_llm(tiny_dir, device, max_model_len=45)
    out = llm.generate(token_prompts([prompts[6]]), GREEDY, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == reference[6][:45 - 40]
    assert out.finish_reason == "length"


def test_stop_strings_on_detokenized_text(demo_dir, device):
    llm = make_llm(demo_dir, device, num_kv_blocks=32)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = llm.generate("Hello, my name is", base, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert full.text == tok.decode(full.token_ids, skip_special_tokens=True)
    assert len(full.text) > 20
    stop = full.text[12:15]
    at = full.text.index(stop)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
    cut = llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0]
    assert cut.text == full.text[:at]
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)] and len(cut.token_ids) < 40
    # The stop string ends inside the text of the last token generated.
    assert len(tok.decode(cut.token_ids)) >= at + len(stop) > len(tok.decode(cut.token_ids[:-1]))
    kept = llm.generate("Hello, my name is", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                             stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[:at + len(stop)]

    # Streaming gives the same text, never showing the stop string.
    pieces = list(llm.stream(["Hello, my name is"], params))
    assert "".join(c.text for d in pieces for c in d.outputs) == cut.text
    assert sum(len(c.token_ids) for d in pieces for c in d.outputs) == len(cut.token_ids)
    assert pieces[-1].finished and pieces[-1].outputs[-1].finish_reason == "stop"
    assert not llm.engine.has_unfinished_requests()


def test_stream_matches_generate_and_stopping_early_frees_the_cache(tiny_dir, device, prompts, reference):
    llm = make_llm(tiny_dir, device)
    got: dict[str, list[int]] = {}
    for delta in llm.stream(token_prompts(prompts[:3]), GREEDY):
        for c in delta.outputs:
            got.setdefault(delta.request_id, []).extend(c.token_ids)
    assert list(got.values()) == reference[:3]
    free = llm.engine.block_manager.num_free
    stream = llm.stream(token_prompts(prompts), GREEDY)
    next(stream)
    assert llm.engine.block_manager.num_free < free
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free == free
    assert run(llm, prompts) == reference


def _streamed(deltas) -> dict[str, dict[int, list[int]]]:
    got: dict[str, dict[int, list[int]]] = {}
    for delta in deltas:
        for c in delta.outputs:
            got.setdefault(delta.request_id, {}).setdefault(c.index, []).extend(c.token_ids)
    return got


def test_calls_interleaved_each_get_all_of_their_outputs(tiny_dir, device, prompts, reference):
    """A stream paused while generate runs, and two streams read in turn: each call gets its own
    outputs whole, however the engine's steps fell between them (they used to be dropped by
    whichever call's step received them, and the other call then waited forever)."""
    llm = make_llm(tiny_dir, device)
    stream = llm.stream(token_prompts(prompts[:2]), GREEDY)
    first = next(stream)
    assert run(llm, prompts[2:4]) == reference[2:4]  # runs the paused stream's requests too
    got = _streamed([first, *stream])
    assert [got[i][0] for i in sorted(got, key=int)] == reference[:2]

    a, b = llm.stream(token_prompts([prompts[4]]), GREEDY), llm.stream(token_prompts([prompts[5]]), GREEDY)
    deltas_a, deltas_b = [], []
    for x, y in itertools.zip_longest(a, b):
        deltas_a += [x] if x is not None else []
        deltas_b += [y] if y is not None else []
    assert [list(_streamed(deltas_a).values())[0][0],
            list(_streamed(deltas_b).values())[0][0]] == reference[4:6]
    assert deltas_a[-1].finished and deltas_b[-1].finished
    assert not llm.engine.has_unfinished_requests() and not llm._parked and not llm._owned


def test_stream_sends_each_finished_completion_once(tiny_dir, device, prompts):
    llm = make_llm(tiny_dir, device)
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    whole = llm.generate(token_prompts([prompts[0]]), sampled, use_tqdm=False)[0]
    # Completion 1 (the same seed, so the same draws) stops by its third token at the latest.
    short = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True,
                           stop_token_ids=[whole.outputs[1].token_ids[2]])
    deltas = list(llm.stream(token_prompts([prompts[0]]), short))
    ends = [c.index for d in deltas for c in d.outputs if c.finish_reason is not None]
    assert sorted(ends) == [0, 1, 2]  # each completion's finish_reason comes exactly once
    final = llm.generate(token_prompts([prompts[0]]), short, use_tqdm=False)[0]
    got = _streamed(deltas)[deltas[0].request_id]
    assert [got[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert len(final.outputs[1].token_ids) <= 3


def test_a_stop_token_keeps_out_of_the_text(demo_dir, device):
    """As vLLM: the token that stops a completion (EOS, a stop id) is in token_ids but not in
    the text, unless include_stop_str_in_output."""
    llm = make_llm(demo_dir, device, num_kv_blocks=32)
    tok = llm.get_tokenizer()
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate("Hello, my name is", base, use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[5]
    cut_at = full.token_ids.index(stop_id) + 1
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                stop_token_ids=[stop_id], include_stop_str_in_output=include)
        out = llm.generate("Hello, my name is", params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full.token_ids[:cut_at]
        shown = out.token_ids if include else out.token_ids[:-1]
        assert out.text == tok.decode(shown, skip_special_tokens=True)
        streamed = "".join(c.text for d in llm.stream("Hello, my name is", params) for c in d.outputs)
        assert streamed == out.text


def test_chat_uses_the_chat_template(demo_dir, device):
    llm = make_llm(demo_dir, device, num_kv_blocks=32)
    messages = [{"role": "user", "content": "hi there"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    want = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == want
    assert out.prompt_token_ids == llm.get_tokenizer().encode(want, add_special_tokens=False)
    same = llm.generate({"prompt_token_ids": out.prompt_token_ids},
                        SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    two = llm.chat([messages, messages + [{"role": "assistant", "content": "x"}]], use_tqdm=False)
    assert len(two) == 2


def test_chat_continues_the_final_message(demo_dir, device):
    """continue_final_message (vLLM's LLM.chat): the prompt is transformers'
    apply_chat_template(continue_final_message=True), the last message left open; the output
    is only the continuation. With add_generation_prompt, or an empty conversation, refused."""
    from transformers import AutoTokenizer

    llm = make_llm(demo_dir, device, num_kv_blocks=32)
    oracle = AutoTokenizer.from_pretrained(demo_dir)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    convs = [[{"role": "user", "content": "Tell me a story"},
              {"role": "assistant", "content": "Once upon a "}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "Hello, my name is"}],
             [{"role": "user", "content": "The capital of France is"}]]  # any role, as transformers
    outs = llm.chat(convs, params, add_generation_prompt=False, continue_final_message=True,
                    use_tqdm=False)
    for conv, out in zip(convs, outs):
        want = oracle.apply_chat_template(conv, continue_final_message=True, tokenize=False)
        assert want.endswith(conv[-1]["content"]) and not want.endswith("<|im_end|>\n")
        assert out.prompt == want
        assert out.prompt_token_ids == oracle.encode(want, add_special_tokens=False)
        same = llm.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)[0]
        assert same.outputs[0].token_ids == out.outputs[0].token_ids
        assert len(out.outputs[0].token_ids) == 5
        assert not out.outputs[0].text.startswith(conv[-1]["content"])  # only the new text
    # chat_template_kwargs' flags win over the arguments, as vLLM's LLM.chat
    via_kwargs = llm.chat_prompts(convs[0], chat_template_kwargs={
        "add_generation_prompt": False, "continue_final_message": True})
    assert via_kwargs[0]["prompt"] == outs[0].prompt
    assert llm.chat_prompts(convs[0], add_generation_prompt=False)[0]["prompt"].endswith(
        "<|im_end|>\n")  # without the flag the turn is closed
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(convs[0], params, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(convs[0], params, add_generation_prompt=True, continue_final_message=True,
                 use_tqdm=False)
    with pytest.raises(ValueError, match="conversation is empty"):
        llm.chat([[]], params, add_generation_prompt=False, continue_final_message=True,
                 use_tqdm=False)
    with pytest.raises(ValueError, match="non-empty"):
        llm.chat([], params, add_generation_prompt=False, continue_final_message=True,
                 use_tqdm=False)
    assert not llm.engine.requests


def test_dtype_and_parallel_options(tiny_dir, device):
    assert make_llm(tiny_dir, device, dtype=torch.bfloat16).engine.runner.params.dtype == torch.bfloat16
    assert make_llm(tiny_dir, device, dtype="float16").engine.runner.cache.dtype == torch.float16
    assert make_llm(tiny_dir, device, dtype="auto").engine.runner.params.dtype == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        make_llm(tiny_dir, device, dtype="float8")
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        make_llm(tiny_dir, device, tensor_parallel_size=3)  # 4 heads (test_tp_*: TP that works)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_llm(tiny_dir, device, max_model_len=100_000)


def test_progress_bar_reports_throughput(tiny_dir, device, prompts, capsys):
    llm = make_llm(tiny_dir, device)
    llm.generate(token_prompts(prompts[:2]), GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "toks/s" in err and "2/2" in err


def test_step_input_reuses_plain_rows_and_sends_steps(tiny_dir, device, prompts):
    """A sequence's SamplingRow is built once it only changes by its step (past min_tokens, no
    penalty) and reused; StepInput.steps carries each row's step, the tokens generated so far."""
    llm = make_llm(tiny_dir, device)
    engine = llm.engine
    seen = []
    launch = engine.runner.launch

    def record(step):
        seen.append(([(r, r.banned_ids) for r in step.rows], step.steps))
        return launch(step)
    engine.runner.launch = record
    params = [SamplingParams(temperature=1.0, seed=3, min_tokens=3, stop_token_ids=[5], max_tokens=8),
              SamplingParams(temperature=1.0, seed=4, presence_penalty=0.5, max_tokens=8)]
    llm.generate(token_prompts(prompts[:2]), params, use_tqdm=False)
    # rows come in the scheduler's order: find each sequence's row by its seed
    at = [[r.seed for r, _ in rows].index(3) for rows, _ in seen]
    plain = [rows[i] for (rows, _), i in zip(seen, at)]
    assert [steps[i] for (_, steps), i in zip(seen, at)] == list(range(len(seen))) and len(seen) > 4
    assert all(banned == (5,) for _, banned in plain[:3]) and all(b == () for _, b in plain[3:])
    assert all(row is plain[3][0] for row, _ in plain[3:])  # built once, then reused
    assert all(len({id(r) for r, _ in rows}) == len(rows) for rows, _ in seen)
    penalised = [r for rows, _ in seen for r, _ in rows if r.seed == 4]
    assert len({id(r) for r in penalised}) == len(penalised)  # rebuilt each step (its output ids)


def test_feed_back_writes_the_previous_steps_tokens(tiny_dir, device):
    """The runner's device-side feed-back of pending tokens, both ways: the one-copy path (row k
    to input k) and the general gather."""
    from minivllm.runtime.runner import StepInput

    runner = make_llm(tiny_dir, device).engine.runner
    runner.last_tokens = torch.tensor([7, 8, 9], device=runner.device)
    for pairs, want in ((((0, 0), (1, 1), (2, 2)), [7, 8, 9, -1]),
                        (((0, 0), (1, 1)), [7, 8, -1, -1]),
                        (((0, 2), (3, 0)), [9, -1, -1, 7]),
                        (((1, 1), (2, 2)), [-1, 8, 9, -1])):
        ids = torch.full((4,), -1, device=runner.device)
        runner._feed_back(ids, StepInput([], [], pairs))
        assert ids.tolist() == want, pairs


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_decode_graph_path_gives_identical_outputs(tiny_dir, device, prompts, reference, async_scheduling):
    """The runner's CUDA-graph decode path (static buffers filled from pinned staging, padding to
    a bucket, pending tokens fed back into the static input ids) with each "replay" run as the
    eager forward over the static buffers, so that it runs on the CPU too: the same tokens as
    transformers, with and without asynchronous scheduling."""
    from minivllm.runtime.graphs import DecodeGraphs

    llm = make_llm(tiny_dir, device, max_num_seqs=8, async_scheduling=async_scheduling)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.params, runner.cache, runner.backend, max_num_seqs=8,
                          max_blocks_per_seq=-(-llm.config.max_model_len // llm.config.block_size),
                          compile_forward=False)
    replayed = []

    def replay(b):
        bs = graphs.bucket(b)
        replayed.append((b, bs))
        logits, _ = minivllm.forward(graphs.params, graphs.cache, graphs.batch_view(bs), graphs.backend)
        return logits[:b]

    graphs.replay = replay
    runner.graphs = graphs
    assert run(llm, prompts[:7]) == reference[:7]  # 7 rows: padded to the bucket of 8
    assert any(b < bs for b, bs in replayed) and len(replayed) >= MAX_TOKENS - 1


def test_released_graphs_leave_an_engine_that_runs_eagerly(tiny_dir, device, prompts, reference):
    """release_graphs (what a tensor-parallel rank does before it leaves its process group)
    drops the graphs, and the same engine then runs every step eagerly, with the same tokens."""
    from minivllm.runtime.graphs import DecodeGraphs

    llm = make_llm(tiny_dir, device, max_num_seqs=8)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.params, runner.cache, runner.backend, max_num_seqs=8,
                          max_blocks_per_seq=-(-llm.config.max_model_len // llm.config.block_size),
                          compile_forward=False)
    resets = []

    class Captured:  # a stand-in: the CPU captures nothing
        def reset(self):
            resets.append(True)

    graphs.graphs[2], graphs.outputs[2] = Captured(), torch.zeros(2, 1)
    runner.graphs = graphs
    runner.release_graphs()
    assert resets == [True] and runner.graphs is None and not graphs.graphs and not graphs.outputs
    assert run(llm, prompts[:3]) == reference[:3]
