"""Priority scheduling (vLLM's scheduling_policy="priority"): requests with a lower priority
value are admitted, take the step budget and keep their blocks first; the outputs of greedy
requests do not depend on the order they ran in (against the same requests under "fcfs"). The
scheduler's own invariants under both policies are test_runtime_scheduler.py's state machine."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.runtime.demo import ensure_demo_model

from engine_helpers import make_llm

PROMPTS = ["The quick brown fox", "Hello, my name is", "To be, or not to be",
           "Once upon a time", "The capital of France is"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir():
    return ensure_demo_model()


def run_in_order(llm, priority):
    """Every prompt queued at once, then stepped to the end: (outputs by prompt, the order the
    requests finished in)."""
    engine = llm.engine
    ids = engine.add_requests(PROMPTS, [GREEDY] * len(PROMPTS), priority)
    done, order = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
                order.append(ids.index(out.request_id))
    return [done[i] for i in ids], order


def test_one_at_a_time_they_run_in_priority_order(model_dir, device):
    priority = [2, 0, 1, 0, -1]
    llm = make_llm(model_dir, device, max_num_seqs=1, scheduling_policy="priority",
                   async_scheduling=False)
    outs, order = run_in_order(llm, priority)
    assert order == sorted(range(len(PROMPTS)), key=lambda k: (priority[k], k))  # ties: arrival
    fcfs = make_llm(model_dir, device, max_num_seqs=1)
    want, fcfs_order = run_in_order(fcfs, None)
    assert fcfs_order == list(range(len(PROMPTS))) and outs == want


def test_the_lowest_priority_is_preempted_and_results_do_not_change(model_dir, device):
    """A cache too small for all five: the scheduler preempts, always the lowest priority's
    latest of all running (as vLLM's), and greedy outputs are those of the
    same requests under fcfs with a cache that holds them all."""
    priority = [3, 0, 2, 1, 0]
    llm = make_llm(model_dir, device, num_kv_blocks=8, block_size=8, scheduling_policy="priority")
    preempted = []
    scheduler = llm.engine.scheduler
    real = scheduler.preempt

    def record(seq):
        preempted.append(seq.priority)
        real(seq)
    scheduler.preempt = record
    outs, order = run_in_order(llm, priority)
    assert preempted and scheduler.num_preemptions == len(preempted)
    assert 0 not in preempted  # the two of priority 0 always find a lower one to preempt
    assert order.index(1) < order.index(0) and order.index(4) < order.index(0)
    want, _ = run_in_order(make_llm(model_dir, device), None)
    assert outs == want
    assert llm.engine.block_manager.num_free == llm.engine.num_blocks


@pytest.mark.parametrize("policy, priority, error, match", [
    ("fcfs", [0, 1, 0, 0, 0], ValueError, "Priority scheduling is not enabled"),
    ("priority", [0, 1], ValueError, "5 prompts but 2 priorities"),
    ("priority", [0, 1.5, 0, 0, 0], TypeError, "must be an integer"),
    ("priority", [0, True, 0, 0, 0], TypeError, "must be an integer"),
    ("priority", 3.5, TypeError, "a list of integers"),
])
def test_bad_priorities_are_refused_before_any_is_queued(model_dir, device, policy, priority,
                                                         error, match):
    llm = make_llm(model_dir, device, scheduling_policy=policy)
    with pytest.raises(error, match=match):
        llm.generate(PROMPTS, GREEDY, priority=priority, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        make_llm(model_dir, device, scheduling_policy="lifo")
