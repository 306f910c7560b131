"""Sharded state through the public Checkpointer: FSDP2 on gloo, real processes, 2 ranks.

tests/e2e/sharded_train.py trains an FSDP2 MLP (AdamW, a LambdaLR schedule, dropout, each
rank its own data, an EMA: an AveragedModel whose module is sharded too) with
``pitstop.Checkpointer`` and the same calls as an unsharded run;
every save is a checkpoint directory ``step_<12 digits>/`` (DCP's files and pitstop's
manifest). Checked here against one uninterrupted run: a run SIGKILLed after a save and
resumed in fresh processes ends bitwise equal (local shards, EMA, optimizer, schedule, RNG);
a run without an EMA resumes such a checkpoint only with strict=False; one
rank reshards a two-rank checkpoint (strict=True names the per-rank RNG that cannot continue;
strict=False loads the full tensors); a flipped byte in the newest checkpoint's shard makes
every rank fall back to the previous one, and with every checkpoint torn the run starts fresh as
the straight run did; a read that fails on one rank after the checks leaves every rank as it
was; a save killed between the shards and the manifest
is never listed; retention deletes old directories and keeps the pointer targets; export,
load_weights (the model's weights and the EMA's), verify, info, load and the CLI read a
checkpoint directory. In the background
(``--async``): a run killed while the shards are written resumes from the previous checkpoint,
bitwise (its shards were written only after the next step changed the model), every record
pending until a later call publishes it; a write failing on rank 1 raises on both ranks and is
undone; a staging or a part failing on rank 1 is raised on both ranks at a later call, and
no rank's DCP write of it began; rank 1's DCP write failing to start ends rank 0's at once;
a Checkpointer dropped with a save in flight publishes
nothing. With ``--overlap`` (the parameters and optimizer state copied after the call), a run
killed after a save resumes bitwise, and its checkpoints hold what the synchronous run's hold.
Every job is a tests/multirank.py Job (bounded waits; every process ended when the
test ends).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch
from torch import nn

import pitstop
from multirank import Finished, Job
from pitstop.cli import main as cli
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.formatting import format_size
from pitstop.shell.format import fileformat
from pitstop.shell.sharded.engine import MODEL, full_state_dict
from pitstop.shell.store.directory import CheckpointDirectory, scan
from pitstop.shell.store.sharddir import read_layout
from pitstop.shell.store.storage import LocalStorage
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).with_name("sharded_train.py")
TARGET = 6  # saves every 2 steps, keep_last=2: step 2 is deleted by the step-6 save
_STRICT = re.compile(r'^strict error (".*")$')


@attrs.frozen
class Run:
    directory: Path
    ranks: list[dict[str, Any]]
    finished: Finished


def train(directory: Path, out: Path, *args: str, ranks: int = 2, code: int = 0) -> Run:
    with Job(
        SCRIPT, "--dir", directory, "--out", out, "--target", str(TARGET), *args, ranks=ranks
    ) as job:
        finished = job.wait()
    if code == 0:
        finished.check()
        outputs = [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(ranks)]
    else:
        assert set(finished.codes.values()) == {code}, finished.describe()
        outputs = []
    return Run(directory=directory, ranks=outputs, finished=finished)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted 2-rank run to step 6."""
    root = tmp_path_factory.mktemp("straight")
    return train(root / "checkpoints", root / "out")


def copy_run(straight: Run, tmp_path: Path) -> Path:
    target = tmp_path / "checkpoints"
    shutil.copytree(straight.directory, target, symlinks=True)
    return target


def trained(run: dict[str, Any]) -> dict[str, Any]:
    """What must be bitwise equal between two runs that reach the same step."""
    return {k: v for k, v in run.items() if k != "resumed"}


def names(directory: Path) -> list[str]:
    return [e.name for e in scan(LocalStorage(directory)).catalog]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# --- saving, retention ------------------------------------------------------------------------


def test_saves_are_directories_and_retention_keeps_the_pointer_targets(straight: Run) -> None:
    directory = straight.directory
    assert names(directory) == [sharded_name(4), sharded_name(6)]  # step 2: deleted
    assert not (directory / sharded_name(2)).exists()
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    for pointer in ("last", "final"):
        assert (directory / pointer).readlink() == Path(sharded_name(6))
        assert (directory / pointer / MANIFEST_NAME).is_file()
    latest = json.loads((directory / "latest.json").read_text())
    assert latest["pointers"]["last"] == sharded_name(6)
    files = sorted(p.name for p in (directory / sharded_name(6)).iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", MANIFEST_NAME]


# --- resuming ---------------------------------------------------------------------------------


def test_a_run_killed_after_a_save_resumes_bitwise_equal(straight: Run, tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    killed = train(directory, tmp_path / "killed", "--die-at", "4", code=-9)
    assert "step 4" in killed.finished.lines(1)
    assert names(directory)[-1] == sharded_name(4)
    resumed = train(directory, tmp_path / "resumed")
    for rank in range(2):
        assert resumed.ranks[rank]["resumed"] == 4
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def test_a_resume_that_checks_its_own_files_takes_four_rounds(
    straight: Run, tmp_path: Path
) -> None:
    """Rank 0's settle with the resume order, the checks with the comparison, the restore with
    the apply and rank 0's schedule, and the copy: four of pitstop's collectives on every
    rank."""
    again = train(copy_run(straight, tmp_path), tmp_path / "again")
    for rank in range(2):
        assert again.ranks[rank]["resumed"] == 6
        assert "resume collectives 4" in again.finished.lines(rank), again.finished.describe()


def test_one_rank_reshards_a_two_rank_checkpoint(straight: Run, tmp_path: Path) -> None:
    directory = copy_run(straight, tmp_path)
    one = train(directory, tmp_path / "one", "--strict-first", "--note-checks", ranks=1)
    # rank 1's file has no writer in the run to check it: the one rank checks it, once
    assert checked(one.finished, 0)[0] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    refused = [m.group(1) for line in one.finished.lines(0) if (m := _STRICT.match(line))]
    assert len(refused) == 1, one.finished.describe()
    message = json.loads(refused[0])
    assert "world size is 2 in the checkpoint, 1 in the run" in message
    assert "RNG streams" in message
    (restored,) = one.ranks
    assert restored["resumed"] == TARGET
    assert_same(restored["full"], straight.ranks[0]["full"])
    assert_same(restored["local"], straight.ranks[0]["full"])  # one rank holds everything
    assert_same(restored["schedule"], straight.ranks[0]["schedule"])


def test_a_run_without_an_ema_resumes_an_ema_checkpoint_only_when_not_strict(
    straight: Run, tmp_path: Path
) -> None:
    directory = copy_run(straight, tmp_path)
    plain = train(directory, tmp_path / "plain", "--no-ema", "--strict-first")
    for rank in range(2):
        lines = plain.finished.lines(rank)
        refused = [json.loads(m.group(1)) for line in lines if (m := _STRICT.match(line))]
        assert refused == [
            "checkpoint is incompatible (1 difference(s)):\n  - "
            f"{sharded_name(6)}: ema: the checkpoint holds EMA weights, the run has no EMA"
        ], plain.finished.describe()
        restored = plain.ranks[rank]
        assert restored["resumed"] == TARGET
        without = {k: v for k, v in straight.ranks[rank]["full"].items() if k != "ema"}
        assert_same(restored["full"], without)
    warned = [line for line in plain.finished.lines(0) if "the run has no EMA" in line]
    assert warned, plain.finished.describe()


def checked(finished: Finished, rank: int) -> list[list[str]]:
    """The shard files ``rank`` verified, per candidate (``--note-checks``)."""
    lines = finished.lines(rank)
    return [json.loads(line[len("checked ") :]) for line in lines if line.startswith("checked ")]


@pytest.mark.parametrize(
    ("shard", "found_by"),
    [("__1_0.distcp", "rank 1"), ("__0_0.distcp", "rank 0")],
    ids=["read-by-both", "read-by-rank-0"],
)
def test_a_flipped_byte_in_a_shard_falls_back_on_every_rank(
    straight: Run, tmp_path: Path, shard: str, found_by: str
) -> None:
    """Rank 0 reads both shard files (rank 1's holds values stored once), rank 1 its own: each
    file is verified once, by its writer, and the other rank falls back on its word."""
    directory = copy_run(straight, tmp_path)
    flip_byte(directory / sharded_name(6) / shard)
    again = train(directory, tmp_path / "again", "--note-checks")
    assert checked(again.finished, 0)[0] == [".metadata", "__0_0.distcp"]  # step 6
    assert checked(again.finished, 1)[0] == ["__1_0.distcp"]
    warned = [line for line in again.finished.lines(0) if "does not verify" in line]
    assert len(warned) == 1, again.finished.describe()  # rank 0 warns, once per problem
    assert f"{sharded_name(6)}: {shard} fails its checksum" in warned[0]
    assert f"({found_by})" in warned[0]  # the one rank that checked it
    assert not [line for line in again.finished.lines(1) if "does not verify" in line]
    for rank in range(2):
        assert again.ranks[rank]["resumed"] == 4  # on every rank
        assert_same(trained(again.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    pitstop.verify(directory / sharded_name(6))  # the run saved step 6 again, whole


def test_a_run_whose_every_checkpoint_is_torn_starts_fresh_as_the_straight_run_did(
    straight: Run, tmp_path: Path
) -> None:
    """Nothing verifies, so the resume restores nothing: the optimizer DCP's checks gave zeroed
    state to read into has none again, and the run ends bitwise equal to the straight one (with
    that state left, AdamW's first step would have been its step 2)."""
    directory = copy_run(straight, tmp_path)
    for step in (4, 6):
        flip_byte(directory / sharded_name(step) / "__0_0.distcp")
    again = train(directory, tmp_path / "again")
    warned = [line for line in again.finished.lines(0) if "does not verify" in line]
    assert len(warned) == 2, again.finished.describe()
    for rank in range(2):
        assert again.ranks[rank]["resumed"] == 0
        assert_same(trained(again.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def test_an_apply_that_fails_on_one_rank_after_the_read_leaves_every_rank_as_it_was(
    straight: Run, tmp_path: Path
) -> None:
    """Every file of step 6 checks out as DCP reads it into staging, then rank 1's optimizer
    refuses the state (rank 0's apply went through). Both ranks raise CheckpointCorrupt naming
    rank 1, with the model, the EMA, the optimizer (no state), the schedule and the RNG as
    before the resume on both. Nothing was wrong with the files: the next resume takes step 6."""
    directory = copy_run(straight, tmp_path)
    failed = train(directory, tmp_path / "failed", "--refuse-apply-at-resume", code=3)
    for rank in range(2):
        lines = failed.finished.lines(rank)
        assert "untouched model True ema True optimizer True schedule True rng True" in lines, (
            failed.finished.describe()
        )
        (error,) = [line for line in lines if line.startswith("error ")]
        assert error.startswith("error CheckpointCorrupt "), error
        assert "optimizer refused its state on rank 1" in error, error
    again = train(directory, tmp_path / "again")
    assert not [line for line in again.finished.lines(0) if "does not verify" in line]
    for rank in range(2):
        assert again.ranks[rank]["resumed"] == 6
        assert_same(trained(again.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def test_a_shard_torn_as_dcp_reads_it_falls_back_on_every_rank(
    straight: Run, tmp_path: Path
) -> None:
    """Rank 1's shard file of step 6 is cut in half as DCP's read sets up (rank 0 reads its own
    file whole, and a few values from rank 1's, which rank 1 checks as it reads it): the read
    fails on every rank before anything live is touched, and every rank resumes step 4."""
    directory = copy_run(straight, tmp_path)
    again = train(directory, tmp_path / "again", "--tear-at-resume")
    warned = [line for line in again.finished.lines(0) if "does not verify" in line]
    assert len(warned) == 1, again.finished.describe()
    assert "(rank 1)" in warned[0], warned[0]
    assert f"{sharded_name(6)}: __1_0.distcp is " in warned[0]  # its size: cut in half
    for rank in range(2):
        assert again.ranks[rank]["resumed"] == 4
        assert_same(trained(again.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def test_a_save_killed_between_the_shards_and_the_manifest_is_never_listed(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "checkpoints"
    train(directory, tmp_path / "out", "--die-in-write-at", "4", code=-9)
    temps = [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert [p.name.endswith(sharded_name(4)) for p in temps] == [True]
    assert (temps[0] / "__1_0.distcp").is_file()  # the shards were written, the manifest not
    assert names(directory) == [sharded_name(2)]
    assert pitstop.verify(directory) == directory / sharded_name(2)
    with CheckpointDirectory(directory):  # the next writer removes the dead one's directory
        pass
    assert not temps[0].exists()


def test_a_checkpoint_named_directory_without_a_good_manifest_is_not_listed(
    straight: Run, tmp_path: Path
) -> None:
    directory = copy_run(straight, tmp_path)
    (directory / sharded_name(4) / MANIFEST_NAME).unlink()
    with (directory / sharded_name(6) / MANIFEST_NAME).open("r+b") as manifest:
        manifest.truncate(100)  # no footer: an incomplete file
    found = scan(LocalStorage(directory))
    assert list(found.catalog) == []
    assert sorted(found.unreadable) == [sharded_name(4), sharded_name(6)]


# --- in the background (async_save=True: DCP's async_save, published by a later call) ---------


def statuses(run: Run, rank: int) -> list[str]:
    return [line for line in run.finished.lines(rank) if line.startswith(("saved ", "status "))]


def test_a_run_killed_while_background_shards_are_written_resumes_from_the_previous(
    straight: Run, tmp_path: Path
) -> None:
    directory = tmp_path / "checkpoints"
    killed = train(
        directory,
        tmp_path / "killed",
        "--async",
        "--hold-shards-at",  # step 2's shards are written only after step 3 changed the model
        "2",
        "--die-in-shards-at",
        "4",
        code=-9,
    )
    assert "killing in shards" in killed.finished.lines(0)
    assert names(directory) == [sharded_name(2)]  # never listed before its shards are durable
    assert (directory / "last").readlink() == Path(sharded_name(2))
    resumed = train(directory, tmp_path / "resumed", "--async")
    for rank in range(2):  # step 2, saved in the background while training went on, is exact
        assert resumed.ranks[rank]["resumed"] == 2
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
        assert statuses(resumed, rank) == [  # pending on every rank until a later call
            "saved 4 pending",
            "saved 6 pending",
            "status 4 published",
            "status 6 published",
        ], resumed.finished.describe()
    assert names(directory) == [sharded_name(4), sharded_name(6)]
    assert (directory / "final").readlink() == Path(sharded_name(6))
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert pitstop.verify(directory) == directory / sharded_name(6)


def test_a_background_save_failing_on_one_rank_raises_on_every_rank_and_is_undone(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "checkpoints"
    run = train(directory, tmp_path / "failed", "--async", "--fail-shards-at", "4")
    for rank in range(2):
        lines = run.finished.lines(rank)
        errors = [json.loads(line[len("save error ") :]) for line in lines if "save error" in line]
        assert len(errors) == 1, run.finished.describe()
        assert "background save of step 4" in errors[0]
        assert "injected on rank 1" in errors[0]  # rank 1's error, raised on rank 0 too
        assert "status 4 failed" in lines
        assert "status 2 published" in lines
    assert names(directory) == [sharded_name(2), sharded_name(6)]  # the schedule went on
    assert (directory / "last").readlink() == Path(sharded_name(6))
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


def assert_step_4_failed(run: Run, what: str, *, wrote: bool, later: bool) -> None:
    """Rank 1's injected ``what`` failure of the step-4 save was raised once on both ranks:
    at that call, or (``later``, a background save) at a later call, after the step-4 call had
    returned its pending record, whose status then says failed; DCP's write of it had begun and
    ended (``wrote``) or never begun on any rank; nothing of step 4 is left and steps 2 and 6
    were published."""
    for rank in range(2):
        lines = run.finished.lines(rank)
        errors = [json.loads(line[len("save error ") :]) for line in lines if "save error" in line]
        assert len(errors) == 1, run.finished.describe()
        assert f"{what} injected on rank 1" in errors[0]
        assert f"write began {wrote} ended {wrote}" in lines, run.finished.describe()
        if later:
            assert "background save of step 4" in errors[0]
            assert {"saved 4 pending", "status 4 failed"} <= set(lines)
            saved_4 = lines.index("saved 4 pending")
            assert saved_4 < lines.index(f"save error {json.dumps(errors[0])}")
        else:
            assert not [line for line in lines if line.startswith("saved 4")]
        assert "status 2 published" in lines
    # Step 6 is published by its own call, or by finish() when that call raised the failure
    # (a background save's failure is heard at the first call that finds it settled).
    assert names(run.directory) == [sharded_name(2), sharded_name(6)]
    assert not [p for p in run.directory.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_a_part_that_fails_on_one_rank_raises_on_every_rank(tmp_path: Path, mode: str) -> None:
    """Rank 1's own part (RNG, per-rank state) of the step-4 save fails, after its shards are
    written (sync) or staged (async): sync: the same error on both ranks at that call (rank 1
    raises its own OSError), once DCP's write had ended; async: the call returns on both ranks
    and the failure is raised on both at a later call, as a failed background save — no rank's
    DCP write of step 4 ever began —; nothing of step 4 left, and the next saves go on over the
    same groups."""
    directory = tmp_path / "checkpoints"
    options = ["--fail-part-at", "4"] + (["--async"] if mode == "async" else [])
    wrote, later = mode == "sync", mode == "async"
    run = train(directory, tmp_path / "failed", *options)
    assert_step_4_failed(run, "part", wrote=wrote, later=later)
    if mode == "sync":  # rank 1's own error, named as rank 1's on rank 0 — nothing of DCP's
        expected = ["rank 1: OSError: part injected on rank 1", "part injected on rank 1"]
        for rank in range(2):
            said = [
                json.loads(line[len("save error ") :])
                for line in run.finished.lines(rank)
                if "save error" in line
            ]
            assert said == [expected[rank]], run.finished.describe()


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "async"])
def test_a_file_table_that_fails_on_one_rank_raises_on_every_rank(
    tmp_path: Path, mode: str
) -> None:
    """Rank 1's table of the files it wrote for step 4 (made in DCP's write step, and handed
    to rank 0 with DCP's results) cannot be made: DCP's write of step 4 ends on both ranks,
    and the failure is raised on both — at that call (sync: rank 1's own OSError, rank 0 a
    SaveError naming rank 1), or at a later call as a failed background save naming it;
    nothing of step 4 is left, and the next saves go on."""
    options = ["--fail-table-at", "4"] + (["--async"] if mode == "async" else [])
    run = train(tmp_path / "checkpoints", tmp_path / "failed", *options)
    assert_step_4_failed(run, "table", wrote=True, later=mode == "async")
    said = [
        [json.loads(line[len("save error ") :]) for line in lines if "save error" in line]
        for lines in (run.finished.lines(0), run.finished.lines(1))
    ]
    if mode == "sync":
        assert said == [["rank 1: OSError: table injected on rank 1"], ["table injected on rank 1"]]
    else:  # rank 0's SaveError on both, naming rank 1's own error once
        assert said[0][0].endswith("failed: rank 1: OSError: table injected on rank 1"), said
        assert said[1] == ["rank 0: " + said[0][0]], said


def test_a_staging_that_fails_on_one_rank_starts_no_rank_s_background_write(
    tmp_path: Path,
) -> None:
    """Rank 1's staging of the step-4 save (the copy DCP's background write starts from)
    raises: the call returns on both ranks (the round that agrees every rank staged runs in the
    background), and the failure is raised on both at a later call, as a failed background
    save naming rank 1's error; no rank's DCP write of step 4 began (so no rank waits on DCP's
    collectives until their timeout), nothing of step 4 is left, and the next saves go on over
    the same groups. The collectives' timeout is longer than the job's: a wait for it fails
    the test."""
    directory = tmp_path / "checkpoints"
    options = ["--async", "--fail-stage-at", "4", "--pg-timeout", "600"]
    run = train(directory, tmp_path / "failed", *options)
    assert_step_4_failed(run, "staging", wrote=False, later=True)


def test_dcp_s_write_that_cannot_start_on_one_rank_ends_every_rank_s_write_at_once(
    tmp_path: Path,
) -> None:
    """Rank 1's call of DCP's ``async_save`` for step 4 raises, after every rank agreed that
    every rank staged, while rank 0's DCP write has begun: rank 1 joins that write with a
    planner that fails before DCP's first collective, so both ranks' writes end at once with
    rank 1's error — raised on both at a later call as a failed background save — instead of
    rank 0 waiting for the collectives' timeout (longer than the job's here: a wait for it
    fails the test). Nothing of step 4 is left, and step 6 is published (by its own call, or
    by finish() when that call is the one that raised step 4's failure)."""
    directory = tmp_path / "checkpoints"
    options = ["--async", "--fail-start-at", "4", "--pg-timeout", "600"]
    run = train(directory, tmp_path / "failed", *options)
    for rank in range(2):
        lines = run.finished.lines(rank)
        errors = [json.loads(line[len("save error ") :]) for line in lines if "save error" in line]
        assert len(errors) == 1, run.finished.describe()
        assert "background save of step 4" in errors[0]
        assert "rank 1 could not start DCP's write: OSError: start injected on rank 1" in errors[0]
        assert {"saved 4 pending", "status 4 failed", "status 2 published"} <= set(lines)
    # rank 0's DCP write was set up and never wrote; rank 1's never began
    assert "write began True ended False" in run.finished.lines(0), run.finished.describe()
    assert "write began False ended False" in run.finished.lines(1), run.finished.describe()
    assert names(directory) == [sharded_name(2), sharded_name(6)]
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_a_checkpointer_dropped_with_a_background_save_in_flight_publishes_nothing(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "checkpoints"
    with Job(
        SCRIPT,
        "--dir",
        directory,
        "--out",
        tmp_path / "out",
        "--target",
        "6",
        "--async",
        "--drop-at",
        "2",
        ranks=2,
    ) as job:
        finished = job.wait()
    finished.check()  # no rank hangs on a collective that cannot run any more
    for rank in range(2):
        assert "dropped" in finished.lines(rank)
    logged = [line for line in finished.lines(0) if "nobody was left to raise it" in line]
    assert len(logged) == 1, finished.describe()
    assert "dropped without close() while this sharded save was in flight" in logged[0]
    assert names(directory) == []
    assert not (directory / "last").exists()
    with CheckpointDirectory(directory):  # the next writer removes what the save left
        pass
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


# --- reading a checkpoint directory on its own ------------------------------------------------


def plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 5))


def test_export_and_load_weights_give_an_unsharded_model_the_full_tensors(
    straight: Run, tmp_path: Path
) -> None:
    full = straight.ranks[0]["full"]["model"]
    exported = pitstop.export_weights(straight.directory, tmp_path / "weights.pt")
    model = plain_model()
    model.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    assert_same(dict(model.state_dict()), full)
    other = plain_model()
    pitstop.load_weights(other, straight.directory / "last", strict=True)
    assert_same(dict(other.state_dict()), full)
    averaged = straight.ranks[0]["full"]["ema"]  # the AveragedModel's: module.*, n_averaged
    ema = {k.removeprefix("module."): v for k, v in averaged.items() if k != "n_averaged"}
    exported = pitstop.export_weights(straight.directory, tmp_path / "ema.pt", weights="ema")
    model = plain_model()
    model.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    assert_same(dict(model.state_dict()), ema)
    assert not torch.equal(ema["0.weight"], full["0.weight"])  # the EMA's, not the model's
    other = plain_model()
    pitstop.load_weights(other, straight.directory, weights="ema", strict=True)
    assert_same(dict(other.state_dict()), ema)


def test_verify_info_load_and_the_cli_read_a_checkpoint_directory(
    straight: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = copy_run(straight, tmp_path)
    newest = directory / sharded_name(6)
    assert pitstop.verify(directory) == newest
    record = pitstop.info(newest)
    assert record.step == TARGET
    assert {t.name for t in record.tensors} >= {
        "model.0.weight",
        "optimizer.state.0.weight.exp_avg",
    }
    tree = pitstop.load(directory)
    assert_same(tree["sharded"]["model"], straight.ranks[0]["full"]["model"])
    assert cli(["ls", str(directory), "--check"]) == 0
    assert f"would use {sharded_name(6)} (step 6)" in capsys.readouterr().out
    # verify says what it checked: every file of the directory, all their bytes, every value
    assert cli(["verify", str(newest)]) == 0
    files = sorted(newest.iterdir())
    layout, _ = read_layout(newest)
    manifest = fileformat.read_manifest(newest / MANIFEST_NAME)
    assert len(files) == len(layout.files) + 1
    assert len(layout.values) > len(manifest.tensors)
    assert capsys.readouterr().out == (
        f"OK {newest}: sharded, {len(files)} files, "
        f"{format_size(sum(f.stat().st_size for f in files))}: {len(layout.values)} sharded "
        f"values, {len(manifest.tensors)} tensors in the manifest\n"
    )
    flip_byte(newest / "__0_0.distcp")
    with pytest.raises(pitstop.CheckpointCorrupt, match=r"__0_0\.distcp fails its checksum"):
        pitstop.verify(newest)
    assert cli(["verify", str(newest)]) != 0


def test_prune_deletes_old_directories_and_keeps_the_resume_point(
    straight: Run, tmp_path: Path
) -> None:
    directory = copy_run(straight, tmp_path)
    assert cli(["prune", str(directory), "--keep-last", "1"]) == 0
    assert names(directory) == [sharded_name(6)]
    assert not (directory / sharded_name(4)).exists()
    assert (directory / "last" / MANIFEST_NAME).is_file()


def test_an_overlap_run_killed_after_a_save_resumes_bitwise_from_what_it_saved(
    straight: Run, tmp_path: Path
) -> None:
    """async_save="overlap": each save's parameters and optimizer state are copied after the
    call (by pitstop's thread, or the next optimizer step's pre-hook). Killed right after the
    step-4 call, the run had published step 2 only; resumed in overlap mode, it ends bitwise
    as the straight run did, and its checkpoints of steps 4 and 6 — each followed by an
    optimizer step while it was in flight — hold what the straight run's synchronous saves
    of those steps hold."""
    directory = tmp_path / "checkpoints"
    killed = train(directory, tmp_path / "killed", "--overlap", "--die-at", "4", code=-9)
    assert "saved 4 pending" in killed.finished.lines(0)
    assert names(directory) == [sharded_name(2)]  # step 4 was in flight: never published
    resumed = train(directory, tmp_path / "resumed", "--overlap")
    for rank in range(2):
        assert resumed.ranks[rank]["resumed"] == 2
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    assert names(directory) == [sharded_name(4), sharded_name(6)]
    for step in (4, 6):
        for component in (MODEL, "optimizer", "ema"):
            ours = full_state_dict(directory / sharded_name(step), component)
            theirs = full_state_dict(straight.directory / sharded_name(step), component)
            assert_same(ours, theirs, f"step {step} {component}")


@pytest.mark.slow
def test_four_ranks_reshard_to_two_with_the_full_tensors(tmp_path: Path) -> None:
    four = train(tmp_path / "checkpoints", tmp_path / "four", ranks=4)
    two = train(four.directory, tmp_path / "two", "--strict-first", ranks=2)
    for rank in range(2):
        assert any(line.startswith("strict error") for line in two.finished.lines(rank))
        assert two.ranks[rank]["resumed"] == TARGET
        assert_same(two.ranks[rank]["full"], four.ranks[0]["full"], f"rank {rank}")
        assert_same(two.ranks[rank]["schedule"], four.ranks[0]["schedule"])
