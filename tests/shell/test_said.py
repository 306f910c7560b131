"""What pitstop says: one INFO line when a run resumes (from where, which step, any fallback)
and when it stops (why, at which step, whether that step is saved); a StopRequest's own view."""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from pitstop import Checkpointer, Policy, Progress, StopRequest
from pitstop.shell.format import fileformat

INFO = (logging.INFO, "pitstop")


def _ckpt(directory: Path) -> Checkpointer:
    model = nn.Linear(2, 2)
    return Checkpointer(directory, model=model, policy=Policy(every_steps=2, keep_last=None))


def _said(caplog: pytest.LogCaptureFixture, words: str) -> list[str]:
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    return [m for m in messages if words in m]


def test_a_resume_says_where_it_resumed_and_what_it_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(*INFO)
    with _ckpt(tmp_path) as ckpt:
        assert ckpt.resume() == Progress()
        progress = Progress()
        for _ in range(4):
            progress = progress.advance()
            ckpt.maybe_save(progress)
    assert _said(caplog, "holds no checkpoint; starting fresh")
    with _ckpt(tmp_path) as ckpt:
        ckpt.resume()
    (line,) = _said(caplog, "resumed from")
    assert line.endswith("step_000000000004.pitstop: step 4, epoch 0, batch 4"), line

    # A real flipped byte in a tensor's bytes: the scan lists the file, the resume skips it.
    newest = tmp_path / "step_000000000004.pitstop"
    manifest = fileformat.read_manifest(newest)
    offset = manifest.blobs[manifest.tensors[0].blob].offset
    with open(newest, "r+b") as file:
        file.seek(offset)
        byte = file.read(1)[0]
        file.seek(offset)
        file.write(bytes([byte ^ 0x01]))
    caplog.clear()
    with _ckpt(tmp_path) as ckpt:
        ckpt.resume()
    (line,) = _said(caplog, "resumed from")
    assert "step_000000000002.pitstop: step 2" in line, line
    assert "1 newer checkpoint(s) skipped" in line, line


def test_a_stop_says_once_why_and_which_step_is_saved(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(*INFO)
    stop = StopRequest()
    with _ckpt(tmp_path) as ckpt, stop.catch_signals():
        progress = ckpt.resume().advance()
        assert ckpt.maybe_save(progress, stop=stop) is None
        assert not _said(caplog, "stop requested")
        signal.raise_signal(signal.SIGTERM)  # a real signal, to this process
        saved = ckpt.maybe_save(progress.advance().advance(), stop=stop)  # step 3, off the interval
        assert saved is not None
        ckpt.finish(progress.advance().advance(), stop=stop)  # the same step: saved already
    (line,) = _said(caplog, "stop requested")
    assert line == "stop requested (SIGTERM) at step 3: every rank stops there; saving it", line


def test_one_process_sees_its_own_request_at_once() -> None:
    stop = StopRequest()
    assert (bool(stop), stop.requested_here, stop.reason) == (False, False, None)
    stop.request("preempted")
    stop.request("later")
    assert (bool(stop), stop.requested_here, stop.reason) == (True, True, "preempted")
    assert torch.distributed.is_available()  # several ranks: see tests/e2e/test_stop_agreement
