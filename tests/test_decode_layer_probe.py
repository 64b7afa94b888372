"""benchmarks/decode_layer_probe.py's reading of the stack's in-kernel timeline (the figures
BENCHMARKS.md gives for where a layer's time goes), on a timeline built by hand."""

import pytest
import torch

from benchmarks.decode_layer_probe import PHASE_NAMES, timeline_phases, timeline_report
from minivllm.kernels.decode_layer import PHASES


def synthetic_timeline(layers, work_us, barrier_us, ramp_us):
    """Three programs; in phase p program i works (i + 1) * work_us[p], and all leave the barrier
    barrier_us[p] after the last arrives. The first layer's qkv phase takes every program ramp_us
    longer (the launch's ramp-up)."""
    programs = 3
    rows = [torch.zeros(programs, dtype=torch.float64)]
    before = rows[0]
    for layer in range(layers):
        for p in range(PHASES):
            ramp = ramp_us if layer == 0 and p == 0 else 0.0
            arrive = before + (torch.arange(1, programs + 1) * work_us[p] + ramp) * 1e3
            leave = torch.full((programs,), arrive.max().item() + barrier_us[p] * 1e3)
            rows += [arrive, leave]
            before = leave
    return (torch.stack(rows) + 1e9).round().to(torch.int64)


def test_timeline_phases_split_each_span_into_work_and_barrier():
    work = [1.0, 2.0, 0.5, 1.5, 3.0, 2.5]
    barrier = [1.0, 1.1, 0.9, 1.2, 1.05, 0.95]
    stamps = synthetic_timeline(3, work, barrier, ramp_us=50.0)
    got = timeline_phases(stamps)
    assert list(got) == list(PHASE_NAMES)
    for (span, mid, slowest), w, b in zip(got.values(), work, barrier):
        # the first layer's ramp is left out of the average
        assert span == pytest.approx(3 * w + b)
        assert mid == pytest.approx(2 * w) and slowest == pytest.approx(3 * w)
    lines = timeline_report(stamps)
    assert len(lines) == PHASES + 2
    assert f"a layer: {sum(3 * w + b for w, b in zip(work, barrier)):.2f} us" in lines[-1]


def test_a_single_layer_timeline_is_averaged_over_that_layer():
    work, barrier = [1.0] * PHASES, [0.5] * PHASES
    stamps = synthetic_timeline(1, work, barrier, ramp_us=0.0)
    assert all(v == pytest.approx((3.5, 2.0, 3.0)) for v in timeline_phases(stamps).values())
