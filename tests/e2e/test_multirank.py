"""Many ranks, with real processes: DDP on gloo, 2 ranks on the CPU (tests/e2e/ddp_loop.py).

Every rank makes the same pitstop calls on one directory; only rank 0 writes, and every
rank's RNG streams and per-rank components are gathered into the one file. Checked here:
exact continuation after a SIGTERM to one rank (directly launched, under torchrun, with
background saves), a kill -9 mid-save, a changed world size, and a failed write on rank 0.
Every job is a tests/multirank.py Job: each wait is bounded and every process it started is
killed when the test ends, passing or not.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from multirank import Finished, Job
from pitstop.shell.format import fileformat
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).with_name("ddp_loop.py")
RANKS = 2
TARGET = 10  # optimizer updates: 5 batches per epoch per rank, so the run spans 2 epochs
EVERY = 3  # Policy.every_steps of the runs below (unless a test says otherwise)
STOP_AT = 4  # off the save interval, inside epoch 0
COMPARED = ("model", "ema", "optimizer", "scheduler", "meter", "draws", "progress")
_ERROR = re.compile(r'^error (\w+) (".*")$')


# --- running the script -------------------------------------------------------------------


def job(directory: Path, out: Path, *options: str, **kwargs: Any) -> Job:
    return Job(SCRIPT, "--dir", directory, "--out", out, *options, **kwargs)


def outputs(out: Path, ranks: int = RANKS) -> list[dict[str, Any]]:
    """What each rank of a finished run wrote to ``<out>.rank<R>.pitstop``."""
    return [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(ranks)]


def train(directory: Path, out: Path, *options: str, **kwargs: Any) -> list[dict[str, Any]]:
    """Run the script to its end (every rank must exit 0); return what the ranks wrote."""
    with job(directory, out, "--target", str(TARGET), *options, **kwargs) as running:
        finished = running.wait().check()
    return outputs(out, len(finished.codes))


def train_and_stop(
    directory: Path,
    out: Path,
    *options: str,
    rank: int = 1,
    at: int = STOP_AT,
    sig: signal.Signals = signal.SIGTERM,
    **kwargs: Any,
) -> list[dict[str, Any]]:
    """Run to TARGET, but send ``sig`` to ``rank`` alone once it printed ``step {at}``.

    The rank holds after printing it until the signal has arrived (the script's --hold-at),
    so the stop always lands, at step ``at``, on every rank.
    """
    hold = ("--hold-at", str(at), "--hold-rank", str(rank))
    with job(
        directory, out, "--target", str(TARGET), "--report", *hold, *options, **kwargs
    ) as running:
        running.wait_for(rank, f"step {at}")
        running.signal(rank, sig)
        finished = running.wait().check()
    results = outputs(out, len(finished.codes))
    for r, result in enumerate(results):
        assert result["progress"][0] == at, (r, result["progress"], finished.describe())
        assert result["stop_reason"] is not None, (r, finished.describe())
    assert results[rank]["stop_reason"] == sig.name
    return results


def errors(finished: Finished) -> dict[int, tuple[str, str]]:
    """Each rank's ``error <Type> <message>`` line: {rank: (type name, message)}."""
    found = {}
    for rank in finished.codes:
        for line in finished.lines(rank):
            match = _ERROR.match(line.strip())
            if match:
                found[rank] = (match.group(1), json.loads(match.group(2)))
                break
    return found


# --- what the directory holds ---------------------------------------------------------------


@attrs.frozen
class Published:
    step: int
    reason: str
    detail: str
    world_size: object


def published(directory: Path) -> list[Published]:
    """The published checkpoint files of ``directory`` (never temp files), by step."""
    found = []
    for path in sorted(directory.glob("step_*.pitstop")):
        meta = fileformat.read_manifest(path).meta
        found.append(
            Published(
                step=meta["progress"]["step"],
                reason=meta["reason"],
                detail=meta.get("detail", ""),
                world_size=meta.get("world_size"),
            )
        )
    return found


def assert_one_stop_checkpoint(directory: Path, at: int, detail: str = "SIGTERM") -> None:
    saved = published(directory)
    stops = [p for p in saved if p.reason == "stop"]
    assert len(stops) == 1, saved
    assert (stops[0].step, stops[0].detail) == (at, detail), saved
    assert all(p.world_size == RANKS for p in saved), saved


# --- comparing ------------------------------------------------------------------------------


def assert_continues_exactly(
    straight: list[dict[str, Any]], first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> None:
    """Per rank: N, stop, resume, M is bitwise the straight N+M, data order included."""
    assert len(straight) == len(first) == len(second)
    for rank, (whole, before, after) in enumerate(zip(straight, first, second, strict=True)):
        assert after["stop_reason"] is None, rank
        assert after["resumed"]["progress"] == before["progress"][:3], rank
        assert before["batches"] + after["batches"] == whole["batches"], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


@attrs.frozen
class Straight:
    """The uninterrupted 2-rank run to TARGET: what each rank wrote, and its directory."""

    results: list[dict[str, Any]]
    directory: Path


_straight: dict[str, Straight | str] = {}


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> Straight:
    """The straight run, computed once per session (a failure is remembered, not retried)."""
    if "run" not in _straight:
        root = tmp_path_factory.mktemp("straight")
        try:
            results = train(root / "ckpt", root / "out")
        except AssertionError as failure:
            _straight["run"] = f"the straight 2-rank run failed:\n{failure}"
        else:
            _straight["run"] = Straight(results, root / "ckpt")
    value = _straight["run"]
    if isinstance(value, str):
        pytest.fail(value, pytrace=False)
    return value


# --- the tests ------------------------------------------------------------------------------


def test_sigterm_to_one_rank_then_resume_is_bitwise_identical(
    tmp_path: Path, straight: Straight
) -> None:
    whole = straight.results
    # The ranks really differ: their own data shard, dropout masks and RNG draws.
    assert whole[0]["batches"] != whole[1]["batches"]
    assert not torch.equal(whole[0]["draws"][0], whole[1]["draws"][0])
    assert whole[0]["meter"]["loss_sum"] != whole[1]["meter"]["loss_sum"]

    directory = tmp_path / "ckpt"
    first = train_and_stop(directory, tmp_path / "first", rank=1, at=STOP_AT)
    assert_one_stop_checkpoint(directory, STOP_AT)
    second = train(directory, tmp_path / "second")
    assert_continues_exactly(whole, first, second)


@pytest.mark.slow  # test_multirank_harness.py launches a job under torchrun by default
def test_under_torchrun(tmp_path: Path, straight: Straight) -> None:
    directory = tmp_path / "ckpt"
    first = train_and_stop(directory, tmp_path / "first", rank=1, at=STOP_AT, torchrun=True)
    assert_one_stop_checkpoint(directory, STOP_AT)
    second = train(directory, tmp_path / "second", torchrun=True)
    assert_continues_exactly(straight.results, first, second)


@pytest.mark.parametrize("mode", [pytest.param("on", marks=pytest.mark.slow), "overlap"])
def test_background_saves_continue_exactly(tmp_path: Path, straight: Straight, mode: str) -> None:
    # Saving every 2 steps, a background save of step 4 is in flight when the stop at step 5
    # comes; the result is still the synchronous straight run's, bit for bit.
    directory = tmp_path / "ckpt"
    options = ("--async-save", mode, "--every", "2")
    first = train_and_stop(directory, tmp_path / "first", *options, rank=1, at=5)
    assert_one_stop_checkpoint(directory, 5)
    second = train(directory, tmp_path / "second", *options)
    assert_continues_exactly(straight.results, first, second)


def test_kill_9_of_rank_0_mid_save_leaves_a_resumable_directory(
    tmp_path: Path, straight: Straight
) -> None:
    directory = tmp_path / "ckpt"
    hang_at = 5
    options = ("--target", str(TARGET), "--every", "1", "--report")
    with job(directory, tmp_path / "first", *options, "--hang-write-at", str(hang_at)) as running:
        running.wait_for(0, f"writing {hang_at}")  # half of step 5's file is on disk
        saves = [int(m.group(1)) for x in running.lines(0) if (m := re.match(r"saved (\d+)$", x))]
        running.kill(0)
    # Leaving the block killed rank 1 too, wherever it was waiting.
    assert saves, running.describe()
    last_returned = max(saves)
    assert last_returned == hang_at - 1, running.describe()
    assert max(p.step for p in published(directory)) == hang_at - 1

    second = train(directory, tmp_path / "second", "--report")
    resumed = second[0]["resumed"]["progress"][0]
    assert last_returned <= resumed < hang_at
    for rank, (whole, after) in enumerate(zip(straight.results, second, strict=True)):
        assert after["resumed"]["progress"][0] == resumed, rank
        assert after["batches"] == whole["batches"][resumed:], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


def _world_size_line(message: str) -> str:
    lines = [x for x in message.splitlines() if re.search(r"world.size", x, re.IGNORECASE)]
    assert lines, message
    return lines[0]


def test_a_changed_world_size_is_incompatible(tmp_path: Path, straight: Straight) -> None:
    directory = tmp_path / "ckpt"
    shutil.copytree(straight.directory, directory, symlinks=True)
    options = ("--target", str(TARGET + 2))
    with job(directory, tmp_path / "strict", *options, ranks=1) as running:
        finished = running.wait()
    assert finished.codes == {0: 3}, finished.describe()
    kind, message = errors(finished)[0]
    assert kind == "IncompatibleCheckpoint", finished.describe()
    line = _world_size_line(message)
    assert re.search(r"\b2\b", line), line  # names both sizes
    assert re.search(r"\b1\b", line), line

    # strict=False: the weights and the optimizer load, with a warning; per-rank state is new.
    with job(directory, tmp_path / "loose", *options, "--no-resume-strict", ranks=1) as running:
        finished = running.wait().check()
    # A Python warning (catchable), worded for the call that was made.
    warned = re.search(
        r"ResumeWarning: resume\(strict=False\) from step_\d{12}\.pitstop: world size is 2 in "
        r"the checkpoint, 1 in the run: .* restored; the per-rank state \(RNG streams.*\) "
        r"starts fresh",
        finished.outputs[0],
    )
    assert warned, finished.describe()
    (loose,) = outputs(tmp_path / "loose", ranks=1)
    stored = straight.results[0]
    assert loose["resumed"]["progress"][0] == TARGET
    for key in ("model", "ema", "optimizer"):
        assert_same(stored[key], loose["resumed"][key], key)
    assert loose["progress"][0] == TARGET + 2


def fail_at(tmp_path: Path, option: str, step: int) -> dict[int, tuple[str, str]]:
    """Train with ``option`` making step ``step``'s call fail; check that every rank stopped
    with a pitstop error at that call (none trained on) and only step 2 was published; return
    each rank's error (:func:`errors`)."""
    directory = tmp_path / "ckpt"
    options = ("--target", str(TARGET), "--every", "2", "--report", option, str(step))
    with job(directory, tmp_path / "out", *options) as running:
        finished = running.wait()
    assert finished.codes == {0: 3, 1: 3}, finished.describe()
    for rank in (0, 1):  # at the same call; no rank trained on
        assert f"step {step + 1}" not in finished.lines(rank), finished.describe()
    assert [p.step for p in published(directory)] == [2]
    found = errors(finished)
    assert sorted(found) == [0, 1], finished.describe()
    return found


def test_a_failed_write_on_rank_0_raises_save_error_on_every_rank(tmp_path: Path) -> None:
    for rank, (kind, message) in fail_at(tmp_path, "--fail-write-at", 4).items():
        assert kind == "SaveError", (rank, kind, message)
        assert re.search(r"step\D{0,3}0*4\b", message), (rank, message)


def test_a_part_that_cannot_be_saved_on_rank_1_raises_on_every_rank(tmp_path: Path) -> None:
    found = fail_at(tmp_path, "--bad-meter-at", 4)
    kind, own = found[1]
    assert kind == "SaveError", found
    assert "meter" in own, own  # its own error names the key path
    assert "hook" in own, own
    assert found[0] == ("SaveError", f"rank 1: {own}"), found


def test_a_call_refused_on_rank_1_raises_on_every_rank(tmp_path: Path) -> None:
    found = fail_at(tmp_path, "--bad-metric-at", 3)  # a step that saves nothing
    own = (
        "maybe_save(step=3): metrics['loss'] must be a number (an int, a float, a one-element "
        "tensor or a NumPy scalar), got str 'high'"
    )
    assert found == {1: ("ConfigError", own), 0: ("ConfigError", f"rank 1: {own}")}, found


def check_sigterm_anywhere(tmp_path: Path, straight: Straight, rank: int, at: int) -> None:
    directory = tmp_path / "ckpt"
    first = train_and_stop(directory, tmp_path / "first", rank=rank, at=at)
    assert_one_stop_checkpoint(directory, at)
    second = train(directory, tmp_path / "second")
    assert_continues_exactly(straight.results, first, second)


# The default run takes one point the tests above do not: rank 0 signalled at the end of an
# epoch (step 5 of 5 batches); the slow sweep takes every step on both ranks.
@pytest.mark.parametrize(("rank", "at"), [(0, 5)])
def test_sigterm_to_one_rank_at_a_step_then_resume(
    tmp_path: Path, straight: Straight, rank: int, at: int
) -> None:
    check_sigterm_anywhere(tmp_path, straight, rank, at)


@pytest.mark.slow
@pytest.mark.parametrize("at", range(1, TARGET))
@pytest.mark.parametrize("rank", range(RANKS))
def test_sigterm_to_one_rank_anywhere_then_resume(
    tmp_path: Path, straight: Straight, rank: int, at: int
) -> None:
    check_sigterm_anywhere(tmp_path, straight, rank, at)
