"""`minivllm bench`: the throughput workload of nano-vllm's bench.py, and a single-stream latency
run, on a checkpoint or on random weights of a named shape.

    minivllm bench --shape qwen3-0.6b                  # throughput, random weights
    minivllm bench --shape qwen3-8b --quantization awq # random AWQ 4-bit linears (or fp8)
    minivllm bench --model DIR --latency --json out.json
    minivllm bench --shape qwen3-8b --latency \
        --speculative-config '{"model": "random:qwen3-0.6b", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import time

import torch

from ..kernels.memory_read import READ_BLOCK, READ_PROGRAMS_PER_SM, stream_read
from ..state.config import FP8_DTYPES, SHAPES, ModelConfig
from .config import check_draft_model, random_model
from .pooling import check_generates
from .spec_decode import SpeculativeConfig
from .workload import (MAX_PROMPT_ID, check_throughput_workload, check_vocabulary,
                       held_expert_bytes, held_weight_bytes, throughput_workload,
                       traffic_floor_bytes)


def _seconds_per_call(fn, device: torch.device, repeats: int) -> float:
    """Mean seconds of fn() over `repeats` calls launched back to back (after one untimed)."""
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float | None:
    """Bytes read + written per second by a device-to-device copy (None off CUDA)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    seconds = _seconds_per_call(lambda: dst.copy_(src), device, repeats)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def read_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10,
                   rounds: int = 3) -> float | None:
    """Bytes read per second by kernels.memory_read's read-only kernel over `nbytes` of bf16
    (None off CUDA), the best of `rounds`. The workload's traffic is reads, so this is the
    tighter floor's rate. Best of several: after the throughput run, one round of ten calls
    read at 3.96-3.99 TB/s in 8 runs of 9 on one H200, below the copy's 4.24 in the same runs;
    the best of three read 4.61 in each of its 3 runs there (BENCHMARKS.md session 25)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2 // READ_BLOCK * READ_BLOCK, dtype=torch.bfloat16, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(READ_PROGRAMS_PER_SM * sms, dtype=torch.float32, device=device)
    seconds = min(_seconds_per_call(lambda: stream_read(src, out), device, repeats)
                  for _ in range(rounds))
    nbytes = src.numel() * src.element_size()
    del src, out
    torch.cuda.empty_cache()
    return nbytes / seconds


def device_peak_bytes(device: torch.device) -> int:
    """This device's peak use since torch.cuda.reset_peak_memory_stats: what the caching
    allocator does not hold (the CUDA context, loaded kernels, graph executables; it does not
    shrink, so it was there at the peak too) plus the allocator's own peak reserved."""
    from .memory import bytes_outside_allocator  # here: the CLI imports bench to build its parser

    return bytes_outside_allocator(device) + torch.cuda.max_memory_reserved(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _backend_name(llm) -> str:
    runner = llm.engine.runner
    backend = getattr(runner, "backend", None)
    return getattr(backend, "name", None) or str(llm.config.attention_backend or "default")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def traced_steps(engine, path: str, *, skip: int, active: int, counting=None):
    """Wrap engine.step so that steps skip..skip+active-1 are recorded by torch.profiler (CPU and
    CUDA) into a Chrome trace at `path`. Returns the profiler (stop it after the run).
    counting: a function saying whether a step counts (default: all do): steps while it says no
    neither advance the window nor are recorded."""
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities,
                   schedule=schedule(wait=skip, warmup=TRACE_WARMUP, active=active, repeat=1),
                   on_trace_ready=lambda p: p.export_chrome_trace(path))
    inner = engine.step

    def step(**kw):
        out = inner(**kw)
        if counting is None or counting():
            prof.step()
        return out

    engine.step = step
    prof.start()
    return prof


def _check_trace_written(path: str) -> None:
    """Say so where a run ended before its traced window (a speculative run takes fewer steps
    than it has tokens), instead of leaving no file and no word."""
    if not os.path.exists(path):
        logging.getLogger("minivllm").warning(
            "minivllm bench: the run ended before the traced steps; no trace was written to %s",
            path)


def timed_steps(engine, log: list):
    """Wrap engine.step to append one record per call: its seconds, running and waiting
    sequences, the prompt tokens it scheduled (prefill work: with asynchronous scheduling the
    call launches that step and returns the previous one's tokens), and what paused it besides
    the GPU (cyclic-GC seconds, the kernels Triton compiled, dynamo frames compiled, and on CUDA
    in steps with sequences waiting the caching allocator's cudaMalloc calls; else None). Returns a
    function that removes the GC and Triton hooks."""
    import gc

    pauses = {"gc_s": 0.0, "triton_compiles": 0}
    compiled: list[str] = []  # the kernels Triton compiled, in order
    gc_start = []

    def on_gc(phase, info):
        if phase == "start":
            gc_start.append(time.perf_counter())
        elif gc_start:
            pauses["gc_s"] += time.perf_counter() - gc_start.pop()

    gc.callbacks.append(on_gc)
    try:
        import triton

        def on_compile(**kw):
            pauses["triton_compiles"] += 1
            fn = kw.get("fn")
            compiled.append(str(getattr(fn, "name", None) or getattr(fn, "__name__", "?")))
            return False

        triton.knobs.runtime.jit_post_compile_hook = on_compile
    except (ImportError, AttributeError):
        triton = None
    from torch._dynamo.utils import counters

    inner = engine.step
    device = getattr(engine.runner, "device", None)
    on_cuda = device is not None and torch.device(device).type == "cuda"

    def device_allocs() -> int:  # the caching allocator's cudaMalloc calls so far
        return torch.cuda.memory_stats(device)["num_device_alloc"]

    def step(**kw):
        before = dict(pauses, frames=counters["stats"]["unique_graphs"],
                      prompt_tokens=engine.stats.prompt_tokens_computed)
        # prefill-phase steps only: reading the allocator's counters costs ~0.1 ms
        count_allocs = on_cuda and len(engine.scheduler.waiting) > 0
        allocs = device_allocs() if count_allocs else None
        t0 = time.perf_counter()
        out = inner(**kw)
        seconds = time.perf_counter() - t0
        if allocs is not None:
            allocs = device_allocs() - allocs
        new_compiles = pauses["triton_compiles"] - before["triton_compiles"]
        log.append({"s": seconds, "running": len(engine.scheduler.running),
                    "waiting": len(engine.scheduler.waiting),
                    "prompt_tokens": engine.stats.prompt_tokens_computed - before["prompt_tokens"],
                    "gc_s": pauses["gc_s"] - before["gc_s"],
                    "triton_compiles": new_compiles,
                    "triton_kernels": compiled[len(compiled) - new_compiles:],
                    "frames": counters["stats"]["unique_graphs"] - before["frames"],
                    "device_allocs": allocs})
        return out

    engine.step = step

    def remove_hooks():
        gc.callbacks.remove(on_gc)
        if triton is not None:
            triton.knobs.runtime.jit_post_compile_hook = None

    return remove_hooks


def host_and_wait(engine, log: list):
    """Wrap engine.step to append, for each call, (its seconds, the seconds of it spent waiting
    for the device's sampled tokens, the seconds of it in runner.launch, the seconds of it in a
    draft model's runner.propose): the rest is the host's own work for a step, which with
    asynchronous scheduling overlaps the device's, and launch's share of it is where the host
    meets CUDA (copies, the replay, the sampler's launches), so a call that blocks there shows
    apart from the Python around it. propose's share is the host's queueing of the draft's
    rounds: they run on the device while the host builds and launches the verification step,
    whose wait for its tokens includes them. Returns a function that unwraps."""
    runner = engine.runner
    inner_step, inner_launch = engine.step, runner.launch
    inner_propose = getattr(runner, "propose", None)
    waited, launching, drafting = [0.0], [0.0], [0.0]

    def propose(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner_propose(*args, **kwargs)
        finally:
            drafting[0] += time.perf_counter() - t0

    def launch(step_input):
        t0 = time.perf_counter()
        pending = inner_launch(step_input)
        launching[0] += time.perf_counter() - t0
        inner_result = pending.result

        def result():
            t0 = time.perf_counter()
            try:
                return inner_result()
            finally:
                waited[0] += time.perf_counter() - t0

        pending.result = result
        return pending

    def step(**kw):
        waited[0] = launching[0] = drafting[0] = 0.0
        t0 = time.perf_counter()
        out = inner_step(**kw)
        log.append((time.perf_counter() - t0, waited[0], launching[0], drafting[0]))
        return out

    engine.step, runner.launch = step, launch
    if inner_propose is not None:
        runner.propose = propose

    def unwrap():
        engine.step, runner.launch = inner_step, inner_launch
        if inner_propose is not None:
            runner.propose = inner_propose

    return unwrap


def _spec_counts(llm) -> tuple[int, int, int]:
    """The engine's speculative-decoding counters: (drafts, draft tokens, accepted tokens)."""
    stats = llm.engine.stats
    return stats.spec_drafts, stats.spec_draft_tokens, stats.spec_accepted_tokens


def spec_result(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """The acceptance of the timed run, from _spec_counts before and after it: drafts (a
    sequence's step that drafted), draft tokens proposed, those accepted, their ratio (None where
    nothing was drafted) and the mean accepted a draft."""
    drafts, tokens, accepted = (b - a for a, b in zip(before, after))
    return {"spec_drafts": drafts, "spec_draft_tokens": tokens, "spec_accepted_tokens": accepted,
            "spec_acceptance": accepted / tokens if tokens else None,
            "spec_accepted_per_draft": accepted / drafts if drafts else None}


def run_throughput(llm, *, num_seqs: int = 256, max_input_len: int = 1024,
                   max_output_len: int = 1024, trace: str | None = None, trace_from: int = 400,
                   step_times: str | None = None) -> dict:
    from .sampling_params import SamplingParams

    prompts, max_tokens = throughput_workload(num_seqs, max_input_len, max_output_len)
    check_vocabulary(llm.engine.vocab_size)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    # One warm-up request before timing, as nano-vllm's bench does.
    llm.generate([{"prompt_token_ids": list(range(1, 9))}], SamplingParams(), use_tqdm=False)
    device = llm.config.device
    _sync(device)
    steps0 = llm.stats.steps
    prof = traced_steps(llm.engine, trace, skip=trace_from, active=TRACE_STEPS) if trace else None
    log, waits, remove_hooks, unwrap = [], [], None, None
    if step_times:
        # Each record also gets the seconds its step spent waiting for the device's tokens
        # (wait_s; the rest of s is the host's own work): where a band of steps barely waits,
        # the host bounds it.
        unwrap = host_and_wait(llm.engine, waits)
        remove_hooks = timed_steps(llm.engine, log)
    spec0 = _spec_counts(llm)
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync(device)
    seconds = time.perf_counter() - t0
    spec = spec_result(spec0, _spec_counts(llm))
    if prof is not None:
        prof.stop()
        _check_trace_written(trace)
    if step_times:
        remove_hooks()
        unwrap()
        for record, (_, wait, launch, _) in zip(log, waits, strict=True):
            record["wait_s"], record["launch_s"] = wait, launch
        with open(step_times, "w") as f:
            json.dump(log, f)
    steps = llm.stats.steps - steps0
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    floor = traffic_floor_bytes(llm.engine.model_config, [len(p) for p in prompts], max_tokens,
                                dtype_bytes=llm.config.dtype.itemsize,
                                kv_dtype_bytes=llm.config.cache_dtype.itemsize,
                                tensor_parallel_size=llm.config.tensor_parallel_size,
                                # a checkpoint's linears as loaded (a Qwen3-AWQ one's packed)
                                step_weight_bytes=held_weight_bytes(llm.engine.runner.params),
                                step_expert_bytes=held_expert_bytes(llm.engine.runner.params))
    return {"workload": "throughput", "num_seqs": num_seqs, "prompt_tokens": sum(map(len, prompts)),
            "output_tokens": output_tokens, "seconds": seconds,
            "output_tok_per_s": output_tokens / seconds, "floor_bytes": floor["total_bytes"],
            "steps": steps, "ms_per_step": 1e3 * seconds / max(steps, 1), **spec}


LATENCY_MAX_NUM_SEQS = 2  # the smallest decode bucket: one sequence runs padded to it either way
BENCH_MAX_MODEL_LEN = 4096  # nano-vllm's bench
TRACE_STEPS = 8  # steps a --trace records
TRACE_WARMUP = 2  # steps the profiler runs, unrecorded, before them
# --latency --trace: the last stream's decode steps from this one, or from the middle of a
# shorter stream (speculation decodes several tokens a step).
LATENCY_TRACE_FROM = 100


def run_latency(llm, *, prompt_len: int = 512, output_len: int = 256, repeats: int = 3,
                trace: str | None = None) -> dict:
    """Time to first token of a `prompt_len` prompt and single-stream decode tok/s (each repeat
    uses a fresh random prompt, so that the prefix cache cannot serve it). trace: a Chrome trace
    of 8 decode steps of the last repeat (the timing then includes the profiler's overhead)."""
    from .sampling_params import SamplingParams

    rng = random.Random(1)
    device = llm.config.device
    vocab = min(MAX_PROMPT_ID, llm.engine.vocab_size)

    def prompt():
        return {"prompt_token_ids": [rng.randrange(vocab) for _ in range(prompt_len)]}

    llm.generate([prompt()], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    # One stream, untimed (and before the profiler counts steps), with each step split into the
    # host's work and its wait for the device (medians over the decode steps, in us): whether
    # the host or the GPU bounds the single stream.
    log: list = []
    unwrap = host_and_wait(llm.engine, log)
    try:
        llm.generate([prompt()], SamplingParams(max_tokens=output_len, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    finally:
        unwrap()
    decode = log[2:] or log
    prof, tracing = None, [False]
    if trace:
        # Steps of the last repeat's stream only, counted from its prompt's step: a stream
        # with speculation takes fewer steps than tokens, as many as the untimed one took, give
        # or take what its drafts' acceptance changes (hence its middle, where it is short).
        start = min(LATENCY_TRACE_FROM, max(len(log) - TRACE_WARMUP - TRACE_STEPS, 0) // 2)
        prof = traced_steps(llm.engine, trace, active=TRACE_STEPS, skip=start,
                            counting=lambda: tracing[0])
    ttfts, decode_rates = [], []
    spec0 = _spec_counts(llm)  # the timed streams' acceptance (greedy, as their tokens)
    for i in range(repeats):
        # Each prompt drawn before its clock starts: the time is from submission on.
        first, stream = [prompt()], [prompt()]
        _sync(device)
        t0 = time.perf_counter()
        llm.generate(first, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        _sync(device)
        ttft = time.perf_counter() - t0
        tracing[0] = i == repeats - 1
        t0 = time.perf_counter()
        out = llm.generate(stream, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                  ignore_eos=True), use_tqdm=False)
        _sync(device)
        total = time.perf_counter() - t0
        n = len(out[0].outputs[0].token_ids)
        ttfts.append(ttft)
        decode_rates.append((n - 1) / max(total - ttft, 1e-9))
    spec = spec_result(spec0, _spec_counts(llm))
    if prof is not None:
        prof.stop()
        _check_trace_written(trace)
    rate = statistics.median(decode_rates)
    # us a step: in all, waiting for the device, in runner.launch (copies, replays, launches:
    # where a call that blocks on the device would show) and in a draft model's propose (queueing
    # its rounds; the rest of the host's time schedules, builds and launches the step)
    total, wait, launch, draft = ([1e6 * x for x in column] for column in zip(*decode))
    host = [t - w for t, w in zip(total, wait)]
    drafting = {"draft_us_p10_50_90": _percentiles(draft)} if any(draft) else {}
    # The floor of the stream's output_len tokens decoded one a step: each step reads the
    # weights once (of a sparse layer's experts, the token's top k) and the stream's context so
    # far (speculation may beat it: several tokens a step for one read of the target's weights;
    # the draft's reads are not counted).
    floor = traffic_floor_bytes(llm.engine.model_config, [prompt_len], [output_len],
                                dtype_bytes=llm.config.dtype.itemsize,
                                kv_dtype_bytes=llm.config.cache_dtype.itemsize,
                                tensor_parallel_size=llm.config.tensor_parallel_size,
                                step_weight_bytes=held_weight_bytes(llm.engine.runner.params),
                                step_expert_bytes=held_expert_bytes(llm.engine.runner.params))
    return {"workload": "latency", "prompt_tokens": prompt_len, "output_tokens": output_len,
            "ttft_s": statistics.median(ttfts), "output_tok_per_s": rate,
            "seconds": output_len / rate, "floor_bytes": floor["total_bytes"],
            "host_us_per_step": statistics.median(host),
            "wait_us_per_step": statistics.median(wait),
            "host_us_p10_50_90": _percentiles(host), "wait_us_p10_50_90": _percentiles(wait),
            "launch_us_p10_50_90": _percentiles(launch), **drafting, **spec}


def _percentiles(values: list[float], ps=(0.1, 0.5, 0.9)) -> list[float]:
    values = sorted(values)
    return [values[int(p * (len(values) - 1))] for p in ps]


def add_bench_args(p) -> None:
    p.add_argument("--model", help="a local Hugging Face Qwen3 checkpoint directory")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="random weights of this shape (default qwen3-0.6b when --model is not given)")
    p.add_argument("--quantization", default=None, choices=("awq", "fp8"),
                   help="random weights only: the decoder linears as the engine holds an AWQ "
                        "4-bit checkpoint's (group 128) or a block-fp8 one's ([128, 128] blocks; "
                        "not under MINIVLLM_FP8_WEIGHTS=dequantize); a checkpoint's own config "
                        "decides its")
    p.add_argument("--latency", action="store_true", help="single-stream decode and time to first token")
    p.add_argument("--json", default=None, help="write the result to this JSON file")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-seqs", type=int, default=None,
                   help="throughput: sequences (default 256)")
    p.add_argument("--max-input-len", type=int, default=None,
                   help="throughput: prompt lengths drawn from [100, this] (default 1024); "
                        "--latency: the prompt's length (default 512)")
    p.add_argument("--max-output-len", type=int, default=None,
                   help="throughput: output lengths drawn from [100, this] (default 1024); "
                        "--latency: tokens decoded (default 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"default {BENCH_MAX_MODEL_LEN} (nano-vllm's), or the model's "
                        f"max_position_embeddings when that is smaller")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default 256; with --latency 2, so that start-up captures the decode "
                        "graphs of 1 and 2 rows (without persistent decode: one, padded to 2) "
                        "instead of 20")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model's dtype) or fp8 (float8 e4m3; the floor counts its bytes)")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--persistent-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps of 1-2 sequences: every layer in one persistent kernel "
                        "(default: on for one CUDA GPU with the triton attention backend)")
    p.add_argument("--sync-scheduling", action="store_true",
                   help="read each step's tokens before scheduling the next (no overlap)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--step-times", default=None,
                   help="write a record per engine step (seconds and those spent waiting for "
                        "the device, running and waiting sequences, prompt tokens, GC seconds, "
                        "Triton compiles, dynamo frames) to this JSON file")
    p.add_argument("--trace", default=None,
                   help="write a Chrome trace (torch.profiler) of 8 decode steps to this path "
                        "(steps --trace-from + 2 to + 9, after the profiler's 2 warm-up steps; "
                        "with --latency, steps 102-109 of the last stream); the timing then "
                        "includes the profiler's overhead")
    from ..cli import _json_object  # here: the CLI imports bench to build its parser

    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help="speculative decoding (vLLM's; it turns asynchronous scheduling off): "
                        "n-gram, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": "
                        "4}', or a draft model, a checkpoint directory or random weights of a "
                        "shape, e.g. '{\"model\": \"random:qwen3-0.6b\", "
                        "\"num_speculative_tokens\": 4}' (random weights are drawn with the "
                        "engine's seed: a draft of the target's own shape is the target, every "
                        "greedy draft accepted; another shape's, about none). The result records "
                        "the config and the timed run's acceptance")
    p.add_argument("--trace-from", type=int, default=400,
                   help="where the throughput run's trace starts, its warm-up steps included "
                        "(400: ~150 sequences running; 900: ~40, the tail)")


def _or(value, default):
    return default if value is None else value


def _check_workload(args, model: str) -> tuple[tuple[int, int], int]:
    """ValueError naming the flag where the workload cannot run as asked on `model`: checked
    from its config before the engine starts. Returns ((input length, output length),
    max_model_len)."""
    if args.latency:
        if args.num_seqs is not None:
            raise ValueError("--num-seqs is for the throughput run; --latency runs one stream")
        lengths = (_or(args.max_input_len, 512), _or(args.max_output_len, 256))
        # A decode rate needs a decode step; the trace, the decode steps it records.
        least = LATENCY_TRACE_FROM + TRACE_WARMUP + TRACE_STEPS if args.trace else 2
        for flag, n, low in (("--max-input-len", lengths[0], 1), ("--max-output-len", lengths[1], least)):
            if n < low:
                raise ValueError(f"{flag} must be at least {low} for the latency run"
                                 f"{' with --trace' if args.trace and low > 1 else ''}, got {n}")
        if args.step_times:
            raise ValueError("--step-times records the throughput run's steps; --latency has its "
                             "own per-step figures in the result")
    else:
        lengths = (_or(args.max_input_len, 1024), _or(args.max_output_len, 1024))
        check_throughput_workload(_or(args.num_seqs, 256), *lengths)
        if args.trace:
            # The run has at least as many steps as its longest output has tokens (one a step):
            # a window past them might never be reached, and the trace never written.
            longest = max(throughput_workload(_or(args.num_seqs, 256), *lengths)[1])
            latest = longest - TRACE_WARMUP - TRACE_STEPS
            if not 0 <= args.trace_from <= latest:
                raise ValueError(f"--trace-from must be in [0, {latest}] for this workload (its "
                                 f"longest output is {longest} tokens, so its run is sure of "
                                 f"only {longest} steps), got {args.trace_from}")
    for flag in ("json", "step_times", "trace"):  # a finished run's output must not be lost
        path = getattr(args, flag)
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and (not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
            raise ValueError(f"--{flag.replace('_', '-')} {path}: cannot write into {folder}")
        if path and os.path.isdir(path):  # open(path, "w") would fail after the run
            raise ValueError(f"--{flag.replace('_', '-')} {path}: is a directory, not a file")
    config = random_model(model)[0] if model.startswith("random:") else ModelConfig.from_json(model)
    if not model.startswith("random:"):
        check_generates(model, None, "bench")  # it measures generation: a pooling model cannot
    if not args.latency:
        check_vocabulary(config.vocab_size)
    limit = _or(args.max_model_len, min(BENCH_MAX_MODEL_LEN, config.max_context_len))
    if sum(lengths) > limit:
        raise ValueError(f"prompts of up to {lengths[0]} tokens and {lengths[1]} new ones do not "
                         f"fit max_model_len={limit} (the run would cut them short and "
                         f"misstate its floor); raise --max-model-len or lower the lengths")
    speculative = SpeculativeConfig.create(getattr(args, "speculative_config", None))
    if speculative is not None and speculative.method == "draft_model":
        # the draft's config against the target's (a checkpoint's read, a random one's shape)
        check_draft_model(speculative, config, tensor_parallel_size=args.tensor_parallel_size,
                          runner="generate", enable_lora=False, enable_prompt_embeds=False,
                          max_model_len=limit)
    return lengths, limit


def main(args) -> dict:
    from .llm import LLM

    if args.model and args.shape:
        raise ValueError("give --model or --shape, not both")
    quantization = getattr(args, "quantization", None)
    if args.model and quantization:
        raise ValueError("--quantization draws random weights (with --shape); a checkpoint's "
                         "config.json decides its own quantization")
    model = args.model or f"random:{args.shape or 'qwen3-0.6b'}" + (
        f":{quantization}" if quantization else "")
    lengths, max_model_len = _check_workload(args, model)  # before the engine starts (slow)
    speculative_config = getattr(args, "speculative_config", None)
    max_num_seqs = (args.max_num_seqs if args.max_num_seqs is not None
                    else LATENCY_MAX_NUM_SEQS if args.latency else 256)
    start = time.perf_counter()
    llm = LLM(model, dtype=args.dtype, max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
              attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype,
              tensor_parallel_size=args.tensor_parallel_size, device=args.device,
              async_scheduling=not args.sync_scheduling, persistent_decode=args.persistent_decode,
              speculative_config=speculative_config)
    device = llm.config.device
    startup_s = time.perf_counter() - start
    print(f"engine started in {startup_s:.1f} s", flush=True)
    if args.latency:
        result = run_latency(llm, prompt_len=lengths[0], output_len=lengths[1], trace=args.trace)
    else:
        result = run_throughput(llm, num_seqs=_or(args.num_seqs, 256), max_input_len=lengths[0],
                                max_output_len=lengths[1], trace=args.trace,
                                trace_from=args.trace_from,
                                step_times=args.step_times)
    try:  # 2-4 GiB beside the engine's memory: within what gpu_memory_utilization leaves
        bandwidth, read = copy_bandwidth(device), read_bandwidth(device)
    except torch.OutOfMemoryError:
        # the result stands without its floor's share rather than being lost to the measuring
        logging.getLogger("minivllm").warning("bench: no memory left to measure the GPU's "
                                              "bandwidth; the floor's share is not reported")
        bandwidth = read = None
    if bandwidth:
        floor_s = result["floor_bytes"] / bandwidth
        result.update(copy_bandwidth_tb_s=bandwidth / 1e12, floor_seconds=floor_s,
                      floor_fraction=floor_s / result["seconds"])
    if read:
        floor_s = result["floor_bytes"] / read
        result.update(read_bandwidth_tb_s=read / 1e12, read_floor_seconds=floor_s,
                      read_floor_fraction=floor_s / result["seconds"])
    result.update(shape=args.shape or (None if args.model else "qwen3-0.6b"), model=args.model,
                  quantization=quantization,
                  max_num_seqs=max_num_seqs, kv_cache_dtype=str(llm.config.cache_dtype),
                  block_size=llm.config.block_size,
                  device=_device_name(device), tensor_parallel_size=args.tensor_parallel_size,
                  backend=_backend_name(llm), dtype=str(llm.config.dtype),
                  cuda_graphs=getattr(llm.engine.runner, "graphs", None) is not None,
                  prefill_graphs=[g.num_tokens for g in getattr(llm.engine.runner, "prefill_graphs", [])],
                  startup_s=startup_s, async_scheduling=llm.engine.async_scheduling,
                  persistent_decode=llm.config.persistent_decode,
                  speculative_config=speculative_config,
                  date=datetime.date.today().isoformat())
    workload = result["workload"] + (f", {quantization} weights" if quantization else "") + (
        ", fp8 KV cache" if llm.config.cache_dtype in FP8_DTYPES else "")
    line = (f"{workload}: {result['output_tokens']} output tokens in "
            f"{result['seconds']:.2f} s = {result['output_tok_per_s']:.0f} tok/s")
    if "ttft_s" in result:
        line += (f", time to first token {result['ttft_s'] * 1e3:.1f} ms; a decode step: host "
                 f"{result['host_us_per_step']:.0f} us"
                 + f" (launching {result['launch_us_p10_50_90'][1]:.0f} us"
                 + (f", drafting {result['draft_us_p10_50_90'][1]:.0f} us"
                    if "draft_us_p10_50_90" in result else "") + " of it)"
                 + f", waiting for the device {result['wait_us_per_step']:.0f} us (medians)")
    if "floor_fraction" in result:
        line += (f" ({result['floor_fraction']:.0%} of the memory-traffic floor: "
                 f"{result['floor_seconds']:.2f} s at {result['copy_bandwidth_tb_s']:.2f} TB/s"
                 + (f" on each of {args.tensor_parallel_size} GPUs" if args.tensor_parallel_size > 1
                    else ""))
        if "read_floor_fraction" in result:
            line += (f"; {result['read_floor_fraction']:.0%} of it at the read rate: "
                     f"{result['read_floor_seconds']:.2f} s at {result['read_bandwidth_tb_s']:.2f} TB/s")
        line += ")"
    if speculative_config is not None:
        spec = llm.config.speculative
        what = (f"draft model {spec.model}" if spec.method == "draft_model" else "n-gram") + \
            f", k={spec.num_speculative_tokens}"
        if result["spec_draft_tokens"]:
            line += (f"; speculative ({what}): {result['spec_acceptance']:.1%} of "
                     f"{result['spec_draft_tokens']} draft tokens accepted, "
                     f"{result['spec_accepted_per_draft']:.2f} a draft of {result['spec_drafts']}")
        else:
            line += f"; speculative ({what}): nothing drafted"
    print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
