"""benchmarks/sampler_stages.py runs (small, on this machine's clock). The draw of truncated rows
it times is tested in test_truncated_sample.py (the kernel) and test_sampling_audit.py (the
frequencies)."""

from __future__ import annotations

import json


def test_sampler_stages_runs_small(tmp_path):
    from benchmarks.sampler_stages import SETTINGS, main

    out = tmp_path / "t.json"
    assert main(["--rows", "3", "--vocab", "300", "--iters", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    by = {r["setting"]: r for r in rows}
    assert list(by) == list(SETTINGS) and all(r["sample_ms"] > 0 for r in rows)
    assert "topk_ms" in by["top_k20_top_p095"] and "topk_ms" not in by["top_p095"]
    assert "inverse_cdf_ms" in by["min_p005"] and "inverse_cdf_ms" not in by["plain"]
    assert "penalties_ms" in by["penalties"] and "penalties_ms" in by["allowed_ids"]
