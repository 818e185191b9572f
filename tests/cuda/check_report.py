"""A pytest plugin for scripts/gpu_check.sh's test stages: ``-p tests.cuda.check_report --check-json FILE``
rewrites FILE as each test's setup, call and teardown end (its outcome, seconds, the figures it
recorded with ``record_property``, a failure's exception or the skip's reason), so a stage cut
short by its time limit keeps what finished ("running": the test it was in).
A session in which no test passed (none selected, or all skipped) exits 1: a check that ran
nothing has not passed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption("--check-json", default=None, help="write each test's outcome to this JSON file as it ends")


def pytest_configure(config):
    path = config.getoption("--check-json")
    if path:
        config.pluginmanager.register(CheckReport(Path(path)), "check_report")


class CheckReport:
    def __init__(self, path: Path):
        self.path = path
        self.tests: dict[str, dict] = {}
        self.write()

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"outcome": "running", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.user_properties:
            entry["properties"] = dict(report.user_properties)
        if report.passed:  # a test passes with its call; a teardown that fails after it makes it an error
            if report.when == "call":
                entry["outcome"] = "passed"
        elif report.skipped:
            entry["outcome"] = "skipped"
            entry["message"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else "skipped"
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            crash = getattr(report.longrepr, "reprcrash", None)  # the exception's own line(s)
            entry["message"] = (crash.message if crash is not None else report.longreprtext)[:500]
        self.write()

    def counts(self) -> dict[str, int]:
        outcomes = [t["outcome"] for t in self.tests.values()]
        return {k: outcomes.count(k) for k in ("passed", "failed", "error", "skipped", "running")}

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**self.counts(), "tests": self.tests}, indent=1))
        tmp.replace(self.path)  # whole or absent: the stage may be killed at any moment

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        if exitstatus == 0 and self.counts()["passed"] == 0:
            session.exitstatus = 1
            print(f"\ncheck_report: no test passed ({len(self.tests)} ran); the stage fails")
