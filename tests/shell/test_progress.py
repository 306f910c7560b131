"""Byte progress of long work: who watches hears begin / advance / end; nobody watching costs
nothing; a broken watcher never breaks the work."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from pitstop.bars import ByteBars
from pitstop.shell.format import fileformat
from pitstop.shell.format import progress as events


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def begin(self, description: str, total: int) -> object:
        self.calls.append(("begin", (description, total)))
        return len(self.calls)

    def advance(self, handle: object, nbytes: int) -> None:
        self.calls.append(("advance", nbytes))

    def end(self, handle: object) -> None:
        self.calls.append(("end", handle))


def _write(path: Path) -> Path:
    with open(path, "wb") as file:
        fileformat.write(file, fileformat.prepare({"w": torch.zeros(5000), "b": torch.ones(7)}), {})
    return path


def test_nobody_watching_is_the_idle_task() -> None:
    assert events.task("anything", 10) is events.IDLE


def test_writing_and_verifying_report_every_byte(tmp_path: Path) -> None:
    recorder = Recorder()
    with events.watching(recorder):
        path = _write(tmp_path / "a.pitstop")
        manifest = fileformat.read_manifest(path)
        fileformat.verify(path)
    begins = [c[1] for c in recorder.calls if c[0] == "begin"]
    assert begins[0] == (f"writing {path}", manifest.manifest_offset)
    assert begins[1] == (f"verifying {path}", manifest.manifest_offset)
    ends = [i for i, c in enumerate(recorder.calls) if c[0] == "end"]
    assert len(ends) == 2
    written = sum(c[1] for c in recorder.calls[: ends[0]] if c[0] == "advance")
    checked = sum(c[1] for c in recorder.calls[ends[0] :] if c[0] == "advance")
    assert written == path.stat().st_size  # every byte written, manifest and footer too
    data = sum(blob.length for blob in manifest.blobs)
    assert data <= checked <= manifest.manifest_offset  # every data byte, padding perhaps
    assert events.task("after", 1) is events.IDLE  # the watcher is gone after the block


def test_a_watcher_that_raises_is_dropped_and_the_work_goes_on(tmp_path: Path) -> None:
    class Broken(Recorder):
        def advance(self, handle: object, nbytes: int) -> None:
            raise RuntimeError("a broken progress bar")

    broken = Broken()
    with events.watching(broken):
        path = _write(tmp_path / "a.pitstop")
        fileformat.verify(path)
        assert events.task("x", 1) is events.IDLE  # dropped at its first failure


@pytest.mark.parametrize("delay", [0.0, 60.0])
def test_byte_bars_draw_only_work_that_lasts(tmp_path: Path, delay: float) -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    bars = ByteBars(console, delay)
    with events.watching(bars):
        fileformat.verify(_write(tmp_path / "step_000000000001.pitstop"))
    bars.close()
    drawn = out.getvalue()
    if delay:
        assert drawn == ""  # shorter than the delay: nothing at all
    else:
        assert "verifying step_000000000001.pitstop" in drawn
        assert "KiB" in drawn
