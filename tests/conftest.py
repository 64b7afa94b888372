"""Test setup: Triton's interpreter on machines without a GPU (set before triton is imported),
its launches recorded for the compile check at the suite's end, and a device fixture that is
"cuda" when a GPU is present (the GPU run of the suite)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    # Every interpreted launch is kept for test_zz_kernels_compile.py (tests/kernel_launches.py).
    from kernel_launches import install  # noqa: E402

    install()

settings.register_profile("ci", deadline=None, max_examples=25, derandomize=True)
settings.register_profile("dev", deadline=None, max_examples=25)
# The GPU run (benchmarks/gpu_checks.sh): each new shape is a Triton compile of seconds, and the
# suite shares a 10-minute device call with the benchmarks.
settings.register_profile("gpu", deadline=None, max_examples=6, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
