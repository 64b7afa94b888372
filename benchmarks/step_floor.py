"""Each decode step of the throughput run against its own memory-traffic floor, from the step
records `minivllm bench --step-times F` writes.

    python benchmarks/step_floor.py steps.json [--shape qwen3-0.6b] [--tb-s 4.24]

A step's floor is the KV of the sequences running then plus the weights, at the copy bandwidth.
The KV is modelled from the workload: every sequence decodes one token a step from the first
step with nothing waiting, until its max_tokens (preemption would break the model; the bench's
KV cache is large enough that none happens). Prints, by batch size, the steps, their measured and
floor seconds, the time each step loses to everything but reading KV and weights, (records
since session 20) the share of the steps' time spent waiting for the device's tokens (near 0:
the host bounds those steps) and the median step's host work (its time less the wait), and
(records since session 32) the median time in runner.launch, where the host meets CUDA. Then the
steps that computed prompt tokens (prefill and mixed), with their tokens a second and the time
they waited for the device (session 27: ~0 since norm_rope_store, i.e. the host's launching
bounds them). A .gz file is read as gzip."""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import statistics

from minivllm.runtime.workload import (expert_bytes, expert_share_read, kv_bytes_per_token,
                                       throughput_workload, weight_bytes)
from minivllm.state.config import config_for_shape

BANDS = ((151, 256), (61, 150), (17, 60), (1, 16))


def check_workload(records: list[dict], num_seqs: int) -> None:
    """ValueError unless the record's run had `num_seqs` sequences (where its records say):
    floors from another workload than the one that ran would be quietly wrong."""
    seen = max((r["running"] + r["waiting"] for r in records if "running" in r), default=None)
    if seen is not None and seen != num_seqs:
        raise ValueError(f"the record's run had {seen} sequences, the workload {num_seqs}: pass "
                         f"the bench run's --num-seqs, --max-input-len and --max-output-len")


def step_floors(records: list[dict], prompt_lens: list[int], max_tokens: list[int],
                kv_per_token: int, weights: int, bandwidth: float, experts: int = 0,
                expert_share=None) -> list[tuple]:
    """(sequences running, measured s, floor s, s waiting for the device or None, s in
    runner.launch or None) for each decode step, i.e. each step from the first with nothing
    waiting. At decode step j a sequence with n output tokens is running if j + 1 < n (its first
    token came from prefill) and holds p + j tokens of KV. experts: the part of `weights` that
    is a mixture of experts' experts, of which a step of B sequences reads expert_share(B)."""
    start = next((i for i, r in enumerate(records) if r["waiting"] == 0), None)
    if start is None:
        raise ValueError("no step without waiting sequences: is this a throughput run's record?")
    out = []
    for j, record in enumerate(records[start:]):
        running = [(p, n) for p, n in zip(prompt_lens, max_tokens) if j + 1 < n]
        kv = sum((p + j) * kv_per_token for p, _ in running)
        step_weights = weights if not experts else \
            weights - experts + experts * expert_share(len(running))
        out.append((len(running), record["s"], (kv + step_weights) / bandwidth,
                    record.get("wait_s"), record.get("launch_s")))
    return out


def bands(floors: list[tuple]) -> list[dict]:
    """Per band of running sequences: steps, measured and floor seconds, the share of the
    measured time spent waiting for the device, the median step's host work (ms: its time less
    the wait) and the median ms in runner.launch (each None when the records do not say)."""
    rows = []
    for low, high in BANDS:
        steps = [(s, f, w, la) for n, s, f, w, la in floors if low <= n <= high]
        if steps:
            measured, floor = sum(s for s, *_ in steps), sum(f for _, f, *_ in steps)
            waited = all(w is not None for _, _, w, _ in steps)
            launched = all(la is not None for *_, la in steps)
            rows.append({"sequences": f"{high}-{low}", "steps": len(steps), "measured_s": measured,
                         "floor_s": floor, "of_floor": floor / measured,
                         "lost_ms_per_step": 1e3 * (measured - floor) / len(steps),
                         "waiting": sum(w for _, _, w, _ in steps) / measured if waited else None,
                         "host_ms": 1e3 * statistics.median(s - w for s, _, w, _ in steps)
                         if waited else None,
                         "launch_ms": 1e3 * statistics.median(la for *_, la in steps)
                         if launched else None})
    return rows


def prefill_summary(records: list[dict]) -> dict | None:
    """The steps that computed prompt tokens (prefill and mixed steps; records from before
    session 5 lack the count: None): their number, seconds, prompt tokens, tokens a second, and
    seconds spent waiting for the device (None where the records lack it, before session 20)."""
    if not records or "prompt_tokens" not in records[0]:
        return None
    steps = [r for r in records if r["prompt_tokens"] > 0]
    seconds, tokens = sum(r["s"] for r in steps), sum(r["prompt_tokens"] for r in steps)
    waited = sum(r["wait_s"] for r in steps) if all("wait_s" in r for r in steps) else None
    return {"steps": len(steps), "seconds": seconds, "prompt_tokens": tokens,
            "tok_per_s": tokens / seconds if seconds else 0.0, "wait_s": waited}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("steps")
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--num-seqs", type=int, default=256,
                    help="the workload bench ran (its --num-seqs, --max-input-len, --max-output-len)")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--tb-s", type=float, default=4.24, help="copy bandwidth, TB/s")
    ap.add_argument("--kv-bytes", type=int, default=2, help="bytes a cached K or V element takes "
                    "(2: bf16, 1: fp8)")
    args = ap.parse_args()
    with (gzip.open if args.steps.endswith(".gz") else open)(args.steps, "rt") as f:
        records = json.load(f)
    config = config_for_shape(args.shape)
    prompts, max_tokens = throughput_workload(args.num_seqs, args.max_input_len, args.max_output_len)
    try:
        check_workload(records, len(prompts))
    except ValueError as e:
        raise SystemExit(f"step_floor: {e}") from None
    floors = step_floors(records, [len(p) for p in prompts], max_tokens,
                         kv_bytes_per_token(config, args.kv_bytes),
                         weight_bytes(config), args.tb_s * 1e12, experts=expert_bytes(config),
                         expert_share=functools.partial(expert_share_read, config))
    print(f"{'sequences':>10} {'steps':>6} {'measured s':>11} {'floor s':>8} {'of floor':>9} "
          f"{'lost ms/step':>13} {'waiting':>8} {'host ms':>8} {'launch ms':>10}")
    for r in bands(floors):
        waiting = "?" if r["waiting"] is None else f"{r['waiting']:.0%}"
        host = "?" if r["host_ms"] is None else f"{r['host_ms']:.2f}"
        launch = "?" if r["launch_ms"] is None else f"{r['launch_ms']:.2f}"
        print(f"{r['sequences']:>10} {r['steps']:>6} {r['measured_s']:>11.3f} {r['floor_s']:>8.3f} "
              f"{r['of_floor']:>9.0%} {r['lost_ms_per_step']:>13.2f} {waiting:>8} {host:>8} "
              f"{launch:>10}")
    prefill = prefill_summary(records)
    if prefill:
        print(f"steps with prompt tokens: {prefill['steps']}, {prefill['seconds']:.3f} s, "
              f"{prefill['prompt_tokens']} tokens, {prefill['tok_per_s']:,.0f} tok/s"
              + ("" if prefill["wait_s"] is None else
                 f", {prefill['wait_s']:.3f} s of it waiting for the device"))
    for i, r in enumerate(records):  # the prefill phase, step by step
        if r["waiting"] == 0 and r.get("prompt_tokens", 0) == 0:
            break
        print(f"  step {i:3}: {1e3 * r['s']:6.1f} ms, {r.get('prompt_tokens', '?'):>5} prompt "
              f"tokens, {r['running']:3} running, {r['waiting']:3} waiting, cudaMalloc calls "
              f"{r.get('device_allocs')}"
              + (f", waited {1e3 * r['wait_s']:.2f} ms" if "wait_s" in r else ""))


if __name__ == "__main__":
    main()
