"""SIGTERM and SIGINT to a real `pitstop train` process: pause cleanly, resume exactly.

configs/smoke.yaml accumulates 2 micro-batches per update, so micro-batch N belongs to update
ceil(N / 2). A pausing child (pausing_pitstop.py) waits before micro-batch N's forward pass,
the test signals it there, and the child finishes that window, saves `last` with the signal as
its reason and exits 0. A resume to the same target must then end bitwise where the
uninterrupted run ends: weights, EMA, optimizer, scheduler, RNG streams.
"""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path

import pytest
from trainkit import (
    PAUSING,
    SMOKE,
    child,
    last,
    pitstop_argv,
    read_until,
    signal_while_paused,
    smoke_config,
    steps_on_disk,
    train,
    tree,
)

from pitstop.core.records import SaveReason
from trees import assert_same

TARGET = 10  # updates; the smoke config's 2-micro-batch windows make 20 micro-batches
ACCUMULATE = 2


def pause_and_signal(
    output_dir: Path, micro: int, sig: signal.Signals, config: Path = SMOKE
) -> str:
    """Train to TARGET, signal the child before micro-batch ``micro``; return its stdout."""
    argv = [
        sys.executable,
        str(PAUSING),
        str(micro),
        "train",
        "--config",
        str(config),
        "--output-dir",
        str(output_dir),
        "--max-steps",
        str(TARGET),
    ]
    with child(argv) as process:
        lines = read_until(process, f"paused at micro {micro}")
        signal_while_paused(process, sig)
        out, err = process.communicate("go\n", timeout=600)
        assert process.returncode == 0, err[-3000:]
    return "".join(lines) + out


def check_paused_and_resumed(
    straight: Path, output_dir: Path, micro: int, sig: signal.Signals
) -> None:
    out = pause_and_signal(output_dir, micro, sig)
    stopped_at = math.ceil(micro / ACCUMULATE)  # the window that was running finished
    saved = last(output_dir / "checkpoints")
    assert (saved.step, saved.reason, saved.detail) == (stopped_at, SaveReason.STOP, sig.name)
    assert f"stopped by {sig.name} at step {stopped_at} " in out
    assert "final evaluation skipped" in out
    assert not (output_dir / "checkpoints" / "final").exists()

    resumed = train(SMOKE, output_dir, "--max-steps", str(TARGET), "--resume").stdout
    assert f"at step {stopped_at} " in resumed.splitlines()[0]
    assert f"finished at step {TARGET} " in resumed
    assert_same(tree(straight / "checkpoints" / "final"), tree(output_dir / "checkpoints/final"))


# Micro-batch 3 opens the window of update 2 (a checkpoint interval: the stop still records
# its reason); micro-batch 6 closes the window of update 3. The slow sweep takes every one.
@pytest.mark.parametrize(
    ("sig", "micro"),
    [(signal.SIGTERM, 3), pytest.param(signal.SIGINT, 6, marks=pytest.mark.slow)],
    ids=["SIGTERM-3", "SIGINT-6"],
)
def test_a_signal_inside_an_accumulation_window_pauses_and_resume_is_bitwise(
    tmp_path: Path, straight: Path, sig: signal.Signals, micro: int
) -> None:
    check_paused_and_resumed(straight, tmp_path, micro, sig)


@pytest.mark.slow
@pytest.mark.parametrize("micro", range(1, 2 * TARGET + 1))
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_at_any_micro_batch_pauses_and_resume_is_bitwise(
    tmp_path: Path, straight: Path, sig: signal.Signals, micro: int
) -> None:
    check_paused_and_resumed(straight, tmp_path, micro, sig)


def test_sigterm_to_plain_pitstop_train(tmp_path: Path) -> None:
    """No test hook at all: SIGTERM once the child reports step 2, wherever it lands."""
    # No interval or best saves, so the stop's save is the only one; the run is long enough
    # that the signal always comes first. The schedule's horizon is fixed (scheduler.max_steps
    # is not tied to run.max_steps here), so the reference run can be chosen afterwards.
    endless = smoke_config(
        tmp_path / "endless.yaml",
        run={"max_steps": 1_000_000, "eval_every": None},
        scheduler={"max_steps": 40},
        checkpoint={"every_steps": None, "best": None},
    )
    paused = tmp_path / "paused"
    with child(pitstop_argv("train", "--config", endless, "--output-dir", paused)) as process:
        read_until(process, "step 2/")
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
    saved = last(paused / "checkpoints")
    assert (saved.reason, saved.detail) == (SaveReason.STOP, "SIGTERM")
    assert saved.step >= 2
    assert f"stopped by SIGTERM at step {saved.step} " in out

    target = saved.step + 3
    finite = smoke_config(
        tmp_path / "finite.yaml",
        run={"max_steps": target, "eval_every": None},
        scheduler={"max_steps": 40},
        checkpoint={"every_steps": None, "best": None},
    )
    train(finite, paused, "--resume")
    train(finite, tmp_path / "straight")
    assert_same(tree(tmp_path / "straight" / "checkpoints"), tree(paused / "checkpoints"))


def test_a_second_sigint_ends_the_process_promptly(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        str(PAUSING),
        "3",
        "train",
        "--config",
        str(SMOKE),
        "--output-dir",
        str(tmp_path),
        "--max-steps",
        str(TARGET),
    ]
    with child(argv) as process:
        read_until(process, "paused at micro 3")
        signal_while_paused(process, signal.SIGINT)  # the first: a stop request
        process.send_signal(signal.SIGINT)  # the second, while still paused: the user insists
        process.wait(timeout=600)  # stdin stays open: only the signal can end the pause
        out, err = process.communicate(timeout=600)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "SIGINT again while a stop (SIGINT) was pending" in err
    assert "stopped by" not in out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_the_run_is_built_ends_it_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """A stop signal as soon as `pitstop train` says it prepares the run (before torch is even
    imported): status 0, "stopped before training began", nothing trained or saved."""
    output_dir = tmp_path / "early"
    argv = pitstop_argv("train", "--config", SMOKE, "--output-dir", output_dir)
    with child(argv) as process:
        assert process.stderr is not None
        line = process.stderr.readline()
        assert line.startswith("preparing the run from "), line
        process.send_signal(sig)
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, line + err[-3000:]
    assert "stopped before training began" in out, out
    assert not (output_dir / "checkpoints").exists() or not steps_on_disk(
        output_dir / "checkpoints"
    )
