"""The tensor-parallel engine on CPU (gloo) with a worker that is stuck rather than dead (stopped:
alive, its socket open, reading nothing): rank 0's messages and its stop message are sent under
a timeout, so that a message fails and a shutdown returns instead of waiting on the control
group's idle timeout (a year)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from minivllm import LLM, SamplingParams

from hf_tiny import make_hf_model, save_checkpoint

ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
PROMPT = [{"prompt_token_ids": [3, 14, 15, 92, 65]}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=5), tmp_path_factory.mktemp("tp") / "model")


def in_thread(fn, timeout: float):
    """fn()'s outcome, ("ok", value) or ("raised", exception), or None when it is still running
    after `timeout` s (a hang)."""
    box = []

    def run():
        try:
            box.append(("ok", fn()))
        except BaseException as e:
            box.append(("raised", e))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return box[0] if box else None


def minivllm_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("minivllm")]


def release(worker) -> None:
    """End a stopped worker of this test (whatever the engine did about it)."""
    if worker.is_alive():
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)


def test_a_stuck_worker_fails_the_engines_messages_within_the_timeout(tiny_dir, monkeypatch):
    """Sleep and wake-up messages run no collective (CPU: no graphs), so with the worker stopped
    only the control group's send can notice: it fails within MINIVLLM_DIST_TIMEOUT once the
    sockets' buffers are full, the engine refuses further work, and the worker is ended. The
    process then runs another tensor-parallel LLM, which gives TP=1's tokens."""
    with LLM(tiny_dir, **ENGINE) as ref:
        want = ref.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm = LLM(tiny_dir, tensor_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    worker = llm.engine.runner.workers.procs[0]
    try:
        assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        monkeypatch.setenv("MINIVLLM_DIST_TIMEOUT", "2")  # read by each message's send
        os.kill(worker.pid, signal.SIGSTOP)

        def cycles():
            for _ in range(1000):  # 512 KiB a cycle: far past any socket buffer
                llm.sleep(1)
                llm.wake_up()
        outcome = in_thread(cycles, 40)
        assert outcome is not None, "rank 0's send waits on the stuck worker for ever"
        assert outcome[0] == "raised" and "Timed out" in str(outcome[1]), outcome
        worker.join(5)
        assert not worker.is_alive() and not minivllm_children()
        # Whichever message failed (a failed wake-up leaves the engine asleep), the next is refused.
        refused = llm.wake_up if llm.is_sleeping() else \
            (lambda: llm.generate(PROMPT, GREEDY, use_tqdm=False))
        with pytest.raises(RuntimeError, match="engine is stopped: a step failed .*Timed out"):
            refused()
    finally:
        release(worker)
    monkeypatch.delenv("MINIVLLM_DIST_TIMEOUT")
    with LLM(tiny_dir, tensor_parallel_size=2, **ENGINE) as again:
        assert again.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want


def test_rank_0s_sends_are_bounded(monkeypatch):
    """A step's message waits at most the collective timeout, the stop message STOP_TIMEOUT (the
    control group's own timeout is the workers' idle wait, a year)."""
    import datetime

    import torch

    from minivllm.runtime import distributed

    timeouts = []

    class Control:
        def broadcast(self, tensors, opts):
            timeouts.append((opts.rootRank, opts.timeout, tensors[0].numel()))
            return self

        def wait(self):
            pass

    monkeypatch.setenv("MINIVLLM_DIST_TIMEOUT", "7")
    groups = distributed.Groups(data=None, control=Control(), buffer=torch.zeros(
        distributed.STEP_BUFFER_BYTES, dtype=torch.uint8))
    distributed.broadcast_step(("a step",), groups)
    distributed.broadcast_step(b"x" * distributed.STEP_BUFFER_BYTES, groups)  # two sends
    distributed.broadcast_step(None, groups)
    step, stop = datetime.timedelta(seconds=7), datetime.timedelta(seconds=10)
    assert [(r, t) for r, t, _ in timeouts] == [(0, step)] * 3 + [(0, stop)]
    assert timeouts[2][2] > 0 and stop == distributed.STOP_TIMEOUT


def test_a_stop_message_not_taken_ends_the_workers_without_grace(monkeypatch):
    """The stop message failed (a worker dead or stuck): the workers are terminated at once, not
    after STOP_GRACE_S, and the groups aborted as after any failure."""
    import minivllm.runtime.executor as executor

    calls = []

    class Runner:
        def release_graphs(self):
            pass

    class Workers:
        def stop_watching(self):
            pass

        def stop(self, grace):
            calls.append(("stop", grace))

    def refused(step, groups):
        raise RuntimeError("Timed out waiting 10000ms for send operation to complete")
    monkeypatch.setattr(executor, "broadcast_step", refused)
    monkeypatch.setattr(executor, "abort_groups", lambda: calls.append("abort"))
    monkeypatch.setattr(executor, "destroy_groups", lambda **kw: None)
    executor._Closer(groups=None, workers=Workers(), runner=Runner())()
    assert calls == ["abort", ("stop", 0.0)]
