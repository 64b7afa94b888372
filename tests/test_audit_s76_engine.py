"""Session 76's audit of the engine's error handling: a launched step whose tokens can never be read
(its result raises: a device or worker error), a wake_up whose runner fails part-way, and the
pooling calls' lora_request (vLLM's argument, which they lacked).

The oracle of the failures is the same requests on a fresh engine that never fails: after the
error, later steps give exactly its outputs (greedy, and seeded sampling), every block is back in
the free queue, and the block manager's own check holds at every step."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._pytree import tree_leaves

from minivllm import LLM, LoRARequest, PoolingParams, SamplingParams

import engine_helpers
from hf_tiny import make_hf_model
from test_audit_s75_lifecycle import BS, make_llm as lifecycle_llm, tiny_dir  # noqa: F401
from test_embed import write_embedding_layout
from test_rerank import seq_cls_model

BASE = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 11]
GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True)


def make_llm(path, device, **kw):
    kw.setdefault("num_kv_blocks", 32)
    return lifecycle_llm(path, device, **kw)


# -- a step whose tokens are lost ------------------------------------------------------------------


class DeviceError(RuntimeError):
    pass


class Lost:
    """A launched step whose result raises `errors` in turn (a KeyboardInterrupt while waiting,
    then the device's error), as a failed device or worker's would."""

    def __init__(self, *errors):
        self.errors = list(errors)

    def result(self):
        raise self.errors.pop(0) if len(self.errors) > 1 else self.errors[0]


def failing_launches(monkeypatch, runner, plan: dict):
    """runner.launch, launch k (from 1) failing as plan[k] says: "read" (it runs, its tokens are
    never read), "unwritten" (as "read", and its K/V never reaches the cache: zeroed after it),
    "interrupted" (a Ctrl-C while reading it, then the device's error at the next read) or
    "launch" (the launch itself raises)."""
    real, count = runner.launch, [0]

    def launch(step):
        count[0] += 1
        how = plan.get(count[0])
        if how == "launch":
            raise DeviceError("launch failed")
        pending = real(step)
        if how is None:
            return pending
        if how == "unwritten":
            for t in tree_leaves(runner.cache):
                if isinstance(t, torch.Tensor):
                    t.zero_()
        if how == "interrupted":
            return Lost(KeyboardInterrupt(), DeviceError("device lost"))
        return Lost(DeviceError("device lost"))
    monkeypatch.setattr(runner, "launch", launch)


def add_mixed(eng) -> list[str]:
    """Two greedy requests sharing a prefix, a seeded n=2 one, and an embedding (the engine
    pools beside generations, whatever its runner)."""
    ids = eng.add_requests([{"prompt_token_ids": BASE[:9]}, {"prompt_token_ids": BASE[:6]},
                            {"prompt_token_ids": [5, 40, 41, 42, 43]}], [GREEDY, GREEDY, SEEDED])
    ids += eng.add_pooling_requests([{"prompt_token_ids": BASE[:10]}], [PoolingParams()])
    return ids


def result_of(out):
    if hasattr(out.outputs, "embedding"):
        return out.outputs.embedding
    return [c.token_ids for c in out.outputs]


def run_through(eng, errors: list) -> dict:
    """Step until nothing is left, each error of a step kept in `errors` (as a caller that
    retries), the block manager checked after each step; the finished outputs by request id."""
    done = {}
    for _ in range(80):
        if not (eng.has_unfinished_requests() or eng.in_flight is not None or eng.unread):
            break
        try:
            outs = eng.step()
        except (RuntimeError, KeyboardInterrupt) as e:
            errors.append(e)
            outs = []
            if not isinstance(e, KeyboardInterrupt):
                # Consistent at once: no token pending, nothing in flight.
                assert all(s.num_pending == 0 for s in eng.scheduler.sequences)
                assert eng.in_flight is None and eng.unread is None
        for o in outs:
            if o.finished:
                done[o.request_id] = result_of(o)
        eng.block_manager.check(eng.scheduler.sequences)
    return done


@pytest.mark.parametrize("plan", [{1: "read"}, {3: "read"}, {2: "read", 3: "launch"},
                                  {2: "interrupted"}, {1: "unwritten"}],
                         ids=["prefill", "decode", "launch-and-read", "interrupted", "unwritten"])
def test_a_step_whose_tokens_are_lost_is_run_again(tiny_dir, device, monkeypatch, plan):
    """Asynchronous scheduling: step N's result raised (launched, its tokens never read), with
    step N + 1 launched on them. Its sequences were advanced (a PENDING token each, their tokens
    counted computed) and never resolved: each later step's token took the place of the one
    before (a token lost), a PENDING stayed at the end for good, and once every other token was
    out the engine raised "the scheduler could not schedule anything" at every step, the
    requests and their blocks held for ever (an embedding pooled in that step never came). Now
    both steps are undone, as the synchronous path's abandon undoes a step that never ran: a
    caller that steps on gets what an engine that never failed gives."""
    want = run_through(_fresh(tiny_dir, device), [])
    llm = make_llm(tiny_dir, device)
    eng = llm.engine
    assert eng.async_scheduling
    ids = add_mixed(eng)
    failing_launches(monkeypatch, eng.runner, plan)
    errors = []
    got = run_through(eng, errors)
    kinds = [type(e).__name__ for e in errors]
    assert kinds in (["DeviceError"], ["KeyboardInterrupt", "DeviceError"]), errors
    assert_same(got, want)
    assert set(got) == set(ids)
    assert not eng.requests and eng.in_flight is None and eng.unread is None
    assert eng.block_manager.num_free == eng.num_blocks


def _fresh(path, device):
    """An engine that never fails, holding add_mixed's requests."""
    eng = make_llm(path, device).engine
    add_mixed(eng)
    return eng


def assert_same(got: dict, want: dict) -> None:
    """The same token ids; embeddings equal to fp32 rounding (recomputed in other batches)."""
    assert set(got) == set(want)
    for key, value in want.items():
        if value and isinstance(value[0], float):
            torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(value))
        else:
            assert got[key] == value, key


def test_a_lost_step_leaves_no_unwritten_block_in_the_prefix_cache(tiny_dir, device,
                                                                   monkeypatch):
    """The lost step registered its prompts' full blocks in the prefix cache when it was
    scheduled, for K/V it never wrote. generate() raised and aborted its requests, whose blocks
    went back to the free queue still registered: the next generate() of prompts with that
    prefix took them as hits and computed from K/V that was never there. Now the engine forgets
    every block no sequence holds when a step is lost, and the next call gives what a fresh
    engine gives; no request of the failed call is left in the engine."""
    prompts = [{"prompt_token_ids": BASE[:9]}, {"prompt_token_ids": BASE[:10] + [30]}]
    want = [o.outputs[0].token_ids
            for o in make_llm(tiny_dir, device).generate(prompts, GREEDY, use_tqdm=False)]
    llm = make_llm(tiny_dir, device)
    eng = llm.engine
    failing_launches(monkeypatch, eng.runner, {1: "unwritten"})
    with pytest.raises(DeviceError):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not eng.requests and not eng.has_unfinished_requests()
    eng.block_manager.check([])
    assert eng.block_manager.num_free == eng.num_blocks
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    # The second call's own outputs, not the first's (request ids go on).
    assert [o.request_id for o in llm.generate(prompts[:1], GREEDY, use_tqdm=False)] == ["4"]


def test_an_abort_after_a_lost_step_frees_everything(tiny_dir, device, monkeypatch):
    """A caller that aborts instead of retrying (the server fails the step's requests): every
    block is free and the next requests run as on a fresh engine."""
    want = run_through(_fresh(tiny_dir, device), [])
    eng = make_llm(tiny_dir, device).engine
    ids = add_mixed(eng)
    failing_launches(monkeypatch, eng.runner, {3: "read"})
    with pytest.raises(DeviceError):
        for _ in range(5):
            eng.step()
    eng.abort_request(ids)
    assert not eng.has_unfinished_requests()
    run_through(eng, [])
    eng.block_manager.check([])
    assert eng.block_manager.num_free == eng.num_blocks
    again = add_mixed(eng)
    got = run_through(eng, [])
    assert_same({i: got[j] for i, j in zip(ids, again)}, want)


def test_a_speculative_step_that_fails_before_its_tokens_are_recorded(tiny_dir, device,
                                                                       monkeypatch):
    """A draft model (synchronous steps): the verification step ran and was advanced, then the
    draft's catch_up failed (a device error) before its tokens were resolved. The sequences kept
    a PENDING token that no step would feed back, and every later step raised a KeyError for
    ever. Now the step is undone as a lost one, and stepping on gives the outputs of an engine
    without speculation."""
    want = run_through(_fresh(tiny_dir, device), [])
    eng = make_llm(tiny_dir, device, speculative_config={
        "model": tiny_dir, "num_speculative_tokens": 3}).engine
    assert not eng.async_scheduling
    add_mixed(eng)
    real, calls = eng.runner.catch_up, []

    def catch_up(tokens, *rest):
        if tokens:
            calls.append(len(tokens))
            if len(calls) == 1:
                raise DeviceError("device lost")
        return real(tokens, *rest)
    monkeypatch.setattr(eng.runner, "catch_up", catch_up)
    errors = []
    got = run_through(eng, errors)
    assert len(calls) > 1 and [type(e) for e in errors] == [DeviceError]
    assert_same(got, want)
    assert not eng.requests and eng.block_manager.num_free == eng.num_blocks


def test_a_progress_bar_that_cannot_be_made_leaves_no_request_behind(tiny_dir, device,
                                                                      monkeypatch):
    """generate(use_tqdm=True) queued its requests, then made its bar outside the block that
    aborts them on an error: a bar that failed (tqdm.auto's "IProgress not found" in a notebook
    without ipywidgets) left them running on in the engine, whose sleep and load_weights then
    refused "while requests are unfinished"."""
    from minivllm.runtime import llm as llm_module

    llm = make_llm(tiny_dir, device)

    def no_bar(*args):
        raise ImportError("IProgress not found. Please update jupyter and ipywidgets.")
    monkeypatch.setattr(llm_module, "_Progress", no_bar)
    with pytest.raises(ImportError, match="IProgress"):
        llm.generate([{"prompt_token_ids": BASE[:5]}], GREEDY)
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks
    llm.load_weights([])  # refused while requests were left


# -- wake_up failing part-way ---------------------------------------------------------------------


SLEEP = dict(enable_sleep_mode=True, num_kv_blocks=16)


def run(llm):
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": BASE[:9]}], GREEDY, use_tqdm=False)]


def test_a_wake_up_that_fails_after_the_weights_leaves_only_the_cache_asleep(
        tiny_dir, monkeypatch):
    """The runner restored the weights, then failed on the KV cache (its memory still taken by
    the trainer, say): the engine said both slept, though the weights were back, so
    load_weights was refused "while the weights sleep", and a wake_up of the cache alone left
    "weights" asleep for ever after (requests refused) with everything awake. Now the engine
    holds asleep what the runner does; a retry wakes the rest."""
    from minivllm.runtime import runner as runner_module

    llm = make_llm(tiny_dir, torch.device("cpu"), **SLEEP)
    want = run(llm)
    llm.sleep(1)
    real, calls = runner_module.restore, []

    def restore(off):
        calls.append(off)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory")
        real(off)
    monkeypatch.setattr(runner_module, "restore", restore)
    with pytest.raises(torch.OutOfMemoryError):
        llm.wake_up()
    assert llm.engine.sleeping == {"kv_cache"} and llm.is_sleeping()
    llm.load_weights([])  # the weights are awake: taken (nothing to copy)
    with pytest.raises(ValueError, match="sleeping"):
        run(llm)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    assert run(llm) == want


def test_a_wake_up_whose_recapture_fails_can_be_retried(tiny_dir, monkeypatch):
    """Every tag restored, then the graphs' capture failed: the engine must run no step until a
    wake_up captures them, and a retry does (the runner captures once nothing sleeps)."""
    llm = make_llm(tiny_dir, torch.device("cpu"), **SLEEP)
    want = run(llm)
    llm.sleep(1)
    runner, captures = llm.engine.runner, []
    real = runner._capture_again

    def capture():
        captures.append(1)
        if len(captures) == 1:
            raise torch.OutOfMemoryError("capture failed")
        real()
    monkeypatch.setattr(runner, "_capture_again", capture)
    llm.wake_up(["weights"])
    assert llm.engine.sleeping == {"kv_cache"} and not captures
    with pytest.raises(torch.OutOfMemoryError, match="capture failed"):
        llm.wake_up(["kv_cache"])
    assert runner.asleep == {} and llm.engine.sleeping == {"kv_cache"}
    with pytest.raises(ValueError, match="sleeping"):
        run(llm)
    llm.wake_up()
    assert captures == [1, 1] and not llm.is_sleeping()
    assert run(llm) == want


def test_a_tensor_parallel_wake_up_that_fails_on_rank_0(tiny_dir, monkeypatch):
    """tensor_parallel_size=2: rank 0 restores its weights and fails on its cache. Any failure
    stops a tensor-parallel engine; is_sleeping and the engine's tags then say what rank 0
    holds asleep (the cache), and every later call is refused as stopped."""
    llm = LLM(tiny_dir, device="cpu", attention_backend="reference", block_size=BS,
              skip_tokenizer_init=True, tensor_parallel_size=2, **SLEEP)
    try:
        llm.sleep(1)
        rank0 = llm.engine.runner.runner
        real = rank0.wake_up

        def wake_up(tags):
            real(("weights",))
            raise torch.OutOfMemoryError("CUDA out of memory")
        monkeypatch.setattr(rank0, "wake_up", wake_up)
        with pytest.raises(torch.OutOfMemoryError):
            llm.wake_up()
        assert llm.engine.sleeping == {"kv_cache"} and llm.is_sleeping()
        with pytest.raises(RuntimeError, match="engine is stopped"):
            llm.wake_up()
    finally:
        llm.shutdown()


# -- lora_request on the pooling calls ------------------------------------------------------------


@pytest.fixture(scope="module")
def pooling_llms(tmp_path_factory, device):
    """(an embedding LLM, a classifier LLM) on a tiny backbone, with the demo tokenizer."""
    from minivllm.runtime.demo import build_tokenizer

    tok = build_tokenizer()
    backbone = make_hf_model(seed=0, std=0.1, vocab_size=len(tok))
    embed_dir = write_embedding_layout(backbone, tok, tmp_path_factory.mktemp("emb") / "model")
    cls_dir = str(tmp_path_factory.mktemp("cls") / "model")
    seq_cls_model(backbone, 3).save_pretrained(cls_dir)
    tok.save_pretrained(cls_dir)
    return (engine_helpers.make_llm(embed_dir, device, runner="pooling"),
            engine_helpers.make_llm(cls_dir, device, runner="pooling"))


def test_pooling_calls_take_vllms_lora_request(pooling_llms):
    """vLLM's LLM.embed / classify / score take lora_request (keyword, default None), as
    generate does; minivllm's raised TypeError on it. None, and a list of one None per prompt,
    run the base model as before."""
    for name in ("embed", "classify", "score"):
        p = inspect.signature(getattr(LLM, name)).parameters["lora_request"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    emb, cls = pooling_llms
    prompts = [{"prompt_token_ids": BASE[:5]}, {"prompt_token_ids": BASE[2:9]}]
    base = [o.outputs.embedding for o in emb.embed(prompts, use_tqdm=False)]
    for lr in (None, [None, None], (None, None)):
        assert [o.outputs.embedding for o in emb.embed(prompts, use_tqdm=False,
                                                       lora_request=lr)] == base
    probs = [o.outputs.probs for o in cls.classify(prompts, use_tqdm=False)]
    assert [o.outputs.probs for o in cls.classify(prompts, use_tqdm=False,
                                                  lora_request=[None, None])] == probs
    scores = [o.outputs.score for o in emb.score("a fox", ["a dog", "a cat"], use_tqdm=False)]
    assert [o.outputs.score for o in emb.score("a fox", ["a dog", "a cat"], use_tqdm=False,
                                               lora_request=None)] == scores


@pytest.mark.parametrize("lora_request, error, match", [
    (LoRARequest("sql", 1, "/nowhere"), ValueError, "LoRA adapter 'sql' asked of a pooling"),
    ([None, LoRARequest("sql", 1, "/nowhere")], ValueError, "generating models only"),
    ([None], ValueError, "2 prompts but 1 lora requests"),
    ("sql", TypeError, "lora_request must be a LoRARequest"),
    (1, TypeError, "lora_request must be a LoRARequest"),
    ({"lora_name": "sql"}, TypeError, "lora_request must be a LoRARequest"),
    ([None, "sql"], TypeError, "items must be LoRARequests or None"),
])
def test_pooling_calls_refuse_an_adapter_before_any_work(pooling_llms, lora_request, error,
                                                         match):
    """A pooling LLM serves no adapter (enable_lora is for generating models): an adapter asked
    for is refused, not left out in silence, and so is a lora_request of the wrong type or
    length, each before any request is queued or step run."""
    emb, cls = pooling_llms
    prompts = [{"prompt_token_ids": BASE[:5]}, {"prompt_token_ids": BASE[2:9]}]
    calls = [lambda: emb.embed(prompts, use_tqdm=False, lora_request=lora_request),
             lambda: cls.classify(prompts, use_tqdm=False, lora_request=lora_request)]
    if not (isinstance(lora_request, list) and len(lora_request) == 1):  # score: no count
        calls.append(lambda: emb.score("a fox", ["a dog", "a cat"], use_tqdm=False,
                                       lora_request=lora_request))
    for call in calls:
        steps = [llm.engine.stats.steps for llm in pooling_llms]
        with pytest.raises(error, match=match):
            call()
        for llm, before in zip(pooling_llms, steps):
            assert not llm.engine.requests and llm.engine.stats.steps == before


def test_a_pooling_config_that_is_no_object_is_named(tmp_path):
    """A sentence-transformers Pooling config.json holding a list (not an object) escaped as
    "AttributeError: 'list' object has no attribute 'items'"; now the checkpoint's ValueError
    names the directory, as for the other unreadable configs."""
    import json

    from minivllm.runtime.pooling import sentence_transformers_pooling
    from test_embed import write_st_config

    write_st_config(tmp_path)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(["pooling_mode_lasttoken"]))
    with pytest.raises(ValueError, match="sentence-transformers pooling config .*holds a list"):
        sentence_transformers_pooling(str(tmp_path))
