"""pytest plugin (-p benchmarks.report_failures_now): prints each failure's traceback the moment
the test ends, so a GPU run cut short by its time limit still shows why tests failed (pytest
prints them only in its final summary), with the end of what the test wrote to stderr: a Triton
compile that fails says why only there (MLIR's diagnostic before "PassManager::run failed");
and each test's time as it ends.

A failure that ends after STEP_DEADLINE (epoch seconds; gpu_checks.sh's `step` sets it to when
its `timeout` sends SIGABRT) is marked as such: a Triton compile running at that moment catches
the signal in MLIR's crash recovery and fails with "PassManager::run failed", with no diagnostic
(session 43: one decode_mlp case, 0.4 s after the signal, that compiled and passed in 36 of 36
fresh processes after). Session 27's fp16 decode-stack compile failure, which never recurred,
came at its step's limit too (the next test was killed 15 s later); session 18's may have
(its limit is not recorded)."""

import os
import time

STDERR_TAIL = 4000  # characters


def pytest_runtest_logreport(report):
    if report.failed:
        stderr = report.capstderr[-STDERR_TAIL:]
        stderr = f"\n-- its stderr (last {STDERR_TAIL} characters):\n{stderr}" if stderr else ""
        late = after_deadline(time.time(), os.environ.get("STEP_DEADLINE"))
        print(f"\n---- {report.nodeid} ({report.when}) failed{late}:\n{report.longreprtext}"
              f"{stderr}\n----", flush=True)


def after_deadline(now: float, deadline: str | None) -> str:
    """A note for a failure's header when `now` is past `deadline` (epoch seconds), else ""."""
    if not deadline or now < float(deadline):
        return ""
    return (f" after the step's time limit ({now - float(deadline):.0f} s past its SIGABRT; a "
            f"Triton compile under way fails on that signal)")


# Each test's time and the time since the run began, as it ends: a suite cut short by its limit
# (pytest's --durations prints only at the end) still says where the time went.
_STARTED: dict[str, float] = {}
_RUN_START = time.monotonic()


def pytest_runtest_logstart(nodeid, location):
    _STARTED[nodeid] = time.monotonic()


def pytest_runtest_logfinish(nodeid, location):
    now = time.monotonic()
    print(f"   [{now - _STARTED.pop(nodeid, now):.1f} s; {now - _RUN_START:.0f} s in]", flush=True)
