"""Sleep mode with a draft model (speculative_config {"model": DRAFT, ...}): as vLLM, whose
draft is loaded into the "weights" memory pool and whose KV cache holds the draft's layers, sleep
frees the draft's weights (level 1: a host copy) and its KV cache with the target's, wake_up's
"weights" and "kv_cache" tags bring back each model's share, and a failure part-way through
the draft's part gives everything back. Level 2 is refused: vLLM leaves a draft's discarded
weights undefined after its reload_weights (vllm-project/vllm issue 52479).

Oracles: transformers' greedy decoding of the target checkpoint, an engine with the same draft
that never slept (its tokens and its speculative acceptance counters), and the storages' sizes
(on the CPU they are resized as on a GPU, so what sleep frees is checked byte for byte)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._pytree import tree_leaves

from minivllm import LLM, SamplingParams

from hf_tiny import hf_greedy, make_hf_model, save_checkpoint

ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu", block_size=4,
              max_num_batched_tokens=64, enable_sleep_mode=True)
NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [torch.randint(0, 101, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (23, 6, 11)]


@pytest.fixture(scope="module")
def target_model():
    return make_hf_model(seed=1)


@pytest.fixture(scope="module")
def dirs(target_model, tmp_path_factory):
    """The target's checkpoint and a draft's: the target's weights slightly perturbed, whose
    drafts are partly accepted (so the acceptance counters tell a right draft from a wrong one)."""
    root = tmp_path_factory.mktemp("sleep_draft")
    near = make_hf_model(seed=1)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(0.03 * torch.randn_like(p))
    return save_checkpoint(target_model, root / "target"), save_checkpoint(near, root / "near")


@pytest.fixture(scope="module")
def reference(target_model):
    return [hf_greedy(target_model, p, NEW) for p in PROMPTS]


def spec(dirs) -> dict:
    return {"model": dirs[1], "num_speculative_tokens": 3}


def make(dirs, **kw) -> LLM:
    return LLM(dirs[0], speculative_config=spec(dirs), **dict(ENGINE, **kw))


def counters(llm) -> tuple:
    s = llm.stats
    return (s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens,
            tuple(s.spec_accepted_per_pos))


def run(llm) -> tuple[list[list[int]], tuple]:
    """The prompts' greedy tokens and what this run added to the speculative counters."""
    before = counters(llm)
    tokens = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)]
    after = counters(llm)
    pos = tuple(a - b for a, b in zip(after[3], before[3] + (0,) * len(after[3])))
    return tokens, tuple(a - b for a, b in zip(after[:3], before[:3])) + (pos,)


@pytest.fixture(scope="module")
def never_slept(dirs):
    """An engine with the same draft, no sleep: its tokens and counters for one run."""
    with LLM(dirs[0], speculative_config=spec(dirs),
             **dict(ENGINE, enable_sleep_mode=False)) as llm:
        return run(llm)


def sizes(tree) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def expected_sizes(tree) -> list[int]:
    return [t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def trees(runner) -> dict:
    return {"params": runner.params, "cache": runner.cache, "draft_params": runner.draft_params,
            "draft_cache": runner.draft_cache}


def freed(runner) -> dict[str, bool]:
    """Per tree, whether every storage under it is empty (nbytes 0)."""
    return {name: set(sizes(tree)) == {0} for name, tree in trees(runner).items()}


def whole(runner) -> dict[str, bool]:
    """Per tree, whether every leaf has its storage's bytes."""
    return {name: sizes(tree) == expected_sizes(tree) for name, tree in trees(runner).items()}


def weights_of(runner) -> list[torch.Tensor]:
    return [t.clone() for t in tree_leaves((runner.params, runner.draft_params))
            if isinstance(t, torch.Tensor)]


def same_weights(runner, saved) -> bool:
    now = [t for t in tree_leaves((runner.params, runner.draft_params))
           if isinstance(t, torch.Tensor)]
    return len(now) == len(saved) and all(torch.equal(a, b) for a, b in zip(now, saved))


def test_level_1_frees_the_draft_and_wakes_to_the_same_tokens_and_acceptance(
        dirs, reference, never_slept):
    """sleep(1) empties every storage of the target's and the draft's weights and caches; after
    wake_up, in the same tensor objects, the tokens are transformers' and the never-slept
    engine's, and the drafts are accepted as often, position by position (a draft whose weights
    came back wrong would draft other tokens)."""
    assert never_slept[0] == reference
    drafts, drafted, accepted, _ = never_slept[1]
    assert drafts > 0 and 0 < accepted < drafted  # partial acceptance: the counters tell
    with make(dirs) as llm:
        runner = llm.engine.runner
        objects = trees(runner)
        before = run(llm)
        assert before == never_slept
        saved = weights_of(runner)
        llm.sleep(1)
        assert llm.is_sleeping()
        assert freed(runner) == dict.fromkeys(objects, True)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert all(trees(runner)[name] is tree for name, tree in objects.items())
        assert all(whole(runner).values())
        assert same_weights(runner, saved)
        assert run(llm) == never_slept
        # and again: a second cycle from the state the first left
        llm.sleep(1)
        assert freed(runner) == dict.fromkeys(objects, True)
        llm.wake_up()
        assert run(llm) == never_slept


@pytest.mark.parametrize("first", ["weights", "kv_cache"])
def test_tag_wise_wake_up_brings_back_each_models_share(dirs, never_slept, first):
    """wake_up([first]) brings back the target's and the draft's memory of that tag only (the
    weights with their bytes, the caches zeroed); the rest sleeps, steps are refused, until the
    other tag's wake_up. verl's order (weights, load_weights, kv_cache) loads the target's
    checkpoint again in between."""
    other = "kv_cache" if first == "weights" else "weights"
    weight_trees, cache_trees = {"params", "draft_params"}, {"cache", "draft_cache"}
    woken = weight_trees if first == "weights" else cache_trees
    with make(dirs) as llm:
        runner = llm.engine.runner
        run(llm)
        saved = weights_of(runner)
        llm.sleep(1)
        llm.wake_up([first])
        assert llm.engine.sleeping == {other}
        assert whole(runner) == {name: name in woken for name in trees(runner)}
        assert freed(runner) == {name: name not in woken for name in trees(runner)}
        if first == "kv_cache":
            assert not any(t.any() for t in tree_leaves((runner.cache, runner.draft_cache)))
        with pytest.raises(ValueError, match="sleeping"):
            run(llm)
        if first == "weights":
            assert same_weights(runner, saved)
            pairs = list(load_file(os.path.join(dirs[0], "model.safetensors")).items())
            llm.load_weights(pairs)
        llm.wake_up([other])
        assert not llm.is_sleeping() and all(whole(runner).values())
        assert same_weights(runner, saved)
        assert run(llm) == never_slept


def test_level_2_is_refused_with_a_draft_model(dirs, never_slept, reference):
    """Level 2 would discard the draft's weights, which load_weights (the target's names) does
    not refill: a ValueError naming the draft model before anything is freed, from the engine
    and from the runner alike; the engine then runs and sleeps at level 1 as before. n-gram
    speculation, which has no draft model, sleeps at level 2 as an engine without speculation."""
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with LLM(dirs[0], speculative_config=ngram, **ENGINE) as llm:
        assert llm.engine.runner.draft_params is None
        llm.sleep(2)
        llm.wake_up()
        llm.load_weights(list(load_file(os.path.join(dirs[0], "model.safetensors")).items()))
        assert run(llm)[0] == reference
    with make(dirs) as llm:
        runner = llm.engine.runner
        run(llm)
        saved = weights_of(runner)
        with pytest.raises(ValueError, match="level=2.*draft model"):
            llm.sleep(2)
        with pytest.raises(ValueError, match="level=2.*draft model"):
            runner.sleep(2)
        assert not llm.is_sleeping() and runner.asleep == {}
        assert all(whole(runner).values()) and same_weights(runner, saved)
        assert run(llm) == never_slept
        llm.sleep(1)
        llm.wake_up()
        assert run(llm) == never_slept


def unresizable(tensor: torch.Tensor) -> None:
    """Point `tensor` at a copy of its bytes in memory that cannot be resized (numpy's, as a
    memory-mapped checkpoint's is): sleep's resize_(0) of it raises."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().copy()
    storage = torch.from_numpy(data).untyped_storage()
    assert not storage.resizable()
    with torch.no_grad():
        tensor.set_(storage, 0, tensor.shape, tensor.contiguous().stride())


def resizable_again(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.set_(tensor.clone().untyped_storage(), 0, tensor.shape, tensor.stride())


@pytest.mark.parametrize("part", ["draft_params", "draft_cache"])
def test_a_failure_in_the_drafts_part_of_sleep_gives_everything_back(dirs, never_slept, part):
    """A sleep that fails freeing the draft's last storage (its weights: after both caches and
    the target's weights were freed; its cache: after the target's cache was) raises with the
    engine awake: every storage has its bytes again, the weights their values, and the engine
    gives the never-slept engine's tokens and acceptance; once the storage can be freed, sleep
    and wake_up work."""
    with make(dirs) as llm:
        runner = llm.engine.runner
        run(llm)
        saved = weights_of(runner)
        victim = [t for t in tree_leaves(getattr(runner, part)) if isinstance(t, torch.Tensor)][-1]
        unresizable(victim)
        with pytest.raises(RuntimeError, match="not resizable"):
            llm.sleep(1)
        assert not llm.is_sleeping() and runner.asleep == {}
        assert all(whole(runner).values())
        assert same_weights(runner, saved)
        assert run(llm) == never_slept
        resizable_again(victim)
        llm.sleep(1)
        assert all(freed(runner).values())
        llm.wake_up()
        assert run(llm) == never_slept


# -- on a GPU -------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_sleep_frees_the_drafts_memory_and_its_graphs_replay_after_wake_up(dirs,
                                                                               monkeypatch):
    """On a GPU, a compiled engine with decode CUDA graphs for the target and the draft, bf16:
    sleep(1) empties every storage of both models' weights and caches and lowers
    torch.cuda.memory_allocated by at least their bytes; wake_up takes at least that back,
    captures both models' decode graphs again (no compile), and the draft's graphs replay in
    propose's rounds, with the tokens and acceptance counters of before the sleep."""
    from engine_helpers import make_llm
    from minivllm.runtime.graphs import DecodeGraphs

    captures = []
    inner = DecodeGraphs.capture
    monkeypatch.setattr(DecodeGraphs, "capture",
                        lambda self, *a, **kw: captures.append(self) or inner(self, *a, **kw))
    cuda = torch.device("cuda")
    llm = make_llm(dirs[0], cuda, graphs=True, dtype="bfloat16", block_size=16,
                   enable_sleep_mode=True, speculative_config=spec(dirs))
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.draft_graphs is not None
    assert len(captures) == 2  # the target's decode graphs and the draft's
    draft_replays, inner_replay = [], runner.draft_graphs.replay
    runner.draft_graphs.replay = lambda b: draft_replays.append(b) or inner_replay(b)
    before = run(llm)
    assert draft_replays and before[1][1] > 0
    draft_held = sum(expected_sizes(runner.draft_params)) + \
        sum(expected_sizes(runner.draft_cache))
    held = sum(expected_sizes(runner.params)) + sum(expected_sizes(runner.cache)) + draft_held
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    llm.sleep(1)
    assert all(freed(runner).values()), freed(runner)
    drop = allocated - torch.cuda.memory_allocated()
    assert drop >= held, (drop, held, draft_held)
    llm.wake_up()
    assert all(whole(runner).values())
    assert len(captures) == 4 and runner.draft_graphs in captures[2:]  # again, once each
    assert torch.cuda.memory_allocated() >= allocated - drop + held
    draft_replays.clear()
    assert run(llm) == before
    assert draft_replays  # propose's rounds replayed the draft's new graphs
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles
    llm.shutdown()


def test_the_servers_level_2_sleep_is_refused_with_a_draft_model_aborting_nothing(
        dirs, never_slept, monkeypatch):
    """POST /sleep?level=2 on a server whose engine drafts with a model: a 400 naming the draft
    model, checked before the sleep's default mode (abort) would abort the running requests."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from minivllm.runtime.server import OpenAIServer

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with make(dirs, max_model_len=256) as llm:
        srv = OpenAIServer(llm, port=0, model_name="m")
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        slept = []  # the engine loop's sleep (which aborts the running requests first)
        real_sleep = srv.loop.sleep
        monkeypatch.setattr(srv.loop, "sleep", lambda *a: slept.append(a) or real_sleep(*a))
        host, port = srv.address
        req = urllib.request.Request(f"http://{host}:{port}/sleep?level=2", data=b"",
                                     method="POST")
        try:
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            assert e.value.code == 400
            assert "draft model" in json.loads(e.value.read())["error"]["message"]
            assert not slept and not llm.is_sleeping()
            assert run(llm) == never_slept
        finally:
            srv.shutdown()
