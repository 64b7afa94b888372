"""Every benchmark script answers --help with what it measures and measures nothing (README:
"`--help` on each says what it measures"); a probe without options used to start its GPU run."""

import pathlib
import runpy
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


def test_the_scripts_are_found():
    assert len(SCRIPTS) >= 30 and ROOT / "benchmarks" / "greedy_pick_probe.py" in SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_the_usage_and_exits(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    monkeypatch.syspath_prepend(str(ROOT))
    threads = torch.get_num_threads()  # host_cost.py sets 1 on import
    try:
        with pytest.raises(SystemExit) as stop:
            runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    assert stop.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: ") and len(out.splitlines()) > 3, out[:200]
