"""`make demo` installs what its plot needs; `make test` needs nothing more than it had."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _dry_run(target: str) -> str:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    result = subprocess.run(
        ["make", "--dry-run", "--always-make", target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout


def test_make_demo_installs_the_plot_extra() -> None:
    commands = _dry_run("demo")
    assert "pip install --quiet -e '.[plot]'" in commands
    assert commands.index(".[plot]") < commands.index("pitstop demo")


def test_make_test_does_not_install_the_plot_extra() -> None:
    assert "plot" not in _dry_run("test")


def test_the_plot_extra_is_matplotlib_and_no_other_extra_needs_it() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(req.startswith("matplotlib") for req in extras["plot"])
    for name, requirements in extras.items():
        if name != "plot":
            assert not any(req.startswith("matplotlib") for req in requirements), name


def test_make_test_runs_the_test_files_side_by_side_one_file_per_worker() -> None:
    commands = _dry_run("test")
    pytest_line = next(line for line in commands.splitlines() if " -m pytest" in line)
    assert " -n " in pytest_line
    assert "--dist loadfile" in pytest_line  # a file's module fixtures are computed once
