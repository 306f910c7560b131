"""Hostile sharded layouts: a real 2-rank FSDP2 checkpoint whose manifest is rewritten, its
checksums valid, to claim what its DCP files do not hold.

Chunks that cover only part of a value, an unknown dtype, shapes of 2**62, 2**64-1 and
3·2**28 elements (from a checkpoint of kilobytes), a key path that is both a leaf and a
subtree, an empty key path: every reader refuses it with one ``CheckpointCorrupt`` naming the
value — ``verify``, ``info``, ``load``, ``export_weights`` and ``pitstop ls --check`` — before
anything is allocated, so ``verify`` fails exactly when a reader would. (A scan reads the meta
and file table alone: it lists the checkpoint, which every check then refuses.)
"""

from __future__ import annotations

import contextlib
import io
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sharded_torch", exc_type=ImportError)  # on an older torch: skipped, saying why

import pitstop
from multirank import Job
from pitstop.cli import main as cli
from pitstop.core.sharding.sharded import MANIFEST_NAME, sharded_name
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import scan
from pitstop.shell.store.publish import publish_file
from pitstop.shell.store.storage import LocalStorage

SCRIPT = Path(__file__).with_name("sharded_train.py")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank FSDP2 run's checkpoint directory, saved at step 2."""
    root = tmp_path_factory.mktemp("hostile")
    args = ("--dir", root / "checkpoints", "--out", root / "out", "--target", "2", "--no-ema")
    with Job(SCRIPT, *args, ranks=2) as job:
        job.wait().check()
    return root / "checkpoints"


def _tensor(wire: dict[str, Any]) -> list[Any]:
    """The first model value of the layout stored in two chunks (one per rank)."""
    return next(v for v in wire["values"] if v[1][0] == "model" and len(v[4]) == 2)


def _uncovered(wire: dict[str, Any]) -> None:
    value = _tensor(wire)
    value[3][0] += 1  # one more row than the chunks hold: it would be uninitialised memory


def _unknown_dtype(wire: dict[str, Any]) -> None:
    _tensor(wire)[2] = "float99"


def _huge(elements: int) -> Callable[[dict[str, Any]], None]:
    def change(wire: dict[str, Any]) -> None:
        value = _tensor(wire)
        half = elements // 2
        value[3] = [elements]
        value[4][0][0], value[4][0][1] = [0], [half]
        value[4][1][0], value[4][1][1] = [half], [elements - half]  # covered: bytes can tell

    return change


def _leaf_and_subtree(wire: dict[str, Any]) -> None:
    first, second = [v for v in wire["values"] if v[1][0] == "model"][:2]
    second[1] = [*first[1], "inner"]


def _empty_path(wire: dict[str, Any]) -> None:
    _tensor(wire)[1] = []


CASES = {
    "uncovered": (_uncovered, "covered exactly once"),
    "unknown dtype": (_unknown_dtype, "unknown dtype 'float99'"),
    "2**62 elements": (_huge(2**62), "stored in"),
    "2**64-1 elements": (_huge(2**64 - 1), "stored in"),
    "3*2**28 elements": (_huge(3 * 2**28), "stored in"),
    "leaf and subtree": (_leaf_and_subtree, "both a value and holding"),
    "empty key path": (_empty_path, "empty key path"),
}


def _hostile_copy(saved: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of ``saved`` whose newest checkpoint's manifest holds ``change``'s layout,
    re-signed: its checksums are valid."""
    directory = tmp_path / "checkpoints"
    shutil.copytree(saved, directory, symlinks=True)
    checkpoint = directory / sharded_name(2)
    manifest = fileformat.read_manifest(checkpoint / MANIFEST_NAME)
    tree = fileformat.load(checkpoint / MANIFEST_NAME)
    meta = dict(manifest.meta)
    change(meta["sharded"])
    (checkpoint / MANIFEST_NAME).unlink()
    prepared = fileformat.prepare(tree)
    publish_file(
        LocalStorage(checkpoint),
        MANIFEST_NAME,
        secrets.token_hex(4),
        lambda file, sync: fileformat.write(file, prepared, meta, sync=sync),
    )
    return checkpoint


@pytest.mark.parametrize("case", list(CASES))
def test_every_reader_refuses_a_hostile_layout(saved: Path, tmp_path: Path, case: str) -> None:
    change, why = CASES[case]
    checkpoint = _hostile_copy(saved, tmp_path, change)
    readers: dict[str, Callable[[], object]] = {
        "verify": lambda: pitstop.verify(checkpoint),
        "info": lambda: pitstop.info(checkpoint),
        "load": lambda: pitstop.load(checkpoint),
        "export_weights": lambda: pitstop.export_weights(checkpoint, tmp_path / "w.pt"),
    }
    for name, read in readers.items():
        with pytest.raises(CheckpointCorrupt, match=why):
            read()
        assert not (tmp_path / "w.pt").exists(), name
    # A scan reads a sharded manifest's meta and file table, never its values (so that listing
    # costs about the manifest's bytes): it lists the checkpoint; every check refuses it.
    found = scan(LocalStorage(checkpoint.parent))
    assert checkpoint.name in {entry.name for entry in found.catalog}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli(["ls", str(checkpoint.parent), "--check"]) == 1
    assert why in " ".join(out.getvalue().split())  # the table wraps long reasons
