# The wire form of a sharded checkpoint's layout: the msgpack-able lists and dicts that the
# manifest's `sharded` key holds, and the checked way back.
#
# Rules: a layout read back is untrusted: every field is type-checked and cross-checked (the
# layout records' own checks in pitstop.core.sharding.sharded; each tensor value's dtype known
# and its chunks' bytes enough for their elements: pitstop.core.sharding.shardcover), each
# problem a CheckpointCorrupt naming the key path: layout_from_wire is the one check every
# reader's layout passes before anything is allocated. A directory scan reads only the files
# (files_from_wire); the values are checked when the checkpoint is read or verified.
# How: pure functions over plain lists; LAYOUT_FORMAT versions the form.

"""The wire form of a sharded layout (:func:`layout_to_wire`, :func:`layout_from_wire`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from pitstop.core.sharding.shardcover import extent_problem
from pitstop.core.sharding.sharded import (
    ShardedLayout,
    ShardFile,
    StoredChunk,
    StoredValue,
    _check,
    _ints,
)

__all__ = ["LAYOUT_FORMAT", "files_from_wire", "layout_from_wire", "layout_to_wire"]

LAYOUT_FORMAT: Final = 1
"""The version of the layout's wire form (the manifest's ``sharded`` key)."""


def layout_to_wire(layout: ShardedLayout) -> dict[str, Any]:
    """The layout as plain lists and dicts, for the manifest's ``sharded`` key."""
    return {
        "format": LAYOUT_FORMAT,
        "world_size": layout.world_size,
        "dcp_version": layout.dcp_version,
        "files": [[f.name, f.size, f.crc32, f.rank] for f in layout.files],
        "values": [
            [
                v.fqn,
                list(v.path),
                v.dtype,
                list(v.shape),
                [[list(c.offsets), list(c.sizes), c.file, c.start, c.length] for c in v.chunks],
            ]
            for v in layout.values
        ],
    }


def _row(value: object, length: int, where: str) -> Sequence[Any]:
    _check(
        isinstance(value, (list, tuple)) and len(value) == length,
        where,
        f"a list of {length}",
        value,
    )
    assert isinstance(value, (list, tuple))
    return value


def _int_tuple(value: object, where: str) -> tuple[int, ...]:
    _check(isinstance(value, (list, tuple)), where, "a list of ints >= 0", value)
    assert isinstance(value, (list, tuple))
    result = tuple(value)
    _check(_ints(result), where, "a list of ints >= 0", value)
    return result


def _str(value: object, where: str) -> str:
    _check(isinstance(value, str), where, "a str", value)
    assert isinstance(value, str)
    return value


def files_from_wire(data: object, where: str = "sharded") -> tuple[ShardFile, ...]:
    """The files of a layout's wire form, each row checked (what a directory scan reads of a
    sharded checkpoint: its values are checked when it is read or verified).

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the key path of the first problem.
    """
    _check(isinstance(data, Mapping), where, "a mapping", type(data).__name__)
    assert isinstance(data, Mapping)
    _check(
        isinstance(data.get("files"), (list, tuple)), f"{where}.files", "a list", data.get("files")
    )
    files = []
    for i, raw in enumerate(data["files"]):
        name, size, crc, rank = _row(raw, 4, f"{where}.files[{i}]")
        numbers = _int_tuple((size, crc, rank), f"{where}.files[{i}]")
        files.append(
            ShardFile(
                name=_str(name, f"{where}.files[{i}][0]"),
                size=numbers[0],
                crc32=numbers[1],
                rank=numbers[2],
            )
        )
    _check(len({f.name for f in files}) == len(files), f"{where}.files", "unique names", files)
    return tuple(files)


def layout_from_wire(
    data: object, where: str = "sharded", *, itemsizes: Mapping[str, int]
) -> ShardedLayout:
    """Rebuild a layout from its wire form, checking every field (the manifest is untrusted):
    besides the layout's own checks, each tensor value's dtype is one of ``itemsizes`` (the
    reader's allow-list: bytes per element, by name) and each chunk's bytes hold its elements.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the key path of the first problem.
    """
    _check(isinstance(data, Mapping), where, "a mapping", type(data).__name__)
    assert isinstance(data, Mapping)
    _check(
        data.get("format") == LAYOUT_FORMAT,
        f"{where}.format",
        str(LAYOUT_FORMAT),
        data.get("format"),
    )
    for key in ("files", "values"):
        _check(isinstance(data.get(key), (list, tuple)), f"{where}.{key}", "a list", data.get(key))
    files = files_from_wire(data, where)
    values = []
    for i, raw in enumerate(data["values"]):
        at = f"{where}.values[{i}]"
        fqn, path, dtype, shape, chunks = _row(raw, 5, at)
        _check(
            isinstance(path, (list, tuple)) and all(type(p) in (str, int) for p in path),
            f"{at}.path",
            "a list of keys",
            path,
        )
        _check(dtype is None or isinstance(dtype, str), f"{at}.dtype", "a str or None", dtype)
        _check(isinstance(chunks, (list, tuple)), f"{at}.chunks", "a list", chunks)
        stored = []
        for j, chunk in enumerate(chunks):
            offsets, sizes, file, start, length = _row(chunk, 5, f"{at}.chunks[{j}]")
            span = _int_tuple((start, length), f"{at}.chunks[{j}]")
            stored.append(
                StoredChunk(
                    offsets=_int_tuple(offsets, f"{at}.chunks[{j}].offsets"),
                    sizes=_int_tuple(sizes, f"{at}.chunks[{j}].sizes"),
                    file=_str(file, f"{at}.chunks[{j}].file"),
                    start=span[0],
                    length=span[1],
                )
            )
        values.append(
            StoredValue(
                fqn=_str(fqn, f"{at}.fqn"),
                path=tuple(path),
                dtype=dtype,
                shape=_int_tuple(shape, f"{at}.shape"),
                chunks=tuple(stored),
            )
        )
    for i, value in enumerate(values):
        if value.dtype is not None:
            spans = [((c.offsets, c.sizes), c.length) for c in value.chunks]
            problem = extent_problem(value.dtype, spans, itemsizes)
            _check(problem is None, f"{where}.values[{i}] ({value.fqn})", "readable", problem)
    (world,) = _int_tuple((data.get("world_size"),), f"{where}.world_size")
    return ShardedLayout(
        world_size=world,
        dcp_version=_str(data.get("dcp_version"), f"{where}.dcp_version"),
        files=files,
        values=tuple(values),
    )
