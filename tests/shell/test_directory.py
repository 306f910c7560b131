"""Scanning a directory: untrusted pointers, stale pointers, corrupt files, resume fallback."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from dirtools import save, snapshot
from pitstop.core.records import NO_CHECKPOINT, Best, PointerName, Policy
from pitstop.core.saving.schedule import Call
from pitstop.errors import SaveError
from pitstop.shell.store.directory import CheckpointDirectory, choose_resume, scan
from pitstop.shell.store.storage import LocalStorage


def _name(step: int) -> str:
    return f"step_{step:012d}.pitstop"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A directory with checkpoints 1, 2 (best), 3 (final)."""
    policy = Policy(keep_last=None, best=Best("loss"))
    with CheckpointDirectory(tmp_path, policy=policy) as directory:
        save(directory, 1, call=Call.MAYBE, metrics={"loss": 0.9})
        save(directory, 2, call=Call.MAYBE, metrics={"loss": 0.1})
        save(directory, 3, call=Call.FINISH)
    return tmp_path


def test_scan_reads_what_was_published(run: Path) -> None:
    found = scan(LocalStorage(run), Best("loss"))
    assert [e.step for e in found.catalog] == [1, 2, 3]
    assert [e.seq for e in found.catalog] == [1, 2, 3]
    assert found.pointers.last == found.pointers.final == _name(3)
    assert (found.pointers.best, found.pointers.best_value) == (_name(2), 0.1)
    assert found.warnings == ()
    assert os.readlink(run / "best") == _name(2)
    latest = json.loads((run / "latest.json").read_text())
    assert latest["path"] == _name(3)
    assert latest["pointers"] == {"last": _name(3), "best": _name(2), "final": _name(3)}


def _replace_link(run: Path, name: str, target: str) -> None:
    (run / name).unlink()
    os.symlink(target, run / name)


@pytest.mark.parametrize(
    "target",
    ["/etc/passwd", "../elsewhere/step_000000000002.pitstop", "step_2.pitstop", "latest.json"],
)
def test_a_hostile_symlink_is_ignored_never_followed(run: Path, target: str) -> None:
    _replace_link(run, "best", target)
    found = scan(LocalStorage(run), Best("loss"))
    assert found.pointers.best == _name(2)  # from latest.json, never from the symlink
    assert any(repr(target) in w and "never followed" in w for w in found.warnings)


def test_a_symlink_to_a_symlink_is_ignored(run: Path) -> None:
    os.symlink("/etc/passwd", run / "step_000000000009.pitstop")
    _replace_link(run, "final", "step_000000000009.pitstop")
    found = scan(LocalStorage(run))
    assert found.pointers.final == _name(3)
    assert any("step_000000000009.pitstop is not a regular file" in w for w in found.warnings)
    assert "step_000000000009.pitstop" in found.unreadable


@pytest.mark.parametrize(
    "latest",
    [
        {"pointers": {"last": "../../etc/passwd", "best": "/etc/passwd", "final": 7}},
        {"pointers": "step_000000000001.pitstop"},
        ["not", "an", "object"],
    ],
)
def test_a_hostile_latest_json_is_ignored(run: Path, latest: object) -> None:
    for pointer in ("last", "best", "final"):
        (run / pointer).unlink()
    (run / "latest.json").write_text(json.dumps(latest))
    found = scan(LocalStorage(run), Best("loss"))
    # Everything is recomputed from what the files themselves record.
    assert found.pointers.last == found.pointers.final == _name(3)
    assert found.pointers.best == _name(2)
    assert found.warnings


def test_a_huge_latest_json_is_not_read(run: Path) -> None:
    with open(run / "latest.json", "wb") as f:
        f.truncate(2 << 20)
    found = scan(LocalStorage(run))
    assert any("latest.json is unreadable" in w for w in found.warnings)


def test_a_stale_pointer_never_hides_a_newer_checkpoint(run: Path) -> None:
    # A crash after step 3 was published but before any pointer moved.
    _replace_link(run, "last", _name(2))
    latest = json.loads((run / "latest.json").read_text())
    latest["pointers"]["last"] = _name(2)
    (run / "latest.json").write_text(json.dumps(latest))
    found = scan(LocalStorage(run))
    assert found.pointers.last == _name(3)
    assert sum("stale" in w for w in found.warnings) == 2
    choice = choose_resume(LocalStorage(run), found, PointerName.LAST)
    assert choice.entry is not NO_CHECKPOINT
    assert choice.entry.step == 3


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_corrupt_newest_checkpoint_falls_back_with_a_warning(
    run: Path, where: float, caplog: pytest.LogCaptureFixture
) -> None:
    newest = run / _name(3)
    _flip(newest, int(where * (newest.stat().st_size - 1)))
    storage = LocalStorage(run)
    with caplog.at_level(logging.WARNING, logger="pitstop"):
        found = scan(storage)
        choice = choose_resume(storage, found, PointerName.LAST)
    assert choice.entry is not NO_CHECKPOINT
    assert choice.entry.step == 2
    skipped = _name(3) in choice.skipped or _name(3) in found.unreadable
    assert skipped
    assert _name(3) in caplog.text or any(_name(3) in w for w in found.warnings)


@pytest.mark.parametrize("keep", [0, 10, 100, 1000])
def test_a_truncated_newest_checkpoint_is_not_a_checkpoint(run: Path, keep: int) -> None:
    newest = run / _name(3)
    os.truncate(newest, keep)
    found = scan(LocalStorage(run))
    assert [e.step for e in found.catalog] == [1, 2]
    assert _name(3) in found.unreadable
    assert found.pointers.last == _name(2)
    assert found.pointers.final is NO_CHECKPOINT  # the only normal end is gone


def test_best_resume_falls_back_to_the_next_best(run: Path) -> None:
    _flip(run / _name(2), 200)
    storage = LocalStorage(run)
    choice = choose_resume(storage, scan(storage, Best("loss")), PointerName.BEST, Best("loss"))
    assert choice.entry is not NO_CHECKPOINT
    assert choice.entry.step == 1
    assert list(choice.skipped) == [_name(2)]


def test_an_empty_directory_resumes_fresh(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "nothing-here")
    choice = choose_resume(storage, scan(storage), PointerName.LAST)
    assert choice.entry is NO_CHECKPOINT
    assert choice.path is None


def test_opening_removes_temp_files_of_dead_writers(
    run: Path, caplog: pytest.LogCaptureFixture
) -> None:
    leftover = run / ".tmp-deadbeef-step_000000000004.pitstop"
    leftover.write_bytes(b"half a checkpoint")
    foreign = run / "notes.txt"
    foreign.write_text("mine")
    with caplog.at_level(logging.WARNING, logger="pitstop"), CheckpointDirectory(run):
        pass
    assert not leftover.exists()
    assert foreign.exists()
    assert "left by a writer that died" in caplog.text


def test_retention_deletes_only_after_the_new_save(tmp_path: Path) -> None:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=2)) as directory:
        for step in (1, 2, 3, 4):
            save(directory, step, call=Call.MANUAL)
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".pitstop"))
    assert names == [_name(3), _name(4)]


class InterruptedRemoval(LocalStorage):
    """A local directory whose ``at``-th removal raises KeyboardInterrupt (Ctrl-C), before the
    unlink or, with ``after``, just after it (where a signal lands once the syscall returns)."""

    def __init__(self, root: Path, at: int, *, after: bool) -> None:
        super().__init__(root)
        self.at, self.after = at, after
        self.removals = 0

    def remove(self, name: str) -> None:
        self.removals += 1
        if self.removals != self.at:
            super().remove(name)
        elif self.after:
            super().remove(name)
            raise KeyboardInterrupt
        else:
            raise KeyboardInterrupt


@pytest.mark.parametrize("after", [False, True], ids=["before-unlink", "after-unlink"])
def test_an_interrupted_retention_leaves_the_catalog_as_the_disk_is(
    tmp_path: Path, after: bool
) -> None:
    """Before, Ctrl-C during retention's deletions left the catalog as it was before the save:
    the save just published missing from it, the deleted files still in it — so the next save
    reused a sequence number and never deleted the orphans."""
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=None)) as directory:
        for step in (1, 2, 3):
            save(directory, step)
    storage = InterruptedRemoval(tmp_path, at=2, after=after)
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=1), storage=storage) as directory:
        with pytest.raises(KeyboardInterrupt):
            save(directory, 4)  # retention deletes 1, 2, 3: interrupted at 2
        found = scan(LocalStorage(tmp_path))
        on_disk = [e.step for e in found.catalog]
        assert on_disk == ([3, 4] if after else [2, 3, 4])
        assert [(e.name, e.seq) for e in directory.catalog] == [
            (e.name, e.seq) for e in found.catalog
        ]
        assert directory.pointers.last == _name(4) == found.pointers.last
        save(directory, 5)  # the next save numbers after 4 and deletes what is left
    found = scan(LocalStorage(tmp_path))
    assert [(e.step, e.seq) for e in found.catalog] == [(5, 5)]
    assert found.warnings == ()


# --- what a writer refuses before it writes (issue 11) ----------------------------------------


@pytest.mark.parametrize("name", ["last", "best", "final", "latest.json"])
def test_a_directory_in_a_pointers_place_is_refused_at_open(run: Path, name: str) -> None:
    target = run / name
    target.unlink()
    target.mkdir()
    with pytest.raises(SaveError, match="is a directory") as info:
        CheckpointDirectory(run).open()
    assert str(target) in str(info.value)
    assert f"mv {target} {target}.old" in str(info.value)
    target.rmdir()
    with CheckpointDirectory(run):  # the failed open released the lock
        pass


def test_a_protected_directory_refuses_a_fresh_save_naming_the_way_out(run: Path) -> None:
    before = snapshot(run)
    directory = CheckpointDirectory(run, protect=True)
    with directory:
        with pytest.raises(SaveError) as info:
            save(directory, 1)
        message = str(info.value)
        for part in (str(run), "3 checkpoint(s)", "step 3", _name(3), "resume()"):
            assert part in message
        assert "overwrite=True" in message
        assert snapshot(run) == before  # refused before a byte was written
        directory.adopt()  # resumed: the checkpoints are this run's to replace
        save(directory, 4)
    assert scan(LocalStorage(run)).pointers.last == _name(4)


def test_an_unprotected_directory_or_an_empty_one_saves(run: Path, tmp_path: Path) -> None:
    with CheckpointDirectory(run) as directory:
        save(directory, 4)
    with CheckpointDirectory(tmp_path / "empty", protect=True) as directory:
        save(directory, 1)


def test_components_carried_forward_are_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pitstop"), CheckpointDirectory(tmp_path) as d:
        d.note_carried(set(), "nothing")
        d.note_carried({"opt", "sched"}, "step_000000000001.pitstop")
        d.note_carried({"opt"}, "step_000000000001.pitstop")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1
    assert "'opt', 'sched'" in warnings[0]
    assert "step_000000000001.pitstop" in warnings[0]


@pytest.mark.parametrize("world_size", ["two", 0, -1, 1.5, None, True])
def test_a_malformed_world_size_is_corrupt(tmp_path: Path, world_size: object) -> None:
    with CheckpointDirectory(tmp_path) as directory:
        save(directory, 1)
        save(directory, 2, meta={"world_size": world_size})
    found = scan(LocalStorage(tmp_path))
    assert [e.step for e in found.catalog] == [1]
    assert "world_size" in found.unreadable[_name(2)]


def test_a_best_value_the_checkpoint_did_not_record_is_not_trusted(run: Path) -> None:
    latest = json.loads((run / "latest.json").read_text())
    assert latest["best_value"] == 0.1
    latest["best_value"] = 0.01  # flipped: it would keep a better run from becoming best
    (run / "latest.json").write_text(json.dumps(latest))
    found = scan(LocalStorage(run), Best("loss"))
    assert (found.pointers.best, found.pointers.best_value) == (_name(2), 0.1)
    assert any("best_value 0.01 is not what" in w for w in found.warnings)


def test_a_latest_json_nested_too_deep_is_ignored(run: Path) -> None:
    (run / "latest.json").write_text("[" * 200_000)
    found = scan(LocalStorage(run))
    assert found.pointers.last == _name(3)
    assert any("latest.json is unreadable" in w for w in found.warnings)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_latest_json_that_is_no_regular_file_is_not_read(run: Path, kind: str) -> None:
    (run / "latest.json").unlink()
    if kind == "fifo":
        os.mkfifo(run / "latest.json")
    else:
        os.symlink("/dev/zero", run / "latest.json")
    found = scan(LocalStorage(run))  # returns at once: a FIFO is never opened for reading
    assert found.pointers.last == _name(3)
    assert any("latest.json is a" in w for w in found.warnings)


class _PrunedAfterListing(LocalStorage):
    """A directory whose live writer, just after the first listing, publishes ``newer`` and
    prunes everything older (as ``keep_last=1`` does): the listing names only what is gone."""

    def __init__(self, root: Path, staged: Path, newer: str) -> None:
        super().__init__(root)
        self.staged, self.newer, self.listings = staged, newer, 0

    def names(self) -> list[str]:
        names = super().names()
        self.listings += 1
        if self.listings == 1:
            os.replace(self.staged, self.path(self.newer))
            for name in names:
                if name.startswith("step_"):
                    os.unlink(self.path(name))
        return names


def test_a_scan_taken_just_before_a_publish_and_prune_starts_over(tmp_path: Path) -> None:
    run, other = tmp_path / "run", tmp_path / "other"
    for root, step in ((run, 1), (other, 2)):
        with CheckpointDirectory(root, policy=Policy(keep_last=1)) as directory:
            save(directory, step)
    storage = _PrunedAfterListing(run, other / _name(2), _name(2))
    found = scan(storage)
    assert [e.step for e in found.catalog] == [2]  # not an empty directory
    assert (found.unreadable, found.gone) == ({}, frozenset())
    assert storage.listings == 2
