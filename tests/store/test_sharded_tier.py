"""A remote tier for sharded state: ``Checkpointer(local_dir, remote="s3://...")`` with FSDP2,
2 gloo ranks sharing one local directory, in real processes against the real S3 server
(SeaweedFS, tests/s3server.py).

tests/e2e/sharded_train.py saves every step (keep_last=2 locally; the remote tier keeps the last
one and every second step). Checked: each sharded checkpoint is published locally, then uploaded
by rank 0 as one commit over its files, and retired there by the remote policy; the records say
which tiers hold each step; a run paused by SIGTERM whose local directory is then deleted
resumes, in fresh processes, bitwise from the remote tier (the checkpoint copied into the local
directory first), and its later checkpoints are uploaded and retired as before (with
``async_save=True`` too, under -m slow). Under -m slow: an upload the remote refuses keeps the
local checkpoint and finish() raises it, and the next run uploads it after its resume; a
remote checkpoint with a flipped byte is never copied in (checked against its commit first) and
the resume takes the one before.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import torch

import pitstop
from multirank import Finished, Job
from pitstop.core.sharding.sharded import sharded_name
from pitstop.shell.format import fileformat
from pitstop.shell.store.objectstore import ObjectStorage
from s3server import remote_steps
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).parents[1] / "e2e" / "sharded_train.py"
TIMEOUT_S = 300.0
SLOW = pytest.mark.slow  # by default: the synchronous case
TIERED = ("--every", "1", "--keep-last", "2", "--remote-keep-last", "1", "--remote-every", "2")


def run(
    local: Path, url: str, out: Path, env: dict[str, str], *args: str, ranks: int = 2
) -> Finished:
    """A job of ``ranks`` ranks on ``local`` with the remote tier ``url``."""
    job = Job(
        SCRIPT, "--dir", local, "--remote", url, "--out", out, *args,
        ranks=ranks, env={"TMPDIR": str(out.parent), **env}, timeout=TIMEOUT_S,
    )  # fmt: skip
    with job:
        return job.wait()


def local_steps(local: Path) -> list[str]:
    return sorted(p.name for p in local.glob("step_*"))


def tiers(finished: Finished) -> list[list[Any]]:
    (line,) = [x for x in finished.lines(0) if x.startswith("tiers ")]
    return list(json.loads(line.removeprefix("tiers ")))


@pytest.mark.parametrize(
    "mode", [pytest.param((), id="sync"), pytest.param(("--async",), id="async", marks=SLOW)]
)
def test_a_paused_run_whose_local_directory_is_gone_resumes_bitwise_from_the_remote_tier(
    s3_env: dict[str, str], s3_url: str, tmp_path: Path, mode: tuple[str, ...]
) -> None:
    env, url, tiered = s3_env, s3_url, (*TIERED, *mode)
    local = tmp_path / "checkpoints"
    paused = run(local, url, tmp_path / "a", env, *tiered, "--target", "6", "--stop-at", "4")
    paused.check()
    assert all("stopped 4" in paused.lines(r) for r in range(2)), paused.describe()
    assert local_steps(local) == [sharded_name(3), sharded_name(4)]
    assert remote_steps(url) == [2, 4]  # uploaded, then retired by the remote policy
    assert tiers(paused) == [[2, ["remote"]], [3, ["local"]], [4, ["local", "remote"]]]
    shutil.rmtree(local)  # the node's disk is gone

    resumed = run(local, url, tmp_path / "b", env, *tiered, "--target", "6", "--out-resumed")
    resumed.check()
    warned = [x for x in resumed.lines(0) if "WARNING" in x]  # the copy in and its pointers
    assert not warned, resumed.describe()
    for rank in range(2):
        assert "resumed 4" in resumed.lines(rank), resumed.describe()
        saved = fileformat.load(tmp_path / f"a.rank{rank}.pitstop")
        restored = fileformat.load(tmp_path / f"b.resumed.rank{rank}.pitstop")
        assert_same(restored, {k: saved[k] for k in restored}, f"rank {rank}")
    assert local_steps(local) == [sharded_name(5), sharded_name(6)]
    assert remote_steps(url) == [2, 4, 6]
    pitstop.verify(local / sharded_name(6))


@pytest.mark.slow  # by default: tests/store/test_tiers.py's refused upload (the same thread)
def test_an_upload_the_remote_refuses_keeps_the_local_checkpoint_and_finish_raises_it(
    s3_env: dict[str, str], s3_url: str, tmp_path: Path
) -> None:
    env, url = s3_env, s3_url
    local = tmp_path / "checkpoints"
    args = ("--every", "2", "--target", "2", "--fresh", "--remote-secret", "not-the-secret")
    finished = run(local, url, tmp_path / "out", env, *args, ranks=1)
    assert finished.codes == {0: 3}, finished.describe()
    (error,) = [x for x in finished.lines(0) if x.startswith("error ")]
    assert error.startswith("error SaveError"), error
    message = json.loads(error.split(" ", 2)[2])
    assert f"step 2 ({sharded_name(2)})" in message
    assert url in message
    assert "the local checkpoint is kept" in message
    pitstop.verify(local / sharded_name(2))  # published locally, whole
    assert remote_steps(url) == []


@pytest.mark.slow  # by default: the refused upload above, and tests/store/test_catchup.py
def test_the_next_run_uploads_the_sharded_checkpoint_a_refused_upload_left_local_only(
    s3_env: dict[str, str], s3_url: str, tmp_path: Path
) -> None:
    local = tmp_path / "checkpoints"
    refused = ("--every", "2", "--target", "2", "--fresh", "--remote-secret", "not-the-secret")
    assert run(local, s3_url, tmp_path / "a", s3_env, *refused, ranks=1).codes == {0: 3}
    assert remote_steps(s3_url) == []
    args = ("--every", "2", "--target", "4", "--remote-every", "2")
    resumed = run(local, s3_url, tmp_path / "b", s3_env, *args, ranks=1).check()
    assert "resumed 2" in resumed.lines(0), resumed.describe()
    assert remote_steps(s3_url) == [2, 4]  # step 2 caught up after the resume, then step 4
    assert tiers(resumed) == [[2, ["local", "remote"]], [4, ["local", "remote"]]]


@pytest.mark.slow  # by default: test_sharded_objects.py's flipped byte (the reader's check)
def test_a_damaged_remote_checkpoint_is_never_copied_in_and_the_resume_takes_the_one_before(
    s3_env: dict[str, str], s3_url: str, tmp_path: Path
) -> None:
    local = tmp_path / "checkpoints"
    args = ("--every", "1", "--keep-last", "1", "--remote-keep-last", "3", "--target", "3")
    assert run(local, s3_url, tmp_path / "a", s3_env, *args, ranks=1).check()
    assert remote_steps(s3_url) == [1, 2, 3]
    shutil.rmtree(local)
    flip(s3_url, sharded_name(3), "__0_0.distcp")
    args = (*args[:-1], "2")  # resume, train nothing
    resumed = run(local, s3_url, tmp_path / "b", s3_env, *args, ranks=1).check()
    assert "resumed 2" in resumed.lines(0), resumed.describe()
    skipped = [x for x in resumed.lines(0) if "skips" in x]
    assert len(skipped) == 1, resumed.describe()
    assert sharded_name(3) in skipped[0]
    assert "fails its checksum" in skipped[0]
    assert f"from the remote tier {s3_url}" in skipped[0]  # checked before it was copied in
    assert local_steps(local) == [sharded_name(2)]


def flip(url: str, name: str, file: str) -> None:
    """Flip one byte in the middle of ``file`` of the remote sharded checkpoint ``name``."""
    storage = ObjectStorage(url)
    try:
        key = f"{storage.commit(name).data}/{file}"
        data = bytearray(storage.get(key, limit=1 << 30))
        data[len(data) // 2] ^= 0x01
        storage.put(key, bytes(data), "overwrite")
    finally:
        storage.close()
