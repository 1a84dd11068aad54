"""pytest plugin of bench/run_gpu_check.sh (`-p pytest_progress_log`, bench/ on the path): each test's
outcome, and each failure's or error's report with its traceback, appended to $PROGRESS_LOG as soon as
pytest has it (with pytest-xdist: in the controller, as workers report). pytest's summary and the JUnit
XML are written only at the end, so a check stopped at its time limit said nothing about which tests had
failed (session 25: ~70 failures and errors shown as letters only); this log keeps them."""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("PROGRESS_LOG")
    if not path or (report.when != "call" and not report.failed):
        return  # one line per test (its call), plus any failed setup or teardown
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{report.outcome.upper()} {report.nodeid} ({report.when}, {report.duration:.1f} s)\n")
        if report.failed:
            log.write(report.longreprtext + "\n\n")
