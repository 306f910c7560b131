"""Edges a new user finds, through the real Checkpointer (issue 11): each fails early and
loudly, naming the path and the way out, or is handled.

* a directory (not a link) named ``last``, ``best``, ``final`` or ``latest.json`` in the
  checkpoint directory: refused when the Checkpointer opens, never at step N;
* a checkpoint directory that is a file: a pitstop error, not ``FileExistsError``;
* a fresh run (no ``resume()``) in a directory holding another run's checkpoints: refused before
  anything is written, naming the directory, its newest step and the ways out (resume, another
  directory, ``overwrite=True``);
* a component the checkpoint holds that the resumed run never registers: one warning, by name,
  at the first save;
* a manifest whose checksum passes but whose ``world_size`` is malformed: corrupt, so resume
  falls back past it — never a ValueError.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from dirtools import snapshot
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage


def _run(path: Path, steps: tuple[int, ...] = (1, 2), **options: Any) -> None:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pitstop.Checkpointer(path, model=model, state={"opt": opt}, **options) as ckpt:
        ckpt.resume()
        for step in steps:
            ckpt.save(pitstop.Progress(step=step))


@pytest.mark.parametrize("name", ["last", "best", "final", "latest.json"])
def test_a_directory_in_a_pointers_place_is_refused_when_the_checkpointer_opens(
    tmp_path: Path, name: str
) -> None:
    (tmp_path / name).mkdir()
    with pytest.raises(SaveError) as info:
        pitstop.Checkpointer(tmp_path, model=torch.nn.Linear(3, 2))
    message = str(info.value)
    assert str(tmp_path / name) in message
    assert "is a directory" in message
    assert "move it out of the way" in message
    assert "another checkpoint directory" in message
    (tmp_path / name).rmdir()  # the way out works, and the lock was released
    _run(tmp_path)


def test_a_checkpoint_directory_that_is_a_file_is_a_pitstop_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints"
    path.write_text("oops")
    with pytest.raises(SaveError, match=r"checkpoints is not a directory"):
        pitstop.Checkpointer(path, model=torch.nn.Linear(3, 2))


def test_a_fresh_run_never_replaces_another_runs_checkpoints(tmp_path: Path) -> None:
    _run(tmp_path, steps=(1, 2, 3))
    before = snapshot(tmp_path)
    model = torch.nn.Linear(3, 2)
    with pitstop.Checkpointer(tmp_path, model=model) as ckpt:  # no resume()
        with pytest.raises(SaveError) as info:
            ckpt.save(pitstop.Progress(step=1))  # synchronous: refused here, before writing
        message = str(info.value)
        for part in (str(tmp_path), "step 3", "step_000000000003.pitstop", "resume()"):
            assert part in message
        assert "another checkpoint directory" in message
        assert "overwrite=True" in message
    assert snapshot(tmp_path) == before


def test_a_resume_that_fails_leaves_another_runs_checkpoints_protected(tmp_path: Path) -> None:
    _run(tmp_path, steps=(1, 2, 3))
    before = snapshot(tmp_path)
    model = torch.nn.Linear(5, 2)  # another shape: the resume is refused
    with pitstop.Checkpointer(tmp_path, model=model, policy=pitstop.Policy(keep_last=1)) as ckpt:
        with pytest.raises(IncompatibleCheckpoint):
            ckpt.resume()
        with pytest.raises(SaveError, match="step 3"):
            ckpt.save(pitstop.Progress(step=1))  # still another run's: refused, nothing deleted
    assert snapshot(tmp_path) == before


def test_resuming_lets_the_run_continue_and_replace_its_own_steps(tmp_path: Path) -> None:
    _run(tmp_path, steps=(1, 2, 3))
    model = torch.nn.Linear(3, 2)
    with pitstop.Checkpointer(tmp_path, model=model) as ckpt:
        assert ckpt.resume().step == 3
        ckpt.save(pitstop.Progress(step=4))
    assert scan(LocalStorage(tmp_path)).pointers.last == "step_000000000004.pitstop"


def test_overwrite_true_replaces_another_runs_checkpoints(tmp_path: Path) -> None:
    _run(tmp_path, steps=(1, 2))
    model = torch.nn.Linear(3, 2)
    with pitstop.Checkpointer(tmp_path, model=model, overwrite=True) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    assert scan(LocalStorage(tmp_path)).pointers.last == "step_000000000001.pitstop"


def test_a_component_never_registered_is_named_once_at_the_first_save(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, steps=(1,))
    model = torch.nn.Linear(3, 2)
    with (
        caplog.at_level(logging.WARNING, logger="pitstop"),
        pitstop.Checkpointer(tmp_path, model=model) as ckpt,  # the optimizer forgotten
    ):
        ckpt.resume()
        assert "'opt'" not in caplog.text  # not yet: register() may still come
        ckpt.save(pitstop.Progress(step=2))
        ckpt.save(pitstop.Progress(step=3))
    warnings = [r.getMessage() for r in caplog.records if "'opt'" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "never registered" in warnings[0]
    assert "step_000000000001.pitstop" in warnings[0]


def test_a_registered_component_raises_no_such_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, steps=(1,))
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        _run(tmp_path, steps=(2,))
    assert "never registered" not in caplog.text


def _rewrite_meta(path: Path, **changes: object) -> None:
    """Write ``path`` again with its manifest's meta changed; every checksum stays valid."""
    meta = dict(fileformat.read_manifest(path).meta)
    meta.update(changes)
    tree = fileformat.load(path)
    prepared = fileformat.prepare(tree)
    temp = path.with_name(path.name + ".new")
    with open(temp, "wb") as file:
        fileformat.write(file, prepared, meta)  # type: ignore[arg-type]
    os.replace(temp, path)


@pytest.mark.parametrize("world_size", ["two", -1, 0, 2.5, None, [2]])
def test_a_malformed_world_size_is_corrupt_and_resume_falls_back(
    tmp_path: Path, world_size: object, caplog: pytest.LogCaptureFixture
) -> None:
    _run(tmp_path, steps=(1, 2))
    newest = tmp_path / "step_000000000002.pitstop"
    _rewrite_meta(newest, world_size=world_size)
    fileformat.verify(newest)  # the checksums pass
    found = scan(LocalStorage(tmp_path))
    assert "world_size" in found.unreadable[newest.name]
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        caplog.at_level(logging.WARNING, logger="pitstop"),
        pitstop.Checkpointer(tmp_path, model=model, state={"opt": opt}) as ckpt,
    ):
        assert ckpt.resume().step == 1
    assert "world_size" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="world_size"):
        pitstop.info(newest)
