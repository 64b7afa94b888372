"""Bad input is a ValueError raised before anything is scheduled: the other requests of the same
call never run, and the engine (queues, blocks, prefix cache, KV cache contents) is unchanged,
so that the next call gives exactly what it would have given."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minivllm import SamplingParams
from minivllm.runtime.config import EngineConfig

from engine_helpers import make_llm
from hf_tiny import make_hf_model, save_checkpoint

GOOD = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=1), tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture
def llm(tiny_dir, device):
    return make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_model_len=60)


def snapshot(llm):
    e = llm.engine
    bm = e.block_manager
    return dict(free=list(bm.free), registered=bm.registered_blocks(), steps=e.stats.steps,
                waiting=len(e.scheduler.waiting), running=len(e.scheduler.running),
                requests=len(e.requests), k=[t.clone() for t in e.runner.cache.k])


def assert_unchanged(llm, before):
    after = snapshot(llm)
    k_before, k_after = before.pop("k"), after.pop("k")
    assert after == before
    assert all(torch.equal(a, b) for a, b in zip(k_before, k_after))


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

BAD_PROMPTS = {
    "empty ids": {"prompt_token_ids": []},
    "empty string": "",
    "id above vocab": {"prompt_token_ids": [1, 2, 101]},
    "negative id": {"prompt_token_ids": [1, -1]},
    "float id": {"prompt_token_ids": [1, 2.0]},
    "longer than max_model_len": {"prompt_token_ids": [1] * 61},
    "as long as max_model_len": {"prompt_token_ids": [1] * 60},
    "string without tokenizer": "hello",
    "a tuple of ids": (1, 2, 3),
    "dict without ids": {"text": "x"},
    "0-d tensor of ids": {"prompt_token_ids": torch.tensor(5)},
    "bool ids": {"prompt_token_ids": torch.tensor([True, False])},
    "a key minivllm does not take": {"prompt_token_ids": [1, 2], "multi_modal_data": {"image": 0}},
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompt_is_refused_before_anything_runs(llm, name):
    want = llm.generate({"prompt_token_ids": GOOD}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    before = snapshot(llm)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": GOOD}, BAD_PROMPTS[name]], GREEDY, use_tqdm=False)
    assert_unchanged(llm, before)
    assert llm.generate({"prompt_token_ids": GOOD}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


BAD_PARAMS = [
    dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(top_k=1.5), dict(min_p=-0.1), dict(min_p=1.1), dict(max_tokens=0),
    dict(max_tokens=-3), dict(n=0), dict(n=1.0), dict(logprobs=-2), dict(presence_penalty=2.5),
    dict(frequency_penalty=-3), dict(repetition_penalty=0.0), dict(min_tokens=-1),
    dict(min_tokens=9, max_tokens=8), dict(seed="1"), dict(stop=[""]), dict(stop=[1]),
    dict(stop_token_ids=[-1]), dict(prompt_logprobs=-2), dict(prompt_logprobs=False),
    # silently taken before: a dict's keys as stop strings, an int, a truthy string as a flag
    dict(stop={"a": 1}), dict(stop=5), dict(stop_token_ids=5), dict(ignore_eos="no"),
    dict(include_stop_str_in_output=1), dict(temperature=1e39),
    # an int too large for a float (once an OverflowError), bools in numpy / torch form
    dict(temperature=10**400), dict(max_tokens=torch.tensor(True)), dict(n=np.bool_(True)),
    dict(stop_token_ids=[np.bool_(True)]),
]


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=[str(k)[:60] for k in BAD_PARAMS])
def test_invalid_sampling_params_raise(kw):
    with pytest.raises(ValueError, match="SamplingParams"):
        SamplingParams(**kw)


def test_numpy_and_torch_scalars_are_taken_as_python_numbers():
    """As vLLM, which does not type-check them: counts and ids often come out of arrays."""
    given = SamplingParams(n=np.int64(2), top_k=np.int32(5), seed=torch.tensor(7),
                           max_tokens=np.uint16(9), min_tokens=np.int8(1), logprobs=np.int64(3),
                           temperature=np.float32(0.5), top_p=np.float64(0.9), min_p=np.float16(0),
                           repetition_penalty=np.int64(1), stop_token_ids=[np.int64(4)],
                           prompt_logprobs=np.int32(2), truncate_prompt_tokens=torch.tensor(6),
                           logit_bias={np.int64(5): np.float32(1.5)},
                           allowed_token_ids=[np.int64(5), torch.tensor(6)])
    want = SamplingParams(n=2, top_k=5, seed=7, max_tokens=9, min_tokens=1, logprobs=3,
                          temperature=0.5, top_p=0.9, min_p=0.0, repetition_penalty=1.0,
                          stop_token_ids=[4], prompt_logprobs=2, truncate_prompt_tokens=6,
                          logit_bias={5: 1.5}, allowed_token_ids=[5, 6])
    for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "temperature",
                 "top_p", "min_p", "repetition_penalty", "stop_ids", "prompt_logprobs",
                 "truncate_prompt_tokens", "bias_pairs", "allowed_ids"):
        assert type(getattr(given, name)) is type(getattr(want, name)), name
        assert getattr(given, name) == getattr(want, name), name
    assert type(given.stop_ids[0]) is int
    assert [type(x) for x in (*given.bias_pairs[0], *given.allowed_ids)] == [int, float, int, int]
    # A one-element tensor of rank 1 is no scalar (torch's __index__ would take its element).
    for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
                 "truncate_prompt_tokens"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: torch.tensor([3])})


def test_engine_options_take_numpy_integers_and_refuse_non_bool_flags(tiny_dir):
    config = EngineConfig.create(tiny_dir, device="cpu", max_model_len=np.int64(48),
                                 num_kv_blocks=np.int32(16), block_size=torch.tensor(4),
                                 max_num_seqs=np.uint8(8), seed=np.int64(-3),
                                 gpu_memory_utilization=np.float32(0.5))
    assert (config.max_model_len, config.num_kv_blocks, config.block_size, config.max_num_seqs,
            config.seed, config.gpu_memory_utilization) == (48, 16, 4, 8, -3, 0.5)
    assert all(type(v) is int for v in (config.max_model_len, config.num_kv_blocks,
                                         config.block_size, config.max_num_seqs, config.seed))
    # None is the flag's default, as in vLLM; anything but a bool is refused: bool("false") is True.
    config = EngineConfig.create(tiny_dir, device="cpu", enable_prefix_caching=None,
                                 async_scheduling=None, enforce_eager=None)
    assert (config.enable_prefix_caching, config.async_scheduling, config.enforce_eager) == \
        (True, True, False)
    for name in ("enable_prefix_caching", "async_scheduling", "enforce_eager"):
        for value in ("false", 0, 1, np.bool_(False)):
            with pytest.raises(TypeError, match=name):
                EngineConfig.create(tiny_dir, device="cpu", **{name: value})
    assert EngineConfig.create(tiny_dir, device="cpu", seed=None).seed == 0  # as vLLM
    for kw in (dict(max_model_len=True), dict(num_kv_blocks=np.float64(16)), dict(seed="1"),
               dict(max_logprobs=-2), dict(gpu_memory_utilization=True)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineConfig.create(tiny_dir, device="cpu", **kw)


@pytest.mark.parametrize("kw", [dict(logprobs=21), dict(stop="x"), dict(stop_token_ids=[101])],
                         ids=["logprobs above max", "stop string without tokenizer", "stop id above vocab"])
def test_params_the_engine_cannot_serve_are_refused(llm, kw):
    before = snapshot(llm)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": GOOD}] * 2, [GREEDY, SamplingParams(**kw)], use_tqdm=False)
    assert_unchanged(llm, before)


def test_wrong_argument_shapes(llm):
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([{"prompt_token_ids": GOOD}] * 2, [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate({"prompt_token_ids": GOOD}, {"temperature": 0}, use_tqdm=False)


def test_a_request_that_exactly_fits_the_cache_runs(tiny_dir, device):
    """4 blocks of 4 hold 16 tokens; the last token is never fed back, so a prompt of 10 with
    7 new tokens fits exactly and runs, and one more token is refused."""
    small = make_llm(tiny_dir, device, num_kv_blocks=4, block_size=4, max_model_len=60)
    prompt = {"prompt_token_ids": GOOD[:10]}
    out = small.generate(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7
    with pytest.raises(ValueError, match="never fit"):
        small.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)


def test_sampling_params_greedy_is_vllms_temperature_0():
    # vLLM raises a positive temperature below 1e-2 to 1e-2, so only 0 reaches its 1e-5 threshold.
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_request_that_can_never_fit_the_cache_is_refused(llm):
    # 16 blocks of 4 = 64 slots; this one may grow to 10 + 58 - 1 tokens, capped by max_model_len
    # 60 to 59 slots: it fits. With 8 blocks it would not.
    assert llm.generate({"prompt_token_ids": GOOD[:10]}, SamplingParams(max_tokens=50), use_tqdm=False)
    small = make_llm(llm.config.model, llm.config.device, num_kv_blocks=8, block_size=4,
                     max_model_len=60)
    before = snapshot(small)
    with pytest.raises(ValueError, match="never fit the KV cache"):
        small.generate({"prompt_token_ids": GOOD[:10]}, SamplingParams(max_tokens=50), use_tqdm=False)
    assert_unchanged(small, before)
    # One that fits runs, even though it must wait for the others' blocks.
    fits = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = small.generate([{"prompt_token_ids": GOOD[:10]}] * 3, fits, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_step_that_raises_leaves_no_unwritten_block_in_the_prefix_cache(tiny_dir, device,
                                                                          async_scheduling):
    """The scheduler registers a prompt's full blocks when it schedules them; if the step then
    raises (an error, Ctrl-C) before it runs, their K/V is never written. A later request with
    the same prompt must not hit them: it gets what a fresh engine gives."""
    def make():
        return make_llm(tiny_dir, device, num_kv_blocks=16, block_size=4, max_model_len=60,
                        async_scheduling=async_scheduling)

    expected = make().generate({"prompt_token_ids": GOOD}, GREEDY, use_tqdm=False)
    llm = make()
    runner = llm.engine.runner
    name = "launch" if async_scheduling else "execute"
    real = getattr(runner, name)

    def interrupted(step_input):
        raise KeyboardInterrupt
    setattr(runner, name, interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate({"prompt_token_ids": GOOD}, GREEDY, use_tqdm=False)
    setattr(runner, name, real)
    e = llm.engine
    assert not e.block_manager.registered_blocks()  # the step's four full blocks are unregistered
    e.block_manager.check(e.scheduler.running)
    assert e.stats.steps == 0 and e.stats.prompt_tokens_computed == 0  # nothing ran
    again = llm.generate({"prompt_token_ids": GOOD}, GREEDY, use_tqdm=False)
    assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert again[0].num_cached_tokens == 0


def test_a_step_that_raises_recomputes_a_sequence_that_shared_its_blocks(tiny_dir, device):
    """Two sequences of one prompt (n=2) are admitted in one step, the second taking the first's
    just-registered blocks as prefix hits. If that step never runs, the second must not keep
    them as computed: abandoning the step preempts it, and it recomputes."""
    llm = make_llm(tiny_dir, device, num_kv_blocks=32, block_size=4, max_model_len=60)
    e = llm.engine
    e.add_request({"prompt_token_ids": GOOD}, SamplingParams(n=2, temperature=0, max_tokens=4,
                                                               ignore_eos=True))
    out = e.scheduler.schedule()
    first, second = (c.seq for c in out.chunks)
    assert second.num_computed == 16 and second.block_table[:4] == first.block_table[:4]
    e.scheduler.abandon(out)
    assert not e.block_manager.registered_blocks()
    assert second.num_computed == 0 and second in e.scheduler.waiting
    e.block_manager.check(e.scheduler.running)


OTHER = {"prompt_token_ids": [30, 31, 32, 33, 34, 35]}


def make_graph_llm(tiny_dir, device):
    # On CUDA with graphs (small ones: engine_helpers.make_llm): the decode steps of the two
    # greedy requests below replay a graph that picks their tokens itself, into a static buffer
    # the next replay rewrites and into the graph's input ids (runner.ids_in_graph). An eager
    # engine would leave that form of "the device's last tokens already rewritten" untested.
    # Each such engine still takes ~45 s to start on the H200, the first ~100 s (session 41).
    return make_llm(tiny_dir, device, graphs=True, num_kv_blocks=32, block_size=4, max_model_len=60)


@pytest.fixture(scope="module")
def alone(tiny_dir, device):
    """What GOOD and OTHER each get alone, from one engine (one compile on CUDA): run one after
    the other, they share no block (OTHER's first block is not GOOD's), so neither hits the
    other's prefix."""
    llm = make_graph_llm(tiny_dir, device)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for p in ({"prompt_token_ids": GOOD}, OTHER)]


@pytest.mark.parametrize("where", ["after the launch ran", "reading the tokens"])
def test_an_interrupted_step_leaves_a_paused_streams_tokens_right(tiny_dir, device, alone, where):
    """Asynchronous scheduling launches step N+1 before it reads step N's tokens. A Ctrl-C that
    lands after a launch ran (the device's last tokens already rewritten) or while the host waits
    for a step's tokens must not cost the requests that outlive the call it ends: here a stream
    paused while generate runs gets what it gets alone."""
    llm = make_graph_llm(tiny_dir, device)
    runner = llm.engine.runner
    real_launch, launches = runner.launch, [0]
    picked = []  # per launch: whether a decode graph picked the step's tokens itself

    def interrupted_once(step_input):
        pending = real_launch(step_input)
        picked.append(runner.ids_in_graph is not None)
        launches[0] += 1
        if launches[0] == 4:
            if where == "after the launch ran":
                raise KeyboardInterrupt
            real_result = pending.result

            def result():
                pending.result = real_result
                raise KeyboardInterrupt
            pending.result = result
        return pending

    stream = llm.stream({"prompt_token_ids": GOOD}, GREEDY)
    first = next(stream)
    runner.launch = interrupted_once
    with pytest.raises(KeyboardInterrupt):
        llm.generate(OTHER, GREEDY, use_tqdm=False)
    runner.launch = real_launch
    # On CUDA the interrupted launch (both requests' decode) replayed a graph that picked them.
    assert picked[3] == (device.type == "cuda"), picked
    tokens = [t for d in (first, *stream) for c in d.outputs for t in c.token_ids]
    assert tokens == alone[0]
    assert llm.generate(OTHER, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == alone[1]
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("content, match", [
    ("{not json", "cannot read it as JSON"),
    ('[1, 2]', "must hold a JSON object, got list"),
    ('{"eos_token_id": "7"}', "eos_token_id must be"),
    ('{"eos_token_id": [7, -1]}', "eos_token_id must be"),
])
def test_a_malformed_generation_config_is_named(tmp_path, content, match):
    from types import SimpleNamespace

    from minivllm.runtime.engine import read_eos_ids

    config = SimpleNamespace(eos_token_ids=(3,))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [5, null, 6]}')
    assert read_eos_ids(str(tmp_path), config, None) == (3, 5, 6)
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match) as e:
        read_eos_ids(str(tmp_path), config, None)
    assert "generation_config.json" in str(e.value)
