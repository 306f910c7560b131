"""Exact continuation, with real processes: N+M steps straight equals N, stop, resume, M.

Each run is a fresh Python process (tests/e2e/train_loop.py), so nothing survives a stop but
what the checkpoint holds. Compared bitwise: model, EMA, optimizer, scheduler, GradScaler,
the sequence of batches trained on, and draws from every RNG after training.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import zygote
from pitstop.shell.format import fileformat
from trees import assert_same

SCRIPT = Path(__file__).with_name("train_loop.py")
TARGET = 12  # optimizer updates; 5 per epoch with accumulation 2, so the run spans 3 epochs


def run(directory: Path, out: Path, *extra: str) -> dict[str, Any]:
    """Run the training loop to completion in a new process; return what it wrote."""
    result = zygote.run(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--out", str(out), *extra],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded: dict[str, Any] = fileformat.load(out)
    return loaded


def assert_continues_exactly(
    straight: dict[str, Any], first: dict[str, Any], second: dict[str, Any]
) -> None:
    assert first["stop_reason"] is not None, "the first process should have been stopped"
    assert second["stop_reason"] is None
    assert first["batches"] + second["batches"] == straight["batches"]
    for key in ("model", "ema", "optimizer", "scheduler", "scaler", "draws", "progress"):
        assert_same(straight[key], second[key], key)


_straight_cache: dict[tuple[str, ...], dict[str, Any]] = {}


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict[str, Any]]:
    """The uninterrupted run for a set of options (computed once per option set)."""

    def get(*options: str) -> dict[str, Any]:
        if options not in _straight_cache:
            root = tmp_path_factory.mktemp("straight")
            _straight_cache[options] = run(
                root / "ckpt", root / "out.pitstop", "--target", str(TARGET), *options
            )
        return _straight_cache[options]

    return get


def split_run(
    tmp_path: Path, stop_at_micro: int, *options: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    directory = tmp_path / "ckpt"
    first = run(
        directory,
        tmp_path / "first.pitstop",
        "--target",
        str(TARGET),
        "--stop-at-micro",
        str(stop_at_micro),
        *options,
    )
    second = run(directory, tmp_path / "second.pitstop", "--target", str(TARGET), *options)
    return first, second


# Micro-batch 7 is inside an accumulation window of epoch 0; 10 ends epoch 0 exactly; 13 is
# mid-window early in epoch 1. The slow sweep takes every micro-batch.
@pytest.mark.parametrize("stop_at", [7, pytest.param(10, marks=pytest.mark.slow)])
def test_stop_and_resume_is_bitwise_identical(
    tmp_path: Path, straight: Callable[..., dict[str, Any]], stop_at: int
) -> None:
    first, second = split_run(tmp_path, stop_at)
    assert first["progress"][0] == (stop_at + 1) // 2  # the window finished before saving
    assert_continues_exactly(straight(), first, second)


@pytest.mark.slow
@pytest.mark.parametrize("stop_at", range(1, 2 * TARGET))
def test_stop_anywhere_and_resume_is_bitwise_identical(
    tmp_path: Path, straight: Callable[..., dict[str, Any]], stop_at: int
) -> None:
    first, second = split_run(tmp_path, stop_at)
    assert_continues_exactly(straight(), first, second)


def test_background_saves_continue_exactly(
    tmp_path: Path, straight: Callable[..., dict[str, Any]]
) -> None:
    # Paused by a run saving in overlap mode, resumed by one saving in the background: the
    # result is still the synchronous straight run's, bit for bit.
    directory = tmp_path / "ckpt"
    options = ("--target", str(TARGET))
    first = run(
        directory,
        tmp_path / "a.pitstop",
        *options,
        "--stop-at-micro",
        "9",
        "--async-save",
        "overlap",
    )
    second = run(directory, tmp_path / "b.pitstop", *options, "--async-save", "on")
    assert_continues_exactly(straight(), first, second)


def test_reduce_lr_on_plateau(tmp_path: Path, straight: Callable[..., dict[str, Any]]) -> None:
    first, second = split_run(tmp_path, 13, "--scheduler", "plateau")
    assert_continues_exactly(straight("--scheduler", "plateau"), first, second)


@pytest.mark.slow  # compiling costs ~25 s; tests/shell/test_weights.py covers the wrapper
def test_torch_compiled_model(tmp_path: Path, straight: Callable[..., dict[str, Any]]) -> None:
    try:
        torch.compile(torch.nn.Linear(2, 2), backend="aot_eager")(torch.randn(1, 2))
    except Exception as error:  # no dynamo for this Python or platform
        pytest.skip(f"torch.compile is unavailable here: {error}")
    first, second = split_run(tmp_path, 9, "--compile", "--workers", "0")
    assert_continues_exactly(straight("--compile", "--workers", "0"), first, second)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.mark.slow  # tests/e2e/test_multirank.py continues DDP across 2 processes by default
def test_one_process_ddp(tmp_path: Path, straight: Callable[..., dict[str, Any]]) -> None:
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is unavailable")
    reference = straight("--ddp-port", str(_free_port()), "--workers", "0")
    directory = tmp_path / "ckpt"
    options = ("--target", str(TARGET), "--workers", "0")
    first = run(
        directory,
        tmp_path / "a.pitstop",
        *options,
        "--stop-at-micro",
        "11",
        "--ddp-port",
        str(_free_port()),
    )
    second = run(directory, tmp_path / "b.pitstop", *options, "--ddp-port", str(_free_port()))
    assert_continues_exactly(reference, first, second)


@pytest.mark.parametrize(
    "sig",  # SIGINT by default: tests/train/test_signals.py sends it to `pitstop train`
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
)
def test_a_real_signal_mid_run_pauses_and_resume_continues_exactly(
    tmp_path: Path, straight: Callable[..., dict[str, Any]], sig: signal.Signals
) -> None:
    directory = tmp_path / "ckpt"
    command = [
        sys.executable,
        str(SCRIPT),
        "--dir",
        str(directory),
        "--out",
        str(tmp_path / "a.pitstop"),
        "--target",
        str(TARGET),
        "--report",
    ]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}
    ) as child:
        try:
            assert child.stdout is not None
            for line in child.stdout:
                if line.strip() == "step 4":
                    child.send_signal(sig)
                    break
            child.stdout.read()
            assert child.wait(timeout=600) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=60)
    first: dict[str, Any] = fileformat.load(tmp_path / "a.pitstop")
    assert first["stop_reason"] == sig.name
    assert 4 <= first["progress"][0] < TARGET
    second = run(directory, tmp_path / "b.pitstop", "--target", str(TARGET))
    assert_continues_exactly(straight(), first, second)
