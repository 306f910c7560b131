"""The command line, run as a real process: exit codes and what it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dirtools import save
from pitstop.core.records import Best, Policy
from pitstop.core.schedule import Call
from pitstop.shell.directory import CheckpointDirectory


def pitstop(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pitstop", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture
def run(tmp_path: Path) -> Path:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=2, best=Best("loss"))) as d:
        for step, loss in [(1, 0.5), (2, 0.2), (3, 0.4)]:
            save(d, step, call=Call.MANUAL, metrics={"loss": loss})
        save(d, 4, call=Call.FINISH)
    return tmp_path


def test_ls_shows_every_checkpoint_and_why_it_is_kept(run: Path) -> None:
    result = pitstop("ls", str(run))
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    assert [row.split("│")[1].strip() for row in rows] == ["2", "3", "4"]
    assert "pointer:best" in rows[0]
    assert "recent" in rows[1]
    assert "newest" in rows[2]
    assert "last, final" in rows[2]


def test_ls_check_names_the_corrupt_file_and_the_resume_point(run: Path) -> None:
    newest = run / "step_000000000004.pitstop"
    with open(newest, "r+b") as f:
        f.seek(70)
        f.write(b"\x00\x01")
    result = pitstop("ls", "--check", str(run))
    assert result.returncode == 1
    assert "CORRUPT" in result.stdout
    assert "would use step_000000000003.pitstop" in result.stdout.replace("\n", " ")
    assert "after skipping step_000000000004.pitstop" in result.stdout.replace("\n", " ")


def test_verify_exit_codes(run: Path) -> None:
    ok = pitstop("verify", str(run / "best"))
    assert ok.returncode == 0
    assert "OK" in ok.stdout
    target = run / "step_000000000002.pitstop"
    with open(target, "r+b") as f:
        f.seek(64)
        f.write(b"\xde\xad")
    bad = pitstop("verify", str(target))
    assert bad.returncode == 1
    assert "CORRUPT" in bad.stdout
    assert "step_000000000002.pitstop" in bad.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    assert pitstop("ls").returncode == 2
    assert pitstop("frobnicate").returncode == 2
    missing = pitstop("ls", str(tmp_path / "missing"))
    assert missing.returncode == 1
    assert "is not a directory" in missing.stdout
