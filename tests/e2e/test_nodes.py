"""Nodes that share no directory: two torchrun agents, each in a mount namespace of its own.

The checkpoint path is the same on every rank and a different directory on each node
(tests/nodes.py), as on machines with local disks: no rank sees another node's files. The
DDP script is tests/e2e/ddp_loop.py (2 ranks, one per node). Checked: every node's directory
holds a complete copy of every checkpoint; a SIGTERM to one node's rank stops both and the
resume is bitwise the straight run; a node whose directory was wiped, or holds a corrupt copy,
gets the peer's copy before the resume (of ``last``, or of an explicit path: a path on no node
is one error on every rank naming it); a node killed mid-save leaves a job that resumes from
the newest checkpoint complete somewhere. Each wait is bounded and every process is killed
when a test ends, passing or not.
"""

from __future__ import annotations

import re
import shutil
import signal
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import pitstop
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


@attrs.frozen
class Run:
    """Where a test's nodes keep their files: one directory per node, one mount point."""

    root: Path
    per_node: int = 1

    @property
    def ranks(self) -> int:
        return 2 * self.per_node

    @property
    def mount(self) -> Path:
        return self.root / "mnt"

    def node(self, index: int) -> Path:
        """Node ``index``'s own checkpoint directory, as the test (outside it) sees it."""
        return self.root / f"node{index}" / "ckpt"

    def nodes(self, out: str, *options: str, script: Path = SCRIPT) -> Nodes:
        return Nodes(
            script,
            "--dir",
            self.mount / "ckpt",
            "--out",
            self.root / out,
            *options,
            node_dirs=[self.root / "node0", self.root / "node1"],
            mount=self.mount,
            per_node=self.per_node,
            timeout=TIMEOUT,
        )

    def outputs(self, out: str) -> list[dict[str, Any]]:
        return [fileformat.load(self.root / f"{out}.rank{r}.pitstop") for r in range(self.ranks)]

    def train(self, out: str, *options: str) -> list[dict[str, Any]]:
        with self.nodes(out, "--target", str(TARGET), *options) as nodes:
            for finished in nodes.wait(TIMEOUT):
                finished.check()
        return self.outputs(out)

    def train_and_stop(self, out: str, rank: int = 1, at: int = STOP_AT) -> list[dict[str, Any]]:
        """Run to TARGET, SIGTERM job-wide rank ``rank`` once it printed ``step {at}``."""
        hold = ("--hold-at", str(at), "--hold-rank", str(rank), "--report")
        with self.nodes(out, "--target", str(TARGET), *hold) as nodes:
            nodes[0].wait_for(0, "resumed 0")
            nodes[1].wait_for(0, "resumed 0")
            index, local = nodes.locate(rank)
            nodes[index].wait_for(local, f"step {at}")
            nodes[index].signal(local, signal.SIGTERM)
            for finished in nodes.wait(TIMEOUT):
                finished.check()
                for local in range(self.per_node):  # the save at step 3: as many rounds as on
                    said = finished.lines(local)  # one node (rank 1's plan rides the parts')
                    assert said[said.index("saved 3") + 1] == "save collectives 4", said
        results = self.outputs(out)
        assert [r["progress"][0] for r in results] == [at] * self.ranks
        assert results[rank]["stop_reason"] == "SIGTERM"
        return results


def steps(directory: Path) -> list[int]:
    """The steps of the checkpoint files in ``directory`` (each verified whole)."""
    found = []
    for path in sorted(directory.glob("step_*.pitstop")):
        pitstop.verify(path)
        found.append(fileformat.read_manifest(path).meta["progress"]["step"])
    return found


def assert_same_copies(run: Run) -> None:
    """Both nodes hold the same checkpoints, each copy whole and holding the same tree."""
    assert steps(run.node(0)) == steps(run.node(1))
    for path in sorted(run.node(0).glob("step_*.pitstop")):
        assert_same(pitstop.load(path), pitstop.load(run.node(1) / path.name), path.name)


def assert_continues_exactly(
    straight: list[dict[str, Any]], first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> None:
    for rank, (whole, before, after) in enumerate(zip(straight, first, second, strict=True)):
        assert after["resumed"]["progress"] == before["progress"][:3], rank
        assert before["batches"] + after["batches"] == whole["batches"], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


_straight: dict[str, Any] = {}


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted run on two nodes, once per session: every node holds every copy."""
    if "run" not in _straight:
        run = Run(tmp_path_factory.mktemp("straight-nodes"))
        try:
            results = run.train("out")
            assert steps(run.node(0)) == [6, 9, 10], steps(run.node(0))  # keep_last 3
            assert_same_copies(run)
        except AssertionError as failure:
            _straight["run"] = f"the straight 2-node run failed:\n{failure}"
        else:
            _straight["run"] = results
    value = _straight["run"]
    if isinstance(value, str):
        pytest.fail(value, pytrace=False)
    return value  # type: ignore[no-any-return]


def test_each_node_keeps_a_whole_copy_and_a_sigterm_on_one_node_resumes_bitwise(
    tmp_path: Path, straight: list[dict[str, Any]]
) -> None:
    run = Run(tmp_path)
    first = run.train_and_stop("first", rank=1)
    assert not list(run.mount.iterdir())  # outside the nodes, the shared path stays empty
    assert steps(run.node(0)) == steps(run.node(1)) == [3, STOP_AT]
    assert_same_copies(run)
    second = run.train("second")
    assert_continues_exactly(straight, first, second)
    assert_same_copies(run)


@pytest.mark.parametrize(
    ("wiped", "source"),
    [
        (0, "path"),
        pytest.param(1, "path", marks=pytest.mark.slow),
        pytest.param(0, "last", marks=pytest.mark.slow),
        pytest.param(1, "last", marks=pytest.mark.slow),
    ],
)
def test_a_wiped_node_gets_the_peers_copy_and_resumes_bitwise(
    tmp_path: Path, straight: list[dict[str, Any]], wiped: int, source: str
) -> None:
    run = Run(tmp_path)
    first = run.train_and_stop("first", rank=0)
    shutil.rmtree(run.node(wiped))  # a new machine: nothing of the run on its disk
    explicit = run.mount / "ckpt" / f"step_{STOP_AT:012d}.pitstop"
    nowhere = run.mount / "elsewhere" / "step_000000000002.pitstop"
    options = ("--resume-from", str(explicit), "--try-resume-from", str(nowhere))
    with run.nodes(
        "second", "--target", str(TARGET), *(options if source == "path" else ()), "--log-transfers"
    ) as nodes:
        finished = [node.check() for node in nodes.wait(TIMEOUT)]
    # The copy's bytes took the direct stream between the nodes' writers, not the group.
    said = finished[wiped].outputs[0].splitlines()
    heard = [line for line in said if line.startswith("INFO pitstop.transfer")]
    assert len(heard) == 1, finished[wiped].describe()
    assert heard[0].endswith(f"{explicit.name} from rank {1 - wiped} over a direct stream"), heard
    if source == "path":  # first a path on none
        for node in finished:  # the same error on every rank, naming the path and each node
            said = [line for line in node.lines(0) if line.startswith("resume error ")]
            assert len(said) == 1, node.describe()
            assert said[0].startswith("resume error CheckpointNotFound"), said
            for named in (str(nowhere), "no node holds", "rank 0's node", "rank 1's node"):
                assert named in said[0], said
    second = run.outputs("second")  # the wiped node's rank read the copy it was sent
    assert_continues_exactly(straight, first, second)
    # The wiped node got the checkpoint it resumed from, then saved the rest itself.
    assert steps(run.node(wiped)) == [STOP_AT, 6, 9, 10][-3:]
    assert_same_copies(run)


def test_a_corrupt_copy_on_one_node_is_fetched_again_from_the_peer(
    tmp_path: Path, straight: list[dict[str, Any]]
) -> None:
    run = Run(tmp_path)
    first = run.train_and_stop("first", rank=1)
    newest = run.node(1) / f"step_{STOP_AT:012d}.pitstop"
    manifest = fileformat.read_manifest(newest)
    assert "weights.raw" in manifest.tensor_paths[0][0], manifest.tensor_paths[0]
    data = bytearray(newest.read_bytes())
    data[manifest.blobs[manifest.tensors[0].blob].offset + 1] ^= 0xFF  # in the model's weights
    newest.write_bytes(bytes(data))
    with pytest.raises(pitstop.CheckpointCorrupt):
        pitstop.verify(newest)
    with run.nodes("second", "--target", str(TARGET)) as nodes:
        finished = [node.check() for node in nodes.wait(TIMEOUT)]
    said = "".join(node.outputs[0] for node in finished)  # rank 0 warns, on its node
    assert re.search(rf"{newest.name} does not verify in rank \d's directory", said), said
    assert_continues_exactly(straight, first, run.outputs("second"))  # from STOP_AT, not 3


def test_a_node_killed_mid_save_resumes_from_the_newest_copy_complete_somewhere(
    tmp_path: Path, straight: list[dict[str, Any]]
) -> None:
    run = Run(tmp_path)
    hang_at = 5
    options = ("--target", str(TARGET), "--every", "1", "--report", "--hang-write-at", str(hang_at))
    with run.nodes("first", *options) as nodes:
        nodes[0].wait_for(0, "resumed 0")
        nodes[1].wait_for(0, "resumed 0")
        index = nodes.node_of(0)  # rank 0's write hangs half-way (ddp_loop's hook)
        nodes[index].wait_for(0, f"writing {hang_at}")
        nodes.kill(index)
    # Leaving the block killed the other node too, wherever it was: its own copy of step 5
    # may be whole (published before the kill) or not.
    other = 1 - index
    assert max(steps(run.node(index))) == hang_at - 1
    newest = max(steps(run.node(other)))
    assert newest in (hang_at - 1, hang_at)
    second = run.train("second", "--report")
    assert [r["resumed"]["progress"][0] for r in second] == [newest, newest]
    for rank, (whole, after) in enumerate(zip(straight, second, strict=True)):
        assert after["batches"] == whole["batches"][newest:], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")
    assert_same_copies(run)


def test_a_write_failing_on_one_node_raises_on_every_rank_and_the_other_copy_resumes(
    tmp_path: Path, straight: list[dict[str, Any]]
) -> None:
    run = Run(tmp_path)
    options = ("--target", str(TARGET), "--every", "2", "--fail-write-at", "4", "--report")
    with run.nodes("first", *options, "--fault-rank", "1") as nodes:
        finished = nodes.wait(TIMEOUT)
    for node in finished:  # every rank raised at the same call, and trained no further
        said = [line for line in node.lines(0) if line.startswith("error ")]
        assert said, node.describe()
        assert said[0].startswith("error SaveError"), said
        assert re.search(r"step\D{0,3}0*4\b", said[0]), said
        assert "step 5" not in node.lines(0), node.describe()
    copies = sorted([steps(run.node(0)), steps(run.node(1))])
    assert copies == [[2], [2, 4]], copies  # rank 0's copy of step 4 was published
    second = run.train("second", "--report")
    assert [r["resumed"]["progress"][0] for r in second] == [4, 4]
    for rank, (whole, after) in enumerate(zip(straight, second, strict=True)):
        assert after["batches"] == whole["batches"][4:], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")
    assert_same_copies(run)
