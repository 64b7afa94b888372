"""The engine's management calls misused or failing part-way (audit, session 75): a refused or
failed reset_prefix_cache, load_weights, sleep or wake_up leaves the engine giving the same
greedy tokens, or says what is left. fp32 on the CPU: tokens match exactly."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import minivllm.runtime.runner as runner_module
from minivllm import LLM, SamplingParams

from hf_tiny import make_hf_model, save_checkpoint

ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu", block_size=4,
              max_num_batched_tokens=64, enable_sleep_mode=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# 23 tokens: five full blocks of 4, which the prefix cache registers.
PROMPTS = [{"prompt_token_ids": torch.randint(0, 101, (n,), generator=torch.Generator()
                                              .manual_seed(n)).tolist()} for n in (23, 6)]


@pytest.fixture(scope="module")
def model():
    return make_hf_model(seed=1)


@pytest.fixture(scope="module")
def path(model, tmp_path_factory):
    return save_checkpoint(model, tmp_path_factory.mktemp("s75") / "a")


@pytest.fixture(scope="module")
def reference(path):
    with LLM(path, **ENGINE) as engine:
        return run(engine)


@pytest.fixture
def llm(path):
    """A fresh engine per test: one a test leaves broken breaks no other."""
    with LLM(path, **ENGINE) as engine:
        yield engine


def run(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def leaves(llm) -> list[torch.Tensor]:
    return [t.clone() for t in tree_leaves(llm.engine.runner.params)
            if isinstance(t, torch.Tensor)]


def test_reset_prefix_cache_while_requests_run_is_refused_as_vllms(llm, reference):
    """vLLM's reset_prefix_cache returns False, resetting nothing, while requests hold blocks
    (whose K/V would stay cached past the reset); True once none does."""
    bm = llm.engine.block_manager
    assert run(llm) == reference
    rid = llm.engine.add_request(PROMPTS[0], GREEDY)
    llm.engine.step()
    registered = dict(bm.registered_blocks())
    assert registered
    refused = llm.reset_prefix_cache()
    kept = bm.registered_blocks()
    llm.engine.abort_request(rid)
    assert refused is False and kept == registered
    assert llm.reset_prefix_cache() is True
    assert not bm.registered_blocks()
    assert run(llm) == reference


@pytest.mark.parametrize("make, match", [
    (lambda t: torch.empty_like(t, device="meta"), "is a meta tensor"),
    (lambda t: t.to_sparse(), "is a sparse_coo tensor"),
])
def test_load_weights_of_an_uncopyable_tensor_changes_nothing(llm, model, reference, make,
                                                              match):
    """A tensor whose values copy_ cannot read, after a good pair: refused before the good
    pair is copied (it was copied, and the update then failed part-way, the weights mixed)."""
    pairs = list(model.state_dict().items())
    old = leaves(llm)
    bad = [(pairs[0][0], torch.zeros_like(pairs[0][1])), (pairs[1][0], make(pairs[1][1]))]
    with pytest.raises(ValueError, match=match):
        llm.load_weights(bad)
    assert all(torch.equal(a, b) for a, b in zip(leaves(llm), old))
    assert run(llm) == reference


def test_a_copy_that_fails_part_way_says_the_weights_may_be_mixed(llm, model, reference,
                                                                  monkeypatch):
    real = runner_module.copy_hf_weights_

    def fails_after_the_first(params, checked):
        real(params, checked[:1])
        raise RuntimeError("device lost")

    pairs = list(model.state_dict().items())
    monkeypatch.setattr(runner_module, "copy_hf_weights_", fails_after_the_first)
    with pytest.raises(RuntimeError, match="some of the new weights.*load the whole set again"):
        llm.load_weights([(n, torch.zeros_like(t)) for n, t in pairs])
    monkeypatch.undo()
    llm.load_weights(pairs)  # the whole set again
    assert run(llm) == reference


@pytest.mark.parametrize("failing", [1, 2])
def test_a_wake_up_that_fails_keeps_what_sleeps_for_a_retry(llm, reference, monkeypatch,
                                                             failing):
    """A restore that fails (the trainer still holds the device's memory: an OOM), part-way
    through the weights (1st) or at the KV cache (2nd): wake_up again wakes all, level 1's
    weights from their host copy (it was forgotten before the restore: KeyError ever after)."""
    real, calls = runner_module.restore, []

    def flaky(off):
        calls.append(off)
        if len(calls) == failing:
            off.storages[0].resize_(off.nbytes[0])  # part-way
            raise RuntimeError("out of memory")
        real(off)

    monkeypatch.setattr(runner_module, "restore", flaky)
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="out of memory"):
        llm.wake_up()
    assert llm.is_sleeping()
    llm.wake_up()
    assert not llm.is_sleeping() and not llm.engine.runner.asleep
    assert run(llm) == reference


def test_a_sleep_that_fails_releases_nothing(llm, reference, monkeypatch):
    """No host memory for the weights' copy: nothing sleeps and the CUDA graphs (here a spy
    standing for them) stay captured; they were released first, every decode replay failing."""
    released = []

    def no_host_memory(tree, *, keep):
        raise RuntimeError("cannot allocate pinned memory")

    monkeypatch.setattr(runner_module, "stage", no_host_memory)
    monkeypatch.setattr(llm.engine.runner, "_drop_captures", lambda: released.append(1))
    with pytest.raises(RuntimeError, match="pinned memory"):
        llm.sleep(1)
    assert not llm.is_sleeping() and not released
    monkeypatch.undo()
    assert run(llm) == reference
