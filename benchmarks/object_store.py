"""Saving to and resuming from ``s3://``: pitstop against obstore's own put and get.

For each size in ``--sizes`` (MiB), a model of that many float32 bytes (8 tensors) is saved to a
fresh prefix by ``Checkpointer("s3://…").save()`` (the checkpoint written locally, uploaded to
its data object, committed) and resumed by a new ``Checkpointer`` on the prefix (listed,
downloaded by ranged, parallel GETs, every blob's CRC-32 checked, loaded into the model). The
reference is obstore on the same endpoint with the same bytes (the checkpoint file): its
``put`` of the file, and its parallel ranged get (``get_ranges``, 8 MiB ranges) into memory.
Each repeat saves, then puts; the two reads alternate which goes first. Each row gives the
medians and the ratio pitstop / obstore (the issue's targets: ≤ 1.2x for both).

The endpoint is a SeaweedFS ``weed mini`` on loopback that the benchmark starts and stops
(tests/s3server.py's launcher): it writes at 14-30 MB/s, so the absolute times say little and
the ratios are what to read.

    .venv/bin/python benchmarks/object_store.py --sizes 64,512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from pitstop.shell.format.untrusted import open_untrusted
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


def measure(server: S3Server, size: int, repeats: int) -> dict[str, list[float]]:
    """``{candidate: [seconds per repeat]}`` for ``size`` bytes."""
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
    times: dict[str, list[float]] = {k: [] for k in ("save", "put", "resume", "get")}
    for repeat in range(repeats):
        url = f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:8]}"
        model = _model(size)

        def save(url: str = url, model: torch.nn.Module = model) -> None:
            with pitstop.Checkpointer(url, model=model) as ckpt:
                times["save"].append(_timed(lambda: ckpt.save(pitstop.Progress(step=1))))

        def resume(url: str = url) -> None:
            with pitstop.Checkpointer(url, model=_model(size)) as ckpt:
                times["resume"].append(_timed(ckpt.resume))

        save()
        with open_untrusted(pitstop.verify(url)) as fetched:  # the bytes obstore moves
            file = Path(tempfile.mkdtemp(prefix="pitstop-s3-bench-")) / "checkpoint"
            file.write_bytes(fetched.read())
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

        put()
        for read in (resume, get) if repeat % 2 == 0 else (get, resume):
            read()
        file.unlink()
        file.parent.rmdir()
    return times


def rows_of(size_mib: float, times: dict[str, list[float]]) -> list[dict[str, Any]]:
    rows = []
    for op, ours, theirs in (("save", "save", "put"), ("resume", "resume", "get")):
        a, b = statistics.median(times[ours]), statistics.median(times[theirs])
        rows.append(
            {"size_mib": size_mib, "op": op, "pitstop_s": a, "obstore_s": b, "ratio": a / b}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64", help="checkpoint sizes in MiB, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each candidate per size")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.repeats < 1 or any(s <= 0 for s in sizes):
        parser.error("--repeats must be at least 1 and every size positive")
    print(f"# {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pitstop-s3-bench-") as tmp:
        server = S3Server.start(Path(tmp))
        saved = {k: os.environ.get(k) for k in server.env()}
        os.environ.update(server.env())
        try:
            for size in sizes:
                rows += rows_of(size, measure(server, int(size * MIB), args.repeats))
        finally:
            server.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    print("| MiB | operation | pitstop s | obstore s | pitstop / obstore |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        theirs = "put" if r["op"] == "save" else "get_ranges"
        print(
            f"| {r['size_mib']:g} | {r['op']} vs {theirs} | {r['pitstop_s']:.2f} | "
            f"{r['obstore_s']:.2f} | {r['ratio']:.2f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
