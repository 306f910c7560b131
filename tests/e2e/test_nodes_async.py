"""Background saves (``async_save``) on nodes that share no directory.

Two torchrun agents, each in a mount namespace of its own (tests/nodes.py), run the DDP script
tests/e2e/ddp_loop.py with ``--async-save``: each node's writer writes its node's copy on its own
writer thread. Checked: a SIGTERM to one node's rank stops both, every node holds a whole copy of
every checkpoint, and the resume is bitwise the straight run's; a background write failing on the
other node's writer is a ``SaveError`` on every rank at the next save, before any copy of that
save is written, and the next run resumes bitwise from the copy rank 0 published. Each wait is
bounded; every process is ended when a test ends, passing or not.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from multirank import Job
from nodes import Nodes, can_simulate_nodes
from pitstop.shell.format import fileformat
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available())
    or not can_simulate_nodes(),
    reason="needs gloo, Linux, root and unshare (a mount namespace per simulated node)",
)

SCRIPT = Path(__file__).with_name("ddp_loop.py")
TARGET = 10
STOP_AT = 4
COMPARED = ("model", "ema", "optimizer", "scheduler", "meter", "draws", "progress")
TIMEOUT = 180.0  # seconds any one wait may take (a bound on a hang, never a timing check)


def outputs(out: Path) -> list[dict[str, Any]]:
    return [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(2)]


def steps(directory: Path) -> list[int]:
    """The steps of the checkpoint files in ``directory``, each verified whole."""
    found = []
    for path in sorted(directory.glob("step_*.pitstop")):
        pitstop.verify(path)
        found.append(fileformat.read_manifest(path).meta["progress"]["step"])
    return found


def assert_same_copies(node_dirs: list[Path]) -> None:
    first, second = (d / "ckpt" for d in node_dirs)
    assert steps(first) == steps(second)
    for path in sorted(first.glob("step_*.pitstop")):
        assert_same(pitstop.load(path), pitstop.load(second / path.name), path.name)


_straight: dict[str, Any] = {}


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted 2-rank run (synchronous saves, one directory), once per session."""
    if "run" not in _straight:
        root = tmp_path_factory.mktemp("straight-async-nodes")
        args = ("--dir", root / "ckpt", "--out", root / "out", "--target", str(TARGET))
        with Job(SCRIPT, *args, timeout=TIMEOUT) as job:
            job.wait().check()
        _straight["run"] = outputs(root / "out")
    return _straight["run"]  # type: ignore[no-any-return]


def nodes(root: Path, out: str, *options: str) -> Nodes:
    mount = root / "mnt"
    args = ("--dir", mount / "ckpt", "--out", root / out, "--target", str(TARGET), *options)
    node_dirs = [root / "node0", root / "node1"]
    return Nodes(SCRIPT, *args, node_dirs=node_dirs, mount=mount, timeout=TIMEOUT)


def continues(straight: list[dict[str, Any]], second: list[dict[str, Any]], at: int) -> None:
    assert [r["resumed"]["progress"][0] for r in second] == [at, at]
    for rank, (whole, after) in enumerate(zip(straight, second, strict=True)):
        assert after["batches"] == whole["batches"][at:], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


@pytest.mark.parametrize("mode", ["on", pytest.param("overlap", marks=pytest.mark.slow)])
def test_background_saves_on_each_node_and_a_sigterm_resume_bitwise(
    tmp_path: Path, straight: list[dict[str, Any]], mode: str
) -> None:
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1", "--report", "--async-save", mode)
    with nodes(tmp_path, "first", *hold) as running:
        running[0].wait_for(0, "resumed 0")
        running[1].wait_for(0, "resumed 0")
        index = running.node_of(1)
        running[index].wait_for(0, f"step {STOP_AT}")
        running[index].signal(0, signal.SIGTERM)
        for finished in running.wait(TIMEOUT):
            finished.check()
    first = outputs(tmp_path / "first")
    assert [r["progress"][0] for r in first] == [STOP_AT, STOP_AT]
    assert steps(node_dirs[0] / "ckpt") == [3, STOP_AT]  # every copy published by finish()
    assert_same_copies(node_dirs)
    with nodes(tmp_path, "second", "--async-save", mode) as running:
        for finished in running.wait(TIMEOUT):
            finished.check()
    continues(straight, outputs(tmp_path / "second"), STOP_AT)
    assert steps(node_dirs[1] / "ckpt") == [6, 9, 10]
    assert_same_copies(node_dirs)


@pytest.mark.parametrize(
    ("every", "at", "raised_at", "copies"),
    [
        pytest.param(2, 4, "step 6", [[2], [2, 4]], marks=pytest.mark.slow),  # the next save
        pytest.param(3, 10, "step 10", [[3, 6, 9], [6, 9, 10]], marks=pytest.mark.slow),  # wait
    ],
    ids=["next save", "finish's wait"],
)
def test_a_background_write_failing_on_one_node_raises_on_every_rank_at_the_next_call(
    tmp_path: Path,
    straight: list[dict[str, Any]],
    every: int,
    at: int,
    raised_at: str,
    copies: list[Any],
) -> None:
    node_dirs = [tmp_path / "node0", tmp_path / "node1"]
    options = ("--every", str(every), "--fail-write-at", str(at), "--fault-rank", "1", "--report")
    with nodes(tmp_path, "first", *options, "--async-save", "on") as running:
        finished = running.wait(TIMEOUT)
    for node in finished:  # every rank raised at the same call, and trained no further
        said = [line for line in node.lines(0) if line.startswith("error ")]
        assert said, node.describe()
        assert said[0].startswith("error SaveError"), said
        assert re.search(rf"step\D{{0,3}}0*{at}\b", said[0]), said
        assert raised_at in node.lines(0), node.describe()
        assert f"step {int(raised_at.split()[1]) + 1}" not in node.lines(0), node.describe()
        assert not [line for line in node.lines(0) if line.startswith("finished")], said
    assert sorted(steps(d / "ckpt") for d in node_dirs) == copies  # rank 0's copy published
    with nodes(tmp_path, "second", "--report") as running:
        for node in running.wait(TIMEOUT):
            node.check()
    continues(straight, outputs(tmp_path / "second"), at)
    assert_same_copies(node_dirs)
