"""Sharded state (FSDP2) on nodes that share no directory: each node keeps its ranks' shards.

Two torchrun agents, one rank each, each in a mount namespace of its own (tests/nodes.py): the
checkpoint path is the same on both ranks and a different directory on each node. The loop is
tests/e2e/sharded_nodes_loop.py. Checked: each node's directory holds a manifest and the shard
files its rank wrote (``pitstop ls`` there says the checkpoint is partial, and which ranks hold
the rest); a SIGTERM to one rank stops both and the resume — each node fetching from the other
the files its rank reads and lacks — continues bitwise as the straight run; with one node's
directory wiped, the shards its rank wrote are lost everywhere and the resume is an error
naming the steps and the missing files; a corrupt shard on one node makes the resume fall back
to the previous checkpoint, with a warning naming the step and the file (rank 1's node by
default, rank 0's under ``-m slow``); a corrupt manifest on one node is fetched from the
other (``-m slow``); a node killed mid-save (its writer in the manifest write) leaves a job that
resumes bitwise from the newest checkpoint complete across the nodes (``-m slow``). The stopped
run is made once and copied for each test. Every wait is bounded; every process is killed when a
test ends, passing or not.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from nodes import Nodes, can_simulate_nodes
from pitstop.shell.format import fileformat
from pitstop.shell.store.sharddir import read_layout
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available())
    or not can_simulate_nodes(),
    reason="needs gloo, Linux, root and unshare (a mount namespace per simulated node)",
)

SCRIPT = Path(__file__).with_name("sharded_nodes_loop.py")
TARGET = 8
STOP_AT = 3  # saves at 2 (the interval) and 3 (the stop)
TIMEOUT = 240.0  # seconds any one wait may take (a bound on a hang, never a timing check)
COMPARED = ("local", "full", "param_groups", "schedule", "draws")


def name(step: int) -> str:
    return f"step_{step:012d}"


@attrs.frozen
class Run:
    """Where a test's nodes keep their files: one directory per node, one mount point."""

    root: Path

    @property
    def mount(self) -> Path:
        return self.root / "mnt"

    def node(self, index: int) -> Path:
        """Node ``index``'s own checkpoint directory, as the test (outside it) sees it."""
        return self.root / f"node{index}" / "ckpt"

    def nodes(self, out: str, *options: str) -> Nodes:
        return Nodes(
            SCRIPT,
            "--dir",
            self.mount / "ckpt",
            "--out",
            self.root / out,
            "--target",
            str(TARGET),
            *options,
            node_dirs=[self.root / "node0", self.root / "node1"],
            mount=self.mount,
            timeout=TIMEOUT,
        )

    def outputs(self, out: str) -> list[dict[str, Any]]:
        return [fileformat.load(self.root / f"{out}.rank{r}.pitstop") for r in range(2)]

    def train(self, out: str, *options: str) -> tuple[list[dict[str, Any]], str]:
        """Run to TARGET; every rank's result and what every node printed."""
        with self.nodes(out, *options) as nodes:
            finished = [node.check() for node in nodes.wait(TIMEOUT)]
        return self.outputs(out), "".join(node.outputs[0] for node in finished)

    def fail(self, out: str) -> list[str]:
        """Run a job whose resume must fail; each rank's ``error`` line."""
        with self.nodes(out) as nodes:
            finished = nodes.wait(TIMEOUT)
        said = []
        for node in finished:
            errors = [line for line in node.lines(0) if line.startswith("error ")]
            assert errors, node.describe()
            said.append(errors[0])
        return said

    def holder(self, rank: int) -> int:
        """The node whose directory holds the shard file rank ``rank`` wrote."""
        found = [i for i in (0, 1) if list(self.node(i).glob(f"step_*/__{rank}_0.distcp"))]
        assert len(found) == 1, found
        return found[0]


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pitstop", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def ls_json(directory: Path) -> list[dict[str, Any]]:
    done = cli("ls", directory, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


_cache: dict[str, Any] = {}


def _once(key: str, make: Any) -> Any:
    """``make()`` once per session; its failure fails every test that needs it."""
    if key not in _cache:
        try:
            _cache[key] = make()
        except (AssertionError, Exception) as failure:
            _cache[key] = f"{key} failed:\n{failure}"
    value = _cache[key]
    if isinstance(value, str):
        pytest.fail(value, pytrace=False)
    return value


@pytest.fixture
def straight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The uninterrupted FSDP2 run on two nodes (each rank's result)."""
    return _once("straight", lambda: Run(tmp_path_factory.mktemp("straight")).train("out")[0])  # type: ignore[no-any-return]


def _stop(root: Path) -> tuple[Path, list[dict[str, Any]]]:
    run = Run(root)
    hold = ("--hold-at", str(STOP_AT), "--hold-rank", "1")
    with run.nodes("first", *hold) as nodes:
        nodes[0].wait_for(0, "resumed 0")
        nodes[1].wait_for(0, "resumed 0")
        index, local = nodes.locate(1)
        nodes[index].wait_for(local, f"step {STOP_AT}")
        nodes[index].signal(local, signal.SIGTERM)
        for finished in nodes.wait(TIMEOUT):
            finished.check()
    results = run.outputs("first")
    assert [r["progress"] for r in results] == [STOP_AT, STOP_AT]
    assert results[1]["stop_reason"] == "SIGTERM"
    return root, results


@pytest.fixture
def stopped(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> tuple[Run, list[Any]]:
    """A run stopped by a SIGTERM at STOP_AT (made once), copied into this test's directory."""
    root, results = _once("stopped", lambda: _stop(tmp_path_factory.mktemp("stopped")))
    for i in (0, 1):
        shutil.copytree(root / f"node{i}", tmp_path / f"node{i}", symlinks=True)
    return Run(tmp_path), results


def assert_continues_exactly(
    straight: list[dict[str, Any]], second: list[dict[str, Any]], resumed: int
) -> None:
    for rank, (whole, after) in enumerate(zip(straight, second, strict=True)):
        assert after["resumed"] == resumed, rank
        assert after["progress"] == TARGET, rank
        for key in COMPARED:
            assert_same(whole[key], after[key], f"rank {rank} {key}")


def test_each_node_keeps_its_shards_and_a_sigterm_resumes_bitwise(
    stopped: tuple[Run, list[Any]], straight: list[dict[str, Any]]
) -> None:
    run, _ = stopped
    for rank in (0, 1):  # each node: the manifest and its own rank's shards, never the other's
        here = run.node(run.holder(rank)) / name(STOP_AT)
        assert (here / "manifest.pitstop").is_file()
        assert not (here / f"__{1 - rank}_0.distcp").exists()
        rows = {row["step"]: row for row in ls_json(run.node(run.holder(rank)))}
        assert sorted(rows) == [2, STOP_AT]
        part = rows[STOP_AT]["here"]
        assert part["complete"] is False, part
        assert part["missing_ranks"] == [1 - rank], part
        assert 0 < part["files_here"] < part["files"], part
        checks = json.loads(cli("ls", run.node(run.holder(rank)), "--check", "--json").stdout)
        assert [row["check"] for row in checks] == ["partial", "partial"], checks
        table = cli("ls", run.node(run.holder(rank))).stdout
        assert f"partial: {part['files_here']} of {part['files']} files" in table, table
        checked = cli("verify", here)  # what is missing here, not a generic corruption
        assert checked.returncode == 1, checked.stdout
        assert f"PARTIAL {here}: partial: this directory holds" in checked.stdout, checked.stdout
        missing = rf"missing here: [^(]*__{1 - rank}_0\.distcp \(written by rank {1 - rank}\b"
        assert re.search(missing, checked.stdout), checked.stdout
    # Resumed with saves in the background; rank 1's write of its step-6 shards fails.
    failing = ("--async-save", "on", "--fail-shards-at", "6", "--fail-rank", "1")
    second, said = run.train("second", *failing)
    assert_continues_exactly(straight, second, STOP_AT)
    errors = [
        json.loads(line[len("save error ") :]) for line in said.splitlines() if "save e" in line
    ]
    assert len(errors) == 2, said  # raised once on each rank, at a later call, and undone
    for error in errors:
        assert "background save of step 6" in error, error
        assert "injected on rank 1" in error, error
    for node in (0, 1):  # retention and pointers on each node as on the other (keep_last 3)
        held = sorted(p.name for p in run.node(node).iterdir() if p.name.startswith("step_"))
        assert held == [name(STOP_AT), name(4), name(TARGET)], held
        assert (run.node(node) / "last").resolve().name == name(TARGET)
        assert not list(run.node(node).glob(".tmp-*")), "the failed save's temp is gone"
    for step in (4, TARGET):  # in the background too, each node holds its own rank's shards
        held = [{p.name for p in (run.node(n) / name(step)).glob("__*.distcp")} for n in (0, 1)]
        assert sorted(held, key=sorted) == [{"__0_0.distcp"}, {"__1_0.distcp"}], held
        assert all((run.node(n) / name(step) / "manifest.pitstop").is_file() for n in (0, 1))
        for node in (0, 1):  # each copy's manifest names the ranks sharing each directory
            meta = read_layout(run.node(node) / name(step))[1]
            assert sorted(meta["directories"]) == [[0], [1]], meta.get("directories")
    # A node fetched a file its rank reads and lacks (DCP stores a replicated value once).
    assert re.search(r"directory lacks __\d_0\.distcp of " + name(STOP_AT), said), said


@pytest.mark.parametrize("source", ["path", pytest.param("last", marks=pytest.mark.slow)])
def test_a_wiped_node_whose_shards_the_other_node_holds_catches_up_and_resumes_bitwise(
    stopped: tuple[Run, list[Any]], straight: list[dict[str, Any]], source: str
) -> None:
    """``path``: ``resume(<dir>/step_000000000003)``, a path the wiped node lacks; ``last``:
    ``resume()``."""
    run, _ = stopped
    wiped, kept = run.holder(1), run.holder(0)
    shard = f"{name(STOP_AT)}/__1_0.distcp"  # the other node holds rank 1's shards too
    shutil.copy2(run.node(wiped) / shard, run.node(kept) / shard)
    shutil.rmtree(run.node(wiped))  # a new machine
    explicit = str(run.mount / "ckpt" / name(STOP_AT)) if source == "path" else "last"
    nowhere = str(run.mount / "ckpt" / name(99))  # first: a path on no node, one error
    second, said = run.train("second", "--resume-from", explicit, "--try-resume-from", nowhere)
    tried = [json.loads(line.split(" ", 3)[3]) for line in said.splitlines() if "resume e" in line]
    assert len(tried) == 2, said
    assert all(f"resume({nowhere!r}): no node holds" in message for message in tried), tried
    assert f"rank 1's directory lacks manifest.pitstop of {name(STOP_AT)}" in said or (
        f"rank 0's directory lacks manifest.pitstop of {name(STOP_AT)}" in said
    ), said
    # Each file took the direct stream between the nodes' writers, not the group.
    received = [line for line in said.splitlines() if re.match(r"INFO rank \d receives ", line)]
    assert any("manifest.pitstop from rank" in line for line in received), said
    assert all(line.endswith(" over a direct stream") for line in received), received
    assert_continues_exactly(straight, second, STOP_AT)
    # The node that caught up wrote its pointers at once, as a save would (each node prints
    # where its `last` leads right after the resume); so did the other, unchanged.
    assert said.count(f"last {name(STOP_AT)}") == 2, said
    for node in (0, 1):
        held = sorted(p.name for p in run.node(node).iterdir() if p.name.startswith("step_"))
        assert held == [name(4), name(6), name(TARGET)], held


# rank 1's node by default; rank 0's (the one that also holds DCP's .metadata) under -m slow
ONE_RANK = [1, pytest.param(0, marks=pytest.mark.slow)]


@pytest.mark.parametrize("lost", ONE_RANK)
def test_a_wiped_node_loses_its_ranks_shards_and_the_resume_names_them(
    stopped: tuple[Run, list[Any]], lost: int
) -> None:
    run, _ = stopped
    wiped = run.holder(lost)
    shutil.rmtree(run.node(wiped))  # a new machine: its rank's shards are on no disk now
    for line in run.fail("second"):  # every rank, the same error: no fresh start
        assert line.startswith("error CheckpointCorrupt"), line
        message = json.loads(line.split(" ", 2)[2])
        for step in (2, STOP_AT):
            shard = f"__{lost}_0.distcp (written by rank {lost})"
            assert re.search(rf"step {step} \({name(step)}\): [^;]*{re.escape(shard)}", message)
        assert f"__{1 - lost}_0.distcp" not in message, message
    assert not list(run.node(wiped).glob(f"step_*/__{lost}_0.distcp"))


@pytest.mark.slow  # the default run: the wiped node (tests/core/test_shardcover_nodes.py: the rule)
@pytest.mark.parametrize("lost", ONE_RANK)
def test_a_corrupt_shard_on_one_node_falls_back_to_the_previous_checkpoint(
    stopped: tuple[Run, list[Any]], straight: list[dict[str, Any]], lost: int
) -> None:
    run, _ = stopped
    shard = run.node(run.holder(lost)) / name(STOP_AT) / f"__{lost}_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    second, said = run.train("second")
    assert f"resume skips step {STOP_AT} ({name(STOP_AT)})" in said, said
    assert f"__{lost}_0.distcp (written by rank {lost}) whole in none" in said, said
    assert f"__{lost}_0.distcp fails its checksum" in said, said
    assert_continues_exactly(straight, second, 2)


@pytest.mark.slow
def test_a_corrupt_manifest_on_one_node_is_fetched_from_the_other(
    stopped: tuple[Run, list[Any]], straight: list[dict[str, Any]]
) -> None:
    run, _ = stopped
    node = run.holder(1)
    manifest = run.node(node) / name(STOP_AT) / "manifest.pitstop"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    manifest.write_bytes(bytes(data))
    second, said = run.train("second")
    assert re.search(rf"in rank 1's directory: .*{name(STOP_AT)}", said), said
    assert f"rank 1's directory lacks manifest.pitstop of {name(STOP_AT)}" in said, said
    assert_continues_exactly(straight, second, STOP_AT)  # the newest, not the one before


def published(directory: Path) -> list[int]:
    """The steps of the sharded checkpoints published in ``directory`` (a manifest inside)."""
    found = directory.glob("step_*/manifest.pitstop")
    return sorted(int(p.parent.name.removeprefix("step_")) for p in found)


@pytest.mark.parametrize(
    "mode", ["off", *(pytest.param(m, marks=pytest.mark.slow) for m in ("on", "overlap"))]
)
def test_a_node_killed_mid_save_resumes_from_the_newest_checkpoint_complete_across_the_nodes(
    tmp_path: Path, straight: list[dict[str, Any]], mode: str
) -> None:
    run, hang_at = Run(tmp_path), 5  # async_save on or overlap: published at a later call
    options = ("--every", "1", "--hang-manifest-at", str(hang_at), "--async-save", mode)
    with run.nodes("first", *options) as nodes:
        nodes[0].wait_for(0, "resumed 0")
        nodes[1].wait_for(0, "resumed 0")
        index = nodes.node_of(0)  # rank 0's manifest write of step 5 waits: its shards unpublished
        nodes[index].wait_for(0, f"writing {hang_at}")
        nodes.kill(index)
    # Leaving the block killed the other node too, wherever it was: its copy of step 5 (its
    # rank's shards and a manifest) may be published, but rank 0's shards of it are on no disk.
    other = 1 - index
    assert published(run.node(index))[-1] == hang_at - 1
    newest = published(run.node(other))[-1]
    assert newest in (hang_at - 1, hang_at)
    assert list(run.node(index).glob(f".tmp-*{name(hang_at)}")), "the killed save's temp"
    second, said = run.train("second", "--every", "1", "--async-save", mode)
    if newest == hang_at:
        assert f"resume skips step {hang_at} ({name(hang_at)})" in said, said
    assert_continues_exactly(straight, second, hang_at - 1)
    assert published(run.node(0)) == published(run.node(1)) == [TARGET - 2, TARGET - 1, TARGET]
    assert not list(run.node(index).glob(".tmp-*")), "the next open removed the killed temp"
