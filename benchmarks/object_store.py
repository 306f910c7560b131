"""Saving to and resuming from ``s3://``: pitstop against obstore's own put and get.

For each size in ``--sizes`` (MiB), a model of that many float32 bytes (8 tensors) is saved to a
fresh prefix by ``Checkpointer("s3://…").save()`` (the checkpoint written locally, uploaded to
its data object, committed) and resumed by a new ``Checkpointer`` on the prefix (listed,
downloaded by ranged, parallel GETs, every blob's CRC-32 checked, loaded into the model). The
reference is obstore on the same endpoint with the same bytes (the checkpoint file): its
``put`` of the file, its ranged get (``get_ranges``, 8 MiB ranges: obstore joins adjacent
ranges into one request) into memory, and its truly parallel get: one ``get_range`` per 8 MiB
range, all at once from 8 threads (the harder reference: 1.3-1.4x faster here). And the floor
of a read that allocates no memory of its own (``floor``: not pitstop; its resume's design
less the listing, the manifest's checks and the restore): the tail GET, then ranged GETs
(``get_range``, 8 threads) cut at blob boundaries from
the manifest (neighbours joined up to 8 MiB, a larger blob in 8 MiB pieces), each blob's CRC-32
checked, every piece copied from obstore's buffer into its place in memory that stands for the
live tensors (made before the clock starts), on one thread: the bytes copied once, no memory of
its own. Each repeat saves, then puts (after one untimed save: the server's first large writes
grow its volumes); the four reads take turns going first. Each row gives
the medians and the ratios pitstop / obstore (the issue's targets: ≤ 1.2x for both). Where
``s3fs`` is installed (an optional benchmark dependency: ``pip install s3fs``), torch.distributed.
checkpoint through its fsspec writer and reader (``FsspecWriter`` / ``FsspecReader``, their
defaults, one process) saves and loads the same model state on the same endpoint too, against
the same two references; without it those rows are skipped with a message.

Each resume is also clocked by phase (medians printed under the table): ``requests`` (listing,
commit objects, pointers: from the call until the download starts), ``read`` (the download:
its header and tail, its ranged GETs, every blob checked), ``copy`` (the restore's copy of the
checked bytes into the model) and ``rest`` (the remainder: the load's decode, freeing memory).

The endpoint is a SeaweedFS ``weed mini`` on loopback that the benchmark starts and stops
(tests/s3server.py's launcher): it writes at 14-30 MB/s, so the absolute times say little and
the ratios are what to read.

    .venv/bin/python benchmarks/object_store.py --sizes 64,512 --repeats 3
    .venv/bin/python benchmarks/object_store.py --sizes 512 --repeats 5 --saves-only  # no reads
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pitstop.core.naming import checkpoint_name
from pitstop.shell.format import fileformat
from pitstop.shell.format.checksums import crc32_combine, crc32_update
from pitstop.shell.format.untrusted import open_untrusted
from pitstop.shell.state.restore import one_thread
from pitstop.shell.store.objectstore import ObjectStorage
from s3server import ACCESS_KEY, BUCKET, SECRET_KEY, S3Server

MIB = 1 << 20
RANGE = 8 * MIB  # obstore's ranged get: the same range size as pitstop's


def _model(size: int) -> torch.nn.Module:
    """Eight random float32 parameters of ``size`` bytes in all."""
    per = max(1, size // 8 // 4)
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(per)) for _ in range(8)])


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


PHASES = ("requests", "read", "copy", "rest")


@contextlib.contextmanager
def _clocked(into: dict[str, list[float]]) -> Iterator[None]:
    """Clock the phases of the resume run inside the block (appended to ``into``): the
    download (ObjectStorage.fetch) and the restore's copy (Restore.commit) timed in place."""
    from pitstop.shell.state.restore import Restore

    spans: dict[str, tuple[float, float]] = {}

    def timing(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spans[name] = (began, time.perf_counter())

        return timed

    originals = (ObjectStorage.fetch, Restore.commit)
    ObjectStorage.fetch = timing("read", ObjectStorage.fetch)  # type: ignore[method-assign]
    Restore.commit = timing("copy", Restore.commit)  # type: ignore[method-assign]
    began = time.perf_counter()
    try:
        yield
    finally:
        ObjectStorage.fetch, Restore.commit = originals  # type: ignore[method-assign]
    total = time.perf_counter() - began
    (read_start, read_end), (copy_start, copy_end) = spans["read"], spans["copy"]
    into["requests"].append(read_start - began)
    into["read"].append(read_end - read_start)
    into["copy"].append(copy_end - copy_start)
    into["rest"].append(
        total - (read_start - began) - (read_end - read_start) - (copy_end - copy_start)
    )


def measure(
    server: S3Server, size: int, repeats: int, tmp: Path, reads: bool = True
) -> dict[str, list[float]]:
    """``{candidate: [seconds per repeat]}`` for ``size`` bytes (the file obstore moves made in
    ``tmp``, removed with it whatever fails); ``reads`` False: the save and the put only."""
    import obstore
    from obstore.store import S3Store

    import pitstop

    store = S3Store(
        BUCKET,
        endpoint=server.endpoint,
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        region="us-east-1",
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "save",
            "put",
            "resume",
            "get",
            "pget",
            "floor",
            "dcp-save",
            "dcp-resume",
            *PHASES,
        )
    }
    # untimed: the server grows its volumes on a run's first large writes (the save's, else)
    with pitstop.Checkpointer(f"s3://{BUCKET}/bench-warm-{size}", model=_model(size)) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    for repeat in range(repeats):
        url = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
        model = _model(size)

        def save(url: str = url, model: torch.nn.Module = model) -> None:
            with pitstop.Checkpointer(url, model=model) as ckpt:
                times["save"].append(_timed(lambda: ckpt.save(pitstop.Progress(step=1))))

        def resume(url: str = url) -> None:
            with pitstop.Checkpointer(url, model=_model(size)) as ckpt, _clocked(times):
                times["resume"].append(_timed(ckpt.resume))

        save()
        file = Path(tempfile.mkdtemp(prefix="pitstop-s3-bench-", dir=tmp)) / "checkpoint"
        storage = ObjectStorage(url)
        try:  # the checkpoint's bytes: what obstore moves
            with storage.fetched(checkpoint_name(1)) as path, open_untrusted(path) as fetched:
                file.write_bytes(fetched.read())
        finally:
            storage.close()
        key = f"bench-ref-{uuid.uuid4().hex[:8]}"
        total = file.stat().st_size
        starts = list(range(0, total, RANGE))
        ends = [min(s + RANGE, total) for s in starts]

        def put(file: Path = file, key: str = key) -> None:
            times["put"].append(_timed(lambda: obstore.put(store, key, file)))

        def get(key: str = key, starts: list[int] = starts, ends: list[int] = ends) -> None:
            times["get"].append(
                _timed(lambda: obstore.get_ranges(store, key, starts=starts, ends=ends))
            )

        def pget(key: str = key, starts: list[int] = starts, ends: list[int] = ends) -> None:
            def one(start: int, end: int) -> Any:
                return obstore.get_range(store, key, start=start, end=end)

            times["pget"].append(_timed(lambda: list(_THREADS.map(one, starts, ends))))

        blobs = sorted((b for b in fileformat.read_manifest(file).blobs if b.length), key=_at)
        live = [torch.zeros(b.length, dtype=torch.uint8) for b in blobs]  # touched: warm
        spans = _cut(blobs)

        def floor(
            key: str = key,
            blobs: list[Any] = blobs,
            live: list[torch.Tensor] = live,
            spans: list[tuple[int, int]] = spans,
            total: int = total,
        ) -> None:
            def one(span: tuple[int, int]) -> Any:
                return obstore.get_range(store, key, start=span[0], end=span[1])

            def run() -> None:
                obstore.get_range(store, key, start=max(0, total - MIB), end=total)
                got = list(_THREADS.map(one, spans))
                parts = [  # (blob, its bytes in a range's buffer, where they go in it)
                    (
                        i,
                        memoryview(data)[max(b.offset, a) - a : min(b.stop, e) - a],
                        max(b.offset, a),
                    )
                    for (a, e), data in zip(spans, got, strict=True)
                    for i, b in enumerate(blobs)
                    if b.offset < e and b.stop > a
                ]
                crcs = [0] * len(blobs)
                for i, view, _ in parts:
                    crcs[i] = crc32_combine(crcs[i], crc32_update(view), view.nbytes)
                if any(c != b.crc32 for c, b in zip(crcs, blobs, strict=True)):
                    raise RuntimeError("a blob fails its CRC-32")
                with warnings.catch_warnings(), one_thread():
                    warnings.simplefilter("ignore")  # obstore's buffers are read-only
                    for i, view, at in parts:
                        at -= blobs[i].offset
                        live[i][at : at + view.nbytes].copy_(
                            torch.frombuffer(view, dtype=torch.uint8)
                        )

            times["floor"].append(_timed(run))
            if any(crc32_update(t.numpy()) != b.crc32 for t, b in zip(live, blobs, strict=True)):
                raise RuntimeError("the floor's copy put bytes in the wrong place")

        put()
        turns = [resume, get, pget, floor] if reads else []
        for read in turns[repeat % 4 :] + turns[: repeat % 4]:
            read()
        if reads and _has_s3fs():
            _dcp(server, f"s3://{BUCKET}/bench-dcp-{uuid.uuid4().hex[:8]}", model, times)
        file.unlink()
        file.parent.rmdir()
    return times


def _at(blob: Any) -> int:
    return int(blob.offset)


def _cut(blobs: list[Any]) -> list[tuple[int, int]]:
    """Ranges over ``blobs`` (sorted by offset) cut only at their boundaries, neighbours joined
    up to RANGE bytes; a blob over RANGE in RANGE-sized pieces."""
    spans: list[tuple[int, int]] = []
    for blob in blobs:
        if spans and blob.stop - spans[-1][0] <= RANGE:
            spans[-1] = (spans[-1][0], blob.stop)
            continue
        spans += [(at, min(at + RANGE, blob.stop)) for at in range(blob.offset, blob.stop, RANGE)]
    return spans


_THREADS = concurrent.futures.ThreadPoolExecutor(8, "bench-get")  # started once, as pitstop's


def _has_s3fs() -> bool:
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return False
    return True


def _dcp(server: S3Server, url: str, model: torch.nn.Module, times: dict[str, list[float]]) -> None:
    """DCP's save of ``model``'s state to ``url`` through fsspec (s3fs), then its load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = {
        "key": ACCESS_KEY,
        "secret": SECRET_KEY,
        "client_kwargs": {"endpoint_url": server.endpoint, "region_name": "us-east-1"},
    }
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process
    state = {"model": model.state_dict()}
    times["dcp-save"].append(
        _timed(lambda: dcp.save(state, storage_writer=FsspecWriter(url, **options)))
    )
    target = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()}}
    times["dcp-resume"].append(
        _timed(lambda: dcp.load(target, storage_reader=FsspecReader(url, **options)))
    )
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())


def rows_of(size_mib: float, times: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    pairs = [("save", "save", "put")] + ([("resume", "resume", "get")] if times["resume"] else [])
    if times["dcp-save"]:
        pairs += [("dcp save", "dcp-save", "put"), ("dcp resume", "dcp-resume", "get")]
    for op, ours, theirs in pairs:
        a, b = statistics.median(times[ours]), statistics.median(times[theirs])
        row = {"size_mib": size_mib, "op": op, "pitstop_s": a, "obstore_s": b, "ratio": a / b}
        if theirs == "get":  # the parallel get too, and the allocation-free floor
            c, d = statistics.median(times["pget"]), statistics.median(times["floor"])
            row.update(parallel_s=c, parallel_ratio=a / c, floor_s=d, floor_ratio=d / c)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64", help="checkpoint sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each candidate per size")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument(
        "--saves-only", action="store_true", help="the save and obstore's put only (no reads)"
    )
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or any(s <= 0 for s in sizes):
        parser.error("--repeats must be at least 1 and every size positive")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    if not _has_s3fs():
        print("# s3fs is not installed: the DCP-through-fsspec rows are skipped (pip install s3fs)")
    rows: list[dict[str, Any]] = []
    phases: list[tuple[float, dict[str, list[float]]]] = []
    with tempfile.TemporaryDirectory(prefix="pitstop-s3-bench-") as tmp:
        server = S3Server.start(Path(tmp))
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            for size in sizes:
                measured = measure(
                    server, int(size * MIB), args.repeats, Path(tmp), not args.saves_only
                )
                rows += rows_of(size, measured)
                phases.append((size, measured))
        finally:
            server.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    print("| MiB | operation | pitstop (or DCP) s | obstore s | ratio | 8-thread get s | ratio |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        theirs = "put" if r["op"].endswith("save") else "get_ranges"
        parallel = (
            f"{r['parallel_s']:.3f} | {r['parallel_ratio']:.2f}" if "parallel_s" in r else "- | -"
        )
        print(
            f"| {r['size_mib']:g} | {r['op']} vs {theirs} | {r['pitstop_s']:.3f} | "
            f"{r['obstore_s']:.3f} | {r['ratio']:.2f} | {parallel} |"
        )
    print()
    for size, measured in phases if args.saves_only else []:  # each repeat: the noise
        each = {k: " ".join(f"{t:.2f}" for t in measured[k]) for k in ("save", "put")}
        print(f"# {size:g} MiB, each repeat: save {each['save']} s; put {each['put']} s")
    if not args.saves_only:
        print(
            "| MiB | resume s | requests | read | copy | rest | get_ranges s | floor s |"
            " floor / pget |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for size, measured in phases if not args.saves_only else []:
        cells = " | ".join(f"{statistics.median(measured[p]):.3f}" for p in ("resume", *PHASES))
        get, floor = (statistics.median(measured[k]) for k in ("get", "floor"))
        ratio = floor / statistics.median(measured["pget"])
        print(f"| {size:g} | {cells} | {get:.3f} | {floor:.3f} | {ratio:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
