"""What decoding a manifest may cost: at most MAX_MANIFEST_NODES values, counted as they are
built; a scan decodes the meta alone.

Checked: a legal-looking 16 MiB manifest of four million small lists (about 21 million values)
is refused by every full reader, while a scan reads its meta; a single array longer than the
limit is refused at its header; the writer refuses a tree a reader would refuse, naming the
count, before a byte is written — with the limit lowered, writer and reader agree on every tree
(property); a manifest of n bytes never holds 2n values (the writer's shortcut, property); a
directory scan lists a checkpoint whose tree every reader refuses, and a resume falls back.
"""

from __future__ import annotations

import contextlib
import io
import struct
import zlib
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import pitstop
from filebytes import DATA, assemble, document, packed
from pitstop.cli import main as cli
from pitstop.core.file.manifest import MAX_MANIFEST_NODES
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.format import fileformat as ff
from pitstop.shell.format import filewrite, treecodec
from pitstop.shell.format.treecodec import ValueBudget, count_values, encode_tree, unpack
from pitstop.shell.store.directory import scan
from pitstop.shell.store.storage import LocalStorage

OVER = f"more than {MAX_MANIFEST_NODES:,} values"


def _with_tree(tree: bytes) -> bytes:
    """The valid manifest of ``document()`` with ``tree`` (packed msgpack) as its tree."""
    head = packed(document(tree=None))
    marker = packed("tree") + packed(None)
    assert head.count(marker) == 1
    return head.replace(marker, packed("tree") + tree)


def _many_lists(count: int, items: int) -> bytes:
    """A manifest whose tree is ``count`` arrays of ``items`` zeros each, packed directly."""
    array = bytes([0x90 | items]) + bytes(items)
    return _with_tree(msgpack.Packer().pack_array_header(count) + array * count)


@pytest.mark.slow
def test_a_manifest_over_the_real_value_limit_is_refused(tmp_path: Path) -> None:
    # 4,194,305 arrays of three zeros, 16 MiB: each array is five values (an item of the tree,
    # itself, its three zeros), 20,971,526 in all.
    count = MAX_MANIFEST_NODES // 4 + 1
    path = assemble(tmp_path / "lists.pitstop", _many_lists(count, 3), DATA)
    for read in (ff.read_manifest, ff.verify, ff.load):
        with pytest.raises(CheckpointCorrupt, match=rf"^{path}: manifest: {OVER}"):
            read(path)
    assert ff.read_meta(path) == {}  # a scan reads the meta alone


@pytest.mark.parametrize("limit", [10_000, MAX_MANIFEST_NODES])
def test_a_manifest_over_the_value_limit_is_refused_by_every_full_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    # The limit lowered (the reduced run; the slow one above runs the real limit everywhere):
    # one more array than the limit allows is refused by every full reader, while a scan reads
    # the meta. At the real limit, read_manifest alone (every reader decodes the same way).
    monkeypatch.setattr(treecodec, "MAX_MANIFEST_NODES", limit)
    path = assemble(tmp_path / "lists.pitstop", _many_lists(limit // 4 + 1, 3), DATA)
    readers = (ff.read_manifest, ff.verify, ff.load) if limit < MAX_MANIFEST_NODES else ()
    for read in (ff.read_manifest, *readers):
        with pytest.raises(CheckpointCorrupt, match=rf"^{path}: manifest: more than {limit:,}"):
            read(path)
    assert ff.read_meta(path) == {}
    if readers:  # and one that fits is read
        fits = assemble(tmp_path / "fits.pitstop", _many_lists(limit // 5 - 20, 3), DATA)
        assert len(ff.read_manifest(fits).tree) == limit // 5 - 20


def test_an_array_longer_than_the_limit_is_refused_at_its_header(tmp_path: Path) -> None:
    length = MAX_MANIFEST_NODES + 1
    tree = msgpack.Packer().pack_array_header(length) + bytes(length)
    path = assemble(tmp_path / "long.pitstop", _with_tree(tree), DATA)
    with pytest.raises(CheckpointCorrupt, match=r"manifest: not a valid manifest encoding"):
        ff.read_manifest(path)


def test_the_writer_refuses_a_tree_over_the_limit_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 1000
    monkeypatch.setattr(filewrite, "MAX_MANIFEST_NODES", limit)
    tree = {"history": [[float(i)] for i in range(400)], "w": torch.ones(3)}  # 1,200+ values
    path = tmp_path / "big.pitstop"
    with path.open("wb") as file, pytest.raises(SaveError, match=r"hold 1,2\d\d values"):
        ff.write(file, ff.prepare(tree), {})
    assert path.stat().st_size == 0  # nothing written
    with path.open("wb") as file:  # within the real limit: written, and read back
        monkeypatch.setattr(filewrite, "MAX_MANIFEST_NODES", MAX_MANIFEST_NODES)
        ff.write(file, ff.prepare(tree), {})
    assert ff.load(path)["history"][399] == [399.0]


_LEAVES = st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=3))
_TREES = st.recursive(
    _LEAVES,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4),
        st.lists(kids, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=3), kids, max_size=4),
        st.frozensets(st.integers(0, 20), max_size=3),
    ),
    max_leaves=40,
)


@given(tree=_TREES)
def test_n_bytes_of_a_tree_hold_fewer_than_2n_values(tree: object) -> None:
    data = encode_tree(tree, on_tensor=None)
    assert count_values(data) < 2 * len(data)  # the writer counts only past MAX_NODES / 2 bytes


@given(tree=_TREES, slack=st.integers(-3, 3))
def test_writer_and_reader_agree_on_the_limit(
    tree: object, slack: int, tmp_path_factory: pytest.TempPathFactory
) -> None:
    directory = tmp_path_factory.mktemp("agree", numbered=True)
    whole = directory / "whole.pitstop"
    with whole.open("wb") as file:
        ff.write(file, ff.prepare({"t": tree}), {"m": tree})
    manifest = _manifest_bytes(whole)
    limit = max(0, count_values(manifest) + slack)
    reader_accepts = True
    try:
        unpack(manifest, ValueBudget(limit))
    except CheckpointCorrupt:
        reader_accepts = False
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(filewrite, "MAX_MANIFEST_NODES", limit)
        writer_accepts = True
        with (directory / "limited.pitstop").open("wb") as file:
            try:
                ff.write(file, ff.prepare({"t": tree}), {"m": tree})
            except SaveError:
                writer_accepts = False
    assert writer_accepts == reader_accepts == (slack >= 0)


def _manifest_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    _, _, _, offset, length, crc = struct.unpack("<8sIIQQI", data[-40:-4])
    manifest = data[offset : offset + length]
    assert zlib.crc32(manifest) == crc
    return manifest


def test_a_scan_lists_a_checkpoint_its_readers_refuse_and_a_resume_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A directory scan decodes each manifest's meta alone (about the manifest's bytes in time
    # and memory, whatever its tree holds); verify and a resume decode the rest and refuse.
    directory = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    with pitstop.Checkpointer(directory, model=model) as ckpt:
        ckpt.resume()
        ckpt.save(pitstop.Progress(step=1))
        ckpt.save(pitstop.Progress(step=2))
    newest = directory / "step_000000000002.pitstop"
    tree = msgpack.ExtType(99, b"")  # an ext code no reader knows
    manifest = _manifest_bytes(newest)
    doc = msgpack.unpackb(manifest, raw=False, strict_map_key=False)
    doc["tree"] = tree
    newest.unlink()
    data = b""  # no tensor left: its table is empty
    doc["tensors"], doc["blobs"] = [], []
    assemble(newest, packed(doc), data)
    assert newest.name in {entry.name for entry in scan(LocalStorage(directory)).catalog}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert cli(["ls", str(directory), "--check"]) == 1
    assert "unknown msgpack ext code 99" in " ".join(out.getvalue().split())
    with pytest.raises(CheckpointCorrupt, match="unknown msgpack ext code 99"):
        pitstop.verify(newest)
    with pitstop.Checkpointer(directory, model=torch.nn.Linear(2, 2)) as again:
        assert again.resume().step == 1
    assert f"skips a checkpoint that does not verify: {newest}" in caplog.text
