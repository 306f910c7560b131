"""Shared test configuration: hypothesis profiles, and the docs' count of blocks run.

``ci`` (the default) keeps the whole suite within minutes on 2 cores; ``thorough`` is for long
local runs: ``HYPOTHESIS_PROFILE=thorough make unit``.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,  # no timing assertions: a slow CI machine must not fail a property
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many blocks of README.md and docs/ tests/test_docs.py ran, and skipped and why."""
    ran: dict[str, int] = {}
    skipped = {"fragment": 0, "skip": 0}
    for outcome in ("passed", "failed", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "test_docs.py::test_doc_block_prints_what_the_doc_shows" not in nodeid:
                continue
            if outcome != "skipped":
                if report.when == "call":
                    ran[outcome] = ran.get(outcome, 0) + 1
                continue
            reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
            skipped["fragment" if "fragment: " in reason else "skip"] += 1
    if ran or any(skipped.values()):
        terminalreporter.write_sep(
            "-",
            f"docs: {sum(ran.values())} blocks ran ({ran.get('passed', 0)} passed, "
            f"{ran.get('failed', 0)} failed), {sum(skipped.values())} skipped "
            f"({skipped['fragment']} fragments, {skipped['skip']} skip markers)",
        )
