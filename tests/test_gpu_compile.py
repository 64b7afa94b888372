"""The GPU-only kernel variants of the single-stream decode (the head, the stem, the greedy
pick) compile for sm_90 on this CPU machine, without spills: Triton's interpreter, which runs
them in the other tests, accepts code that its compiler refuses (session 20's first decode head
did). A subprocess: conftest's TRITON_INTERPRET=1 would make the kernels interpreted functions."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compile_decode_kernel import TRITON_BIN

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not shutil.which("ptxas", path=TRITON_BIN),
                    reason="this Triton has no bundled ptxas")
def test_the_decode_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "tests/gpu_compile_check.py")], env=env,
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    for r in results:
        assert 0 < r["registers"] <= 255 and r["spill_bytes"] == 0, r
