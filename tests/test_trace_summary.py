"""benchmarks/trace_summary.py on a synthetic trace: kernels grouped and counted per step, idle
gaps between kernels counted only when short (launch latency, not the host between steps)."""

import gzip
import json
import pathlib

import pytest

from benchmarks.trace_summary import load_kernels, steps_in, summarize


def test_groups_per_step_and_short_gaps(tmp_path):
    kernels = []
    t = 0.0
    for step in range(2):
        for name, dur in (("triton_per_fused_add_rms_norm_0", 2.0), ("_decode_kernel", 10.0),
                          ("triton_per_fused_mul_sum_3", 4.0)):
            kernels.append({"cat": "kernel", "name": name, "ts": t, "dur": dur})
            t += dur + 1.0  # 1 us between kernels
        t += 500.0  # the host between steps: not a launch gap
    events = list(reversed(kernels)) + [{"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99}]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    s = summarize(load_kernels(str(path)), steps=2)
    assert s["kernels_per_step"] == 3 and s["busy_us_per_step"] == 16.0
    assert s["short_gaps_us_per_step"] == 2.0  # 5 gaps: four of 1 us, the one of 501 us not counted
    assert s["groups"][0] == ("_decode_kernel", 1.0, 10.0)
    assert ("inductor_per", 2.0, 6.0) in s["groups"]


def test_a_trace_without_kernels_is_a_clear_error(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]}))
    with pytest.raises(ValueError, match="no GPU kernels"):
        summarize(load_kernels(str(path)), steps=1)


def test_steps_are_counted_by_the_samplers_once_a_step_kernel():
    """By the Gumbel pass's second kernel, or by torch's arg-max for all-greedy batches."""
    greedy = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps"
    for marker in ("_final_argmax_kernel", greedy):
        kernels = [{"name": n} for n in ["_decode_kernel", marker] * 9 + ["_decode_kernel"]]
        assert steps_in(kernels) == 9
    assert steps_in([{"name": "_decode_kernel"}, {"name": "at::native::reduce_kernel<Sum>"}]) is None


def test_host_side_ranges_and_runtime_calls_per_host_step():
    """The host's named ranges and CUDA runtime calls, per ProfilerStep, longest call kept: a
    blocking call stands out by its longest; kernels and CPU ops are not host rows."""
    from benchmarks.trace_summary import host_summary

    # torch.profiler writes each step range twice: on the host and as a gpu_user_annotation
    events = [{"cat": cat, "name": f"ProfilerStep#{i}", "ts": 0, "dur": 5000}
              for i in range(4) for cat in ("user_annotation", "gpu_user_annotation")]
    for i in range(4):
        events += [{"cat": "user_annotation", "name": "prepare_decode", "ts": 0, "dur": 100.0},
                   {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 20.0},
                   {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 0, "dur": 2.0},
                   {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 0, "dur": 4.0},
                   {"cat": "kernel", "name": "_decode_kernel", "ts": 0, "dur": 900.0},
                   {"cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 9.0}]
    events.append({"cat": "cuda_runtime", "name": "cudaHostAlloc", "ts": 0, "dur": 1200.0})
    steps, rows = host_summary(events)
    assert steps == 4
    assert rows[0] == ("cudaHostAlloc", 0.25, 300.0, 1200.0)
    assert ("prepare_decode", 1.0, 100.0, 100.0) in rows
    assert ("cudaMemcpyAsync", 2.0, 6.0, 4.0) in rows
    assert {r[0] for r in rows} == {"cudaHostAlloc", "prepare_decode", "cudaGraphLaunch",
                                    "cudaMemcpyAsync"}
    with pytest.raises(ValueError, match="ProfilerStep"):
        host_summary([e for e in events if not e["name"].startswith("ProfilerStep")])


def test_host_summary_of_a_real_trace_counts_each_traced_step_once():
    """Session 21's single-stream trace: 8 traced steps (bench --trace), each one decode step
    with one prepare_decode range."""
    from benchmarks.trace_summary import host_summary, load_events

    results = pathlib.Path(__file__).parents[1] / "benchmarks" / "results"
    trace = results / "2026-12-01_s21_c1_trace_latency.json.gz"
    steps, rows = host_summary(load_events(str(trace)))
    assert steps == 8
    assert next(r for r in rows if r[0] == "prepare_decode")[1] == 1.0
