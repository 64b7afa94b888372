"""N-gram speculative decoding (runtime/spec_decode.py): outputs identical, token for token, to
the engine without speculation (greedy and seeded sampling, n > 1, stop strings and ids, lengths,
logprobs), with drafts actually accepted; the lookup against a brute-force reference; preemption
under speculation; bad configs refused."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import given, settings, strategies as st

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model
from minivllm.runtime.prefill_graph import PrefillGraph
from minivllm.runtime.spec_decode import SpeculativeConfig, ngram_propose
from minivllm.state.batch import SeqChunk, batch_arrays, is_decode_step

from engine_helpers import make_llm, stand_in_verify_graphs, ungraphed_verifications
from hf_tiny import make_hf_model, save_checkpoint


def spec(k, hi, lo):
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": hi,
            "prompt_lookup_min": lo}


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "model"))


@pytest.fixture(scope="module")
def base(demo_dir, device):
    """The engine without speculation (asynchronous scheduling, its default)."""
    return make_llm(demo_dir, device)


# Prompts that repeat text, so that lookups hit; a random-weights model also loops on its own.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "To be, or not to be, that is the question. To be, or not to be,",
    "It was the best of times, it was the worst of times. It was the",
    "Hello, my name is Ada.",
    {"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]},
]


def cases(base):
    """SamplingParams to compare, some built from the base engine's own output (a stop string
    and a stop id that occur in it)."""
    greedy = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    text = greedy[0].outputs[0].text
    ids = greedy[1].outputs[0].token_ids
    stop_str = text[len(text) // 2:len(text) // 2 + 3]
    sampled = dict(temperature=0.8, top_k=40, top_p=0.9, seed=7)
    return [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0, max_tokens=3),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=90, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_str]),
        SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[len(ids) // 2]]),
        SamplingParams(temperature=0, max_tokens=30, logprobs=3),
        SamplingParams(**sampled, max_tokens=50, n=2),
        SamplingParams(**sampled, max_tokens=30, n=2, logprobs=2, stop=[stop_str]),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60, ignore_eos=True),
        SamplingParams(temperature=0.5, min_p=0.1, seed=11, max_tokens=40,
                       stop_token_ids=[ids[len(ids) // 3]]),
        # min_tokens pending: no drafts until it is out; penalties: never drafts
        SamplingParams(temperature=0, max_tokens=40, min_tokens=10),
        SamplingParams(temperature=0.7, seed=5, max_tokens=30, presence_penalty=0.5),
    ]


def assert_same(expected, got):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert len(e.outputs) == len(g.outputs)
        for a, b in zip(e.outputs, g.outputs):
            assert a.token_ids == b.token_ids
            assert a.text == b.text
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            if a.logprobs is not None:
                assert len(a.logprobs) == len(b.logprobs)
                for x, y in zip(a.logprobs, b.logprobs):
                    assert list(x) == list(y)  # the same ids, in the same order
                    for i in x:
                        assert x[i].rank == y[i].rank
                        assert x[i].decoded_token == y[i].decoded_token
                        assert x[i].logprob == pytest.approx(y[i].logprob, abs=1e-4)
                assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-3)


@pytest.mark.parametrize("config", [spec(1, 1, 1), spec(2, 3, 1), spec(3, 2, 2), spec(4, 4, 2),
                                    spec(5, 5, 1), spec(5, 3, 3)])
def test_outputs_identical_to_no_speculation(base, demo_dir, device, config):
    llm = make_llm(demo_dir, device, speculative_config=config)
    assert not llm.engine.async_scheduling
    for params in cases(base):
        # All prompts in one batch, and one at a time (other batch compositions)
        assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                    llm.generate(PROMPTS, params, use_tqdm=False))
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=25, n=2)
    for prompt in PROMPTS[:2]:
        assert_same(base.generate([prompt], params, use_tqdm=False),
                    llm.generate([prompt], params, use_tqdm=False))
    s = llm.stats
    assert s.spec_draft_tokens > 0 and 0 < s.spec_accepted_tokens <= s.spec_draft_tokens
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


@pytest.mark.parametrize("config", [spec(1, 1, 1), spec(4, 3, 1)])
def test_verification_graphs_give_identical_outputs(base, demo_dir, device, config):
    """Verification steps through the runner's verification graphs (stand_in_verify_graphs: the
    runner's own choice of graph, padded fill and logits rows; each replay run by the eager
    forward over the graph's buffers, as a CUDA graph would run them): every step with drafts
    takes one, and the outputs are the engine's without speculation."""
    llm = make_llm(demo_dir, device, speculative_config=config, max_num_seqs=8)
    replays = []
    stand_in_verify_graphs(llm.engine.runner, replays)
    ungraphed = ungraphed_verifications(llm.engine.runner)
    for params in cases(base)[::3]:
        assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                    llm.generate(PROMPTS, params, use_tqdm=False))
    # Steps of 1, 2 and 4 sequences whatever the sampled cases' lengths (drawn tokens decide
    # when their sequences stop): that many greedy sequences that never stop early.
    for n in (1, 2, 4):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert_same(base.generate(PROMPTS[:n], params, use_tqdm=False),
                    llm.generate(PROMPTS[:n], params, use_tqdm=False))
    assert llm.stats.spec_draft_tokens > 0 and llm.stats.spec_accepted_tokens > 0
    assert not ungraphed
    # graphs of every size up to 8 sequences took steps, some of several logits rows a sequence
    k = config["num_speculative_tokens"]
    assert {t for t, _, _ in replays} == {b * (k + 1) for b in (1, 2, 4, 8)}, replays
    assert any(n > t // (k + 1) for t, n, _ in replays)


def test_more_rows_than_sequences_are_sampled_in_slices(base, demo_dir, device, monkeypatch):
    """At max_num_seqs 2 and k = 4 a verification step samples up to 10 rows: max_num_seqs at a
    time (the memory start-up set aside for sampling) where a row's sampling allocates the
    logits' size (logprobs, top-k/p, penalties), all at once where none does (plain
    temperature: slices would only cost launches), and by their arg-max with no sampling batch
    where every row is plain greedy. Outputs, logprobs included, equal the engine's without
    speculation."""
    from minivllm.runtime import runner as runner_module

    sliced, real = [], runner_module.sample_in_slices

    def recorded(logits, batches, size):  # n: batches, 0 for the arg-max (None)
        sliced.append((logits.shape[0], 0 if batches is None else len(batches), size))
        return real(logits, batches, size)
    monkeypatch.setattr(runner_module, "sample_in_slices", recorded)
    llm = make_llm(demo_dir, device, speculative_config=spec(4, 3, 1), max_num_seqs=2)
    mixed = [SamplingParams(temperature=0, max_tokens=30, logprobs=3 if i % 2 else None)
             for i in range(len(PROMPTS))]  # slices with logprobs and without, joined
    light = [SamplingParams(temperature=t, seed=i, max_tokens=30)
             for i, t in enumerate([0, 0.8] * len(PROMPTS))][:len(PROMPTS)]
    greedy = SamplingParams(temperature=0, max_tokens=30)
    for params, kind in [(p, None) for p in cases(base)] + [
            (mixed, "heavy"), (light, "light"), (greedy, "greedy")]:
        sliced.clear()
        assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                    llm.generate(PROMPTS, params, use_tqdm=False))
        mine = [(rows, n) for rows, n, size in sliced if size == 2 and rows > 2]  # not base's
        if kind is not None:
            assert mine, "no step sampled more rows than max_num_seqs"
            # the mixed case: steps of only greedy rows without logprobs take the arg-max
            assert all(n in (0, 1, -(-rows // 2)) for rows, n in mine), mine
            assert any(n > 1 for _, n in mine) == (kind == "heavy"), mine
            assert all(n == 0 for _, n in mine) == (kind == "greedy"), mine
    assert llm.stats.spec_accepted_tokens > 0


def watch_mid_draft_stops(llm) -> list:
    """Record each sequence that a stop (a token or a stop string) ends at a token after the first
    of a speculative step's (an accepted draft's round): the truncation under test."""
    sched, hits, accepted = llm.engine.scheduler, [], {}
    accept, finish = sched.accept, sched.finish

    def watched_accept(seq, tok):
        accept(seq, tok)
        accepted[seq.seq_id] = seq.num_tokens
        if seq.finished and seq.finish_reason == "stop":
            hits.append(seq.seq_id)

    def watched_finish(seq, reason, stop_reason=None):
        if reason == "stop" and accepted.get(seq.seq_id) == seq.num_tokens:
            hits.append(seq.seq_id)
        finish(seq, reason, stop_reason)
    sched.accept, sched.finish = watched_accept, watched_finish
    return hits


def test_stop_strings_inside_accepted_drafts(base, demo_dir, device):
    """The demo model's greedy output repeats one token: a stop string of several repeats ends a
    sequence at an accepted draft, and the tokens after it in the step are dropped."""
    llm = make_llm(demo_dir, device, speculative_config=spec(4, 3, 1))
    hits = watch_mid_draft_stops(llm)
    greedy = base.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    for reps in (3, 6, 9, 14):
        stops = sorted({o.outputs[0].text[:reps * len(o.outputs[0].text) // 30] for o in greedy
                        if o.outputs[0].text}, key=len)
        for include in (False, True):
            params = SamplingParams(temperature=0, max_tokens=30, stop=stops[:2],
                                    include_stop_str_in_output=include)
            assert_same(base.generate(PROMPTS, params, use_tqdm=False),
                        llm.generate(PROMPTS, params, use_tqdm=False))
    assert hits and llm.stats.spec_accepted_tokens > 0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """transformers' tiny Qwen3 at std 0.3 (test_engine.py's): varied greedy outputs, so that
    drafts are partly accepted, partly rejected."""
    return save_checkpoint(make_hf_model(seed=0, std=0.3), tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("config", [spec(1, 1, 1), spec(3, 2, 1), spec(5, 4, 1)])
def test_partial_acceptance_and_stop_ids(tiny_dir, device, config):
    import torch

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 101, (n,), generator=g).tolist()}
               for n in (3, 7, 16, 31, 5, 12)]
    ref = make_llm(tiny_dir, device)
    llm = make_llm(tiny_dir, device, speculative_config=config)
    sched = llm.engine.scheduler
    drafted = set()  # (prompt, output index) of tokens recorded as accepted drafts' rounds
    accept = sched.accept

    def recording_accept(seq, tok):
        accept(seq, tok)
        drafted.add((tuple(seq.prompt_ids), seq.num_output - 1))
    sched.accept = recording_accept
    hits = watch_mid_draft_stops(llm)
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.3, seed=1, max_tokens=40, ignore_eos=True, n=2),
                   SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)):
        drafted.clear()
        expected = ref.generate(prompts, params, use_tqdm=False)
        assert_same(expected, llm.generate(prompts, params, use_tqdm=False))
        # Stop ids from the outputs themselves: per prompt, a token whose first occurrence came
        # from an accepted draft's round (so the stop falls there), and one anywhere else.
        per_prompt = []
        for prompt, out in zip(prompts, expected):
            ids = out.outputs[0].token_ids
            key = tuple(prompt["prompt_token_ids"])
            firsts = [i for i, t in enumerate(ids) if ids.index(t) == i]
            inside = [i for i in firsts if (key, i) in drafted]
            stop = [ids[inside[0]]] if inside else []
            stop += [ids[firsts[len(firsts) // 2]]] if len(firsts) > 2 else []
            per_prompt.append(SamplingParams(
                temperature=params.temperature, seed=params.seed, max_tokens=40, n=params.n,
                stop_token_ids=stop, logprobs=params.logprobs))
        assert_same(ref.generate(prompts, per_prompt, use_tqdm=False),
                    llm.generate(prompts, per_prompt, use_tqdm=False))
    s = llm.stats
    assert 0 < s.spec_accepted_tokens < s.spec_draft_tokens  # some accepted, some rejected
    assert hits  # some stop fell on an accepted draft
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


def test_mixed_batch_and_per_request_params(base, demo_dir, device):
    """Speculating and non-speculating sequences (penalties, min_tokens) in the same steps, with
    a step budget that cuts drafts and chunked prefills beside decodes."""
    llm = make_llm(demo_dir, device, speculative_config=spec(4, 3, 1), max_num_batched_tokens=24)
    ref = make_llm(demo_dir, device, max_num_batched_tokens=24)
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0.8, seed=2, max_tokens=40, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, seed=4, max_tokens=40, min_tokens=12, logprobs=1),
              SamplingParams(temperature=0, max_tokens=40, bad_words=["the"]),
              SamplingParams(temperature=0.6, top_k=5, seed=9, max_tokens=40, n=3)]
    assert_same(ref.generate(PROMPTS, params, use_tqdm=False),
                llm.generate(PROMPTS, params, use_tqdm=False))
    assert llm.stats.spec_accepted_tokens > 0
    assert llm.stats.max_step_tokens <= 24


def test_preemption_under_speculation(base, demo_dir, device):
    """A cache too small for every sequence at once: sequences are preempted and recomputed,
    outputs unchanged, and every block comes back."""
    prompts = PROMPTS * 2
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = make_llm(demo_dir, device, speculative_config=spec(4, 3, 1), num_kv_blocks=14)
    expected = base.generate(prompts, params, use_tqdm=False)
    assert_same(expected, llm.generate(prompts, params, use_tqdm=False))
    assert llm.stats.preemptions > 0
    assert llm.stats.spec_accepted_tokens > 0
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks
    # and sampled, with the prefix cache off
    llm = make_llm(demo_dir, device, speculative_config=spec(3, 2, 1), num_kv_blocks=14,
                   enable_prefix_caching=False)
    params = SamplingParams(temperature=0.7, seed=13, max_tokens=60, ignore_eos=True)
    assert_same(base.generate(prompts, params, use_tqdm=False),
                llm.generate(prompts, params, use_tqdm=False))
    assert llm.stats.preemptions > 0
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


def test_max_model_len_bounds_drafts(demo_dir, device):
    ref = make_llm(demo_dir, device, max_model_len=40)
    llm = make_llm(demo_dir, device, max_model_len=40, speculative_config=spec(5, 3, 1))
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    expected = ref.generate(PROMPTS, params, use_tqdm=False)
    assert_same(expected, llm.generate(PROMPTS, params, use_tqdm=False))
    for out in expected:
        assert out.outputs[0].finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 40
    assert llm.stats.spec_accepted_tokens > 0


# -- the lookup ---------------------------------------------------------------------------------

def brute_force(tokens, k, lo, hi):
    """The definition: the largest n in [lo, hi] whose suffix n-gram occurs at an earlier start
    (ending before the last token), the earliest such start's followers."""
    L = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n > L - 1:
            continue
        suffix = tokens[L - n:]
        for j in range(0, L - n):
            if tokens[j:j + n] == suffix:
                return tokens[j + n:j + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6),
       lo=st.integers(1, 5), extra=st.integers(0, 4))
def test_ngram_propose_matches_brute_force(tokens, k, lo, extra):
    hi = lo + extra
    got = ngram_propose(tokens, k, lo, hi)
    assert got == brute_force(tokens, k, lo, hi)
    assert len(got) <= k


def test_ngram_propose_examples():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 2, 1, 3) == [3, 4]
    assert ngram_propose([1, 2, 3, 4, 1, 2], 5, 1, 3) == [3, 4, 1, 2]
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []
    assert ngram_propose([7, 7, 7], 3, 1, 2) == [7]  # overlapping the suffix: 7 7 -> 7
    assert ngram_propose([1, 2, 9, 2], 2, 2, 2) == []  # no 2-gram match, 1-gram not allowed
    assert ngram_propose([1, 2, 9, 2], 2, 1, 2) == [9, 2]


# -- the batch and the runner's graph selection ---------------------------------------------------

def test_batch_logits_rows_of_a_speculative_chunk():
    chunks = [SeqChunk([1, 2, 3], 4, [0, 1], True, 3), SeqChunk([5, 6], 0, [2], True),
              SeqChunk([7], 2, [3], False), SeqChunk([8, 9], 1, [4], True, 2)]
    arrays = batch_arrays(chunks, block_size=4)
    assert arrays["logits_indices"].tolist() == [0, 1, 2, 4, 6, 7]
    assert not is_decode_step(chunks[:1])
    # a graph fits a speculative chunk by its logits rows: 3 here
    fake = types.SimpleNamespace(num_seqs=8, num_tokens=8, min_tokens=1, max_blocks=4,
                                 num_logits=2)
    assert not PrefillGraph.fits(fake, chunks[:1])
    assert PrefillGraph.fits(fake, [SeqChunk([1, 2, 3, 4], 0, [0])])
    fake.num_logits = 3
    assert PrefillGraph.fits(fake, chunks[:1])
    assert not PrefillGraph.fits(fake, chunks)  # 6 rows
    # the decode graphs' selection: a speculative step (more rows than chunks, chunks of several
    # tokens) is never a graph step, while the same chunks' plain decode is
    from minivllm.functional.sampling import SamplingRow
    from minivllm.runtime.runner import ModelRunner, StepInput

    runner = types.SimpleNamespace(graphs=types.SimpleNamespace(bucket=lambda n: n))
    row = SamplingRow(temperature=0.0)
    spec_step = StepInput([SeqChunk([1, 2, 3], 4, [0, 1], True, 3)], [row] * 3, steps=(0, 1, 2))
    assert not ModelRunner._graph_step(runner, spec_step)
    assert ModelRunner._graph_step(runner, StepInput([SeqChunk([1], 4, [0, 1])], [row]))


# -- bad configs --------------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    ({"method": "eagle", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 2}, "method"),
    ({"method": "ngram", "prompt_lookup_max": 2}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0, "prompt_lookup_max": 2}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2.0, "prompt_lookup_max": 2}, "integer"),
    ({"method": "ngram", "num_speculative_tokens": True, "prompt_lookup_max": 2}, "integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, ">= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
      "prompt_lookup_min": 3}, "prompt_lookup_min"),
    # A bad prompt_lookup_min given alone is named as itself, not as the max it stands for.
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min must be an integer >= 1, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "3"},
     "prompt_lookup_min must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "model": "x"},
     "does not take"),
    ("ngram", "dict"),
])
def test_bad_configs_refused(demo_dir, device, config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.create(config)
    with pytest.raises(ValueError, match=match):
        make_llm(demo_dir, device, speculative_config=config)


def test_config_defaults():
    c = SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 4})
    assert (c.num_speculative_tokens, c.prompt_lookup_max, c.prompt_lookup_min) == (3, 4, 4)
    c = SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 2})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (2, 2)
    c = SpeculativeConfig.create({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_max, c.prompt_lookup_min) == (5, 5)  # vLLM's defaults
    assert SpeculativeConfig.create(None) is None


# --- vLLM's spec-decode metrics ----------------------------------------------------------------

@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=30))
def test_draft_counts_per_position(steps):
    """LLMEngine._count_draft against counting by hand: a draft is a sequence's step with draft
    tokens; position p counts the drafts whose first p + 1 tokens were accepted."""
    from minivllm.runtime.engine import EngineStats, LLMEngine

    steps = [(d, min(a, d)) for d, a in steps]
    holder = types.SimpleNamespace(stats=EngineStats())
    for drafted, accepted in steps:
        LLMEngine._count_draft(holder, drafted, accepted)
    s = holder.stats
    drafts = [(d, a) for d, a in steps if d]
    assert s.spec_drafts == len(drafts)
    assert s.spec_draft_tokens == sum(d for d, _ in drafts)
    assert s.spec_accepted_tokens == sum(a for _, a in drafts)
    longest = max((a for _, a in drafts), default=0)
    assert s.spec_accepted_per_pos == [sum(a > p for _, a in drafts) for p in range(longest)]


def test_metrics_report_the_drafts(demo_dir, device):
    """/metrics' spec-decode counters (vLLM's names and labels) after a speculative run: the
    engine's counts, one per-position counter for each of the k positions, and none of the
    family without speculation."""
    from minivllm.runtime import metrics as prom
    from test_metrics import parse

    llm = make_llm(demo_dir, device, speculative_config=spec(4, 3, 1))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    fams = parse(prom.render(prom.snapshot(llm.engine), "m"))

    def one(name):
        (sample,) = fams[name]["samples"]
        assert sample[1] == {"model_name": "m", "engine": "0"}
        return sample[2]
    s = llm.stats
    drafts = one("vllm:spec_decode_num_drafts_total")
    assert drafts == s.spec_drafts > 0
    assert one("vllm:spec_decode_num_draft_tokens_total") == s.spec_draft_tokens <= 4 * drafts
    accepted = one("vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == s.spec_accepted_tokens > 0
    per_pos = {int(lab["position"]): v for _, lab, v in
               fams["vllm:spec_decode_num_accepted_tokens_per_pos_total"]["samples"]}
    assert sorted(per_pos) == [0, 1, 2, 3]
    counts = [per_pos[p] for p in range(4)]
    assert sum(counts) == accepted and drafts >= counts[0]
    assert counts == sorted(counts, reverse=True)
    plain = make_llm(demo_dir, device)
    assert not any(n.startswith("vllm:spec_decode")
                   for n in parse(prom.render(prom.snapshot(plain.engine), "m")))


def test_gpu_ngram_verification_graphs_in_fp32(demo_dir):
    """On CUDA with the compiled forward and CUDA graphs: every verification step replays a
    verification graph, and the outputs equal the same engine's without speculation (fp32: the
    verification's chunk and the decode graphs round alike enough that no near-tie flips)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    kw = dict(graphs=True, dtype="float32", max_num_seqs=8)
    params = [SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=30, n=2)]
    plain = make_llm(demo_dir, cuda, **kw)
    want = [plain.generate(PROMPTS, p, use_tqdm=False) for p in params]
    del plain
    torch.cuda.empty_cache()
    llm = make_llm(demo_dir, cuda, speculative_config=spec(4, 3, 1), **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.verify_graphs
    assert [g.num_tokens for g in runner.verify_graphs] == [5, 10, 20, 40]
    assert all(g.graph is not None for g in runner.verify_graphs)
    replayed = []
    for graph in runner.verify_graphs:
        graph.replay = lambda n, g=graph, r=graph.replay: replayed.append(g.num_tokens) or r(n)
    ungraphed = ungraphed_verifications(runner)
    for p, w in zip(params, want):
        assert_same(w, llm.generate(PROMPTS, p, use_tqdm=False))
    assert llm.stats.spec_accepted_tokens > 0 and replayed and not ungraphed


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_kv_cache_outputs_equal_the_plain_engines(tmp_path_factory, device, backend):
    """With kv_cache_dtype="fp8" a verification chunk [t, d1..dk] reads its earlier tokens' K/V
    from the cache, fp8-rounded, as a decode step reads them (only each query's own token as
    computed): greedy and seeded outputs equal the engine's without speculation. Before, the
    chunk attended to them at full precision and outputs parted from the plain engine's at
    fp8's rounding (the first prompt at its 15th token; with "auto" none)."""
    from minivllm.kernels import available_backends

    if backend not in available_backends(device):
        pytest.skip(f"no {backend} backend on this device")
    path = save_checkpoint(make_hf_model(seed=0), tmp_path_factory.mktemp("fp8spec") / "model")
    prompts = [{"prompt_token_ids": [92, 51, 90] * 3}, {"prompt_token_ids": [39, 38]}] + [
        {"prompt_token_ids": [(7 * i + j * j) % 97 + 3 for j in range(6)] * 2}
        for i in range(4)]
    kw = dict(kv_cache_dtype="fp8", attention_backend=backend, num_kv_blocks=128)
    plain = make_llm(path, device, **kw)
    llm = make_llm(path, device, speculative_config=spec(4, 3, 1), **kw)
    for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)):
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert llm.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("fields,match", [
    (dict(method="ngram", num_speculative_tokens=0, prompt_lookup_max=3, prompt_lookup_min=1),
     "num_speculative_tokens must be an integer >= 1"),
    (dict(method="ngram", num_speculative_tokens=4, prompt_lookup_max=1, prompt_lookup_min=3),
     "prompt_lookup_min \\(3\\) must be <= prompt_lookup_max \\(1\\)"),
    (dict(method="eagle", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1),
     "method must be one of"),
    (dict(method="draft_model", num_speculative_tokens=2, prompt_lookup_max=0,
          prompt_lookup_min=0, model=None), "needs \"model\""),
])
def test_a_speculative_config_object_is_checked_as_its_dict_is(fields, match):
    """LLM(speculative_config=SpeculativeConfig(...)) is refused where the same dict is, before
    an engine starts (an instance used to pass unchecked: k = 0 and min > max ran without
    drafting, "eagle" ran n-gram, a draft model without a model died in an AttributeError)."""
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.create(SpeculativeConfig(**fields))
    ok = SpeculativeConfig.create(SpeculativeConfig("ngram", 3, 4, 2))
    assert (ok.method, ok.num_speculative_tokens, ok.prompt_lookup_max, ok.prompt_lookup_min) == \
        ("ngram", 3, 4, 2)
    draft = SpeculativeConfig.create(SpeculativeConfig("draft_model", 2, 0, 0, model="d"))
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "d", 2)
