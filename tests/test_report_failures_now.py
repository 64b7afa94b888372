"""benchmarks/report_failures_now.py, the GPU calls' pytest plugin: a failure is printed when its
test ends (before the next test runs), with the stderr the test wrote."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SUITE = '''
import sys

def test_fails():
    print("the compiler's diagnostic", file=sys.stderr)
    assert 1 == 2

def test_after():
    pass
'''


def test_a_failure_is_printed_with_its_stderr_before_the_next_test(tmp_path):
    (tmp_path / "test_suite.py").write_text(SUITE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
         "benchmarks.report_failures_now", "-o", "addopts=", "-v",
         str(tmp_path / "test_suite.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": ""})
    out = run.stdout
    report = out.find("---- test_suite.py::test_fails (call) failed:")
    assert report >= 0, out
    after = out.find("test_suite.py::test_after PASSED")
    assert 0 <= report < after, out  # printed as the test ended, not in the final summary
    assert "assert 1 == 2" in out[report:after]
    assert "its stderr" in out[report:after] and "the compiler's diagnostic" in out[report:after]
    assert run.returncode == 1
