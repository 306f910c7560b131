"""A checkpoint argument may be a file, a pointer or a directory; load and verify accept all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from dirtools import save, state_at
from pitstop.core.records import Best, Policy
from pitstop.core.saving.schedule import Call
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.resolve import resolve_checkpoint
from reliability.bounds import bounded


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=None, best=Best("loss"))) as d:
        save(d, 1, call=Call.MAYBE, metrics={"loss": 0.2})
        save(d, 2, call=Call.MANUAL, metrics={"loss": 0.5})
        save(d, 3, call=Call.MANUAL)
    return tmp_path


def test_a_directory_means_its_last(run: Path) -> None:
    assert resolve_checkpoint(run) == run / _name(3)


@pytest.mark.parametrize(("pointer", "step"), [("last", 3), ("best", 1)])
def test_a_pointer_resolves_with_or_without_its_symlink(run: Path, pointer: str, step: int) -> None:
    assert resolve_checkpoint(run / pointer) == run / _name(step)
    os.unlink(run / pointer)  # a filesystem without symlinks: latest.json still knows
    assert resolve_checkpoint(run / pointer) == run / _name(step)


def test_load_returns_the_stored_tree(run: Path) -> None:
    tree = pitstop.load(run / "best")
    expected = state_at(1)
    assert torch.equal(tree["weights"]["raw"]["w"], expected["weights"]["raw"]["w"])
    assert tree["step"] == 1
    assert tree["weights"]["tied"].untyped_storage().data_ptr() == (
        tree["weights"]["raw"]["w"].untyped_storage().data_ptr()
    )


def test_load_falls_back_past_a_corrupt_target_but_verify_does_not(run: Path) -> None:
    with open(run / _name(3), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    assert pitstop.load(run)["step"] == 2
    with pytest.raises(CheckpointCorrupt, match=_name(3)):
        pitstop.verify(run)
    assert pitstop.verify(run / _name(2)) == run / _name(2)


@pytest.mark.parametrize("symlinks", [True, False])
def test_verify_of_a_truncated_last_checks_that_file_and_never_an_older_one(
    run: Path, symlinks: bool
) -> None:
    """A truncated newest file leaves the directory's scan; the pointer still names it."""
    with open(run / _name(3), "r+b") as f:
        f.truncate(1000)
    if not symlinks:
        os.unlink(run / "last")  # latest.json still names it
    for argument in (run, run / "last"):
        with pytest.raises(CheckpointCorrupt, match=_name(3)):
            pitstop.verify(argument)
    assert pitstop.load(run)["step"] == 2  # loading falls back, as it must


@pytest.mark.parametrize("symlinks", [True, False])
@pytest.mark.parametrize(("pointer", "step"), [("last", 3), ("best", 1)])
@pytest.mark.parametrize("call", [pitstop.info, pitstop.verify], ids=["info", "verify"])
def test_info_and_verify_of_a_pointer_to_a_missing_checkpoint_name_the_pointer_and_the_file(
    run: Path, pointer: str, step: int, symlinks: bool, call: Any
) -> None:
    """Before, a raw FileNotFoundError naming only the missing file."""
    gone = run / _name(step)
    gone.unlink()
    if not symlinks:
        (run / pointer).unlink()  # latest.json still names it
    said = f"{run / pointer} points to" if symlinks else f"{run / 'latest.json'} says {pointer} is"
    arguments = [run / pointer, run] if pointer == "last" else [run / pointer]
    for argument in arguments:
        with pytest.raises(CheckpointNotFound) as raised:
            call(argument)
        assert str(raised.value) == f"{said} {gone}, which does not exist"
    assert pitstop.load(run / pointer)["step"] != step  # loading falls back, as it must


@pytest.mark.parametrize("where", ["missing-dir/last", "nope.pitstop"])
def test_nothing_there_is_a_clear_error(tmp_path: Path, where: str) -> None:
    with pytest.raises(CheckpointNotFound, match="no checkpoint at"):
        resolve_checkpoint(tmp_path / where)


def test_a_directory_without_a_final_says_so(run: Path) -> None:
    with pytest.raises(CheckpointNotFound, match="has no valid final checkpoint"):
        resolve_checkpoint(run / "final")
    with pytest.raises(CheckpointNotFound, match="has no final checkpoint"):
        resolve_checkpoint(run / "final", fallback=False)


# --- latest.json that is a FIFO, a device or 2 GiB: every reader refuses it at once ----------


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _zero(path: Path) -> None:
    os.symlink("/dev/zero", path)


def _sparse(path: Path) -> None:
    with open(path, "wb") as file:
        file.truncate(2 << 30)


@pytest.mark.parametrize("plant", [_fifo, _zero, _sparse], ids=["fifo", "dev-zero", "2GiB-sparse"])
@pytest.mark.parametrize(
    "call",
    [
        lambda run: pitstop.load(run),
        lambda run: pitstop.verify(run / "last"),
        lambda run: pitstop.load(run / "last"),
    ],
    ids=["load(dir)", "verify(dir/last)", "load(dir/last)"],
)
def test_a_latest_json_that_is_no_regular_file_never_hangs_or_grows_memory(
    run: Path, plant: Any, call: Any
) -> None:
    (run / "latest.json").unlink()
    plant(run / "latest.json")
    result, error, _ = bounded(lambda: call(run))  # within 5 s and 500 MiB
    assert error is None
    assert result is not None


@pytest.mark.parametrize("call", [pitstop.info, pitstop.verify], ids=["info", "verify"])
def test_a_pointer_whose_target_a_live_run_prunes_right_after_it_was_found_resolves_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: Any
) -> None:
    """The interleaving a reader beside a pruning run met (about once in 30 saves): the pointer
    names step 1 and step 1 exists; then, before the reader goes on, the run publishes step 2,
    moves the pointer and prunes step 1. The reader must not look at step 1 a second time and
    call the pointer dangling (it no longer names step 1): it reads step 2."""
    import pitstop.shell.store.resolve as resolve_module
    from pitstop.shell.store.storage import FileKind, LocalStorage

    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=1)) as writer:
        save(writer, 1, call=Call.MANUAL)
        looked: list[str] = []

        class RacedStorage(LocalStorage):
            def kind(self, name: str) -> FileKind:
                found = super().kind(name)
                if name == _name(1) and not looked:
                    looked.append(name)  # step 1 was found; the run moves on meanwhile
                    save(writer, 2, call=Call.MANUAL)
                    assert not (tmp_path / _name(1)).exists()
                return found

        monkeypatch.setattr(resolve_module, "LocalStorage", RacedStorage)
        result = call(tmp_path / "last")
    assert looked == [_name(1)]
    if call is pitstop.info:
        assert result.step == 2
    else:
        assert result == tmp_path / _name(2)
