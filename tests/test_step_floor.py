"""benchmarks/step_floor.py: each decode step's floor from the workload model, against a count
done by hand on a three-sequence workload."""

import pytest

from benchmarks.step_floor import bands, check_workload, prefill_summary, step_floors


def test_floors_follow_the_running_sequences():
    prompt_lens, max_tokens = [10, 20, 30], [2, 3, 5]
    records = [{"s": 1.0, "waiting": 2}, {"s": 1.0, "waiting": 0}] + [{"s": 0.5, "waiting": 0}] * 4
    floors = step_floors(records, prompt_lens, max_tokens, kv_per_token=1, weights=100, bandwidth=2.0)
    # decode step j (from the first record with nothing waiting): running are the sequences with
    # j + 1 < n, each holding p + j tokens of KV: 10+20+30, 21+31, 32, 33, none
    assert floors == [(3, 1.0, 80.0, None, None), (2, 0.5, 76.0, None, None),
                      (1, 0.5, 66.0, None, None), (1, 0.5, 66.5, None, None),
                      (0, 0.5, 50.0, None, None)]
    (band,) = bands(floors)  # the step with none running counts in no band
    assert band["sequences"] == "16-1" and band["steps"] == 4
    assert band["measured_s"] == 2.5 and band["floor_s"] == 288.5
    assert band["lost_ms_per_step"] == pytest.approx(1e3 * (2.5 - 288.5) / 4)
    assert band["waiting"] is None  # records from before session 20 carry no wait
    assert band["host_ms"] is None and band["launch_ms"] is None


def test_a_mixture_of_experts_step_reads_the_share_of_experts_its_sequences_route_to():
    """experts: the part of the weights of which a step reads expert_share(sequences running)."""
    records = [{"s": 1.0, "waiting": 0}] * 3
    floors = step_floors(records, [10, 20], [2, 3], kv_per_token=1, weights=100, bandwidth=1.0,
                         experts=60, expert_share=lambda b: b / 4)
    # running: 2, 1, 0 sequences; KV 10+20, 21, none; weights 40 + 60 * b / 4
    assert [f[2] for f in floors] == [30 + 40 + 30, 21 + 40 + 15, 0 + 40 + 0]


def test_bands_give_the_share_of_time_spent_waiting_for_the_device():
    records = [{"s": 1.0, "waiting": 0, "wait_s": 0.5}, {"s": 0.5, "waiting": 0, "wait_s": 0.0},
               {"s": 0.5, "waiting": 0, "wait_s": 0.25}]
    floors = step_floors(records, [10, 10], [9, 9], kv_per_token=1, weights=0, bandwidth=1.0)
    (band,) = bands(floors)
    assert band["steps"] == 3 and band["waiting"] == pytest.approx(0.75 / 2.0)
    # host work a step: 0.5, 0.5, 0.25 s; its median in ms
    assert band["host_ms"] == pytest.approx(500.0) and band["launch_ms"] is None
    launched = [dict(r, launch_s=la) for r, la in zip(records, (0.25, 0.125, 0.0625))]
    (band,) = bands(step_floors(launched, [10, 10], [9, 9], kv_per_token=1, weights=0,
                                bandwidth=1.0))
    assert band["launch_ms"] == pytest.approx(125.0)


def test_a_record_that_never_stops_waiting_is_a_clear_error():
    with pytest.raises(ValueError, match="waiting"):
        step_floors([{"s": 1.0, "waiting": 3}], [5], [2], kv_per_token=1, weights=1, bandwidth=1.0)


def test_prefill_summary_counts_the_steps_that_computed_prompt_tokens():
    records = [{"s": 0.5, "prompt_tokens": 100}, {"s": 0.25, "prompt_tokens": 50},
               {"s": 1.0, "prompt_tokens": 0}]
    assert prefill_summary(records) == {"steps": 2, "seconds": 0.75, "prompt_tokens": 150,
                                        "tok_per_s": 200.0, "wait_s": None}
    waited = [dict(r, wait_s=w) for r, w in zip(records, (0.125, 0.0625, 0.5))]
    assert prefill_summary(waited)["wait_s"] == 0.1875  # the steps with prompt tokens only
    assert prefill_summary([{"s": 1.0}]) is None  # a record from before the count existed


def test_a_record_of_another_workload_is_a_clear_error():
    records = [{"s": 1.0, "running": 1, "waiting": 1}, {"s": 0.5, "running": 2, "waiting": 0}]
    check_workload(records, 2)
    with pytest.raises(ValueError, match="the record's run had 2 sequences, the workload 256"):
        check_workload(records, 256)
    check_workload([{"s": 1.0, "waiting": 0}], 256)  # records before "running" say nothing
