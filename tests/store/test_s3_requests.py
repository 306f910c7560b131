"""The requests of a resume from ``s3://``, counted on a real S3 server (SeaweedFS).

A reader (``load``) lists the prefix once, reads every listed commit object, pointer and
``latest.json`` once each (at once, on the download threads, never one after another on the
caller's), reads no commit object again before its data, and makes no HEAD; a writer's resume
right after its open sends no request before the data (the listing its open made under the
lease stands), then the header and tail at once and the ranges. A commit
object carried from the listing to the download that is deleted (or replaced) meanwhile makes
the download "gone", never "corrupt"; a data object missing under an unchanged commit is
corrupt. A reader whose choice a writer prunes between its listing and its download lists
again; and readers racing a live writer on the prefix that prunes every save never fail.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

import pitstop
from multirank import Job
from pitstop.cli import main
from pitstop.core.naming import checkpoint_name
from pitstop.core.s3.objects import deletion_order
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.store.objectstore import ObjectStorage
from tinyrun import same, train_step, trained, weights

WRITER = Path(__file__).parents[1] / "reliability" / "pruning_writer.py"
_CALLS = ("get", "get_range", "get_ranges", "head", "list", "list_with_delimiter", "put", "delete")


class Requests:
    """Every request obstore sends while :meth:`counting`: ``(call, key, on caller's thread)``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, url: str) -> None:
        self.seen: list[tuple[str, str, bool]] = []
        self.prefix = url.split("/", 3)[3] + "/"
        self.caller = threading.get_ident()
        lock = threading.Lock()
        for call in _CALLS:
            real = getattr(obstore, call)

            def counted(
                store: object,
                *args: object,
                _real: object = real,
                _call: str = call,
                **kwargs: object,
            ) -> object:
                key = str(args[0]) if args else ""
                with lock:
                    here = threading.get_ident() == self.caller
                    self.seen.append((_call, key.removeprefix(self.prefix), here))
                return _real(store, *args, **kwargs)  # type: ignore[operator]

            monkeypatch.setattr(obstore, call, counted)

    def before_data(self) -> list[tuple[str, str, bool]]:
        """The requests before the first one for a data object."""
        for at, (_, key, _) in enumerate(self.seen):
            if key.startswith(".data/"):
                return self.seen[:at]
        raise AssertionError(f"no data object was read: {self.seen}")


def _saved(url: str) -> object:
    model, optimizer = trained()
    with pitstop.Checkpointer(url, model=model, policy=pitstop.Policy(keep_last=3)) as ckpt:
        progress = pitstop.Progress()
        for _ in range(4):
            train_step(model, optimizer)
            progress = progress.advance()
            ckpt.save(progress)
    return model


def _check_requests(small: list[tuple[str, str, bool]]) -> None:
    """One listing, then each listed entry read once, at once; nothing else before the data."""
    listings = [r for r in small if r[0] == "list_with_delimiter"]
    assert len(listings) == 1, small
    reads = collections.Counter(key for call, key, _ in small if call == "get")
    listed = {checkpoint_name(s) for s in (2, 3, 4)} | {"last", "latest.json"}
    assert reads == dict.fromkeys(listed, 1), small  # each once, nothing else
    assert [r for r in small if r[0] not in {"get", "list_with_delimiter"}] == [], small
    assert not any(here for call, _, here in small if call == "get"), small  # all at once


def test_a_resume_right_after_open_requests_nothing_before_its_data(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _saved(s3_url)
    other, _ = trained(seed=5)
    with pitstop.Checkpointer(s3_url, model=other) as ckpt:
        requests = Requests(monkeypatch, s3_url)
        assert ckpt.resume().step == 4
    assert requests.before_data() == []  # the open's listing and commits, read once, stand
    assert same(weights(model), weights(other))
    data = [(call, here) for call, key, here in requests.seen if key.startswith(".data/")]
    assert len(data) == 3, data  # its header and tail, then its one range
    assert not any(here for _, here in data[:2]), data  # header and tail at once


def test_a_load_reads_each_commit_and_pointer_once(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _saved(s3_url)
    requests = Requests(monkeypatch, s3_url)
    tree = pitstop.load(s3_url)
    assert same(weights(model), dict(tree["weights"]["raw"]))
    first, *rest = requests.before_data()
    assert first[:2] == ("get", "latest.json")  # the recorded policy: one GET, no HEAD
    _check_requests(rest)


@pytest.fixture
def carried(s3_url: str) -> Iterator[tuple[ObjectStorage, ObjectStorage, str]]:
    """A reader that listed the prefix (the newest commit read), a writer on it, and the name."""
    _saved(s3_url)
    reader, writer = ObjectStorage(s3_url), ObjectStorage(s3_url)
    name = checkpoint_name(4)
    with reader.listed():
        assert reader.size(name) > 0
    try:
        yield reader, writer, name
    finally:
        reader.close()
        writer.close()


def test_a_commit_deleted_after_the_listing_is_gone_not_corrupt(
    carried: tuple[ObjectStorage, ObjectStorage, str],
) -> None:
    reader, writer, name = carried
    for key in deletion_order(writer.commit(name)):  # a pruning writer's order
        writer.delete(key)
    with pytest.raises(FileNotFoundError, match="removed while read"):
        reader.fetch(name)


def test_data_missing_under_its_commit_is_corrupt(
    carried: tuple[ObjectStorage, ObjectStorage, str],
) -> None:
    reader, writer, name = carried
    writer.delete(writer.commit(name).data)
    with pytest.raises(CheckpointCorrupt, match="missing"):
        reader.fetch(name)


def test_a_reader_whose_choice_is_pruned_resolves_again(
    s3_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the listing and the download a real writer publishes step 5 and prunes the only
    checkpoint listed: ``load`` lists again and reads step 5 (never "no valid checkpoint")."""
    _saved(s3_url)
    real = ObjectStorage.fetch
    raced: list[str] = []

    def fetch(self: ObjectStorage, name: str) -> Path:
        if not raced:
            raced.append(name)
            model, _ = trained(seed=3)
            policy = pitstop.Policy(keep_last=1)
            with pitstop.Checkpointer(s3_url, model=model, policy=policy) as ckpt:
                ckpt.resume()
                ckpt.save(pitstop.Progress(step=5))
        return real(self, name)

    monkeypatch.setattr(ObjectStorage, "fetch", fetch)
    assert pitstop.info(s3_url).step == 5
    assert raced == [checkpoint_name(4)]


def _cli(*argv: str) -> None:
    """``pitstop ARGV`` in this process: exit status 0, and ``ls --json`` rows all readable."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    assert code == 0, out.getvalue()
    if "--json" in argv:
        rows = json.loads(out.getvalue())
        assert rows, out.getvalue()
        assert all("unreadable" not in row for row in rows), out.getvalue()


def test_readers_racing_a_pruning_writer_on_s3(s3_url: str, s3_env: dict[str, str]) -> None:
    """A real writer saves 100 times with ``keep_last=1`` (each save deletes the one before)
    while this process reads the prefix in a loop through every public reader — ``load``,
    ``info``, ``verify`` of ``last``, ``pitstop ls`` (plain, ``--json``, ``--check``) and
    ``pitstop verify`` — : no failure."""
    failures: list[str] = []
    rounds = 0
    with Job(WRITER, s3_url, "100", ranks=1, env=s3_env) as job:
        job.wait_for(0, "saved 1")
        while job.running() or rounds == 0:
            rounds += 1
            for what, read in (
                ("load", lambda: pitstop.load(s3_url)),
                ("info", lambda: pitstop.info(s3_url)),
                ("verify last", lambda: pitstop.verify(f"{s3_url}/last")),
                ("pitstop ls", lambda: _cli("ls", s3_url)),
                ("pitstop ls --json", lambda: _cli("ls", s3_url, "--json")),
                ("pitstop ls --check", lambda: _cli("ls", s3_url, "--check")),
                ("pitstop verify last", lambda: _cli("verify", f"{s3_url}/last")),
            ):
                try:
                    read()
                except Exception as exc:  # every failure is one to report
                    failures.append(f"round {rounds}, {what}: {type(exc).__name__}: {exc}")
        job.wait().check()
    assert failures == [], f"{len(failures)} failures in {rounds} rounds:\n" + "\n".join(failures)
    assert pitstop.info(s3_url).step == 100
