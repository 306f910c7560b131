"""The documented stop loop cannot strand a rank; a rank that is gone is named.

Real processes (tests/e2e/stop_points.py): under torchrun, 2 ranks (4 under ``-m slow``), with
a real SIGTERM raised on one rank at every point of a step — before the update, after
``stop.sync()``, after ``maybe_save``, after ``if stop: break`` — every rank must leave the
loop at the same step, the job must end cleanly, and the stop's checkpoint is the step they
left at. Then a rank is killed (-9) between two rounds: every other rank raises a
CollectiveError naming the call and the rank that did not arrive, within its timeout.
Each job is bounded (the harness's waits, the children's collective timeouts): with the
agreed-value rule broken, these tests fail at their timeouts instead of stalling CI.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from multirank import Job

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).with_name("stop_points.py")
TARGET = 4
# Where the signal lands, and whether that step's own agreement takes it (it stops there) or
# it is held for the next step's (it stops one step later).
POINTS = {"step": 0, "sync": 0, "save": 1, "check": 1}
_ERROR = re.compile(r'^error (\w+) (".*")$')


def _scenarios(ranks: int, steps: tuple[int, ...]) -> list[dict[str, Any]]:
    return [
        {"loop": loop, "rank": rank, "step": step, "point": point}
        for loop in ("docs", "sync")
        for point in POINTS
        if not (loop == "docs" and point == "sync")
        for rank in range(ranks)
        for step in steps
    ]


def _run(tmp_path: Path, ranks: int, scenarios: list[dict[str, Any]]) -> dict[int, list[Any]]:
    spec = json.dumps(scenarios)
    args = ("--dir", tmp_path, "--scenarios", spec, "--target", str(TARGET))
    with Job(SCRIPT, *args, ranks=ranks, torchrun=True, timeout=300) as job:
        finished = job.wait().check()
    results: dict[int, list[Any]] = {}
    for rank in range(ranks):
        lines = [line for line in finished.lines(rank) if line.startswith("result ")]
        results[rank] = [json.loads(line.removeprefix("result ")) for line in lines]
        assert len(results[rank]) == len(scenarios), finished.describe()
    return results


def _check(results: dict[int, list[Any]], scenarios: list[dict[str, Any]]) -> None:
    for index, spec in enumerate(scenarios):
        seen = [results[rank][index] for rank in sorted(results)]
        expected = spec["step"] + POINTS[spec["point"]]
        assert {s["left"] for s in seen} == {expected}, (spec, seen)
        assert {s["reason"] for s in seen} == {"SIGTERM"}, (spec, seen)
        # The stop's checkpoint is the step every rank left at, saved once, for the signal.
        assert seen[0]["newest"] == [expected, "stop", "SIGTERM"], (spec, seen[0])


def test_a_sigterm_anywhere_in_a_step_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    # Every point, each rank, at steps 1 and 3 (a stop at 3 that is held leaves at 4, the end).
    scenarios = _scenarios(2, (1, 3))
    _check(_run(tmp_path, 2, scenarios), scenarios)


@pytest.mark.slow
def test_four_ranks_stop_together_wherever_the_signal_lands(tmp_path: Path) -> None:
    scenarios = _scenarios(4, (1, 2, 3))
    _check(_run(tmp_path, 4, scenarios), scenarios)


def test_a_killed_rank_is_named_by_every_rank_still_there(tmp_path: Path) -> None:
    # Directly launched (torchrun would tear the job down when a worker dies): 3 ranks, no
    # DDP, so that the only collectives are pitstop's. Rank 2 is killed after step 2's update;
    # ranks 0 and 1 go on into maybe_save and must name the call and the missing rank.
    args = ("--dir", tmp_path, "--no-ddp", "--die-at", "2", "--die-rank", "2")
    with Job(SCRIPT, *args, ranks=3, timeout=120) as job:
        job.wait_for(2, "holding 2")
        job.kill(2)
        finished = job.wait(grace=None)
    for rank in (0, 1):
        assert finished.codes[rank] == 3, finished.describe()
        errors = [m for line in finished.lines(rank) if (m := _ERROR.match(line))]
        assert errors, finished.describe()
        kind, message = errors[0].group(1), json.loads(errors[0].group(2))
        assert kind == "CollectiveError", message
        assert "maybe_save at step 2" in message, message
        assert "rank 2 did not arrive" in message, message
        assert "timeout_s" in message, message
    other = json.loads(_ERROR.match(finished.lines(0)[-1]).group(2))  # type: ignore[union-attr]
    assert "rank 1 failed at the same round" in other, other
