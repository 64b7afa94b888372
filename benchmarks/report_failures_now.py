"""pytest plugin (-p benchmarks.report_failures_now): prints each failure's traceback the moment
the test ends, so a GPU run cut short by its time limit still shows why tests failed (pytest
prints them only in its final summary), with the end of what the test wrote to stderr: a Triton
compile that fails says why only there (MLIR's diagnostic before "PassManager::run failed";
session 27's one fp16 decode-stack failure left no trace of it, and did not recur)."""

STDERR_TAIL = 4000  # characters


def pytest_runtest_logreport(report):
    if report.failed:
        stderr = report.capstderr[-STDERR_TAIL:]
        stderr = f"\n-- its stderr (last {STDERR_TAIL} characters):\n{stderr}" if stderr else ""
        print(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}{stderr}\n----",
              flush=True)
