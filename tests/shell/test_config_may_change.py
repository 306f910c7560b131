"""Checkpointer(config_may_change=...): keys a resume compares but only reports."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pitstop import Checkpointer, ConfigError, IncompatibleCheckpoint, Progress

CONFIG: dict[str, Any] = {"max_iters": 100, "out_dir": "out/a", "run": {"name": "x"}, "lr": 0.1}
MAY_CHANGE = ["max_iters", "out_dir", "run.*"]


def _saved(tmp_path: Path) -> Path:
    directory = tmp_path / "ck"
    torch.manual_seed(0)
    with Checkpointer(directory, model=nn.Linear(2, 2), config=CONFIG) as ckpt:
        ckpt.save(Progress(step=5))
    return directory


def _resume(directory: Path, config: dict[str, Any], **kwargs: Any) -> Progress:
    with Checkpointer(directory, model=nn.Linear(2, 2), config=config, **kwargs) as ckpt:
        return ckpt.resume()


def test_changes_under_the_patterns_are_one_info_line_and_never_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = _saved(tmp_path)
    changed = {**CONFIG, "max_iters": 200, "out_dir": "out/b", "run": {"name": "y"}}
    with pytest.raises(IncompatibleCheckpoint, match=r"config\.max_iters"):
        _resume(directory, changed)  # without config_may_change: refused, as before
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pitstop"):
        progress = _resume(directory, changed, config_may_change=MAY_CHANGE)
    assert progress.step == 5
    noted = [r for r in caplog.records if "config_may_change" in r.getMessage()]
    assert len(noted) == 1
    assert noted[0].levelno == logging.INFO
    message = noted[0].getMessage()
    assert "step_000000000005.pitstop" in message
    assert "config.max_iters: 100 in the checkpoint, 200 now" in message
    assert "config.out_dir: 'out/a' in the checkpoint, 'out/b' now" in message
    assert "config.run.name: 'x' in the checkpoint, 'y' now" in message
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_other_changes_are_still_differences(tmp_path: Path) -> None:
    directory = _saved(tmp_path)
    changed = {**CONFIG, "max_iters": 200, "lr": 0.2}
    with pytest.raises(IncompatibleCheckpoint) as caught:
        _resume(directory, changed, config_may_change=MAY_CHANGE)
    differences = caught.value.differences
    assert len(differences) == 1
    assert "config.lr: 0.1 in the checkpoint, 0.2 now" in differences[0]


def test_nothing_changed_logs_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = _saved(tmp_path)
    with caplog.at_level(logging.INFO, logger="pitstop"):
        _resume(directory, CONFIG, config_may_change=MAY_CHANGE)
    assert "config_may_change" not in caplog.text


@pytest.mark.parametrize("bad", ["max_iters", [""], [3]])
def test_a_bad_config_may_change_is_a_config_error(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ConfigError, match="config_may_change"):
        Checkpointer(tmp_path / "ck", model=nn.Linear(2, 2), config=CONFIG, config_may_change=bad)
