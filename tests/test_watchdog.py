"""A test that hangs fails, with every thread's traceback, instead of stalling the run.

The project's pytest configuration sets ``faulthandler_timeout`` with
``faulthandler_exit_on_timeout``: past the limit, pytest's faulthandler prints every thread's
stack and ends the process (under pytest-xdist the worker dies and its test is reported
failed, by name). Checked: the running configuration has both, and a hanging test in a
pytest run with the same two settings (a 2 s limit) fails with its traceback.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HANGS = """
import threading


def test_waits_for_ever():
    threading.Event().wait()  # nothing sets it: a hang
"""


def test_the_suite_ends_a_test_that_hangs(pytestconfig: pytest.Config) -> None:
    assert float(pytestconfig.getini("faulthandler_timeout")) > 0
    assert pytestconfig.getini("faulthandler_exit_on_timeout") is True


def test_a_hanging_test_ends_its_run_with_its_traceback(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    limits = ["-o", "faulthandler_timeout=2", "-o", "faulthandler_exit_on_timeout=true"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *limits, "test_hangs.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,  # far beyond the 2 s limit: reaching it means the run was not ended
        check=False,
    )
    assert done.returncode != 0
    assert "Timeout" in done.stderr, done.stderr
    assert "test_waits_for_ever" in done.stderr, done.stderr  # where it hung
