"""Symlinks out of the run: inside a checkpoint directory only the pointers may be links.

A ``step_….pitstop`` that is a symlink to another run's (valid) file, named by ``last``; a
sharded checkpoint whose ``manifest.pitstop`` links to another run's manifest (same bytes, so
its checksums pass); a sharded checkpoint directory that is itself a link to another run's:
each is refused by every reader that names it (``CheckpointCorrupt`` naming the path, one
``error:`` line and exit 1 from the CLI), and skipped with a warning by a scan and a resume —
the other run's bytes are never read as this run's.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import pitstop
from pitstop.cli import main as cli
from pitstop.core.records import Policy
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.storage import LocalStorage
from shell.test_sharded_directory import save_sharded

NEWEST = "step_000000000002.pitstop"
RULE = "only the pointers"


def _run(path: Path, fill: float) -> Path:
    model = torch.nn.Linear(4, 3)
    torch.nn.init.constant_(model.weight, fill)
    with pitstop.Checkpointer(path, model=model, policy=pitstop.Policy(keep_last=None)) as ckpt:
        for step in (1, 2):
            ckpt.save(pitstop.Progress(step=step))
    return path


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    """The exit status, the ``error:`` lines and everything printed."""
    code = cli(list(args))
    captured = capsys.readouterr()
    printed = captured.out + captured.err
    return code, [line for line in printed.splitlines() if "error:" in line], printed


@pytest.fixture
def linked_file(tmp_path: Path) -> Path:
    """A run whose newest checkpoint file (named by ``last``) links to another run's."""
    run = _run(tmp_path / "run", 1.0)
    other = _run(tmp_path / "other", 7.0)
    (run / NEWEST).unlink()
    os.symlink(other / NEWEST, run / NEWEST)
    assert os.readlink(run / "last") == NEWEST
    return run


def test_a_checkpoint_file_linking_out_of_the_run_is_refused_by_every_reader(
    linked_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = linked_file
    for call in (
        lambda: pitstop.verify(run / "last"),
        lambda: pitstop.info(run),
        lambda: pitstop.info(run / "last"),
        lambda: pitstop.load(run / NEWEST),
    ):
        with pytest.raises(CheckpointCorrupt, match=RULE) as raised:
            call()
        assert str(run / NEWEST) in str(raised.value)
    code, errors, printed = _cli(capsys, "inspect", str(run / "last"))
    assert (code, len(errors)) == (1, 1), printed
    assert NEWEST in errors[0]
    code, _, printed = _cli(capsys, "verify", str(run / "last"))
    assert code == 1
    assert f"CORRUPT {run / NEWEST}" in printed


def test_a_checkpoint_file_linking_out_is_skipped_by_a_scan_and_a_resume(
    linked_file: Path,
) -> None:
    found = scan(LocalStorage(linked_file))
    assert NEWEST in found.unreadable
    assert any(f"skipping {linked_file / NEWEST}" in w for w in found.warnings)
    loaded = pitstop.load(linked_file)  # falls back to step 1, this run's own
    assert torch.equal(loaded["weights"]["raw"]["weight"], torch.ones(3, 4))


@pytest.fixture
def sharded_runs(tmp_path: Path) -> tuple[Path, Path]:
    """Two runs with sharded checkpoints of steps 1 and 2, byte for byte the same."""
    paths = []
    for name in ("run", "other"):
        opened = CheckpointDirectory(tmp_path / name, policy=Policy(keep_last=None))
        opened.path.mkdir()
        opened.open()
        save_sharded(opened, 1)
        save_sharded(opened, 2)
        opened.close()
        paths.append(opened.path)
    return paths[0], paths[1]


def test_a_sharded_manifest_linking_out_of_the_run_is_refused_and_skipped(
    sharded_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = sharded_runs
    checkpoint = run / sharded_name(2)
    (checkpoint / MANIFEST_NAME).unlink()
    os.symlink(other / sharded_name(2) / MANIFEST_NAME, checkpoint / MANIFEST_NAME)
    found = scan(LocalStorage(run))
    assert sharded_name(2) in found.unreadable
    assert RULE in found.unreadable[sharded_name(2)]
    for argument in (checkpoint, run / "last", run):
        with pytest.raises(CheckpointCorrupt, match=RULE) as raised:
            pitstop.verify(argument)
        assert str(checkpoint / MANIFEST_NAME) in str(raised.value)
    code, _, printed = _cli(capsys, "ls", "--check", str(run))
    assert code == 1
    assert sharded_name(2) in printed


def test_a_sharded_directory_linking_out_of_the_run_is_refused_by_every_reader(
    sharded_runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    run, other = sharded_runs
    checkpoint = run / sharded_name(2)
    for entry in checkpoint.iterdir():
        entry.unlink()
    checkpoint.rmdir()
    os.symlink(other / sharded_name(2), checkpoint)
    assert os.readlink(run / "last") == sharded_name(2)
    for argument in (run / "last", checkpoint):
        with pytest.raises(CheckpointCorrupt, match=RULE) as raised:
            pitstop.verify(argument)
        assert str(checkpoint) in str(raised.value)
    code, errors, printed = _cli(capsys, "inspect", str(run / "last"))
    assert (code, len(errors)) == (1, 1), printed
    assert sharded_name(2) in errors[0]
    code, _, printed = _cli(capsys, "verify", str(run / "last"))
    assert code == 1
    assert f"CORRUPT {run / sharded_name(2)}" in printed
    assert sharded_name(2) in scan(LocalStorage(run)).unreadable
