"""Several ranks with a remote tier (``remote="s3://..."``), against a real S3 server on loopback.

Two nodes that share no directory (two torchrun agents, each in a mount namespace of its own:
tests/nodes.py), and two ranks sharing one directory (tests/multirank.py), run the DDP script
tests/e2e/ddp_loop.py with a remote tier on SeaweedFS (tests/s3server.py; its AWS environment
reaches every rank through the inherited environment). Checked: rank 0 alone uploads, once per
checkpoint, and no upload fails; a node whose directory is gone while the other node's copy of
the newest checkpoint is damaged (or gone too) takes it from the remote tier, and the resume is
bitwise the straight run's; two ranks sharing a directory that was deleted resume bitwise from
the remote tier, on every rank; two ranks saving straight to an ``s3://`` prefix pause on a
SIGTERM and resume bitwise. Each wait is bounded; every process and the server are ended
when a test ends, passing or not.
"""

from __future__ import annotations

import shutil
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import pitstop
from multirank import Job
from nodes import Nodes, can_simulate_nodes
from pitstop.shell.format import fileformat
from s3server import BUCKET, S3Server, remote_steps
from trees import assert_same

pytest.importorskip("obstore", reason="the s3 extra: pip install pitstop[s3]")
pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="needs gloo",
)
needs_nodes = pytest.mark.skipif(
    not can_simulate_nodes(), reason="needs Linux, root and unshare (a mount namespace per node)"
)

SCRIPT = Path(__file__).with_name("ddp_loop.py")
TARGET = 10
STOP_AT = 4
COMPARED = ("model", "ema", "optimizer", "scheduler", "meter", "draws", "progress")
TIMEOUT = 180.0  # seconds any one wait may take (a bound on a hang, never a timing check)


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server.start(tmp_path_factory.mktemp("s3"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def url(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix of the test bucket; the server's AWS environment set for every child."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


def outputs(out: Path, ranks: int = 2) -> list[dict[str, Any]]:
    return [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(ranks)]


def local_steps(directory: Path) -> list[int]:
    """The steps of the checkpoint files in ``directory``, each verified whole."""
    found = []
    for path in sorted(directory.glob("step_*.pitstop")):
        pitstop.verify(path)
        found.append(fileformat.read_manifest(path).meta["progress"]["step"])
    return found


def flip_a_weight(path: Path) -> None:
    """Flip one byte of the model's weights in checkpoint ``path`` (it no longer verifies)."""
    manifest = fileformat.read_manifest(path)
    data = bytearray(path.read_bytes())
    data[manifest.blobs[manifest.tensors[0].blob].offset + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(pitstop.CheckpointCorrupt):
        pitstop.verify(path)


def assert_continues_exactly(
    straight: list[dict[str, Any]], first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> None:
    for rank, (whole, before, after) in enumerate(zip(straight, first, second, strict=True)):
        assert after["resumed"]["progress"] == before["progress"][:3], rank
        assert before["batches"] + after["batches"] == whole["batches"], f"rank {rank} batches"
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


def no_failed_upload(text: str) -> None:
    """No rank logged a failed upload (a second uploader would lose the prefix's lease)."""
    assert "upload of step" not in text, text


_straight: dict[str, Any] = {}


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted 2-rank run, once per session (where the checkpoints live does not
    change what the ranks train)."""
    if "run" not in _straight:
        root = tmp_path_factory.mktemp("straight-tiers")
        args = ("--dir", root / "ckpt", "--out", root / "out", "--target", str(TARGET))
        with Job(SCRIPT, *args, timeout=TIMEOUT) as job:
            job.wait().check()
        _straight["run"] = outputs(root / "out")
    return _straight["run"]  # type: ignore[no-any-return]


@needs_nodes
@pytest.mark.parametrize("lost", ["damaged", pytest.param("gone", marks=pytest.mark.slow)])
def test_a_node_without_the_checkpoint_and_no_peer_holding_it_resumes_from_the_remote_tier(
    tmp_path: Path, url: str, straight: list[dict[str, Any]], lost: str
) -> None:
    mount, node_dirs = tmp_path / "mnt", [tmp_path / "node0", tmp_path / "node1"]

    def nodes(out: str, *options: str) -> Nodes:
        args = ("--dir", mount / "ckpt", "--out", tmp_path / out, "--remote", url, *options)
        return Nodes(SCRIPT, *args, node_dirs=node_dirs, mount=mount, timeout=TIMEOUT)

    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1", "--report")
    with nodes("first", "--target", str(TARGET), *hold) as running:
        running[0].wait_for(0, "resumed 0")
        running[1].wait_for(0, "resumed 0")
        index = running.node_of(1)
        running[index].wait_for(0, f"step {STOP_AT}")
        running[index].signal(0, signal.SIGTERM)
        said = "".join(n.check().outputs[0] for n in running.wait(TIMEOUT))
    no_failed_upload(said)
    first = outputs(tmp_path / "first")
    assert [r["progress"][0] for r in first] == [STOP_AT, STOP_AT]
    assert remote_steps(url) == [3, STOP_AT]  # each checkpoint uploaded once, by rank 0
    newest = f"step_{STOP_AT:012d}.pitstop"
    shutil.rmtree(node_dirs[0] / "ckpt")  # a new machine on node 0
    if lost == "damaged":
        flip_a_weight(node_dirs[1] / "ckpt" / newest)  # and the peer's copy is no good
    else:
        shutil.rmtree(node_dirs[1] / "ckpt")  # both machines replaced
    with nodes("second", "--target", str(TARGET)) as running:
        said = "".join(n.check().outputs[0] for n in running.wait(TIMEOUT))
    no_failed_upload(said)
    second = outputs(tmp_path / "second")
    assert_continues_exactly(straight, first, second)  # from 4, not 3
    # A node that took it from the remote tier wrote its pointers at once, as a save would.
    assert [r["resumed"]["last"] for r in second] == [newest, newest]
    for node in node_dirs:  # every node took step 4 from the remote tier, then saved the rest
        assert local_steps(node / "ckpt") == [STOP_AT, 6, 9, 10][-3:]
    assert remote_steps(url) == [STOP_AT, 6, 9, 10][-3:]


@pytest.mark.slow  # several ranks reading rank 0's fetch by default: the s3:// prefix test below
def test_ranks_sharing_a_deleted_directory_resume_bitwise_from_the_remote_tier(
    tmp_path: Path, url: str, straight: list[dict[str, Any]]
) -> None:
    directory = tmp_path / "ckpt"

    def job(out: str, *options: str) -> Job:
        args = ("--dir", directory, "--out", tmp_path / out, "--remote", url)
        return Job(SCRIPT, *args, "--target", str(TARGET), *options, timeout=TIMEOUT)

    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1", "--report")
    with job("first", *hold) as running:
        running.wait_for(0, "resumed 0")
        running.wait_for(1, "resumed 0")
        running.wait_for(1, f"step {STOP_AT}")
        running.signal(1, signal.SIGTERM)
        finished = running.wait().check()
    no_failed_upload("".join(finished.outputs.values()))
    first = outputs(tmp_path / "first")
    assert remote_steps(url) == [3, STOP_AT]
    shutil.rmtree(directory)  # the shared disk is gone
    with job("second") as running:
        finished = running.wait().check()
    no_failed_upload("".join(finished.outputs.values()))
    assert_continues_exactly(straight, first, outputs(tmp_path / "second"))
    assert local_steps(directory) == [STOP_AT, 6, 9, 10][-3:]


def test_two_ranks_on_an_s3_prefix_pause_and_resume_bitwise(
    tmp_path: Path, url: str, straight: list[dict[str, Any]]
) -> None:
    """No local directory at all: both ranks' Checkpointer on ``url``; rank 1 reads the
    checkpoint rank 0 fetched (a file of rank 0's cache, not memory only rank 0 can see)."""

    def job(out: str, *options: str) -> Job:
        args = ("--dir", url, "--out", tmp_path / out, "--target", str(TARGET))
        return Job(SCRIPT, *args, *options, env={"TMPDIR": str(tmp_path)}, timeout=TIMEOUT)

    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1", "--report")
    with job("first", *hold) as running:
        running.wait_for(1, f"step {STOP_AT}")
        running.signal(1, signal.SIGTERM)
        running.wait().check()
    assert remote_steps(url) == [3, STOP_AT]
    with job("second") as running:
        running.wait().check()
    assert_continues_exactly(straight, outputs(tmp_path / "first"), outputs(tmp_path / "second"))
    assert remote_steps(url) == [STOP_AT, 6, 9, 10][-3:]
    assert not list(tmp_path.glob("pitstop-s3-*")), "every rank's cache is removed at close"


@needs_nodes
@pytest.mark.parametrize(
    "paused", ["on one machine", pytest.param("on nodes", marks=pytest.mark.slow)]
)
def test_two_nodes_resume_bitwise_straight_from_an_s3_prefix(
    tmp_path: Path, url: str, straight: list[dict[str, Any]], paused: str
) -> None:
    """No local directory, and no temp directory shared: each node's ranks have their caches
    in the node's own directory (TMPDIR), so the rank on the other node than rank 0 reads the
    checkpoint it fetched itself, never rank 0's cache. The run paused by a SIGTERM ran on one
    machine (by default: one node job less) or on the two nodes too."""
    mount, node_dirs = tmp_path / "mnt", [tmp_path / "node0", tmp_path / "node1"]
    env = {"TMPDIR": str(mount)}

    def nodes(out: str, *options: str) -> Nodes:
        args = ("--dir", url, "--out", tmp_path / out, "--target", str(TARGET), *options)
        return Nodes(SCRIPT, *args, node_dirs=node_dirs, mount=mount, env=env, timeout=TIMEOUT)

    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1", "--report")
    if paused == "on nodes":
        with nodes("first", *hold) as running:
            running[0].wait_for(0, "resumed 0")
            running[1].wait_for(0, "resumed 0")
            index = running.node_of(1)
            running[index].wait_for(0, f"step {STOP_AT}")
            running[index].signal(0, signal.SIGTERM)
            for node in running.wait(TIMEOUT):
                node.check()
    else:
        args = ("--dir", url, "--out", tmp_path / "first", "--target", str(TARGET), *hold)
        with Job(SCRIPT, *args, env={"TMPDIR": str(tmp_path)}, timeout=TIMEOUT) as job:
            job.wait_for(1, f"step {STOP_AT}")
            job.signal(1, signal.SIGTERM)
            job.wait().check()
    assert remote_steps(url) == [3, STOP_AT]
    with nodes("second") as running:  # rank 1 cannot open rank 0's fetch: it fetches its own
        for node in running.wait(TIMEOUT):
            node.check()
    assert_continues_exactly(straight, outputs(tmp_path / "first"), outputs(tmp_path / "second"))
    assert remote_steps(url) == [STOP_AT, 6, 9, 10][-3:]
    for node in node_dirs:
        assert not list(node.glob("pitstop-s3-*")), "every rank's cache is removed at close"
