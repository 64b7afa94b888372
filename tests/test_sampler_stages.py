"""benchmarks/sampler_stages.py runs (small, on this machine's clock), and the lever it times
is sound: the Gumbel kernel over truncated logits (temperature 1) draws only the ids truncation
keeps, with their renormalised probabilities."""

from __future__ import annotations

import json

import attrs
import numpy as np
import torch

from minivllm.functional.sampling import (SamplingRow, _gumbel_pass, make_sampling_batch,
                                          truncated_logits)


def test_sampler_stages_runs_small(tmp_path):
    from benchmarks.sampler_stages import SETTINGS, main

    out = tmp_path / "t.json"
    assert main(["--rows", "3", "--vocab", "300", "--iters", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    by = {r["setting"]: r for r in rows}
    assert list(by) == list(SETTINGS) and all(r["sample_ms"] > 0 for r in rows)
    assert "topk_ms" in by["top_k20_top_p095"] and "topk_ms" not in by["top_p095"]
    assert "gumbel_kernel_ms" in by["min_p005"] and "gumbel_kernel_ms" not in by["plain"]
    assert "penalties_ms" in by["penalties"] and "penalties_ms" in by["allowed_ids"]


def test_gumbel_over_truncated_logits_draws_the_truncated_distribution():
    vocab, n = 12, 6000
    logits = torch.tensor([2.0, 1.5, 1.5, 1.0, 0.2, -0.5, -3.0, 0.7, 1.5, -1.0, 0.0, 0.3])
    rows = [SamplingRow(temperature=0.8, top_k=4, top_p=0.9, seed=s) for s in range(n)]
    sb = make_sampling_batch(rows, vocab_size=vocab)
    cut = truncated_logits(logits.expand(n, -1).clone(), sb)
    # the torch reference of the kernel's math (the kernel itself is slow under the interpreter)
    ids = _gumbel_pass(cut, attrs.evolve(sb, temperature=torch.ones(n)), kernel=False)
    counts = np.bincount(ids.numpy(), minlength=vocab)
    p = torch.softmax(cut[0], dim=-1).double().numpy()
    assert (counts[p == 0] == 0).all() and (p > 0).sum() >= 2
    expected = n * p[p > 0]
    stat = float(((counts[p > 0] - expected) ** 2 / expected).sum())
    assert stat < 30.0, (counts, p)  # chi-square, <= 4 degrees of freedom: p ~ 1e-5
