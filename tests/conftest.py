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


# The files that take longest (each over ~30 s on 2 cores), started first: `make unit` hands
# whole files to its workers in collection order, and one of these collected last would leave
# the other worker idle while it runs. Measured with --durations; the order only, no time.
LONGEST_FIRST = (
    "tests/e2e/test_nodes.py",
    "tests/e2e/test_nodes_sharded.py",
    "tests/e2e/test_nodes_tiers.py",
    "tests/train/test_cli_train.py",
    "tests/test_demo.py",
    "tests/e2e/test_nodes_async.py",
    "tests/test_benchmarks_smoke_device.py",
    "tests/train/test_signals.py",
    "tests/test_benchmarks_smoke.py",
    "tests/e2e/test_sharded_checkpointer.py",
    "tests/store/test_sharded_objects.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the files of LONGEST_FIRST first, in its order; the rest as collected."""
    root = config.rootpath

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
