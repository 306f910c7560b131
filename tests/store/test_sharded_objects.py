"""Sharded checkpoints (FSDP2 through DCP) on ``s3://``: 2 gloo ranks in real processes against
the real S3 server (SeaweedFS, tests/s3server.py).

tests/e2e/sharded_train.py trains an FSDP2 MLP (AdamW, a schedule, an EMA, dropout) with the
Checkpointer on an ``s3://`` prefix, saving every 2 steps (keep_last=2). Checked: each rank
uploads its own shards and rank 0 commits one commit object listing every file; a run killed
after a save and resumed in fresh processes ends bitwise equal to the uninterrupted one; a
flipped byte in a shard object of the newest checkpoint makes every rank fall back to the
previous one (with a warning on every rank) and the run still ends bitwise equal; a save killed
after every rank's shards were uploaded but before its commit is never listed, the resume takes
the previous checkpoint, and the next writer removes the uncommitted objects; a rank whose
upload fails fails the save on every rank, nothing committed; of two writers committing one
name exactly one wins; saves in the background (``async_save=True`` and ``"overlap"``) publish
checkpoints that resume bitwise;
``verify``, ``info``, ``load`` and ``pitstop ls`` read an ``s3://`` sharded checkpoint.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import attrs
import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import obstore
import torch

import pitstop
from multirank import Finished, Job
from pitstop.cli import main as cli
from pitstop.core.naming import temp_name
from pitstop.core.records import CheckpointEntry
from pitstop.core.s3.objects import decode_commit
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardFile, sharded_name
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import scan
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.shardobjects import NodeUploads, commit_sharded, upload_shards
from s3server import BUCKET, S3Server
from trees import assert_same

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is unavailable",
)

SCRIPT = Path(__file__).with_name("sharded_s3child.py")  # tests/e2e/sharded_train.py, and more
TARGET = 6  # saves at 2, 4, 6; keep_last=2: step 2 is deleted by the step-6 save
TIMEOUT_S = 300.0


@attrs.frozen
class Run:
    url: str
    ranks: list[dict[str, Any]]
    finished: Finished


def train(url: str, out: Path, env: dict[str, str], *args: str, code: int = 0) -> Run:
    """A job of 2 ranks; their temporary files (a killed rank's too) under ``out``'s folder."""
    job = Job(
        SCRIPT, "--dir", url, "--out", out, "--target", str(TARGET), *args,
        env={"TMPDIR": str(out.parent), **env}, timeout=TIMEOUT_S,
    )  # fmt: skip
    with job:
        finished = job.wait()
    if code == 0:
        finished.check()
        outputs = [fileformat.load(Path(f"{out}.rank{r}.pitstop")) for r in range(2)]
    else:
        assert set(finished.codes.values()) == {code}, finished.describe()
        outputs = []
    return Run(url=url, ranks=outputs, finished=finished)


def fresh_url() -> str:
    return f"s3://{BUCKET}/sharded-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def straight(s3_server: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One uninterrupted 2-rank run to step 6 on its own prefix."""
    return train(fresh_url(), tmp_path_factory.mktemp("straight") / "out", s3_server.env())


def trained(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "resumed"}


def keys(url: str) -> list[str]:
    """Every object under ``url``'s prefix, relative to it."""
    storage = ObjectStorage(url)
    try:
        listed, _ = storage.listing()
        return sorted(listed + storage.data_names())
    finally:
        storage.close()


def _names(url: str) -> list[str]:
    """The checkpoints a reader lists at ``url``."""
    storage = ObjectStorage(url)
    try:
        return [e.name for e in scan(storage).catalog]
    finally:
        storage.close()


def store(server: S3Server) -> Any:
    return obstore.store.S3Store(
        BUCKET,
        endpoint=server.endpoint,
        access_key_id=server.env()["AWS_ACCESS_KEY_ID"],
        secret_access_key=server.env()["AWS_SECRET_ACCESS_KEY"],
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def copy_prefix(server: S3Server, source: str, target: str) -> None:
    """Copy every object of ``source``'s prefix to ``target``'s (both ``s3://`` URLs)."""
    client = store(server)
    cut = len(f"s3://{BUCKET}/")
    src, dst = source[cut:], target[cut:]
    for chunk in obstore.list(client, src + "/"):
        for meta in chunk:
            key = str(meta["path"])
            obstore.put(client, dst + key[len(src) :], bytes(obstore.get(client, key).bytes()))


def commit_of(server: S3Server, url: str, name: str) -> Any:
    cut = len(f"s3://{BUCKET}/")
    raw = bytes(obstore.get(store(server), f"{url[cut:]}/{name}").bytes())
    return decode_commit(name, raw)


def flip_object(server: S3Server, url: str, key: str) -> None:
    """Flip one byte in the middle of the object ``key`` (relative to ``url``'s prefix)."""
    client = store(server)
    path = f"{url[len(f's3://{BUCKET}/') :]}/{key}"
    data = bytearray(bytes(obstore.get(client, path).bytes()))
    data[len(data) // 2] ^= 0x01
    obstore.put(client, path, bytes(data))


# --- saving -----------------------------------------------------------------------------------


def test_each_checkpoint_is_one_commit_over_every_ranks_shard_objects(
    straight: Run, s3_server: S3Server, s3_env: dict[str, str]
) -> None:
    url = straight.url
    assert _names(url) == [sharded_name(4), sharded_name(6)]  # step 2: retired
    commit = commit_of(s3_server, url, sharded_name(6))
    files = {f.name: f.rank for f in commit.files}
    assert files == {".metadata": 0, "__0_0.distcp": 0, "__1_0.distcp": 1, MANIFEST_NAME: 0}
    data = [k for k in keys(url) if k.startswith(".data/")]
    commits = [commit_of(s3_server, url, sharded_name(step)) for step in (4, 6)]
    assert set(data) == {
        obj for c in commits for obj in c.objects()
    }  # nothing of step 2 left, nothing uncommitted
    assert not [k for k in keys(url) if sharded_name(2) in k]


def test_a_rank_whose_upload_fails_fails_the_save_on_every_rank_and_nothing_is_committed(
    straight: Run, s3_server: S3Server, tmp_path: Path
) -> None:
    url, env = fresh_url(), s3_server.env()
    run = train(url, tmp_path / "run", env, "--fail-upload-at", "4", "--fail-rank", "1")
    for rank in range(2):
        errors = [line for line in run.finished.lines(rank) if line.startswith("save error")]
        assert len(errors) == 1, run.finished.describe()
        assert "upload injected on rank 1" in errors[0]
        assert_same(trained(run.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    assert _names_env(url, env) == [sharded_name(2), sharded_name(6)]  # step 4: never committed


@pytest.mark.slow  # the default run: tests/store/test_async_s3.py (single-file, in the background)
@pytest.mark.parametrize("mode", ["--async", "--overlap"])
def test_background_sharded_saves_on_s3_publish_what_a_resume_restores_bitwise(
    straight: Run, s3_server: S3Server, tmp_path: Path, mode: str
) -> None:
    url, env = fresh_url(), s3_server.env()
    run = train(url, tmp_path / "run", env, mode)
    for rank in range(2):
        statuses = [x for x in run.finished.lines(rank) if x.startswith("status ")]
        assert statuses == ["status 2 published", "status 4 published", "status 6 published"]
        assert_same(trained(run.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    assert _names_env(url, env) == [sharded_name(4), sharded_name(6)]
    assert not [k for k in keys_env(url, env) if sharded_name(2) in k]
    resumed = train(url, tmp_path / "resumed", env, mode)  # step 6, as the async run saved it
    for rank in range(2):
        assert resumed.ranks[rank]["resumed"] == TARGET
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def keys_env(url: str, env: dict[str, str]) -> list[str]:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        return keys(url)


# --- resuming ---------------------------------------------------------------------------------


def test_a_run_killed_after_a_save_resumes_bitwise_in_fresh_processes(
    straight: Run, s3_server: S3Server, tmp_path: Path
) -> None:
    url, env = fresh_url(), s3_server.env()
    killed = train(url, tmp_path / "killed", env, "--die-at", "4", code=-9)
    assert "step 4" in killed.finished.lines(1)
    assert _names_env(url, env)[-1] == sharded_name(4)
    temp = tmp_path / "temp"  # where the ranks stage and download: nothing left after close
    temp.mkdir()
    resumed = train(url, tmp_path / "resumed", {**env, "TMPDIR": str(temp)})
    for rank in range(2):
        assert resumed.ranks[rank]["resumed"] == 4
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    assert not list(temp.glob("pitstop-s3-*"))


def _names_env(url: str, env: dict[str, str]) -> list[str]:
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        return _names(url)


def test_a_flipped_byte_in_a_shard_object_falls_back_on_every_rank(
    straight: Run, s3_server: S3Server, tmp_path: Path
) -> None:
    url, env = fresh_url(), s3_server.env()
    copy_prefix(s3_server, straight.url, url)
    commit = commit_of(s3_server, url, sharded_name(6))
    flip_object(s3_server, url, f"{commit.data}/__1_0.distcp")
    resumed = train(url, tmp_path / "resumed", env)
    for rank in range(2):
        warned = [
            line
            for line in resumed.finished.lines(rank)
            if "resume skips a checkpoint that does not verify" in line
            and "__1_0.distcp fails its checksum" in line
        ]
        assert warned, resumed.finished.describe()
        assert resumed.ranks[rank]["resumed"] == 4
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")


def test_a_save_killed_before_its_commit_is_never_listed(
    straight: Run, s3_server: S3Server, tmp_path: Path
) -> None:
    url, env = fresh_url(), s3_server.env()
    killed = train(url, tmp_path / "killed", env, "--die-in-write-at", "4", code=-9)
    assert "killing in write 4" in killed.finished.lines(0), killed.finished.describe()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        torn = [k for k in keys(url) if k.startswith(".data/") and sharded_name(4) in k]
        assert sorted(k.rpartition("/")[2] for k in torn) == ["__0_0.distcp", "__1_0.distcp"]
        assert _names(url) == [sharded_name(2)]  # uploaded, never committed: not listed
    resumed = train(url, tmp_path / "resumed", env)
    for rank in range(2):
        assert resumed.ranks[rank]["resumed"] == 2
        assert_same(trained(resumed.ranks[rank]), trained(straight.ranks[rank]), f"rank {rank}")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        for name in (sharded_name(4), sharded_name(6)):
            commit = commit_of(s3_server, url, name)
            assert not [k for k in torn if k.startswith(commit.data)]
        assert not (set(torn) & set(keys(url)))  # removed by the next writer's open


# --- readers ----------------------------------------------------------------------------------


def test_readers_and_the_cli_take_an_s3_sharded_checkpoint(
    straight: Run, s3_env: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    url = straight.url
    assert pitstop.verify(url).name == sharded_name(6)
    assert pitstop.info(f"{url}/{sharded_name(4)}").step == 4
    assert pitstop.info(url).step == 6
    tree = pitstop.load(f"{url}/last")
    assert_same(tree["sharded"]["model"], straight.ranks[0]["full"]["model"])
    assert cli(["ls", url, "--check"]) == 0
    out = capsys.readouterr().out
    assert f"would use {sharded_name(6)} (step 6)" in out
    assert cli(["ls", url, "--json"]) == 0
    out = capsys.readouterr().out
    assert sharded_name(4) in out
    assert sharded_name(6) in out
    assert cli(["verify", f"{url}/{sharded_name(4)}"]) == 0


@pytest.mark.slow
def test_export_load_weights_and_prune_take_an_s3_sharded_prefix(
    straight: Run, s3_server: S3Server, s3_env: dict[str, str], tmp_path: Path
) -> None:
    full = straight.ranks[0]["full"]["model"]
    exported = pitstop.export_weights(straight.url, tmp_path / "weights.pt")
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 5)
    )
    model.load_state_dict(torch.load(exported, weights_only=True), strict=True)
    assert_same(dict(model.state_dict()), full)
    url = fresh_url()
    copy_prefix(s3_server, straight.url, url)
    old = commit_of(s3_server, url, sharded_name(4))
    assert cli(["prune", url, "--keep-last", "1"]) == 0
    assert _names(url) == [sharded_name(6)]
    assert not [k for k in keys(url) if k.startswith(old.data)]  # its commit, then every file


def stage(storage: ObjectStorage, token: str, name: str, body: bytes) -> tuple[str, ShardFile]:
    """A staged sharded save of ``name`` (one shard, uploaded; a manifest) by attempt ``token``."""
    temp = temp_name(name, token)
    folder = storage.path(temp)
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(body)
    (folder / MANIFEST_NAME).write_bytes(b"manifest " + body)
    shard = ShardFile(name="__0_0.distcp", size=len(body), crc32=0, rank=0)
    upload_shards(storage, folder, [shard])
    return temp, shard


def test_of_two_writers_committing_one_sharded_name_exactly_one_wins(s3_url: str) -> None:
    name, entry = sharded_name(1), {"seq": 1}
    first, second = ObjectStorage(s3_url), ObjectStorage(s3_url)
    try:
        temp_a, shard_a = stage(first, "a", name, b"first")
        temp_b, shard_b = stage(second, "b", name, b"the second")
        commit_sharded(first, temp_a, name, [shard_a], entry)
        with pytest.raises(FileExistsError):
            commit_sharded(second, temp_b, name, [shard_b], entry)
        commit = first.commit(name)
        assert commit.data.split("/")[1] == "a"  # the first's, untouched
        assert [f.size for f in commit.files if f.name == "__0_0.distcp"] == [5]
        assert not [k for k in keys(s3_url) if k.startswith(".data/b/")]  # the loser's: gone
    finally:
        first.close()
        second.close()


def test_rank_0s_wait_for_a_node_whose_upload_failed_fails_at_once_naming_its_rank_and_cause(
    s3_url: str, tmp_path: Path
) -> None:
    """Nodes sharing no directory, a sharded remote tier: node 1's writer cannot upload its
    rank's files (its staged manifest is not a pitstop file); it says so in the attempt's data
    folder, and rank 0, waiting for those files to commit (patience: 60 s), fails at its next
    listing with a SaveError naming rank 1 and the cause — not after its timeout."""
    entry = CheckpointEntry(progress=pitstop.Progress(step=2), seq=2, reason="manual", sharded=True)
    storage = ObjectStorage(s3_url)
    rank0 = NodeUploads("run0", (0,), commits=True, patience=60.0)
    node1 = NodeUploads("run0", (1,), commits=False, patience=60.0)
    try:
        staged = tmp_path / "node1"
        staged.mkdir()
        (staged / MANIFEST_NAME).write_bytes(b"not a pitstop file")
        with pytest.raises(pitstop.CheckpointCorrupt):
            node1.send(storage, entry, staged)
        temp = rank0.temp(entry)
        folder = storage.path(temp)
        folder.mkdir(parents=True)
        (folder / "__0_0.distcp").write_bytes(b"rank 0")
        rows = [["__0_0.distcp", 6, 0, 0], ["__1_0.distcp", 6, 0, 1]]
        with (folder / MANIFEST_NAME).open("wb") as file:
            fileformat.write(file, fileformat.prepare({}), {"sharded": {"files": rows}})
        with pytest.raises(pitstop.SaveError) as raised:
            rank0.wait(storage, temp)
        said = str(raised.value)
        assert "rank 1's node could not upload its files of step_000000000002" in said, said
        assert "not a pitstop file" in said or "manifest" in said, said
        assert "__1_0.distcp (rank 1, 6 bytes)" in said, said
    finally:
        storage.close()


def test_a_node_writer_uploads_each_save_it_followed_where_rank_0_commits_it() -> None:
    """A node that caught up numbers its saves otherwise than rank 0's directory: each save it
    followed goes to the attempt folder of rank 0's seq (the last 64 remembered)."""
    node = NodeUploads("run0", (1,), commits=False, patience=1.0)
    entry = CheckpointEntry(progress=pitstop.Progress(step=6), seq=3, reason="manual", sharded=True)
    assert node.temp(entry) == temp_name(entry.name, "run0-3")  # none followed: its own
    node.follows(6, 3, 4)
    assert node.temp(entry) == temp_name(entry.name, "run0-4")
    for k in range(100):
        node.follows(7 + k, 10 + k, 20 + k)
    assert len(node.seqs) == 64
    assert node.temp(entry) == temp_name(entry.name, "run0-3")
