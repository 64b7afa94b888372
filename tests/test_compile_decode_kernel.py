"""benchmarks/compile_decode_kernel.py: an offline sm_90 compile reports what Triton's pipeliner
allocated (BENCHMARKS.md session 13's figures come from it). A subprocess: the tool compiles for
a GPU, which conftest's TRITON_INTERPRET=1 would turn into interpreted functions."""

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compile_decode_kernel import TRITON_BIN as BIN
from benchmarks.compile_decode_kernel import parse_configs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (shutil.which("ptxas", path=BIN) and shutil.which("cuobjdump", path=BIN)),
                    reason="this Triton has no bundled ptxas/cuobjdump")
def test_more_stages_prefetch_more_tiles_in_more_shared_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks/compile_decode_kernel.py"),
                          "--cache", "fp8", "--configs", "n64w4s3,n64w4s5"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [dict(shared=float(m[0]), tiles=int(m[1]), programs=int(m[2]), hmma=int(m[3]))
            for m in re.findall(r"([\d.]+) KB shared.*? (\d+) tile\(s\) prefetched, (\d+) programs an SM"
                                r".*?HMMA (\d+)", out)]
    assert len(rows) == 2, out
    three, five = rows
    assert (three["tiles"], five["tiles"]) == (1, 2)
    assert five["shared"] - three["shared"] >= 16  # KB: one more 64-token K and V tile of fp8
    assert three["hmma"] == five["hmma"] == 32  # both dots of a 64-token tile, whatever the stages
    assert 1 <= five["programs"] <= three["programs"]


def test_configs_parse_and_bad_ones_are_clear_errors():
    """The notation both compile_decode_kernel.py and sweep_decode_attention.py take."""
    assert parse_configs("n128w4s3,n32w2s2r96") == [
        dict(block_n=128, num_warps=4, num_stages=3),
        dict(block_n=32, num_warps=2, num_stages=2, maxnreg=96)]
    for bad in ("128:3", "n128w4", "n128w0s3", "n128w4s3r", "N128W4S3"):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(bad))):
            parse_configs(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="config ''"):
        parse_configs("n128w4s3,")
