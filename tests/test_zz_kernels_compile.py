"""Every Triton kernel the CPU suite launched, compiled for a Hopper GPU (tests/kernel_launches.py
says why: the interpreter runs code the compiler rejects). Last in the suite (pytest runs the
files in name order), so it sees the launches of every test before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import kernel_launches

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run compiles them")


@triton.jit
def _two_typed_loop_variable_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Session 64's mistake in small: `x` a scalar before the loop and a block in it."""
    x = tl.load(x_ptr)
    acc = tl.zeros([BLOCK], tl.float32) + x
    for off in range(BLOCK, n, BLOCK):
        x = tl.load(x_ptr + off + tl.arange(0, BLOCK))
        acc += x
    tl.store(out_ptr + tl.arange(0, BLOCK), acc)


def _compile(launches: list[dict], tmp_path: Path) -> subprocess.CompletedProcess:
    """tests/kernel_launches.py in a child process without the interpreter."""
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(TESTS / "kernel_launches.py"), str(path)], env=env,
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)


def test_a_kernel_the_interpreter_runs_and_the_compiler_rejects_is_reported(tmp_path):
    before = set(kernel_launches.LAUNCHES)
    x = torch.arange(64, dtype=torch.float32)
    out = torch.empty(16)
    _two_typed_loop_variable_kernel[(1,)](x, out, 64, BLOCK=16)
    assert torch.equal(out, x[0] + x[16:].view(3, 16).sum(0))  # the interpreter's answer
    mine = [kernel_launches.LAUNCHES.pop(k) for k in set(kernel_launches.LAUNCHES) - before]
    assert [launch["name"] for launch in mine] == ["_two_typed_loop_variable_kernel"]
    assert mine[0]["signature"]["x_ptr"] == "*fp32" and mine[0]["constexprs"] == {"BLOCK": 16}
    proc = _compile(mine, tmp_path)
    assert proc.returncode == 1 and "Loop-carried variable x" in proc.stdout, proc.stdout[-3000:]


def test_every_kernel_the_suite_launched_compiles_for_hopper(tmp_path):
    launches = list(kernel_launches.LAUNCHES.values())
    if not launches:
        pytest.skip("no kernel launched earlier in this run")
    proc = _compile(launches, tmp_path)
    assert proc.returncode == 0, f"{len(launches)} launches; failures:\n{proc.stdout[-8000:]}" \
                                 f"\n{proc.stderr[-2000:]}"
