"""Several ranks with a remote tier (``remote="s3://..."``), against a real S3 server on loopback.

Two nodes that share no directory (two torchrun agents, each in a mount namespace of its own:
tests/nodes.py), and two ranks sharing one directory (tests/multirank.py), run the DDP script
tests/e2e/ddp_loop.py with a remote tier on SeaweedFS (tests/s3server.py; its AWS environment
reaches every rank through the inherited environment). Checked: rank 0 alone uploads, once per
checkpoint, and no upload fails; a node whose directory is gone while the other node's copy of
the newest checkpoint is damaged (or gone too) takes it from the remote tier, and the resume is
bitwise the straight run's; two ranks sharing a directory that was deleted resume bitwise from
the remote tier, on every rank; two ranks saving straight to an ``s3://`` prefix pause on a
SIGTERM and resume bitwise. FSDP2 on the two nodes (tests/e2e/sharded_nodes_loop.py) with a
remote tier: every node's writer uploads its rank's shards and rank 0 commits each checkpoint,
whose files are the nodes' own bytes; a node wiped while the tier lacks the newest step resumes
the step before bitwise, the wiped node downloading only the manifest, DCP's metadata and its
lost shard; both wiped (``-m slow``) resume bitwise from it, and so does a run on the prefix.
Each wait is bounded; every process and the server are ended when a test ends, passing or not.
"""

from __future__ import annotations

import json
import re
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
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.sharddir import file_table
from pitstop.shell.store.shardobjects import download_sharded
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


SHARDED = Path(__file__).with_name("sharded_nodes_loop.py")  # FSDP2, two ranks
SHARDED_TARGET = 6  # saves at 2, 4, 6; the remote tier keeps the last 2
SHARDED_COMPARED = ("local", "full", "param_groups", "schedule", "draws")


def sharded_nodes(root: Path, url: str, out: str, *options: str) -> Nodes:
    """The FSDP2 loop on two nodes sharing no directory, with the remote tier ``url``."""
    mount = root / "mnt"
    args = ("--dir", mount / "ckpt", "--out", root / out, "--remote", url, *options)
    node_dirs = [root / "node0", root / "node1"]
    return Nodes(SHARDED, *args, node_dirs=node_dirs, mount=mount, timeout=TIMEOUT)


def sharded_run(root: Path, url: str, out: str = "first", target: int = SHARDED_TARGET) -> str:
    """Train to ``target`` on the nodes; what they printed."""
    with sharded_nodes(root, url, out, "--target", str(target)) as running:
        finished = [node.check() for node in running.wait(TIMEOUT)]
    return "".join(node.outputs[0] for node in finished)


def remote_files(url: str, step: int, into: Path) -> list[str]:
    """The files of the remote tier's checkpoint of ``step``, downloaded (each checked)."""
    storage = ObjectStorage(url)
    try:
        download_sharded(storage, f"step_{step:012d}", into, file_table)
    finally:
        storage.close()
    return sorted(p.name for p in into.iterdir())


def took_from_the_tier(said: str, step: int) -> list[str]:
    """What a node's writer said it downloaded of ``step`` from the remote tier."""
    name = f"step_{step:012d}"
    lines = [line for line in said.splitlines() if f" of {name} from the remote tier " in line]
    assert len(lines) == 1, said
    took = lines[0].split("resume takes ", 1)[1].split(f" of {name} from", 1)[0]
    return [] if took.startswith("nothing") else took.split(", ")


@needs_nodes
def test_sharded_state_on_nodes_is_uploaded_by_every_node_and_committed_by_rank_0(
    tmp_path: Path, url: str
) -> None:
    """FSDP2 on two nodes that share no directory, with a remote tier: each node's writer
    uploads its own rank's shards, rank 0 commits each checkpoint once every file is listed,
    and the remote tier keeps its last two; each committed file is byte for byte the copy on
    the node that wrote it. Then node 1 is wiped and the tier lacks the newest step (never
    uploaded): step 6 is skipped, naming the lost shards, and step 4 is complete with the
    tier's help — node 1 downloads only the manifest, DCP's metadata and the shard it lost,
    node 0 nothing — and the run goes on from it to the same state bitwise."""
    no_failed_upload(sharded_run(tmp_path, url))
    assert remote_steps(url) == [4, SHARDED_TARGET]
    for step in (4, SHARDED_TARGET):
        name, got = f"step_{step:012d}", tmp_path / f"remote-{step}"
        files = remote_files(url, step, got)
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.pitstop"]
        for file in files:  # the node holding a file holds it as uploaded
            held = [d / "ckpt" / name / file for d in (tmp_path / "node0", tmp_path / "node1")]
            there = [p for p in held if p.is_file()]
            assert there, f"{file} of {name} is on no node"
            if file != "manifest.pitstop":  # each node's manifest is its own copy
                assert all(p.read_bytes() == (got / file).read_bytes() for p in there), file
    shutil.rmtree(tmp_path / "node1" / "ckpt")  # a new machine
    kept = {p.name for p in (tmp_path / "node0" / "ckpt" / "step_000000000004").iterdir()}
    lost = {f for f in files if f not in kept}  # node 1's alone (one rank's shard among them)
    assert len([f for f in lost if f.endswith(".distcp")]) == 1, kept
    storage = ObjectStorage(url)
    try:
        storage.delete(f"step_{SHARDED_TARGET:012d}")  # its commit: the tier lacks step 6
    finally:
        storage.close()
    with sharded_nodes(tmp_path, url, "second", "--target", str(SHARDED_TARGET)) as running:
        said = [node.check().outputs[0] for node in running.wait(TIMEOUT)]
    leads = ["each takes what it lacks of it from the remote tier" in s for s in said]
    assert sum(leads) == 1, said  # rank 0 alone says so: its node is rank 0's in this run
    homes = {"__0_0.distcp": leads.index(True), "__1_0.distcp": leads.index(False)}
    assert "resume skips step 6 (step_000000000006)" in said[0] + said[1], said
    every = {".metadata", "manifest.pitstop"}
    for index, files_here in enumerate((kept, set())):  # what each node lacks and no node has
        lacks = (every - files_here) | {f for f in lost - every if homes[f] == index}
        assert took_from_the_tier(said[index], 4) == sorted(lacks), (index, said[index])
    for rank, (before, after) in enumerate(
        zip(outputs(tmp_path / "first"), outputs(tmp_path / "second"), strict=True)
    ):
        assert after["resumed"] == 4, rank
        for key in SHARDED_COMPARED:
            assert_same(before[key], after[key], f"rank {rank} {key}")
    assert remote_steps(url) == [4, SHARDED_TARGET]


@needs_nodes
@pytest.mark.slow  # two node jobs: ~30 s (without a tier: tests/e2e/test_nodes_sharded.py)
def test_shards_lost_on_every_node_and_absent_from_the_remote_tier_are_one_error_naming_them(
    tmp_path: Path, url: str
) -> None:
    """Node 1 wiped (its rank's shards on no node now) and every commit of the remote tier
    deleted: no checkpoint is complete on the nodes or in the tier, and the resume is one
    ``CheckpointCorrupt`` on every rank naming each step and the lost shard — never a fresh
    start, never a wait."""
    no_failed_upload(sharded_run(tmp_path, url))
    node1 = tmp_path / "node1" / "ckpt"
    lost = {p.name for p in node1.glob("step_*/__*.distcp")}
    assert len(lost) == 1, lost  # one rank per node: its shard of every step
    kept = sorted(int(p.name[5:]) for p in (tmp_path / "node0" / "ckpt").glob("step_*"))
    assert kept == [2, 4, SHARDED_TARGET], kept
    shutil.rmtree(node1)  # a new machine
    storage = ObjectStorage(url)
    try:
        for step in remote_steps(url):
            storage.delete(f"step_{step:012d}")  # its commit: the tier lacks it
    finally:
        storage.close()
    assert remote_steps(url) == []
    with sharded_nodes(tmp_path, url, "second", "--target", str(SHARDED_TARGET)) as running:
        finished = running.wait(TIMEOUT)
    (shard,) = lost
    for node in finished:  # every rank, the same error
        said = [line for line in node.lines(0) if line.startswith("error ")]
        assert len(said) == 1, node.describe()
        assert said[0].startswith("error CheckpointCorrupt"), said
        message = json.loads(said[0].split(" ", 2)[2])
        assert "no checkpoint is complete across the nodes' directories" in message, message
        for step in kept:
            assert re.search(rf"step {step} \(step_{step:012d}\): [^;]*{shard}", message), message
        assert not [line for line in node.lines(0) if line.startswith("resumed")], said
    assert not node1.exists() or not list(node1.glob("step_*")), "nothing was made up"


def resume_from_the_tier(tmp_path: Path, url: str, wiped: tuple[int, ...]) -> None:
    """Wipe the nodes ``wiped``; the nodes resume SHARDED_TARGET from the remote tier (rank 1's
    shards on no node), bitwise the state the first run ended in; each node's ``last`` on it."""
    for index in wiped:
        shutil.rmtree(tmp_path / f"node{index}" / "ckpt")
    with sharded_nodes(tmp_path, url, "second", "--target", str(SHARDED_TARGET)) as running:
        said = "".join(node.check().outputs[0] for node in running.wait(TIMEOUT))
    assert "each takes what it lacks of it from the remote tier" in said, said
    for rank, (before, after) in enumerate(
        zip(outputs(tmp_path / "first"), outputs(tmp_path / "second"), strict=True)
    ):
        assert after["resumed"] == SHARDED_TARGET, rank
        for key in SHARDED_COMPARED:
            assert_same(before[key], after[key], f"rank {rank} {key}")
    for node in ("node0", "node1"):
        last = tmp_path / node / "ckpt" / "last"
        assert last.resolve().name == f"step_{SHARDED_TARGET:012d}", node


@needs_nodes
@pytest.mark.slow  # two node jobs: ~30 s
@pytest.mark.parametrize("wiped", [(0, 1)], ids=["both nodes"])  # one node: by default, above
def test_sharded_nodes_wiped_resume_bitwise_from_the_remote_tier_and_so_does_the_prefix(
    tmp_path: Path, url: str, wiped: tuple[int, ...]
) -> None:
    """A node wiped (rank 1's shards on no node) or both: every node's writer takes the remote
    tier's newest checkpoint into its directory and the resume is bitwise; a 2-rank run on the
    ``s3://`` prefix itself resumes from it bitwise too."""
    sharded_run(tmp_path, url)
    resume_from_the_tier(tmp_path, url, wiped=wiped)
    args = ("--dir", url, "--out", tmp_path / "third", "--target", str(SHARDED_TARGET))
    with Job(SHARDED, *args, env={"TMPDIR": str(tmp_path)}, timeout=TIMEOUT) as job:
        job.wait().check()
    for rank, (before, after) in enumerate(
        zip(outputs(tmp_path / "first"), outputs(tmp_path / "third"), strict=True)
    ):
        assert after["resumed"] == SHARDED_TARGET, rank
        for key in SHARDED_COMPARED:
            assert_same(before[key], after[key], f"rank {rank} {key}")


@needs_nodes
@pytest.mark.slow
def test_sharded_nodes_resumed_with_a_remote_tier_go_on_uploading_in_the_background(
    tmp_path: Path, url: str
) -> None:
    """Resumed on the same nodes (the remote tier's catch-up on every node's writer) and saving
    in the background (``async_save``): each later checkpoint is committed with both ranks'
    shards, none fails, and the remote tier keeps its last two."""
    no_failed_upload(sharded_run(tmp_path, url, target=4))
    assert remote_steps(url) == [2, 4]
    with sharded_nodes(tmp_path, url, "second", "--target", "8", "--async-save", "on") as running:
        said = "".join(node.check().outputs[0] for node in running.wait(TIMEOUT))
    no_failed_upload(said)
    assert "resumed 4" in said, said
    assert remote_steps(url) == [6, 8]
    for step in (6, 8):
        files = remote_files(url, step, tmp_path / f"remote-{step}")
        assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.pitstop"]
