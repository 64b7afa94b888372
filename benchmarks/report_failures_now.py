"""pytest plugin (-p benchmarks.report_failures_now): prints each failure's traceback the moment
the test ends, so a GPU run cut short by its time limit still shows why tests failed (pytest
prints them only in its final summary)."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n---- {report.nodeid} ({report.when}) failed:\n{report.longreprtext}\n----",
              flush=True)
