"""Reading a checkpoint from ``s3://`` into memory, every blob checked as it arrives, against a
real S3 server on loopback (SeaweedFS, tests/s3server.py).

A resume reads by ranged GETs straight into memory (no file of the checkpoint on a disk), is
exact when its ranges cut blobs and when its manifest is longer than the tail read first; a
flipped byte in a blob or in the padding makes the checkpoint fail (the resume falls back with
a warning, the model untouched by the damaged one, and ``verify`` names the URL); the memory is
freed once the resume is done, and the map the download leaves for the first load of it is
that load's alone; a data object of another size than its commit records, or missing, is
named (the size read from the tail's GET).
"""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path
from typing import Any

import obstore
import pytest
import torch

import pitstop
from pitstop.core.naming import checkpoint_name
from pitstop.core.s3.objects import parse_url
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat, fileread
from pitstop.shell.format.untrusted import held, open_untrusted
from pitstop.shell.store import objectread
from pitstop.shell.store.objectstore import ObjectStorage
from tinyrun import same, train_step, trained, weights


def saved(url: str, steps: int = 3) -> list[dict[str, torch.Tensor]]:
    """A run that saved steps 1..``steps`` to ``url``; the model's weights at each step."""
    model, optimizer = trained()
    history = []
    with pitstop.Checkpointer(url, model=model, state={"optimizer": optimizer}) as ckpt:
        progress = pitstop.Progress()
        for _ in range(steps):
            train_step(model, optimizer)
            progress = progress.advance()
            ckpt.save(progress)
            history.append(weights(model))
    return history


def damage(url: str, step: int, where: str) -> None:
    """Flip one byte of the checkpoint of ``step``: in its first blob, or in the first padding
    between two blobs."""
    storage = ObjectStorage(url)
    try:
        with storage.fetched(checkpoint_name(step)) as path:
            manifest = fileformat.read_manifest(path)
        commit = storage.commit(checkpoint_name(step))
        key = parse_url(url).key(commit.data)
        data = bytearray(obstore.get(storage.client, key).bytes())
        blobs = sorted(manifest.blobs, key=lambda b: b.offset)
        gaps = [b.stop for b, c in itertools.pairwise(blobs) if b.stop < c.offset]
        data[blobs[0].offset if where == "blob" else gaps[0]] ^= 0x01
        obstore.put(storage.client, key, bytes(data))
    finally:
        storage.close()


def resumed(url: str) -> tuple[int, dict[str, torch.Tensor], pitstop.Checkpointer]:
    """A fresh run resumed from ``url`` (left open): its step and weights."""
    model, optimizer = trained(seed=7)
    ckpt = pitstop.Checkpointer(url, model=model, state={"optimizer": optimizer})
    step = ckpt.resume().step
    return step, weights(model), ckpt


@pytest.mark.parametrize("where", ["blob", "padding"])
def test_a_damaged_byte_fails_as_it_arrives_and_the_resume_falls_back(
    s3_url: str, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    history = saved(s3_url)
    damage(s3_url, 3, where)
    with pytest.raises(CheckpointCorrupt, match=rf"{s3_url}/{checkpoint_name(3)}: .*"):
        pitstop.verify(f"{s3_url}/{checkpoint_name(3)}")
    caplog.set_level(logging.WARNING, logger="pitstop")
    step, now, ckpt = resumed(s3_url)
    ckpt.close()
    assert step == 2
    assert same(now, history[1])  # step 2's weights, nothing of step 3's
    skipped = [r.getMessage() for r in caplog.records if "does not verify" in r.getMessage()]
    assert len(skipped) == 1
    assert checkpoint_name(3) in skipped[0]
    assert ("fails its checksum" if where == "blob" else "is not zero") in skipped[0]


def test_a_resume_reads_into_memory_and_frees_it(s3_url: str) -> None:
    history = saved(s3_url)
    step, now, ckpt = resumed(s3_url)
    try:
        assert step == 3
        assert same(now, history[2])
        cache = ckpt.directory  # the s3 location's local cache: no checkpoint file in it
        assert [p for p in Path(cache).iterdir() if p.name.endswith(".pitstop")] == []
        assert not held(Path(cache) / checkpoint_name(3))  # freed once the resume was done
    finally:
        ckpt.close()
    # the download leaves a copy-on-write map of the memory file for its first load: a tensor
    # of that load written to changes nothing a later load of the file reads
    storage = ObjectStorage(s3_url)
    try:
        with storage.fetched(checkpoint_name(2)) as path:
            first = weights_of(fileread.load(path, verify=False))  # takes the download's map
            second = weights_of(fileread.load(path, verify=False))
            name, kept = next(iter(second.items()))
            kept = kept.clone()
            first[name].add_(1.0)
            assert torch.equal(second[name], kept)
            assert torch.equal(weights_of(fileread.load(path, verify=False))[name], kept)
    finally:
        storage.close()


def test_ranges_that_cut_blobs_and_a_manifest_past_the_tail_read_exactly(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    history = saved(s3_url)
    monkeypatch.setattr(objectread, "RANGE", 100)  # many ranges, most blobs cut across several
    monkeypatch.setattr(objectread, "SPLIT", 100)  # (held as blobs: each joined from its pieces)
    monkeypatch.setattr(objectread, "TAIL", 64)  # the footer, not the manifest: a second GET
    step, now, ckpt = resumed(s3_url)
    ckpt.close()
    assert step == 3
    assert same(now, history[2])
    pitstop.verify(f"{s3_url}/{checkpoint_name(3)}")  # into a memory file, range by range
    monkeypatch.setattr(objectread, "RANGE", 1 << 20)  # neighbours joined: one range
    step, now, ckpt = resumed(s3_url)
    ckpt.close()
    assert step == 3
    assert same(now, history[2])


def test_a_resume_holds_the_blobs_as_they_arrived_for_one_load(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The resume's fetch keeps obstore's buffers: no file of the checkpoint to open (not even
    a memory file), its manifest read from memory, its tensors built once over the buffers."""
    history = saved(s3_url)

    def no_memory_file(*args: object) -> int:
        raise AssertionError("a resume made a memory file")

    with monkeypatch.context() as patched:
        patched.setattr(os, "memfd_create", no_memory_file)
        step, now, ckpt = resumed(s3_url)
        ckpt.close()
    assert step == 3
    assert same(now, history[2])
    storage = ObjectStorage(s3_url)
    storage.as_blobs = True
    try:
        path = storage.fetch(checkpoint_name(3))
        assert held(path)
        with pytest.raises(FileNotFoundError):
            open_untrusted(path)
        assert fileformat.read_manifest(path).meta["seq"] == storage.commit(path.name).entry["seq"]
        fileformat.verify(path)  # (checked as it arrived: `pitstop prune` verifies its choice)
        loaded = weights_of(fileread.load(path, verify=False))
        assert same({k: loaded[k] for k in history[2]}, history[2])
        with pytest.raises(OSError, match="loaded once"):
            fileread.load(path, verify=False)
        storage.release()
        assert not held(path)
    finally:
        storage.close()


def test_without_memory_files_a_checked_temp_file_is_read_and_none_is_left(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where there is no memfd (not Linux): a temp file of the cache, renamed once checked; a
    damaged checkpoint leaves no temp file behind."""
    history = saved(s3_url)
    damage(s3_url, 3, "blob")
    monkeypatch.delattr(os, "memfd_create")
    step, now, ckpt = resumed(s3_url)
    try:
        assert step == 2
        assert same(now, history[1])
        left = sorted(p.name for p in Path(ckpt.directory).iterdir())
        assert [n for n in left if n.startswith(".tmp-")] == []  # the damaged one's is gone
    finally:
        ckpt.close()


def test_a_data_object_not_the_size_its_commit_says_fails_without_a_request_of_its_own(
    s3_url: str,
) -> None:
    """The size check rides on the tail's GET (no HEAD): a data object shorter or longer than
    its commit records, or missing, is named; the resume falls back to the previous one."""
    history = saved(s3_url)
    storage = ObjectStorage(s3_url)
    try:
        key = parse_url(s3_url).key(storage.commit(checkpoint_name(3)).data)
        whole = bytes(obstore.get(storage.client, key).bytes())
        url = f"{s3_url}/{checkpoint_name(3)}"
        for body, said in [
            (
                whole[:-100],
                rf"its data object holds {len(whole) - 100} bytes, its commit says {len(whole)}",
            ),
            (
                whole + b"\0" * 100,
                rf"its data object holds {len(whole) + 100} bytes, its commit says",
            ),
            (None, "its data object .* is missing"),
        ]:
            if body is None:
                obstore.delete(storage.client, key)
            else:
                obstore.put(storage.client, key, body)
            with pytest.raises(CheckpointCorrupt, match=rf"{url}: {said}"):
                pitstop.verify(url)
        step, now, ckpt = resumed(s3_url)
        ckpt.close()
        assert step == 2
        assert same(now, history[1])
    finally:
        storage.close()


def weights_of(tree: Any) -> dict[str, torch.Tensor]:
    """The model's tensors in a loaded checkpoint tree."""
    return dict(tree["weights"]["raw"])
