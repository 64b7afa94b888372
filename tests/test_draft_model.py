"""Draft-model speculative decoding (runtime/spec_decode.py; vLLM's speculative_config
{"model": DRAFT, "num_speculative_tokens": k}): with the target itself as its draft every draft is
accepted (greedy), which holds only while the draft's KV cache is kept right, through prefix-cache
hits, preemption and chunked prefill; with another draft the outputs are still those of the engine
without speculation, token for token (greedy and seeded sampling, rows that may not draft beside
rows that do); what is not served is refused when the engine is configured."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.utils._pytree as pytree

from minivllm import SamplingParams, forward
from minivllm.runtime.config import EngineConfig
from minivllm.runtime.graphs import DecodeGraphs
from minivllm.runtime.spec_decode import SpeculativeConfig
from minivllm.state.config import ceil_div

from engine_helpers import make_llm, stand_in_verify_graphs, ungraphed_verifications
from hf_tiny import hf_greedy, make_hf_model, make_hf_moe_model, save_checkpoint

K = 3


@pytest.fixture(scope="module")
def hf_target():
    return make_hf_model(seed=0)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, hf_target):
    root = tmp_path_factory.mktemp("draft")
    near = make_hf_model(seed=0)  # the target's weights, slightly perturbed: partial acceptance
    torch.manual_seed(1)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(0.03 * torch.randn_like(p))
    return {
        "target": save_checkpoint(hf_target, root / "target"),
        "near": save_checkpoint(near, root / "near"),
        "small": save_checkpoint(make_hf_model(seed=3, num_hidden_layers=1, hidden_size=32,
                                               head_dim=8, intermediate_size=48), root / "small"),
        "vocab": save_checkpoint(make_hf_model(seed=0, vocab_size=103), root / "vocab"),
        "moe": save_checkpoint(make_hf_moe_model(seed=0), root / "moe"),
        "short": save_checkpoint(make_hf_model(seed=0, max_position_embeddings=64),
                                 root / "short"),
    }


def draft(path, k=K):
    return {"model": path, "num_speculative_tokens": k}


PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]},
           {"prompt_token_ids": [1, 2, 3]},
           {"prompt_token_ids": list(range(20, 45))},
           {"prompt_token_ids": [7]}]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def all_accepted(stats) -> bool:
    return stats.spec_accepted_tokens == stats.spec_draft_tokens > 0


@pytest.fixture(scope="module")
def base(paths, device):
    return make_llm(paths["target"], device)


def test_self_draft_accepts_every_draft_and_matches_transformers(paths, base, device, hf_target):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]))
    assert not llm.engine.async_scheduling
    assert llm.engine.runner.draft_cache.num_blocks == llm.engine.num_blocks
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert ids(got) == ids(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    for prompt, out in zip(PROMPTS[:2], got):
        assert out.outputs[0].token_ids == hf_greedy(hf_target, prompt["prompt_token_ids"], 24)
    assert all_accepted(llm.stats), llm.stats
    # every step of a sequence drafted k (but near max_tokens): few steps for 24 tokens each
    assert llm.stats.spec_drafts < 4 * 24 / 2
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


def test_self_draft_after_a_prefix_cache_hit(paths, base, device):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]),
                   block_size=4)
    first = {"prompt_token_ids": list(range(30, 50))}
    second = {"prompt_token_ids": list(range(30, 46)) + [3, 1, 4]}  # 4 full blocks shared
    for prompt in (first, second):
        assert ids(llm.generate([prompt], GREEDY, use_tqdm=False)) == \
            ids(base.generate([prompt], GREEDY, use_tqdm=False))
    assert llm.stats.prompt_tokens_cached >= 16
    assert all_accepted(llm.stats), llm.stats
    # and a hit on blocks that held generated tokens (drafts that were accepted)
    out = llm.generate([first], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    third = {"prompt_token_ids": first["prompt_token_ids"] + out[:12] + [2]}
    cached = llm.stats.prompt_tokens_cached
    assert ids(llm.generate([third], GREEDY, use_tqdm=False)) == \
        ids(base.generate([third], GREEDY, use_tqdm=False))
    assert llm.stats.prompt_tokens_cached - cached >= 28
    assert all_accepted(llm.stats), llm.stats


def test_self_draft_under_preemption(paths, base, device):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]),
                   block_size=4, num_kv_blocks=20, max_model_len=64)
    prompts = [{"prompt_token_ids": [i + 1, i + 2, i + 3, i + 4, i + 5, i + 6]} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    assert ids(llm.generate(prompts, params, use_tqdm=False)) == \
        ids(base.generate(prompts, params, use_tqdm=False))
    assert llm.stats.preemptions > 0
    assert all_accepted(llm.stats), llm.stats
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


def test_self_draft_with_chunked_prefill(paths, base, device):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]),
                   max_num_batched_tokens=8, block_size=4)
    prompts = [{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": list(range(40, 70))},
               {"prompt_token_ids": list(range(60, 81))}]
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        ids(base.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats.max_step_tokens <= 8
    assert all_accepted(llm.stats), llm.stats


def test_self_draft_over_an_fp8_cache_accepts_every_draft(paths, device):
    """With kv_cache_dtype="fp8" the verification chunk reads its earlier tokens from the cache,
    fp8-rounded, as the draft's one-token rounds and the plain engine's decode steps do: every
    greedy self-draft agrees, and outputs equal the plain fp8 engine's, under chunked prefill
    too (it had parted from them where the chunk read them at full precision)."""
    kw = dict(kv_cache_dtype="fp8", attention_backend="reference")
    plain = make_llm(paths["target"], device, **kw)
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]),
                   max_num_batched_tokens=16, **kw)
    prompts = PROMPTS + [{"prompt_token_ids": [92, 51, 90] * 3}, {"prompt_token_ids": [39, 38]}]
    assert ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == \
        ids(plain.generate(prompts, GREEDY, use_tqdm=False))
    assert all_accepted(llm.stats), llm.stats


def test_a_steps_tokens_are_on_their_way_before_the_drafts_mirror(paths, base, device,
                                                                   monkeypatch):
    """runner.launch queues the step's token copies and their event (PendingStep) before the
    draft's mirror of the step, so that reading the tokens does not wait for the mirror: the
    host records them and schedules the next step while it runs (on the GPU; the next draft
    round follows it in stream order). Every mirror comes right after its step's pending; steps
    of verification chunks only have none."""
    from minivllm.runtime import runner as runner_module

    want = ids(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    order = []
    real_pending = runner_module.PendingStep

    def pending(*args, **kwargs):
        order.append("pending")
        return real_pending(*args, **kwargs)
    monkeypatch.setattr(runner_module, "PendingStep", pending)
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]))
    real_mirror = llm.engine.runner._mirror

    def mirror(*args, **kwargs):
        order.append("mirror")
        return real_mirror(*args, **kwargs)
    monkeypatch.setattr(llm.engine.runner, "_mirror", mirror)
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert order[0] == "pending" and "mirror" in order
    assert all(order[i - 1] == "pending" for i, x in enumerate(order) if x == "mirror")
    assert all_accepted(llm.stats), llm.stats


def test_verification_only_steps_are_not_mirrored_and_catch_up_writes_the_last_draft(
        paths, base, device, monkeypatch):
    """A step whose every chunk verifies drafts [t, d1..dk] is not mirrored: propose's rounds
    wrote the draft K/V of t, d1..d(k-1) at their positions already. Only dk's is missing, and
    only matters where every draft was accepted (elsewhere its slot lies past the sequence's
    length): catch_up writes it, one draft round over those sequences. Any other step is
    mirrored. With the target as its own draft every draft is then still accepted (here and in
    the self-draft tests above, prefix-cache hits, preemption, chunked prefill and an fp8 cache
    among them; without catch_up they fail)."""
    from minivllm.state.batch import is_verification_step

    want = ids(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]))
    runner, steps, caught = llm.engine.runner, [], []
    launch, mirror, catch_up = runner.launch, runner._mirror, runner.catch_up

    def recorded_launch(step):
        steps.append([is_verification_step(step.chunks), False])
        return launch(step)

    def recorded_mirror(*args, **kwargs):
        steps[-1][1] = True
        return mirror(*args, **kwargs)

    def recorded_catch_up(tokens, positions, tables):
        caught.append((steps[-1][0], list(positions)))
        return catch_up(tokens, positions, tables)
    monkeypatch.setattr(runner, "launch", recorded_launch)
    monkeypatch.setattr(runner, "_mirror", recorded_mirror)
    monkeypatch.setattr(runner, "catch_up", recorded_catch_up)
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert all(mirrored != verifying for verifying, mirrored in steps), steps
    # steps of both kinds, and catch_up called after verification-only steps
    assert any(verifying for verifying, _ in steps) and not all(v for v, _ in steps)
    assert any(verifying for verifying, _ in caught)
    assert all_accepted(llm.stats), llm.stats


SAMPLED = [
    GREEDY,
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=20, n=2),
    SamplingParams(temperature=0, max_tokens=20, logprobs=2),
]


@pytest.mark.parametrize("name, k", [("near", 1), ("near", 3), ("small", 4)])
def test_other_draft_gives_identical_outputs(paths, base, device, name, k):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths[name], k))
    for params in SAMPLED:
        expected = base.generate(PROMPTS, params, use_tqdm=False)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert ids(got) == ids(expected)
        for e, g in zip(expected, got):
            for a, b in zip(e.outputs, g.outputs):
                assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
                if a.logprobs is not None:
                    assert [list(x) for x in a.logprobs] == [list(y) for y in b.logprobs]
    s = llm.stats
    assert s.spec_draft_tokens > 0 and s.spec_accepted_tokens < s.spec_draft_tokens
    if name == "near":
        assert s.spec_accepted_tokens > 0


@pytest.mark.parametrize("name", ["near", "small"])
def test_verification_graphs_and_the_drafts_mirrors(paths, base, device, name):
    """Verification steps through the runner's verification graphs, and their mirrors through the
    draft's graphs over the same filled buffers (stand_in_verify_graphs: each replay the eager
    forward over the padded buffers, as a CUDA graph would run it): outputs equal the engine's
    without speculation, and the drafts equal the eager speculative engine's (their acceptance,
    position by position), so the mirrors wrote the draft cache the eager mirror writes."""
    kw = dict(speculative_config=draft(paths[name]), max_num_seqs=8)
    eager = make_llm(paths["target"], device, **kw)
    llm = make_llm(paths["target"], device, **kw)
    replays = []
    stand_in_verify_graphs(llm.engine.runner, replays)
    ungraphed = ungraphed_verifications(llm.engine.runner)
    for params in SAMPLED[:2]:
        want = ids(eager.generate(PROMPTS, params, use_tqdm=False))
        assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == want
        assert want == ids(base.generate(PROMPTS, params, use_tqdm=False))
    s, e = llm.stats, eager.stats
    assert s.spec_draft_tokens > 0
    assert (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_per_pos) == \
        (e.spec_drafts, e.spec_draft_tokens, e.spec_accepted_per_pos)
    assert not ungraphed
    # each mirror's replay right after its step's target replay, of the same graph; steps of
    # verification chunks only are not mirrored
    assert replays[0][2] == "target"
    assert all(replays[i - 1][::2] == (t, "target")
               for i, (t, _, who) in enumerate(replays) if who == "draft")


def test_mixed_batch_of_rows_that_may_and_may_not_draft(paths, base, device):
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["near"]))
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, top_p=0.8, seed=5, max_tokens=20,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.7, seed=2, max_tokens=20, min_tokens=8)]
    assert ids(llm.generate(PROMPTS, params, use_tqdm=False)) == \
        ids(base.generate(PROMPTS, params, use_tqdm=False))
    assert llm.stats.spec_draft_tokens > 0
    # the penalised rows alone draft nothing
    drafted = llm.stats.spec_draft_tokens
    llm.generate(PROMPTS[:3], params[1:3] + params[1:2], use_tqdm=False)
    assert llm.stats.spec_draft_tokens == drafted


def test_drafts_stay_on_the_device_until_the_steps_result(paths, base, device, monkeypatch):
    """The verification step is built and launched while the draft's rounds may still run: its
    chunks hold placeholders where the drafts go, its inputs take propose's device tensor itself
    (StepInput.drafts, .drafted), and the drafts come back to the host with the step's sampled
    tokens (StepResult.drafts), as the rows propose computed; outputs those of the engine
    without speculation, every draft accepted (the target as its own draft)."""
    want = ids(base.generate(PROMPTS, GREEDY, use_tqdm=False))
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]))
    runner, seen = llm.engine.runner, []
    propose, launch = runner.propose, runner.launch

    def recorded_propose(*args):
        seen.append([propose(*args)])
        return seen[-1][0]

    def recorded_launch(step):
        if step.drafts is not None:
            seen[-1].append(step)
        pending = launch(step)
        if step.drafts is not None:
            seen[-1].append(pending.result())
            pending.result = lambda: seen[-1][2]
        return pending
    monkeypatch.setattr(runner, "propose", recorded_propose)
    monkeypatch.setattr(runner, "launch", recorded_launch)
    assert ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want
    assert all_accepted(llm.stats)
    assert seen and all(len(s) == 3 for s in seen)  # each proposal went to one step
    for drafts, step, result in seen:
        assert step.drafts is drafts
        assert result.drafts == drafts.tolist()
        tokens = [t for c in step.chunks for t in c.token_ids]
        places, offset, flat = [], 0, []  # each drafting chunk's draft inputs, their ids'
        for c in step.chunks:
            offset += len(c.token_ids)
            if c.num_logits > 1:  # drafts' rows in the chunks' order
                places += range(offset - (c.num_logits - 1), offset)
                row = len(flat) and flat[-1] // drafts.shape[1] + 1
                flat += range(row * drafts.shape[1], row * drafts.shape[1] + c.num_logits - 1)
        assert [i for i, _ in step.drafted] == places
        assert {tokens[i] for i in places} == {0}  # placeholders
        assert [j for _, j in step.drafted] == flat


def test_propose_is_the_drafts_greedy_continuation(paths, device, hf_target):
    """ModelRunner.propose with the target as its own draft: the greedy continuation, and each
    sequence drafts its own count."""
    llm = make_llm(paths["target"], device, speculative_config=draft(paths["target"]))
    runner = llm.engine.runner
    from minivllm.runtime.runner import StepInput
    from minivllm.state.batch import SeqChunk

    a, b = [5, 6, 7, 8, 9], [1, 2, 3]
    # prefill all but the last token of each, into blocks 0-1 and 2-3
    runner.execute(StepInput([SeqChunk(a[:-1], 0, [0, 1], False),
                              SeqChunk(b[:-1], 0, [2, 3], False)], []))
    got = runner.propose([a[-1], b[-1]], [len(a) - 1, len(b) - 1], [[0, 1], [2, 3]], [4, 2])
    assert got.shape == (2, 4)
    assert [row[:n] for row, n in zip(got.tolist(), [4, 2])] == \
        [hf_greedy(hf_target, a, 4), hf_greedy(hf_target, b, 2)]


class EagerDecodeGraphs(DecodeGraphs):
    """The draft's DecodeGraphs with each replay run by the eager forward over the buffers that
    fill wrote, padded to the bucket, as a captured graph would run them (CUDA graphs need a
    GPU); records each replay's (rows, bucket)."""

    def __init__(self, runner):
        super().__init__(runner.draft_params, runner.draft_cache, runner.draft_backend,
                         max_num_seqs=runner.config.max_num_seqs,
                         max_blocks_per_seq=ceil_div(runner.config.max_model_len,
                                                     runner.block_size),
                         compile_forward=False,
                         persistent_decode=runner.config.draft_persistent_decode)
        self.replayed = []

    def replay(self, b):
        bs = self.bucket(b)
        self.replayed.append((b, bs))
        # What the bucket's graph captured: the forward, the persistent decode's kernel and its
        # greedy pick into greedy_tokens in the persistent buckets.
        return self._decode(bs)[:b]


@pytest.mark.parametrize("persistent", [False, True], ids=["compiled_layers", "persistent"])
def test_draft_graphs_give_the_eager_drafts_and_draft_cache(paths, device, persistent):
    """propose's rounds and a decode step's mirror through the draft's decode graphs (their
    fill, device-side ids and replay: EagerDecodeGraphs) give the eager draft's tokens, token for
    token, and its draft cache: with uneven counts (the rows shrink round by round, a prefix of
    the sequences sorted by count) and rows padded to their bucket. persistent: the draft's
    graphs of 1-2 rows run the persistent decode kernel (EngineConfig.draft_persistent_decode),
    whose in-graph greedy pick is what those rounds draft."""
    from minivllm.kernels import available_backends
    from minivllm.runtime.runner import StepInput
    from minivllm.state.batch import DecodeChunks, SeqChunk

    kw = dict(persistent_decode=False)  # where Triton runs (the GPU) the default would take it
    if persistent:
        if "triton" not in available_backends(device):
            pytest.skip("no Triton on this device")
        kw = dict(attention_backend="triton", persistent_decode=True)

    prompts = [[5, 6, 7, 8, 9, 10, 11], [1, 2, 3], list(range(20, 37)), [7, 8, 9],
               [40, 41, 42, 43]]
    counts = [3, 1, 5, 2, 3]  # rounds of 5, 4, 3, 1 and 1 rows
    tables = [list(range(6 * i, 6 * i + 6)) for i in range(len(prompts))]  # 24 slots each
    runners = []
    for graphs in (False, True):
        llm = make_llm(paths["target"], device, speculative_config=draft(paths["near"], 5),
                       block_size=4, max_num_seqs=8, max_model_len=128, **kw)
        runner = llm.engine.runner
        assert runner.draft_graphs is None  # eager here: no CUDA graphs
        assert llm.config.draft_persistent_decode == persistent
        if graphs:
            runner.draft_graphs = EagerDecodeGraphs(runner)
            picks = []  # each round's rows and whether it drafts the graph's own greedy pick
            picks_greedy = runner.draft_graphs.picks_greedy
            runner.draft_graphs.picks_greedy = \
                lambda b, f=picks_greedy: picks.append((b, f(b))) or picks[-1][1]
        # All but the last two tokens as prompts; the next to last as a decode step (its
        # draft mirrored through the graphs); the last drafts.
        runner.execute(StepInput([SeqChunk(p[:-2], 0, t, False) for p, t in zip(prompts, tables)],
                                 []))
        runner.execute(StepInput(DecodeChunks([p[-2] for p in prompts],
                                              [len(p) - 2 for p in prompts], tables), []))
        got = runner.propose([p[-1] for p in prompts], [len(p) - 1 for p in prompts], tables,
                             counts)
        assert got.shape == (len(prompts), max(counts))
        got = [row[:n] for row, n in zip(got.tolist(), counts)]
        runners.append((runner, got))
    (eager, want), (graphed, got) = runners
    assert got == want
    one = 1 if persistent else 2  # a persistent decode's bucket of one row
    assert graphed.draft_graphs.replayed == [(5, 8), (5, 8), (4, 4), (3, 4), (1, one), (1, one)]
    assert picks == [(5, False), (4, False), (3, False), (1, persistent), (1, persistent)]
    # The persistent kernel's K/V are its own fp32 sums, in another order than the forward's.
    tol = 1e-4 if persistent else 1e-5
    for a, b in zip(pytree.tree_leaves(eager.draft_cache), pytree.tree_leaves(graphed.draft_cache)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    graphed.release_graphs()  # the draft's too
    assert graphed.draft_graphs is None


# -- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("config, match", [
    ({"model": "x", "num_speculative_tokens": 0}, ">= 1"),
    ({"model": "x"}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "does not take"),
    ({"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "draft_tensor_parallel_size"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "does not take"),
    ({"model": "x", "num_speculative_tokens": 2, "quantization": "fp8"}, "does not take"),
])
def test_bad_draft_configs_refused(config, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.create(config)


def test_draft_persistent_decode_follows_the_drafts_shape(paths, monkeypatch):
    """A draft's decode graphs run the persistent decode kernel as persistent_decode says: never
    when it is False, wherever the kernel takes the draft when True, and when not given where a
    target of the draft's shape would by default, whatever the target's: a Qwen3-0.6B draft of
    an 8B target (which does not take it) has it."""
    from minivllm import config_for_shape
    from minivllm.kernels import backends
    from minivllm.kernels.launch import triton_usable
    from minivllm.runtime.config import draft_takes_persistent_decode

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("MINIVLLM_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(backends, "available_backends", lambda device: ["triton", "reference"])
    small, large = config_for_shape("qwen3-0.6b"), config_for_shape("qwen3-8b")

    def takes(asked, draft, device=cuda, backend=None, usable=True):
        return draft_takes_persistent_decode(asked, draft, device, backend, None, usable)

    assert takes(None, small) and not takes(None, large)  # measured faster up to 1,024 wide
    assert takes(True, large)  # asked for: wherever the kernel runs
    assert not takes(False, small)
    assert not takes(None, small, backend="reference")  # the kernel's attention is Triton's
    assert not takes(None, small, usable=False) and not takes(True, small, usable=False)
    assert not takes(None, small, device=cpu)  # the interpreter: only when asked
    cfg = EngineConfig.create(paths["target"], device="cpu",
                              speculative_config=draft(paths["small"]))
    assert not cfg.persistent_decode and not cfg.draft_persistent_decode
    if triton_usable(cpu):
        cfg = EngineConfig.create(paths["target"], device="cpu", attention_backend="triton",
                                  persistent_decode=True, speculative_config=draft(paths["near"]))
        assert cfg.persistent_decode and cfg.draft_persistent_decode
        # no draft, nothing to decide
        assert not EngineConfig.create(paths["target"], device="cpu", attention_backend="triton",
                                       persistent_decode=True).draft_persistent_decode


def test_config_forms():
    c = SpeculativeConfig.create({"model": "d", "num_speculative_tokens": 3})
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "d", 3)
    c = SpeculativeConfig.create({"method": "draft_model", "model": "d",
                                  "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1})
    assert (c.method, c.num_speculative_tokens) == ("draft_model", 2)
    c = SpeculativeConfig.create({"method": "ngram", "model": "ngram", "num_speculative_tokens": 2})
    assert c.method == "ngram"


@pytest.mark.parametrize("name, kwargs, match", [
    ("vocab", {}, r"vocab_size \(103.*\(101\)"),
    ("moe", {}, "Qwen3 dense"),
    ("short", {"max_model_len": 128}, "max_model_len=128"),
    ("missing", {}, "not a checkpoint directory"),
    ("target", {"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ("target", {"enable_lora": True}, "enable_lora"),
    ("target", {"runner": "pooling"}, "pooling"),
    ("target", {"enable_prompt_embeds": True}, "enable_prompt_embeds"),
])
def test_unsupported_draft_setups_refused(paths, device, tmp_path, name, kwargs, match):
    path = paths.get(name, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=match):
        EngineConfig.create(paths["target"], device="cpu", speculative_config=draft(path),
                            **kwargs)


def test_a_quantized_draft_is_refused(paths, tmp_path):
    import shutil
    q = tmp_path / "q"
    shutil.copytree(paths["target"], q)
    with open(q / "config.json") as f:
        d = json.load(f)
    d["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128],
                                "activation_scheme": "dynamic"}
    with open(q / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match="quantized"):
        EngineConfig.create(paths["target"], device="cpu", speculative_config=draft(str(q)))


def test_kv_sizing_counts_the_drafts_cache(paths, device, monkeypatch):
    """On the CPU budget, the blocks fit both caches."""
    if device.type != "cpu":
        pytest.skip("the CPU budget")
    monkeypatch.setenv("MINIVLLM_CPU_KV_CACHE_SPACE", str(64 * 1024 / 2**30))  # 64 KiB
    from minivllm import LLM
    kw = dict(device="cpu", attention_backend="reference", max_model_len=64, max_num_seqs=256)
    alone = LLM(paths["target"], **kw).engine.num_blocks
    both = LLM(paths["target"], speculative_config=draft(paths["small"]), **kw)
    t = both.engine.runner
    per = lambda cache: sum(x.numel() * x.element_size() for x in (*cache.k, *cache.v))
    assert per(t.cache) + per(t.draft_cache) <= 64 * 1024
    assert both.engine.num_blocks < alone
    # a draft of half the target's per-block bytes (one layer of half the heads' width)
    assert both.engine.num_blocks == 64 * 1024 // (per(t.cache) // t.num_blocks
                                                    + per(t.draft_cache) // t.num_blocks)


def test_cli_passes_a_draft_model_config(paths, device, capsys, monkeypatch):
    from engine_helpers import small_cli_engines
    from minivllm.cli import main
    from minivllm.runtime.demo import ensure_demo_model

    small_cli_engines(device, monkeypatch)
    demo = ensure_demo_model(os.path.join(os.path.dirname(paths["target"]), "demo"))
    argv = ["generate", "--model", demo, "-p", "a b a b a b", "--max-tokens", "12",
            "--temperature", "0", "--json"]
    assert main(argv) == 0
    plain = capsys.readouterr()
    assert main([*argv, "--speculative-config",
                 json.dumps({"model": demo, "num_speculative_tokens": 3})]) == 0
    spec = capsys.readouterr()
    assert spec.out == plain.out


def test_gpu_self_draft_in_bf16_with_compiled_forward_and_graphs(paths):
    """On CUDA in bf16, the default compiled forward and CUDA graphs (the decode graphs, the
    prefill graphs; the draft's own decode graphs, captured into the target's pool, for every
    drafted token and catch_up's rounds, and its compiled forward for mirrored steps): with the
    target as its own
    draft, greedy outputs equal the same engine's without speculation, and nearly every draft is
    accepted.
    Not every one: in bf16 the verification's batched chunk [t, d1..dk] and the draft's one-token
    decode forwards round differently, which may flip a near-tie between the top two logits (a
    draft rejected, the verification's token kept); hence >= 0.9, not 1.0. The outputs are the
    verification's tokens, which may likewise differ from the plain engine's decode-graph tokens
    at such a tie: a mismatch here names the first differing position to look at."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = torch.device("cuda")
    kw = dict(graphs=True, dtype="bfloat16")
    plain = make_llm(paths["target"], cuda, **kw)
    want = ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert plain.engine.runner.graphs is not None
    del plain
    torch.cuda.empty_cache()
    llm = make_llm(paths["target"], cuda, speculative_config=draft(paths["target"]), **kw)
    runner = llm.engine.runner
    assert runner.graphs is not None and llm.config.dtype == torch.bfloat16
    graphs = runner.draft_graphs
    assert graphs is not None and sorted(graphs.graphs) == graphs.buckets
    # the tiny draft's shape takes the persistent decode (1-2 rows, greedy picks in the graph)
    assert llm.config.draft_persistent_decode and graphs.picks_greedy(1) and 1 in graphs.buckets
    assert graphs.pool == runner.graphs.pool
    assert runner.draft_forward.keywords["layer"] is graphs.fn.keywords["layer"]  # compiled
    replayed, replay = [], graphs.replay
    graphs.replay = lambda b: replayed.append(b) or replay(b)
    # verification steps replay the verification graphs, their mirrors the draft's, all in the
    # prefill graphs' pool
    assert runner.verify_graphs and set(runner.verify_mirrors) == set(runner.verify_graphs)
    pool = runner.prefill_graphs[0].graph.pool()
    assert all(g.graph.pool() == pool for g in runner._captured_steps())
    ungraphed = ungraphed_verifications(runner)
    got = ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g[0], w[0])) if a != b), None)
        assert g == w, f"prompt {i}: first difference at output position {first}"
    stats = llm.stats
    assert stats.spec_draft_tokens > 0
    # every drafted token a row of a propose round's replay (decode steps' mirrors add more)
    assert sum(replayed) >= stats.spec_draft_tokens
    acceptance = stats.spec_accepted_tokens / stats.spec_draft_tokens
    assert acceptance >= 0.9, (acceptance, stats)
    # (steps of verification chunks only are not mirrored: catch_up's rounds are among the draft
    # graphs' replays above; test_verification_graphs_and_the_drafts_mirrors has the mirrors)
    assert not ungraphed
