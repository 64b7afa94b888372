"""The tensor-parallel engine's life on CPU (gloo): a killed worker makes it raise at once and
leaves no process behind; Ctrl-C leaves the ranks in step, and exiting on one stops the worker;
torchrun runs the CLI with rank 0 alone printing; invalid configurations are ValueErrors before
any process starts."""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from minivllm import LLM, SamplingParams
from minivllm.cli import main
from minivllm.runtime.demo import ensure_demo_model
from minivllm import WorkerDiedError  # public: what a caller catches

from hf_tiny import hf_config, make_hf_model, save_checkpoint

TESTS = os.path.dirname(os.path.abspath(__file__))
ENGINE = dict(num_kv_blocks=64, attention_backend="reference", device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_checkpoint(make_hf_model(seed=2), tmp_path_factory.mktemp("tp") / "model")


def gone(pid: int) -> bool:
    """No such process, or only its zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def minivllm_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("minivllm")]


@pytest.mark.parametrize("when", ["between steps", "during a generation"])
def test_killed_worker_makes_the_engine_raise_promptly(tiny_dir, when):
    llm = LLM(tiny_dir, tensor_parallel_size=2, **ENGINE)
    worker = llm.engine.runner.workers.procs[0]
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    assert len(llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 5
    if when == "between steps":
        os.kill(worker.pid, signal.SIGKILL)
        assert "SIGKILL" in llm.engine.runner.workers.wait_dead(5)  # seen by the watcher thread
    else:  # rank 0 is in a collective with it, or about to be
        threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 10
    assert not minivllm_children()
    with pytest.raises(RuntimeError, match="stopped: tensor-parallel worker rank 1"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_an_error_at_start_up_is_rank_0s_own_and_stops_the_worker(tiny_dir, monkeypatch):
    """Every rank fails alike (no memory for the KV cache): rank 0's ValueError, not a report
    of the worker's death, and no process left behind."""
    monkeypatch.setenv("MINIVLLM_CPU_KV_CACHE_SPACE", "1e-9")
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        LLM(tiny_dir, tensor_parallel_size=2, **{**ENGINE, "num_kv_blocks": None})
    assert not minivllm_children()
    assert not dist.is_initialized()


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def _expect(lines: queue.Queue, prefix: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    skipped = []
    while True:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        assert line is not None, f"the child exited before printing {prefix!r}; it printed {skipped}"
        if line.startswith(prefix):
            return line
        skipped.append(line)


def _start_child(tiny_dir, **popen):
    """tp_sigint_child.py running a TP=2 engine: (its process, its stdout lines, the worker's
    pid), once it has started generating."""
    child = subprocess.Popen([sys.executable, os.path.join(TESTS, "tp_sigint_child.py"), tiny_dir],
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONFAULTHANDLER": "1"}, **popen)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(child.stdout, lines), daemon=True).start()
    try:
        worker = int(_expect(lines, "worker").split()[1])
        _expect(lines, "generating")
    except BaseException:
        child.kill()  # its worker follows (it watches its parent)
        child.wait()
        raise
    return child, lines, worker


def test_ctrl_c_keeps_the_ranks_in_step_and_exits_cleanly(tiny_dir):
    with LLM(tiny_dir, **ENGINE) as ref:
        want = ref.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY, use_tqdm=False)[0]
    # Its own session, like a terminal's foreground group: Ctrl-C reaches rank 0 and the worker.
    child, lines, worker = _start_child(tiny_dir, stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(1.0)
        os.killpg(child.pid, signal.SIGINT)
        assert _expect(lines, "interrupted") == "interrupted"
        after = _expect(lines, "after").split()[1:]
        assert [int(t) for t in after] == want.outputs[0].token_ids  # the ranks still agree
        _expect(lines, "generating")
        time.sleep(1.0)
        os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=30)
        err = child.stderr.read()
    except AssertionError as e:  # with what the child said on its way out
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        raise AssertionError(f"{e}\nthe child's exit code {child.returncode}, its stderr:\n"
                             f"{child.stderr.read()[-4000:]}") from e
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
    assert child.returncode != 0 and "KeyboardInterrupt" in err
    assert "worker rank 1 failed" not in err, err
    deadline = time.monotonic() + 5
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(worker)


def test_worker_leaves_when_rank_0_is_killed(tiny_dir):
    """SIGKILL gives rank 0 no chance to stop its worker: the worker leaves by itself."""
    child, lines, worker = _start_child(tiny_dir, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
    finally:
        child.kill()
        child.wait()
    deadline = time.monotonic() + 10
    while not gone(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(worker)


def test_torchrun_cli_equals_tp1(tmp_path, capsys, monkeypatch):
    """`torchrun --nproc-per-node 2 -m minivllm generate`: the tensor-parallel size defaults to
    WORLD_SIZE, rank 1 serves and exits 0, rank 0 prints what one process prints."""
    demo = ensure_demo_model(str(tmp_path / "demo"))
    monkeypatch.setenv("MINIVLLM_ATTENTION_BACKEND", "reference")
    args = ["generate", "--model", demo, "--device", "cpu", "--num-kv-blocks", "64",
            "--max-tokens", "6", "--ignore-eos",
            "--json", "-p", "Hello, my name is", "-p", "The capital of France is"]
    assert main(args) == 0
    want = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "minivllm", *args],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert [json.loads(line) for line in run.stdout.splitlines()] == want


def test_invalid_configurations_fail_at_start_up(tiny_dir, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by the "
                                         r"tensor-parallel size \(3\)"):
        LLM(tiny_dir, tensor_parallel_size=3, **ENGINE)
    hf_config(num_attention_heads=6, num_key_value_heads=3).save_pretrained(tmp_path / "kv3")
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and the tensor-parallel size "
                                         r"\(2\) must divide one another"):
        LLM(tmp_path / "kv3", tensor_parallel_size=2, **ENGINE)
    assert main(["generate", "--model", tiny_dir, "--device", "cpu", "-tp", "3"]) == 2
    assert "is not divisible by the tensor-parallel size (3)" in capsys.readouterr().err
    # More ranks than GPUs (checked from the device count alone: no GPU is touched).
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="need 2 GPUs, but 1 are visible"):
        LLM(tiny_dir, tensor_parallel_size=2, **{**ENGINE, "device": "cuda"})
    with pytest.raises(ValueError, match="need 3 GPUs, but 1 are visible"):
        LLM(tiny_dir, tensor_parallel_size=2, **{**ENGINE, "device": "cuda:1"})
    # A torchrun launch of another size.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tensor_parallel_size=2, but torchrun started WORLD_SIZE=4"):
        LLM(tiny_dir, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=1, but torchrun started WORLD_SIZE=4"):
        LLM(tiny_dir, **ENGINE)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    # A process that is already in a process group (one engine per process).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="already initialized"):
            LLM(tiny_dir, tensor_parallel_size=2, **ENGINE)
    finally:
        dist.destroy_process_group()
    assert not minivllm_children()


@pytest.mark.parametrize("in_step", [True, False])
def test_shutdown_releases_graphs_before_the_groups(monkeypatch, in_step):
    """Rank 0's shutdown order, which NCCL needs (a live graph holding captured collectives makes
    destroy_process_group hang; a rank's shutdown can wait for the others'): the stop message,
    then the captured graphs, then the groups, and only then the wait for the workers. After a
    failure: no message, and the groups aborted before anything waits on the device."""
    import minivllm.runtime.executor as executor

    calls = []

    class Runner:
        def release_graphs(self):
            calls.append("release graphs")

    class Workers:
        def stop_watching(self):
            pass

        def stop(self, grace):
            calls.append("join workers")

    monkeypatch.setattr(executor, "broadcast_step", lambda step, groups: calls.append("stop message"))
    monkeypatch.setattr(executor, "abort_groups", lambda: calls.append("abort groups"))
    monkeypatch.setattr(executor, "destroy_groups", lambda **kw: calls.append("destroy groups"))
    closer = executor._Closer(groups=None, workers=Workers(), runner=Runner())
    closer.in_step = in_step
    closer()
    closer()  # once only
    first = ["stop message"] if in_step else ["abort groups"]
    assert calls == first + ["release graphs", "destroy groups", "join workers"]
    assert closer.runner is None
