"""A background sharded save that every rank foresees is copied while the ranks agree on it.

Two real ranks (FSDP2 on gloo, tests/e2e/staged_round_child.py). Each rank's copy of its
shards runs between the start of the call's round and its end, so rank 0 copies before it
plans; a call nobody foresees copies nothing; a foreseen call that writes nothing leaves no
copy behind; a Ctrl-C during the copy on either rank leaves no rank waiting (the collectives'
timeout is far longer than the job's), no temp directory, and the ranks in step for the next
save.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multirank import Finished, Job

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

CHILD = Path(__file__).with_name("staged_round_child.py")


def run(directory: Path, *args: str) -> Finished:
    with Job(CHILD, "--dir", directory, *args, ranks=2, timeout=180) as job:
        finished = job.wait()
    finished.check()
    return finished


def events(finished: Finished, rank: int) -> dict[str, list[str]]:
    prefix = "events "
    said = [line[len(prefix) :] for line in finished.lines(rank) if line.startswith(prefix)]
    return {call: json.loads(rest) for call, _, rest in (line.partition("|") for line in said)}


def without_copies(said: list[str]) -> list[str]:
    """The events but the stager's copies (in overlap mode a save's second copy is made by
    pitstop's thread, at a moment of its own, unless the next optimizer step makes it)."""
    return [event for event in said if event != "copy"]


@pytest.mark.parametrize("mode", [[], ["--overlap"]], ids=["async", "overlap"])
def test_a_foreseen_save_is_copied_during_its_round_and_an_unforeseen_call_copies_nothing(
    tmp_path: Path, mode: list[str]
) -> None:
    finished = run(tmp_path / "checkpoints", *mode)
    for rank in range(2):
        said = events(finished, rank)
        planned = ["plan"] if rank == 0 else []  # rank 0 plans
        # Each rank copies after its round began and (rank 0) before it plans: the round's
        # wait overlaps the copy.
        assert without_copies(said["save"]) == ["round", "stage", *planned], finished.describe()
        # Not foreseen, not due: the quick round ends the call, no gather round is begun.
        assert said["maybe_save"] == [], finished.describe()
        assert without_copies(said["finish"]) == ["round", "stage", *planned]
        # The step is saved: only the final pointer moves (the round after the plan gathers
        # every rank's part for it, as for any save that writes no shards), and the copy made
        # during the round is dropped: it made its copy at the call once ...
        assert said["finish again"] == ["round", "stage", "copy", *planned, "round"]
        # ... and the next optimizer step makes none (overlap mode: the copy left for later).
        assert said["step"] == [], finished.describe()
        lines = finished.lines(rank)
        assert "maybe None" in lines
        assert 'checkpoints ["step_000000000001", "step_000000000002"]' in lines
        assert "temps 0" in lines
    final = (tmp_path / "checkpoints" / "final").readlink()
    assert final.name == "step_000000000002"


def test_a_ctrl_c_during_rank_0_s_copy_is_raised_on_every_rank_before_anything_is_planned(
    tmp_path: Path,
) -> None:
    finished = run(tmp_path / "checkpoints", "--scene", "interrupt", "--interrupt-rank", "0")
    assert 'interrupted "Ctrl-C during the copy"' in finished.lines(0), finished.describe()
    assert 'interrupted "rank 0: Ctrl-C during the copy"' in finished.lines(1)
    assert events(finished, 0)["save"] == ["round", "stage"], finished.describe()  # no plan
    for rank in range(2):
        lines = finished.lines(rank)
        assert "saved 1" not in lines
        assert "wait ok" in lines, finished.describe()  # nothing was in flight
        assert 'checkpoints ["step_000000000002"]' in lines, finished.describe()
        assert "temps 0" in lines


@pytest.mark.parametrize(
    ("scene", "rank"),
    [("interrupt", 1), pytest.param("late", 0, marks=pytest.mark.slow), ("late", 1)],
    ids=["rank 1 during the round", "rank 0 after the round", "rank 1 after the round"],
)
def test_a_ctrl_c_in_one_rank_s_copy_fails_that_save_on_every_rank_without_a_wait(
    tmp_path: Path, scene: str, rank: int
) -> None:
    """Rank 1's copy made during the round, or either rank's made after it (a save only the
    other rank's stop request makes, which this rank does not foresee), is interrupted: that
    rank raises the interrupt once its part of the save is handed over, as failed; every other
    rank's call returns the save, and every rank hears it fail at the next call — none waits
    for the collectives' timeout."""
    finished = run(tmp_path / "checkpoints", "--scene", scene, "--interrupt-rank", str(rank))
    other = 1 - rank
    assert 'interrupted "Ctrl-C during the copy"' in finished.lines(rank), finished.describe()
    assert "saved 1" in finished.lines(other), finished.describe()
    assert "plan" in events(finished, 0)["save"], finished.describe()  # the save was planned
    if scene == "late" and rank == 0:  # it planned first, then copied (not foreseen)
        assert events(finished, 0)["save"] == ["round", "plan", "stage"], finished.describe()
    for r in range(2):
        lines = finished.lines(r)
        said = [json.loads(line[len("wait error ") :]) for line in lines if "wait error" in line]
        assert len(said) == 1, finished.describe()
        assert "background save of step 1" in said[0]
        assert f"rank {rank}: the copy of this rank's shards was interrupted" in said[0]
        assert 'checkpoints ["step_000000000002"]' in lines, finished.describe()
        assert "temps 0" in lines
