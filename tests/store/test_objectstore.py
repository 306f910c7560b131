"""Checkpoints on ``s3://``, against a real S3 server on loopback (SeaweedFS, tests/s3server.py).

Every guarantee of docs/object-storage.md: an exact resume in a fresh process; the readers
(load, verify, info) on s3 URLs; a writer killed part-way leaves nothing listed that does not
verify, and the next writer removes its upload; a damaged newest checkpoint is skipped with a
warning; one writer per prefix (the lease); refused credentials and a missing bucket are one
error naming the URL, with nothing written; and of two writers committing one name, exactly one
wins.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import BinaryIO

import obstore
import pytest
import torch

import pitstop
from pitstop.core.naming import LOCK_NAME, checkpoint_name
from pitstop.core.s3.objects import Lease, data_name, encode_lease, parse_url
from pitstop.core.s3.uploads import MAX_PARTS, MIN_PART, STREAM_PART, UploadPlan
from pitstop.errors import CheckpointCorrupt, DirectoryLocked, SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.store.lease import torn_uploads
from pitstop.shell.store.objectstore import ObjectStorage
from pitstop.shell.store.publish import publish_file
from pitstop.shell.store.s3client import Upload
from s3server import S3Server, run_python
from tinyrun import same, train_step, trained, weights

CHILD = Path(__file__).with_name("s3child.py")
TIMEOUT_S = 120


def child(url: str, env: dict[str, str], *args: str) -> str:
    """Run tests/store/s3child.py on ``url``; its last line."""
    return run_python([str(CHILD), url, *args], env)


def saved(url: str, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A run that saved ``steps`` checkpoints (steps 1..steps) to ``url`` and closed."""
    model, optimizer = trained()
    with pitstop.Checkpointer(url, model=model, state={"optimizer": optimizer}) as ckpt:
        progress = pitstop.Progress()
        for _ in range(steps):
            train_step(model, optimizer)
            progress = progress.advance()
            ckpt.save(progress)
    return model, optimizer


def objects(url: str) -> list[str]:
    """Every object key under ``url``'s prefix, relative to it."""
    storage = ObjectStorage(url)
    try:
        listed, _ = storage.listing()
        return sorted(listed + storage.data_names())
    finally:
        storage.close()


def test_resume_is_exact_in_a_fresh_process(s3_url: str, s3_env: dict[str, str]) -> None:
    saving = child(s3_url, s3_env, "save", "3")
    resumed = child(s3_url, s3_env, "resume", "3")
    assert saving.startswith("step 6 ")
    assert resumed == saving


def test_readers_take_s3_urls(s3_url: str) -> None:
    model, _ = saved(s3_url)
    last = pitstop.info(s3_url)
    assert last.step == 3
    assert pitstop.info(f"{s3_url}/{checkpoint_name(2)}").step == 2
    assert pitstop.verify(f"{s3_url}/last").name == checkpoint_name(3)
    tree = pitstop.load(s3_url)
    assert same(weights(model), dict(tree["weights"]["raw"]))
    other, _ = trained(seed=9)
    pitstop.load_weights(other, f"{s3_url}/last")
    assert same(weights(model), weights(other))


def test_a_killed_upload_is_never_listed(s3_url: str, s3_env: dict[str, str]) -> None:
    """kill -9 while the third checkpoint uploads: the listing holds only committed, whole
    checkpoints; the next writer resumes from the newest and removes the dead writer's upload."""
    process = subprocess.Popen(
        [sys.executable, str(CHILD), s3_url, "loop", str(2 << 20)],
        env={**os.environ, **s3_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.strip() == "saving 3":
                break
        process.kill()
    finally:
        process.kill()
        process.wait(timeout=TIMEOUT_S)
        assert process.stdout is not None
        process.stdout.close()
    storage = ObjectStorage(s3_url)
    try:
        listed = [n for n in storage.names() if n.endswith(".pitstop")]
        assert listed in (
            [checkpoint_name(s) for s in (1, 2)],
            [checkpoint_name(s) for s in (1, 2, 3)],
        )
        for name in listed:
            pitstop.verify(f"{s3_url}/{name}")
        # an upload whose commit never came, as a writer killed between the two leaves it
        torn = data_name(checkpoint_name(9), "dead_1")
        storage.put(torn, b"torn", "create")
    finally:
        storage.close()
    model, optimizer = trained(seed=3)
    bigger = torch.nn.Sequential(*model, torch.nn.Linear((2 << 20) // 4, 1, bias=False))
    optimizer = torch.optim.AdamW(bigger.parameters(), lr=0.01)
    with pitstop.Checkpointer(s3_url, model=bigger, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == len(listed)
    assert torn not in objects(s3_url)


TORN = """
import os, sys
import obstore
from pitstop.core.s3.objects import data_name, parse_url
from pitstop.shell.store.lease import torn_uploads
from pitstop.shell.store.s3client import open_store
url = sys.argv[1]
location = parse_url(url)
key = location.key(data_name("step_000000000009.pitstop", "dead_1"))
writer = obstore.open_writer(open_store(location), key)
writer.write(b"x" * (12 << 20))  # more than one part: a multipart upload is under way
writer.flush()  # every part sent: the upload is under way on the server
os._exit(0 if torn_uploads(location, None, location.prefix) else 1)  # die without completing
"""


def test_a_torn_multipart_upload_is_aborted_on_the_next_open(
    s3_url: str, s3_env: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """A writer killed mid-way through a multipart upload leaves it incomplete (invisible to a
    listing, its parts held by the bucket): the next writer to open the prefix aborts it."""
    run_python(["-c", TORN, s3_url], s3_env)
    location = parse_url(s3_url)
    assert len(torn_uploads(location, None, location.prefix) or []) == 1
    caplog.set_level(logging.WARNING, logger="pitstop")
    model, _ = trained()
    with pitstop.Checkpointer(s3_url, model=model):
        pass
    assert torn_uploads(location, None, location.prefix) == []
    assert any("aborting the multipart upload" in r.getMessage() for r in caplog.records)


def test_a_damaged_newest_checkpoint_falls_back(
    s3_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    saved(s3_url)
    storage = ObjectStorage(s3_url)
    try:
        commit = storage.commit(checkpoint_name(3))
        key = parse_url(s3_url).key(commit.data)
        data = bytearray(obstore.get(storage.client, key).bytes())
        data[100] ^= 0x01  # a tensor byte: the file is whole, its CRC-32 is not
        obstore.put(storage.client, key, bytes(data))
    finally:
        storage.close()
    with pytest.raises(CheckpointCorrupt):
        pitstop.verify(f"{s3_url}/{checkpoint_name(3)}")
    model, optimizer = trained(seed=7)
    caplog.set_level(logging.WARNING, logger="pitstop")
    with pitstop.Checkpointer(s3_url, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 2
    assert any(checkpoint_name(3) in r.getMessage() for r in caplog.records)


def test_a_pointer_is_never_trusted_over_the_commits(s3_url: str) -> None:
    """``last`` moved back to step 1 by hand: the resume still takes the newest commit."""
    saved(s3_url)
    storage = ObjectStorage(s3_url)
    try:
        storage.swap("last", checkpoint_name(1).encode())
    finally:
        storage.close()
    model, optimizer = trained(seed=7)
    with pitstop.Checkpointer(s3_url, model=model, state={"optimizer": optimizer}) as ckpt:
        assert ckpt.resume().step == 3


def test_one_writer_per_prefix(s3_url: str, caplog: pytest.LogCaptureFixture) -> None:
    model, _ = trained()
    with (
        pitstop.Checkpointer(s3_url, model=model),
        pytest.raises(DirectoryLocked, match=rf"{s3_url} is locked by run \w+ \(pid {os.getpid()}"),
    ):
        pitstop.Checkpointer(s3_url, model=model)
    # a lease from another host that has expired is taken over, with a warning naming it
    storage = ObjectStorage(s3_url)
    try:
        stale = Lease(run_id="gone", host="elsewhere", pid=1, since=0.0, expires=1.0)
        storage.put(LOCK_NAME, encode_lease(stale), "create")
    finally:
        storage.close()
    caplog.set_level(logging.WARNING, logger="pitstop")
    with pitstop.Checkpointer(s3_url, model=model) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    assert any(
        "took over the lease" in r.getMessage() and "gone" in r.getMessage() for r in caplog.records
    )


def test_refused_credentials_are_one_error_and_nothing_is_written(
    s3_url: str, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    model, _ = trained()
    with pytest.raises(SaveError, match=rf"{s3_url}.*credentials were refused"):
        pitstop.Checkpointer(s3_url, model=model)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.env()["AWS_SECRET_ACCESS_KEY"])
    assert objects(s3_url) == []


def test_a_missing_bucket_is_one_error_naming_it(s3_env: dict[str, str]) -> None:
    model, _ = trained()
    with pytest.raises(SaveError, match=r"s3://no-such-bucket/run.*bucket does not exist"):
        pitstop.Checkpointer("s3://no-such-bucket/run", model=model)


def test_without_the_client_an_s3_location_names_the_extra(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['obstore'] = None\n"
        "import torch, pitstop\n"
        "try:\n"
        "    pitstop.Checkpointer('s3://bucket/run', model=torch.nn.Linear(1, 1))\n"
        "except pitstop.ConfigError as e:\n"
        "    print(e)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, check=True
    )
    assert "pip install pitstop[s3]" in done.stdout
    assert not (tmp_path / "s3:").exists()


ROUNDS = 10


def race(writers: list[ObjectStorage], name: str, tokens: list[str], body: bytes) -> list[int]:
    """Both ``writers`` publish ``name`` at once, each under its token; the winners' indices."""
    gate = threading.Barrier(len(writers), timeout=TIMEOUT_S)
    outcome: dict[int, SaveError | None] = {}

    def write(i: int) -> None:
        def fill(file: BinaryIO, sync: object) -> None:
            file.write(body)
            gate.wait()  # every writer has its bytes and is about to upload and commit

        try:
            publish_file(writers[i], name, tokens[i], fill)
            outcome[i] = None
        except SaveError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(writers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    assert len(outcome) == len(writers)
    return [i for i, exc in outcome.items() if exc is None]


def test_two_writers_racing_for_one_commit_exactly_one_wins(s3_url: str) -> None:
    """Each round, two writers publish one checkpoint name at once (each its own data): one
    commit object is created, naming the winner's data; the loser gets an error and its data
    is gone."""
    model, optimizer = trained()
    with pitstop.Checkpointer(s3_url + "-seed", model=model, state={"optimizer": optimizer}) as c:
        c.save(pitstop.Progress(step=1))
    seed = ObjectStorage(f"{s3_url}-seed")
    try:  # a real checkpoint's bytes
        with seed.fetched(checkpoint_name(1)) as path, open_untrusted(path) as file:
            body = file.read()
    finally:
        seed.close()
    writers = [ObjectStorage(s3_url), ObjectStorage(s3_url)]
    try:
        for round_ in range(ROUNDS):
            name = checkpoint_name(round_)
            tokens = [f"w0_{round_}", f"w1_{round_}"]
            winners = race(writers, name, tokens, body)
            assert len(winners) == 1, f"round {round_}: writers {winners} both committed"
            assert writers[0].commit(name).data == data_name(name, tokens[winners[0]])
            loser = tokens[1 - winners[0]]
            assert data_name(name, loser) not in writers[0].data_names()
    finally:
        for writer in writers:
            writer.close()


def test_the_cli_verifies_and_inspects_s3_urls(
    s3_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from pitstop.cli import main

    saved(s3_url)
    assert main(["verify", s3_url]) == 0
    assert main(["inspect", f"{s3_url}/{checkpoint_name(2)}"]) == 0
    out = capsys.readouterr().out
    assert checkpoint_name(3) in out
    assert checkpoint_name(2) in out


def test_a_checkpoint_goes_up_in_parts_while_it_is_written(s3_url: str, tmp_path: Path) -> None:
    """A checkpoint file streams to its data object: its parts are under way by the time the
    writer is done (nothing visible yet), its bytes copied as they come (the tensors changed
    then do not change it); completed, the object is the file, and the local file holds its
    header, manifest and footer at their offsets, so its manifest reads as the whole file's."""
    tensor = torch.randn(14 << 18)  # 14 MiB: three parts of MIN_PART
    prepared = fileformat.prepare({"w": tensor})
    whole = tmp_path / "whole"
    with whole.open("wb") as file:
        fileformat.write(file, prepared, {"step": 1})
    location, storage = parse_url(s3_url), ObjectStorage(s3_url)
    try:
        data = data_name(checkpoint_name(1), "t_1")
        kept = tmp_path / "kept"
        kept.touch()
        upload = Upload(storage, data, kept, UploadPlan(MIN_PART, 2))
        fileformat.write(upload, prepared, {"step": 1})  # type: ignore[arg-type]
        assert len(torn_uploads(location, None, location.key(data)) or []) == 1  # under way
        assert storage.head(data) is None
        tensor.add_(1.0)  # the writer's memory changes: what was sent does not
        upload.close()
        upload.finish()
        got = bytes(obstore.get(storage.client, location.key(data)).bytes())
        assert got == whole.read_bytes()
        assert torn_uploads(location, None, location.key(data)) == []
    finally:
        storage.close()
    assert kept.stat().st_size == whole.stat().st_size
    ours, theirs = fileformat.read_manifest(kept), fileformat.read_manifest(whole)
    fields = ("size", "manifest_offset", "blobs", "tensors", "tensor_paths", "meta")
    assert [getattr(ours, f) for f in fields] == [getattr(theirs, f) for f in fields]


def test_a_save_failing_part_way_leaves_no_upload_and_nothing_listed(s3_url: str) -> None:
    """A checkpoint whose write fails after parts went up: SaveError, its multipart upload
    aborted, no data object, nothing listed, no temp file left."""
    location, storage = parse_url(s3_url), ObjectStorage(s3_url)

    def failing(file: BinaryIO, sync: object) -> None:
        file.write(bytes(2 * STREAM_PART + 1))  # two parts under way
        raise OSError(errno.EIO, "the writer failed")

    try:
        with pytest.raises(SaveError, match=r"could not write .*the writer failed"):
            publish_file(storage, checkpoint_name(1), "t_1", failing)
        assert torn_uploads(location, None, location.prefix) == []
        assert storage.names() == []
        assert storage.data_names() == []
    finally:
        storage.close()


def test_a_stream_past_the_largest_object_it_can_send_is_an_error_naming_it(
    s3_url: str, tmp_path: Path
) -> None:
    storage = ObjectStorage(s3_url)
    try:
        (tmp_path / "kept").touch()
        upload = Upload(storage, "big", tmp_path / "kept", UploadPlan(1, 1))
        with pytest.raises(OSError, match=f"{s3_url}/big: .*at most {MAX_PARTS} bytes") as raised:
            upload.write(bytes(MAX_PARTS + 1))
        assert raised.value.errno == errno.EFBIG
        upload.abort()
        assert storage.head("big") is None
    finally:
        storage.close()
