"""Object storage's decisions about sharded checkpoints: which objects make one up, when rank 0
may commit it, what deleting it deletes and in which order, and which data objects are orphans."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.naming import checkpoint_name, sharded_name
from pitstop.core.s3.objects import (
    Commit,
    commit_problem,
    data_name,
    decode_commit,
    deletion_order,
    encode_commit,
    failed_uploads,
    failure_name,
    orphans,
    sharded_commit,
)
from pitstop.core.sharding.sharded import MANIFEST_NAME, ShardFile
from strategies import small_steps

tokens = st.text("abcXYZ019_-", min_size=1, max_size=12)
file_names = st.text("abc_0123.", min_size=1, max_size=10).filter(lambda n: n not in {".", ".."})


@st.composite
def shard_files(draw: st.DrawFn) -> list[ShardFile]:
    """Every rank's files of one sharded checkpoint, the manifest among them (rank 0's)."""
    names = draw(st.sets(file_names.filter(lambda n: n != MANIFEST_NAME), max_size=5))

    def one(name: str) -> ShardFile:
        return ShardFile(
            name=name,
            size=draw(st.integers(0, 1 << 40)),
            crc32=draw(st.integers(0, 0xFFFFFFFF)),
            rank=draw(st.integers(0, 7)),
        )

    return [one(n) for n in sorted(names)] + [
        ShardFile(name=MANIFEST_NAME, size=draw(st.integers(0, 1 << 20)), crc32=1, rank=0)
    ]


@st.composite
def sharded_commits(draw: st.DrawFn) -> Commit:
    entry = {"seq": draw(st.integers(0, 100)), "reason": "manual", "other": 1}
    name = sharded_name(draw(small_steps))
    return sharded_commit(name, draw(tokens), draw(st.permutations(draw(shard_files()))), entry)


@given(sharded_commits())
def test_a_sharded_commit_names_one_object_per_file_under_its_attempts_folder(
    commit: Commit,
) -> None:
    assert commit.data.endswith(f"/{commit.name}")
    assert len(commit.objects()) == len(commit.files) == len(set(commit.objects()))
    assert all(o.startswith(commit.data + "/") for o in commit.objects())
    assert commit.size == sum(f.size for f in commit.files)
    assert MANIFEST_NAME in {f.name for f in commit.files}
    assert "other" not in commit.entry  # only the catalog's fields


@given(sharded_commits())
def test_a_sharded_commit_round_trips(commit: Commit) -> None:
    assert decode_commit(commit.name, encode_commit(commit)) == commit


@given(sharded_commits(), st.data())
def test_a_tampered_sharded_commit_is_refused(commit: Commit, data: st.DataObject) -> None:
    record = json.loads(encode_commit(commit))
    how = data.draw(st.sampled_from(["size", "drop-manifest", "twice", "path", "crc", "none"]))
    if how == "size":
        record["size"] += data.draw(st.integers(1, 10))
    elif how == "drop-manifest":
        record["files"] = [r for r in record["files"] if r[0] != MANIFEST_NAME]
        record["size"] = sum(r[1] for r in record["files"])
    elif how == "twice":
        record["files"].append(record["files"][0])
        record["size"] += record["files"][0][1]
    elif how == "path":
        record["files"][0][0] = "../" + record["files"][0][0]
    elif how == "crc":
        record["files"][0][2] = 1 << 32
    else:
        del record["files"]
    with pytest.raises(ValueError, match=commit.name):
        decode_commit(commit.name, json.dumps(record).encode())


def test_a_sharded_commit_must_hold_its_manifest_and_a_sharded_name() -> None:
    shard = ShardFile(name="__0_0.distcp", size=3, crc32=0, rank=0)
    manifest = ShardFile(name=MANIFEST_NAME, size=1, crc32=0, rank=0)
    with pytest.raises(ValueError, match=MANIFEST_NAME):
        sharded_commit(sharded_name(1), "t", [shard], {})
    with pytest.raises(ValueError, match="sharded"):
        sharded_commit(checkpoint_name(1), "t", [shard, manifest], {})


@given(sharded_commits(), st.data())
def test_rank_0_commits_only_when_every_file_is_listed_at_its_size(
    commit: Commit, data: st.DataObject
) -> None:
    """The one commit comes after every rank's shard objects are uploaded whole: any object
    missing from the listing, or of another size, holds it back (extra objects do not)."""
    sizes = {o: f.size for o, f in zip(commit.objects(), commit.files, strict=True)}
    listed = dict(sizes)
    listed[f"{commit.data}/extra"] = 5
    assert commit_problem(commit, listed) is None
    victim = data.draw(st.sampled_from(sorted(sizes)))
    if data.draw(st.booleans()):
        del listed[victim]
        expected = "was not uploaded"
    else:
        listed[victim] += data.draw(st.integers(1, 9))
        expected = "bytes"
    problem = commit_problem(commit, listed)
    assert problem is not None
    assert victim in problem
    assert expected in problem


@given(sharded_commits())
def test_deleting_a_checkpoint_deletes_its_commit_first_then_every_file(commit: Commit) -> None:
    order = deletion_order(commit)
    assert order[0] == commit.name  # from then on it does not exist
    assert set(order[1:]) == set(commit.objects())
    plain = Commit(name=checkpoint_name(1), data=data_name(checkpoint_name(1), "t"), size=1)
    assert deletion_order(plain) == (plain.name, plain.data)


@given(st.lists(sharded_commits(), max_size=4), st.lists(sharded_commits(), max_size=4))
def test_orphans_are_exactly_the_files_no_commit_names(
    committed: list[Commit], uncommitted: list[Commit]
) -> None:
    """A writer that died after some ranks uploaded leaves files no commit names: they are
    orphans; every file of a committed checkpoint is kept."""
    kept = {o for c in committed for o in c.objects()}
    left = {o for c in uncommitted for o in c.objects()} - kept
    found = orphans([*kept, *left, "not/a/data/object", ".data/x"], committed)
    assert set(found) == left


@given(sharded_commits(), st.sets(st.integers(0, 1 << 20), max_size=4), st.data())
def test_a_failed_writers_object_is_found_in_its_attempts_folder_only_and_is_an_orphan(
    commit: Commit, ranks: set[int], data: st.DataObject
) -> None:
    """rank 0's wait finds exactly the failure objects of its attempt's folder, each writer's
    rank read back; no file's name is one, and the next writer's open clears them."""
    other = data.draw(tokens.filter(lambda t: t != commit.data.split("/")[1]))
    failures = [failure_name(commit.data, r) for r in ranks]
    elsewhere = [failure_name(data_name(commit.name, other), r) for r in ranks]
    listed = [*commit.objects(), *failures, *elsewhere]
    expected = sorted((r, failure_name(commit.data, r)) for r in ranks)
    assert failed_uploads(commit.data, data.draw(st.permutations(listed))) == expected
    assert failed_uploads(commit.data, commit.objects()) == []
    assert set(orphans([*failures, *commit.objects()], [commit])) == set(failures)
