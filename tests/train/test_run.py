"""train_from_config and the console output of `pitstop train`, in this process."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from rich.console import Console
from trainkit import SMOKE, merge, tree

import pitstop.cli
from pitstop.errors import ConfigError
from pitstop.train import train_from_config
from pitstop.train.config import SchedulerSection
from pitstop.train.run import warmup_cosine


def smoke(output_dir: Path, **sections: Any) -> dict[str, Any]:
    data = merge(yaml.safe_load(SMOKE.read_text()), sections)
    data["run"]["output_dir"] = str(output_dir)
    return data


def test_result_steps_are_absolute(tmp_path: Path) -> None:
    first = train_from_config(smoke(tmp_path, run={"max_steps": 3}))
    assert (first.steps, first.start_step, first.new_updates, first.stop_reason) == (3, 0, 3, None)
    assert first.checkpoint_dir == tmp_path / "checkpoints"
    assert [step for step, _ in first.losses] == [1, 2, 3]
    assert set(first.metrics) == {"val_loss"}

    again = train_from_config(smoke(tmp_path, run={"max_steps": 5}), resume=True)
    assert (again.steps, again.start_step, again.new_updates) == (5, 3, 2)
    # checkpoint.resume: true in the configuration does the same as resume=True.
    third = train_from_config(smoke(tmp_path, run={"max_steps": 4}, checkpoint={"resume": True}))
    assert (third.steps, third.new_updates) == (5, 0)


def test_without_resume_a_run_refuses_another_runs_checkpoints_before_its_first_step(
    tmp_path: Path,
) -> None:
    train_from_config(smoke(tmp_path, run={"max_steps": 2}))
    checkpoints = tmp_path / "checkpoints"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.iterdir())
    with pytest.raises(ConfigError) as info:
        train_from_config(smoke(tmp_path, run={"max_steps": 1}))
    message = str(info.value)
    for part in (
        str(checkpoints),
        "step 2",
        "step_000000000002.pitstop",
        "--resume",
        "--overwrite",
    ):
        assert part in message
    assert sorted((p.name, p.stat().st_mtime_ns) for p in checkpoints.iterdir()) == before


def test_overwrite_starts_fresh_over_another_runs_checkpoints(tmp_path: Path) -> None:
    train_from_config(smoke(tmp_path, run={"max_steps": 2}))
    result = train_from_config(
        smoke(tmp_path, run={"max_steps": 1}, checkpoint={"overwrite": True})
    )
    assert (result.start_step, result.steps) == (0, 1)
    assert (tmp_path / "checkpoints" / "last").readlink().name == "step_000000000001.pitstop"


def test_the_schedule_follows_the_current_max_steps(tmp_path: Path) -> None:
    """The seed's CLI sets scheduler.max_steps with --max-steps; a resume uses the new one."""
    train_from_config(smoke(tmp_path, run={"max_steps": 2}, scheduler={"max_steps": 2}))
    train_from_config(smoke(tmp_path, run={"max_steps": 4}, scheduler={"max_steps": 4}), True)
    groups = tree(tmp_path / "checkpoints" / "final")["state"]["optimizer"]["param_groups"]
    factor = warmup_cosine(SchedulerSection(warmup_steps=2, max_steps=4))
    assert groups[0]["lr"] == pytest.approx(0.03 * factor(4)) == 0.0


def test_warmup_cosine() -> None:
    factor = warmup_cosine(SchedulerSection(warmup_steps=2, max_steps=6))
    assert [factor(s) for s in range(7)] == pytest.approx([0.5, 1, 1, 0.8535534, 0.5, 0.1464466, 0])
    assert warmup_cosine(SchedulerSection())(100) == 1.0


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.resume: resuming needs checkpoint.enabled"):
        train_from_config(smoke(tmp_path, checkpoint={"enabled": False}), resume=True)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"run.device: 'cuda' is not available"):
            train_from_config(smoke(tmp_path, run={"device": "cuda"}))
    with pytest.raises(ConfigError, match=r"run.max_stepz: unknown key"):
        train_from_config(smoke(tmp_path, run={"max_stepz": 1}))


def test_checkpointing_disabled(tmp_path: Path) -> None:
    result = train_from_config(smoke(tmp_path, run={"max_steps": 2}, checkpoint={"enabled": False}))
    assert (result.steps, result.checkpoint_dir) == (2, None)
    assert not (tmp_path / "checkpoints").exists()


def run_cli(monkeypatch: pytest.MonkeyPatch, terminal: bool, *args: str) -> str:
    """Run `pitstop ARGS` in this process with stdout a (pretend) terminal or a pipe."""
    buffer = io.StringIO()
    monkeypatch.setattr(
        pitstop.cli,
        "Console",
        lambda **kw: Console(file=buffer, force_terminal=terminal, width=120, **kw),
    )
    assert pitstop.cli.main(list(args)) == 0
    return buffer.getvalue()


def test_a_terminal_gets_a_progress_bar_and_quiet_gets_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["train", "--config", str(SMOKE), "--max-steps", "4"]
    drawn = run_cli(monkeypatch, True, *args, "--output-dir", str(tmp_path / "a"))
    assert "\x1b[" in drawn
    bar = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", drawn)
    assert "train step" in bar
    assert "4/4" in bar
    assert "loss " in bar
    assert "saved " in bar
    assert "blocked training" in bar
    assert "step 3/4 epoch 0 loss" not in bar  # the bar, not per-step lines

    quiet = run_cli(monkeypatch, True, *args, "--output-dir", str(tmp_path / "b"), "--quiet")
    assert "\x1b[" not in quiet  # no terminal control sequences
    assert "step 3/4 epoch 0 loss" in quiet
    assert "saved " in quiet
    assert "finished at step 4 (epoch 0, 4 new updates)" in quiet

    piped = run_cli(monkeypatch, False, *args, "--output-dir", str(tmp_path / "c"))
    assert "\x1b[" not in piped
    assert "step 3/4 epoch 0 loss" in piped
