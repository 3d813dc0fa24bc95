"""A pytest plugin that writes each test's verdict to a file the moment it is known, a failure with its traceback:
`python -m pytest -p tests.stream_report --stream-report FILE ...`. pytest prints its failures' tracebacks at the end
of the session, so a session stopped from outside (the GPU acceptance run's background, stopped when the vLLM checks
are due) left only its progress dots: "FF......" on the H200 of 2026-11-30, two failures without a cause. Here every
line is flushed as it is written: what a stop leaves is every finished test's verdict, its seconds and its cause."""

from __future__ import annotations

import os
import time


def pytest_addoption(parser):
    parser.addoption("--stream-report", default="", help="append each test's verdict (a failure's traceback with it) "
                     "to this file as soon as the test ends")


def pytest_configure(config):
    path = config.getoption("--stream-report")
    if path:
        config.pluginmanager.register(_Stream(path), "stream_report_file")


class _Stream:
    def __init__(self, path: str):
        self.path = path
        self.started: dict[str, float] = {}

    def _write(self, text: str) -> None:
        with open(self.path, "a") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = time.perf_counter()
        self._write(f"started {nodeid}\n")

    def pytest_runtest_logreport(self, report):
        # a test's verdict: its call, or a setup that failed or skipped it, or a teardown that failed
        if not (report.when == "call" or report.failed or (report.when == "setup" and report.skipped)):
            return
        took = time.perf_counter() - self.started.get(report.nodeid, time.perf_counter())
        word = "FAILED" if report.failed else ("skipped" if report.skipped else "passed")
        where = "" if report.when == "call" else f" (in {report.when})"
        line = f"{word} {report.nodeid}{where} {took:.1f} s"
        if report.skipped and isinstance(report.longrepr, tuple):
            line += f": {report.longrepr[2].removeprefix('Skipped: ')}"
        text = line + "\n"
        if report.failed:
            text += "".join(f"    {row}\n" for row in report.longreprtext.splitlines()) + "\n"
        self._write(text)
