"""Sleep mode (vLLM's LLM.sleep / wake_up / is_sleeping, runtime/sleep.py), as RL loops use it
around load_weights. The oracles are transformers' greedy decoding of the same checkpoint and a
fresh engine (fp32 on the CPU: tokens and logprobs match exactly); on the CPU the storages are
resized as on a GPU, so what sleep frees is checked byte for byte."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file
from torch.utils._pytree import tree_leaves

from minivllm import LLM, SamplingParams
from minivllm.runtime.sleep import offload, owned, restore, storages

from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu", block_size=4,
              max_num_batched_tokens=64, enable_sleep_mode=True)
NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
# 23 tokens: five full blocks of 4, which the prefix cache registers.
PROMPTS = [torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (23, 6)]


@pytest.fixture(scope="module")
def models():
    return make_hf_model(seed=1), make_hf_model(seed=2)


@pytest.fixture(scope="module")
def dirs(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("sleep")
    return tuple(save_checkpoint(m, root / name) for m, name in zip(models, "ab"))


@pytest.fixture(scope="module")
def reference(models):
    """Checkpoint A's and B's greedy tokens by transformers, per prompt."""
    return [[hf_greedy(m, p, NEW) for p in PROMPTS] for m in models]


def run(llm, prompts=PROMPTS):
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                               GREEDY, use_tqdm=False)]
    return ([o.token_ids for o in outs],
            [[lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)] for o in outs])


def checkpoint_pairs(path):
    """The checkpoint's own (name, tensor) pairs, read from its safetensors file."""
    return list(load_file(os.path.join(path, "model.safetensors")).items())


def sizes(tree) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def expected_sizes(tree) -> list[int]:
    return [t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


# -- the functions -----------------------------------------------------------------------------


def test_offload_and_restore_keep_the_tensors_and_their_bytes():
    """A storage viewed by two tensors is emptied and copied once; restore brings the bytes back
    (kept) or zeros (discarded), into the same tensor objects."""
    base = torch.randn(6, 4)
    view = base[2:]  # the same storage
    other = torch.randn(3)
    tree = {"a": base, "b": view, "c": [other]}
    want = [t.clone() for t in (base, view, other)]
    assert len(storages(tree)) == 2
    off = offload(tree, keep=True)
    assert sizes(tree) == [0, 0, 0]
    assert off.nbytes == [96, 12]
    restore(off)
    assert all(torch.equal(t, w) for t, w in zip((base, view, other), want))
    off = offload(tree, keep=False)
    restore(off)
    assert sizes(tree) == [96, 96, 12]
    assert not base.any() and not other.any()


def test_owned_copies_only_what_cannot_be_freed(dirs):
    """A CPU checkpoint's tensors are memory-mapped by safetensors (their storages cannot be
    resized): owned copies those, same values, and keeps the others."""
    from minivllm.state.load import load

    params = load(dirs[0])
    mapped = [not t.untyped_storage().resizable() for t in tree_leaves(params)]
    assert any(mapped)
    got = owned(params)
    for was, new, m in zip(tree_leaves(params), tree_leaves(got), mapped):
        assert new.untyped_storage().resizable()
        assert torch.equal(was, new) and (new is not was) == m


# -- the engine --------------------------------------------------------------------------------


def test_level_1_frees_every_storage_and_wakes_to_the_same_tokens(dirs, reference):
    with LLM(dirs[0], **ENGINE) as llm:
        runner = llm.engine.runner
        params, cache = runner.params, runner.cache
        before = run(llm)
        assert before[0] == reference[0]
        run(llm)  # the long prompt's blocks are cached now
        sched = llm.engine.scheduler
        assert sched.num_prefix_cache_hits > 0
        llm.sleep(1)
        assert llm.is_sleeping()
        assert set(sizes(params)) == {0} and set(sizes(cache)) == {0}
        llm.wake_up()
        assert not llm.is_sleeping()
        assert runner.params is params and runner.cache is cache  # the same objects
        assert sizes(params) == expected_sizes(params) and sizes(cache) == expected_sizes(cache)
        hits = sched.num_prefix_cache_hits
        assert run(llm) == before  # no K/V of before the sleep reused: the prefix cache reset
        assert sched.num_prefix_cache_hits == hits


def test_level_2_and_load_weights_equal_a_fresh_engine(dirs):
    with LLM(dirs[0], **ENGINE) as fresh:
        want = run(fresh)
    with LLM(dirs[0], **ENGINE) as llm:
        run(llm)
        llm.sleep(level=2)
        llm.wake_up()
        assert not any(t.any() for t in tree_leaves(llm.engine.runner.params))  # discarded
        llm.load_weights(checkpoint_pairs(dirs[0]))
        assert run(llm) == want


@pytest.mark.parametrize("level", [1, 2])
def test_verls_order_wakes_the_weights_loads_then_wakes_the_cache(models, dirs, reference, level):
    """wake_up(["weights"]), load_weights, wake_up(["kv_cache"]): checkpoint B's tokens."""
    with LLM(dirs[1], **ENGINE) as fresh:
        want = run(fresh)
    assert want[0] == reference[1]
    with LLM(dirs[0], **ENGINE) as llm:
        run(llm)
        runner = llm.engine.runner
        llm.sleep(level)
        llm.wake_up(tags=["weights"])
        assert llm.is_sleeping()  # the KV cache still sleeps
        assert sizes(runner.params) == expected_sizes(runner.params)
        assert set(sizes(runner.cache)) == {0}
        with pytest.raises(ValueError, match="sleeping"):
            run(llm)
        llm.load_weights(models[1].state_dict().items())
        llm.wake_up(tags=["kv_cache"])
        assert not llm.is_sleeping()
        assert run(llm) == want


def test_kv_cache_first_then_weights(dirs):
    with LLM(dirs[0], **ENGINE) as llm:
        before = run(llm)
        llm.sleep()
        llm.wake_up(["kv_cache"])
        with pytest.raises(ValueError, match="while the weights sleep"):
            llm.load_weights(checkpoint_pairs(dirs[0]))
        llm.wake_up(["weights"])
        assert run(llm) == before


def test_sleeping_twice_and_waking_what_is_awake_do_nothing(dirs, caplog):
    """As vLLM: a second sleep (even of another level) and a wake_up of an awake engine or of a
    tag awake already change nothing and warn; the other tags a wake_up names are woken."""
    with LLM(dirs[0], **ENGINE) as llm:
        before = run(llm)
        caplog.set_level(logging.WARNING, logger="minivllm")
        llm.wake_up()
        assert "not sleeping" in caplog.text
        llm.sleep(1)
        caplog.clear()
        llm.sleep(2)  # would discard the host copy
        assert "sleeping already" in caplog.text
        llm.wake_up(["weights"])
        caplog.clear()
        llm.wake_up(["weights", "kv_cache"])  # weights awake already: the cache is woken
        assert "weights is not sleeping" in caplog.text and not llm.is_sleeping()
        assert run(llm) == before


def test_persistent_decode_table_is_rebuilt(dirs, reference):
    """The persistent decode (Triton, under the CPU interpreter) reads the weights and the cache
    through a table of their addresses: after a wake-up it holds the new ones, and the tokens
    are transformers'."""
    from minivllm.kernels import available_backends
    from minivllm.kernels.decode_layer import layer_table

    if "triton" not in available_backends(torch.device("cpu")):
        pytest.skip("no Triton interpreter")
    kw = dict(ENGINE, attention_backend="triton", persistent_decode=True)
    with LLM(dirs[0], **kw) as llm:
        runner = llm.engine.runner

        def table():
            return runner.small_decode_forward.keywords["layers"].keywords["table"]
        assert run(llm, PROMPTS[1:])[0] == reference[0][1:]
        llm.sleep(1)
        llm.wake_up()
        want = layer_table(runner.params.layers, runner.cache.k, runner.cache.v)
        assert torch.equal(table(), want)
        assert run(llm, PROMPTS[1:])[0] == reference[0][1:]


def test_lora_slots_sleep_too(dirs, models, tmp_path):
    """A LoRA engine's slot weights are params: level 1 brings them back; after level 2 the
    adapter is written into its slot again (the merged model's tokens, by transformers)."""
    from test_lora import merged, write_adapter

    from minivllm import LoRARequest

    weights, scale = write_adapter(tmp_path / "ad", dirs[0], r=4, alpha=8,
                                   targets="all-linear", seed=3)
    want = [hf_greedy(merged(models[0], weights, scale), p, NEW) for p in PROMPTS]
    lora = LoRARequest("ad", 1, str(tmp_path / "ad"))
    with LLM(dirs[0], enable_lora=True, max_lora_rank=8, **ENGINE) as llm:
        assert llm.engine.runner.params.lora is not None

        def tokens():
            return [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                lora_request=lora)]
        assert tokens() == want
        llm.sleep(1)
        assert set(sizes(llm.engine.runner.params.lora)) == {0}
        llm.wake_up()
        assert tokens() == want
        llm.sleep(2)
        llm.wake_up()
        llm.load_weights(checkpoint_pairs(dirs[0]))
        assert tokens() == want


def test_pooling_engine(dirs, models):
    """An embedding engine sleeps and wakes to the same embeddings (transformers' last hidden
    state, normalized)."""
    from torch.nn.functional import normalize

    with LLM(dirs[0], runner="pooling", **ENGINE) as llm:
        def embed():
            return [torch.tensor(o.outputs.embedding) for o in
                    llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)]
        before = embed()
        with torch.no_grad():
            want = [normalize(models[0].model(torch.tensor([p])).last_hidden_state[0, -1], dim=-1)
                    for p in PROMPTS]
        for got, w in zip(before, want):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
        llm.sleep(1)
        with pytest.raises(ValueError, match="sleeping"):
            embed()
        llm.wake_up()
        assert all(torch.equal(a, b) for a, b in zip(embed(), before))


# -- refusals: ValueError before any work, nothing changed ----------------------------------------


def test_without_sleep_mode(dirs):
    with LLM(dirs[0], **dict(ENGINE, enable_sleep_mode=False)) as llm:
        for call in (llm.sleep, llm.wake_up):
            with pytest.raises(ValueError, match="enable_sleep_mode=True"):
                call()
        assert not llm.is_sleeping()
        assert set(sizes(llm.engine.runner.params)) != {0}


@pytest.mark.parametrize("level", [0, 3, True, "1", None])
def test_a_bad_level(dirs, level):
    with LLM(dirs[0], **ENGINE) as llm:
        with pytest.raises(ValueError, match="sleep level must be 1"):
            llm.sleep(level)
        assert not llm.is_sleeping()
        assert sizes(llm.engine.runner.params) == expected_sizes(llm.engine.runner.params)


@pytest.mark.parametrize("tags", ["weights", ["weight"], [], ["kv_cache", "cache"], 1])
def test_a_bad_tag(dirs, tags):
    with LLM(dirs[0], **ENGINE) as llm:
        llm.sleep()
        with pytest.raises(ValueError, match="tags are a"):
            llm.wake_up(tags)
        assert llm.engine.sleeping == {"weights", "kv_cache"}
        assert set(sizes(llm.engine.runner.params)) == {0}


def test_sleep_while_requests_run(dirs):
    with LLM(dirs[0], **ENGINE) as llm:
        rid = llm.engine.add_request({"prompt_token_ids": PROMPTS[0]}, GREEDY)
        llm.engine.step()
        with pytest.raises(ValueError, match="requests are unfinished"):
            llm.sleep()
        assert not llm.is_sleeping()
        llm.engine.abort_request(rid)
        llm.sleep()  # accepted once none runs
        assert llm.is_sleeping()


def test_requests_while_asleep(dirs):
    from minivllm import BeamSearchParams

    with LLM(dirs[0], **ENGINE) as llm:
        llm.sleep()
        prompt = {"prompt_token_ids": PROMPTS[1]}
        for call in (lambda: llm.generate([prompt], GREEDY, use_tqdm=False),
                     lambda: list(llm.stream([prompt], GREEDY)),
                     lambda: llm.engine.add_request(prompt, GREEDY),
                     lambda: llm.beam_search([prompt], BeamSearchParams(beam_width=2,
                                                                         max_tokens=2)),
                     lambda: llm.engine.add_pooling_requests([prompt], [None])):
            with pytest.raises(ValueError, match=r"the engine is sleeping .*wake_up\(\)"):
                call()
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="while the weights sleep"):
            llm.load_weights(checkpoint_pairs(dirs[0]))


# -- sequences of sleeps and wake-ups ------------------------------------------------------------

OPS = st.sampled_from([("sleep", 1), ("sleep", 2), ("wake", None), ("wake", ("weights",)),
                       ("wake", ("kv_cache",)), ("wake", ("weights", "kv_cache")),
                       ("load", None), ("run", None)])


@pytest.fixture(scope="module")
def shared(dirs):
    llm = LLM(dirs[0], **ENGINE)
    yield llm
    llm.shutdown()


@settings(max_examples=15)
@given(ops=st.lists(OPS, min_size=1, max_size=8))
def test_any_sequence_of_sleeps_wake_ups_and_loads(shared, dirs, reference, ops):
    """A model of the state: which tags sleep, and whether the weights are the checkpoint's
    (not after a level-2 sleep until load_weights). Each call does what the model says: runs
    give transformers' tokens when all is awake and the weights are whole, are refused while
    anything sleeps; load_weights is refused while the weights sleep."""
    llm = shared
    if llm.is_sleeping():  # each example starts awake, with the checkpoint's weights
        llm.wake_up()
    llm.load_weights(checkpoint_pairs(dirs[0]))
    asleep, whole = set(), True
    for op, arg in ops:
        if op == "sleep":
            llm.sleep(arg)
            if not asleep:
                asleep, whole = {"weights", "kv_cache"}, arg == 1
        elif op == "wake":
            llm.wake_up(None if arg is None else list(arg))
            asleep -= set(arg or asleep)  # None: all that sleeps; a tag awake stays so
        elif op == "load":
            if "weights" in asleep:
                with pytest.raises(ValueError, match="while the weights sleep"):
                    llm.load_weights(checkpoint_pairs(dirs[0]))
            else:
                llm.load_weights(checkpoint_pairs(dirs[0]))
                whole = True
        elif asleep:
            with pytest.raises(ValueError, match="sleeping"):
                run(llm)
        else:
            tokens = run(llm)[0]
            if whole:  # else zeros' tokens, whatever they are
                assert tokens == reference[0]
        assert llm.engine.sleeping == asleep
        assert llm.is_sleeping() == bool(asleep)
        params, cache = llm.engine.runner.params, llm.engine.runner.cache
        assert (set(sizes(params)) == {0}) == ("weights" in asleep)
        assert (set(sizes(cache)) == {0}) == ("kv_cache" in asleep)


# -- tensor parallelism --------------------------------------------------------------------------


def test_tensor_parallel_engine(models, dirs):
    """tensor_parallel_size=2 (gloo, a spawned worker): each rank sleeps its own shard; after a
    level-1 cycle the engine gives TP=1's tokens, and after a level-2 cycle and load_weights of
    checkpoint B, a fresh TP=1 engine of B's."""
    with LLM(dirs[0], **ENGINE) as tp1:
        want_a = run(tp1)
    with LLM(dirs[1], **ENGINE) as tp1:
        want_b = run(tp1)
    with LLM(dirs[0], tensor_parallel_size=2, **ENGINE) as llm:
        run(llm)
        llm.sleep(1)
        assert set(sizes(llm.engine.runner.params)) == {0}
        llm.wake_up()
        got = run(llm)
        assert got[0] == want_a[0]
        torch.testing.assert_close(got[1], want_a[1], rtol=0, atol=1e-5)
        llm.sleep(2)
        llm.wake_up(["weights"])
        llm.load_weights(models[1].state_dict().items())
        llm.wake_up(["kv_cache"])
        got = run(llm)
    assert got[0] == want_b[0]
    torch.testing.assert_close(got[1], want_b[1], rtol=0, atol=1e-5)


# -- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sleep_frees_the_memory_and_the_graphs_replay_after_wake_up(dirs, monkeypatch):
    """On a GPU, a compiled engine with its decode CUDA graphs (and, where it takes them, the
    persistent decode's layer table and the prefill graphs), bf16: sleep(1) lowers
    torch.cuda.memory_allocated by at least the weights' and the cache's bytes (the graphs' pool
    goes too); after wake_up the graphs, captured again with no compile, replay and give the
    greedy tokens of before the sleep."""
    from engine_helpers import make_llm
    from minivllm.runtime.graphs import DecodeGraphs

    captures = []
    inner = DecodeGraphs.capture
    monkeypatch.setattr(DecodeGraphs, "capture",
                        lambda self, *a, **kw: captures.append(1) or inner(self, *a, **kw))
    cuda = torch.device("cuda")
    batches = [PROMPTS, PROMPTS + [[7, 8, 9, 7, 8], list(range(40, 52))]]
    llm = make_llm(dirs[0], cuda, graphs=True, dtype="bfloat16", block_size=16,
                   enable_sleep_mode=True)
    runner = llm.engine.runner
    assert runner.graphs is not None
    replays, inner_replay = [], runner.graphs.replay
    runner.graphs.replay = lambda b: replays.append(b) or inner_replay(b)
    before = [run(llm, b)[0] for b in batches]
    assert replays
    held = sum(expected_sizes(runner.params)) + sum(expected_sizes(runner.cache))
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    llm.sleep(1)
    freed = allocated - torch.cuda.memory_allocated()
    assert freed >= held, (freed, held)
    assert torch.cuda.memory_allocated() < allocated - 0.9 * held
    llm.wake_up()
    assert len(captures) == 2  # captured again, once
    assert torch.cuda.memory_allocated() >= allocated - freed + held
    replays.clear()
    assert [run(llm, b)[0] for b in batches] == before
    assert replays  # the decode steps replayed the new graphs
    # Nothing compiled again: the recapture and the steps ran the code compiled at start-up.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
