"""Engines for the tests that build many of them (test_engine.py, test_engine_bad_input.py,
test_scheduler_audit.py; the CLI's in test_cli.py and test_generation_config.py): on CPU the
arguments given, with the reference attention; on CUDA small engines, so that each file runs on a
fresh GPU machine within one device call."""

from __future__ import annotations

import contextlib
import threading

from minivllm import LLM


def cpu_reference(device):
    """On CPU the reference attention (under TRITON_INTERPRET the default would be the Triton
    interpreter, correct but slow; test_triton_backend_gives_identical_outputs runs it once)."""
    return "reference" if device.type == "cpu" else None


def make_llm(path, device, *, graphs: bool = False, **kw):
    """An engine on `device`, num_kv_blocks 64 unless given.

    On CUDA, unless given: graphs=False runs eagerly at 16 sequences and 512 batched tokens.
    Start-up compiles the forward and captures a graph per decode bucket and prefill size: even
    at 16 sequences and 512 batched tokens test_engine.py's first 8 tests' 13 engines took 580 s
    on a fresh H200 machine (session 32), and at the defaults (256 sequences, 8192 tokens) one
    engine compiled for over 430 s. Eager, the engine's scheduling, sampling and asynchronous
    steps (launch still returns before the tokens are read) are tested on the GPU within one call;
    the compiled and captured engine is tested against transformers by test_engine.py's first
    test and against the eager one by tests/test_gpu_graphs.py.
    graphs=True, for a test of what CUDA graphs change (the decode graph's own greedy pick, its
    static token buffers rewritten by the next replay): compiled and captured, at 4 sequences and
    128 batched tokens (decode buckets of 1, 2 and 4 rows, one prefill graph). On CPU `graphs`
    changes nothing: there are no CUDA graphs."""
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("attention_backend", cpu_reference(device))
    if device.type == "cuda":
        kw.setdefault("enforce_eager", not graphs)
        kw.setdefault("max_num_seqs", 4 if graphs else 16)
        kw.setdefault("max_num_batched_tokens", 128 if graphs else 512)
    return LLM(path, device=device, **kw)


def small_cli_engines(device, monkeypatch) -> None:
    """On CUDA, the engines the CLI starts (cli._make_llm) as make_llm's: eager, at most 16
    sequences, and 512 batched tokens unless --max-num-batched-tokens is given. At the CLI's own
    sizes a command compiled and captured its graphs for ~40 s on a fresh GPU machine, a test of
    several commands for up to 125 s (session 42); what the CLI tests check (its flags, its
    output) does not depend on that. On CPU nothing changes."""
    if device.type != "cuda":
        return
    from minivllm.runtime import llm as llm_module

    real = llm_module.LLM

    def small_llm(model, **kw):
        kw["enforce_eager"] = True
        kw["max_num_seqs"] = min(kw.get("max_num_seqs") or 16, 16)
        kw["max_num_batched_tokens"] = kw.get("max_num_batched_tokens") or 512
        return real(model, **kw)
    monkeypatch.setattr(llm_module, "LLM", small_llm)


@contextlib.contextmanager
def serving(srv):
    """srv (a runtime.server.OpenAIServer) answering on a thread of its own; shut down and
    joined on leaving."""
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        thread.join(timeout=10)


def ungraphed_verifications(runner) -> list:
    """Record each verification step (a speculative chunk, with logits at several rows, beside
    decodes and others: no prompt chunk, which can make a step too large for the graphs) that
    runs through the forward rather than a verification graph."""
    seen, run = [], runner._run

    def watched(cache, step):
        if any(c.num_logits > 1 for c in step.chunks) and \
                all(c.want_logits and c.num_logits == len(c.token_ids) for c in step.chunks):
            seen.append(step)
        return run(cache, step)
    runner._run = watched
    return seen


def stand_in_verify_graphs(runner, replays: list) -> None:
    """Give `runner` the verification graphs (and a draft model's mirrors over their inputs) that
    it captures on a GPU (ModelRunner._make_verify_graphs), each replay run instead by the graph's
    forward over its padded buffers (the CPU has no CUDA graphs): the runner's choice of graph,
    fill, replay and mirror are then the GPU's. Records (tokens, logits rows read, "target" or
    "draft") for each replay."""
    graphs, mirrors = runner._make_verify_graphs()

    def target(graph):
        def replay(n):
            replays.append((graph.num_tokens, n, "target"))
            logits, runner.cache = graph.fn(runner.params, runner.cache, graph.batch,
                                            runner.backend)
            return logits[:n]
        graph.replay = replay

    def draft(mirror):
        def replay(n):
            replays.append((mirror.num_tokens, n, "draft"))
            _, runner.draft_cache = mirror.fn(runner.draft_params, runner.draft_cache,
                                              mirror.batch, runner.draft_backend)
        mirror.replay = replay

    for graph in graphs:
        target(graph)
    for mirror in mirrors.values():
        draft(mirror)
    runner.verify_graphs, runner.verify_mirrors = graphs, mirrors
