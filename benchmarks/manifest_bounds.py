"""What reading a hostile or huge manifest costs: CPU seconds and memory, per reader.

Builds, in ``--dir`` (a fresh temp directory by default):

* ``lists``: a single-file checkpoint whose tree is ``--lists`` one-item lists (``[[0], [0],
  ...]``; 10,000,000 make the 19 MiB manifest of issue 41 section 5), its framing and
  checksums valid, written byte by byte as a hostile writer would;
* ``legal``: the largest tree of one-item lists the writer accepts (just under
  ``MAX_MANIFEST_NODES``), written by pitstop's own writer;
* ``sharded``: a sharded checkpoint directory whose layout lists ``--values`` one-element
  float32 values (200,000 make a layout of about 10 MB), in one shard file.

Then each reader runs on each in a **fresh process** (so that one reader's memory is not the
next one's): the scan's read (``read_meta``, what ``pitstop ls`` and a resume's scan read), the
full ``read_manifest`` (what ``load`` and ``verify`` decode) and ``pitstop.verify``; each row
gives the CPU seconds of that call and its peak resident memory above the process's before it
(``VmHWM``), and how the call ended (``ok`` or the error's class).

Run: ``.venv/bin/python benchmarks/manifest_bounds.py`` (``--lists 1000000 --values 20000
--skip-legal`` for a quick run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from filebytes import DATA, assemble, document, packed


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _hostile_lists(path: Path, count: int) -> None:
    """A file whose manifest's tree is ``count`` one-item lists; everything else valid."""
    packer = msgpack.Packer(use_bin_type=True)
    tree = packer.pack_array_header(count) + b"\x91\x00" * count
    manifest = _with_tree(packed(document(tree=None)), tree)
    assemble(path, manifest, DATA)


def _with_tree(manifest: bytes, tree: bytes) -> bytes:
    marker = packed("tree") + packed(None)
    assert manifest.count(marker) == 1
    return manifest.replace(marker, packed("tree") + tree)


def _legal(path: Path) -> int:
    from pitstop.core.file.manifest import MAX_MANIFEST_NODES
    from pitstop.shell.format import fileformat

    count = (MAX_MANIFEST_NODES - 64) // 3  # a one-item list is three values: item, list, 0
    with path.open("wb") as file:
        fileformat.write(file, fileformat.prepare({"lists": [[0] for _ in range(count)]}), {})
    return count


def _sharded(directory: Path, values: int) -> None:
    from pitstop.core.sharding.layoutwire import LAYOUT_FORMAT
    from pitstop.core.sharding.sharded import ShardedLayout, StoredChunk, StoredValue
    from pitstop.shell.store.sharddir import file_table, write_manifest

    directory.mkdir()
    (directory / "__0_0.distcp").write_bytes(bytes(4 * values))
    files = file_table(directory, ["__0_0.distcp"], 0)
    layout = ShardedLayout(
        world_size=1,
        dcp_version="2",
        files=files,
        values=tuple(
            StoredValue(
                fqn=f"model.w{i}",
                path=("model", f"w{i}"),
                dtype="float32",
                shape=(1,),
                chunks=(
                    StoredChunk(
                        offsets=(0,), sizes=(1,), file=files[0].name, start=4 * i, length=4
                    ),
                ),
            )
            for i in range(values)
        ),
    )
    assert LAYOUT_FORMAT == 1
    write_manifest(directory, layout, {"progress": {"step": 1}})


def _child(reader: str, target: str) -> None:
    import resource

    from pitstop.shell.format import fileformat

    calls = {
        "read_meta": lambda: fileformat.read_meta(target, skip={"sharded": ("values",)}),
        "read_manifest": lambda: fileformat.read_manifest(target),
    }
    if reader == "verify":
        import pitstop

        calls["verify"] = lambda: pitstop.verify(target)
    before_rss = _vm("VmRSS")
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    start = cpu.ru_utime + cpu.ru_stime
    try:
        calls[reader]()
        outcome = "ok"
    except Exception as error:  # reported, as the row's outcome
        outcome = type(error).__name__
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "cpu_s": cpu.ru_utime + cpu.ru_stime - start,
                "peak_mib": (_vm("VmHWM") - before_rss) / 2**20,
                "outcome": outcome,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Build the manifests, run each reader on each in a fresh process, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lists", type=int, default=10_000_000)
    parser.add_argument("--values", type=int, default=200_000)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--skip-legal", action="store_true")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    root = args.dir or Path(tempfile.mkdtemp(prefix="manifest-bounds-"))
    cases: list[tuple[str, Path, tuple[str, ...]]] = []
    lists = root / "lists.pitstop"
    _hostile_lists(lists, args.lists)
    cases.append(
        (f"{args.lists:,} one-item lists (hostile)", lists, ("read_meta", "read_manifest"))
    )
    if not args.skip_legal:
        legal = root / "legal.pitstop"
        count = _legal(legal)
        cases.append(
            (f"{count:,} one-item lists (largest legal)", legal, ("read_meta", "read_manifest"))
        )
    sharded = root / "step_000000000001"
    _sharded(sharded, args.values)
    cases.append(
        (
            f"sharded, {args.values:,} values",
            sharded / "manifest.pitstop",
            ("read_meta", "read_manifest"),
        )
    )
    cases.append((f"sharded, {args.values:,} values", sharded, ("verify",)))
    print("| manifest | bytes | reader | CPU s | peak MiB | outcome |")
    print("|---|---:|---|---:|---:|---|")
    for label, path, readers in cases:
        size = path.stat().st_size if path.is_file() else (path / "manifest.pitstop").stat().st_size
        for reader in readers:
            out = subprocess.run(
                [sys.executable, __file__, "--child", reader, str(path)],
                capture_output=True,
                text=True,
                check=True,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(
                f"| {label} | {size:,} | {reader} | {row['cpu_s']:.2f} | {row['peak_mib']:.0f} "
                f"| {row['outcome']} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
