"""``pitstop ls`` and ``verify`` on one node's directory of a job whose ranks share none.

A sharded checkpoint of two ranks is made in one process with stand-in shard files (as
tests/shell/test_sharded_directory.py does), its manifest naming the ranks sharing each
directory; then the other rank's file is taken out, as on a node that holds only its own
rank's shards. Checked: ``ls`` says the checkpoint is partial and which rank's files are
elsewhere (``--json``: ``here``), ``ls --check`` marks it partial rather than corrupt, and
``verify`` names what is missing here; a file here that is damaged is still corrupt.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pitstop.core.records import NO_CHECKPOINT, Policy, Progress
from pitstop.core.saving.plan import plan_save
from pitstop.core.saving.schedule import Call, ScheduleState, decide_save
from pitstop.core.sharding.shardcover import DIRECTORIES
from pitstop.core.sharding.sharded import ShardedLayout, sharded_name
from pitstop.shell.store.directory import CheckpointDirectory
from pitstop.shell.store.sharddir import file_table


def pitstop(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pitstop", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def save_two_ranks(directory: CheckpointDirectory, step: int) -> None:
    """A sharded checkpoint of ``step`` whose two ranks each wrote one stand-in file."""
    progress = Progress(step=step)
    decision = decide_save(
        directory.policy,
        ScheduleState(timer_start=0.0),
        directory.pointers,
        call=Call.MANUAL,
        progress=progress,
        now=0.0,
    )
    plan = plan_save(
        directory.catalog,
        directory.pointers,
        decision,
        progress=progress,
        policy=directory.policy,
        sharded=True,
    )
    entry = plan.entry
    assert entry is not NO_CHECKPOINT
    temp = directory.sharded_temp(entry)
    (directory.path / temp).mkdir()
    files = []
    for rank in (0, 1):
        (directory.path / temp / f"__{rank}_0.distcp").write_bytes(f"rank {rank}".encode())
        files += file_table(directory.path / temp, [f"__{rank}_0.distcp"], rank)
    layout = ShardedLayout(world_size=2, dcp_version="test", files=tuple(files), values=())
    meta = {DIRECTORIES: [[0], [1]]}
    directory.publish_sharded(plan, entry, layout, {"step": torch.tensor(step)}, meta, temp=temp)


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """Rank 0's node: each checkpoint without rank 1's file."""
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=3)) as directory:
        for step in (2, 4):
            save_two_ranks(directory, step)
    for step in (2, 4):
        (tmp_path / sharded_name(step) / "__1_0.distcp").unlink()
    return tmp_path


def test_ls_says_a_checkpoint_holding_only_this_nodes_shards_is_partial(node: Path) -> None:
    rows = json.loads(pitstop("ls", node, "--json").stdout)
    assert [row["here"] for row in rows] == [
        {"complete": False, "files_here": 1, "files": 2, "missing_ranks": [1]}
    ] * 2
    table = pitstop("ls", node).stdout
    assert table.count("partial: 1 of 2 files (rank 1's elsewhere)") == 2, table
    checked = pitstop("ls", node, "--check", "--json")
    assert [row["check"] for row in json.loads(checked.stdout)] == ["partial", "partial"]
    assert checked.returncode == 1


def test_verify_names_what_is_missing_here_and_a_damaged_file_is_still_corrupt(
    node: Path,
) -> None:
    target = node / sharded_name(4)
    checked = pitstop("verify", target)
    assert checked.returncode == 1
    assert checked.stdout.startswith(
        f"PARTIAL {target}: partial: this directory holds 1 of its 2"
    ), checked.stdout
    assert "missing here: __1_0.distcp (written by rank 1" in checked.stdout, checked.stdout
    (target / "__0_0.distcp").write_bytes(b"rank 9")  # what is here no longer whole
    checked = pitstop("verify", target)
    assert checked.returncode == 1
    assert checked.stdout.startswith(f"CORRUPT {target}"), checked.stdout
    assert "__0_0.distcp fails its checksum" in checked.stdout, checked.stdout


def test_a_whole_directory_lists_every_checkpoint_complete(tmp_path: Path) -> None:
    with CheckpointDirectory(tmp_path, policy=Policy(keep_last=3)) as directory:
        save_two_ranks(directory, 2)
    rows = json.loads(pitstop("ls", tmp_path, "--json").stdout)
    assert rows[0]["here"] == {"complete": True, "files_here": 2, "files": 2, "missing_ranks": []}
    assert "partial" not in pitstop("ls", tmp_path).stdout
