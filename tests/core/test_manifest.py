"""The manifest's structure: header, footer and tables are checked, on any bytes, purely."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pitstop.core.file.layout import align
from pitstop.core.file.manifest import (
    ALIGNMENT,
    FOOTER_SIZE,
    FORMAT_VERSION,
    HEADER_SIZE,
    MANIFEST_KEYS,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    Blob,
    Footer,
    Manifest,
    TensorDescriptor,
    blob_table,
    check_footer,
    check_header,
    check_manifest_bytes,
    check_size,
    descriptor_table,
    pack_footer,
    pack_header,
    parse_manifest,
)
from pitstop.errors import CheckpointCorrupt

T = TypeVar("T")
NAME = "run/step_000000000007.pitstop"
# The reader's allow-list as the shell passes it (names -> bytes per element), a few of them.
ITEMSIZES = {"uint8": 1, "bfloat16": 2, "float32": 4, "int64": 8, "complex128": 16}


def no_tensor_refs(
    tree: object, *, root: str, tensor_count: int | None
) -> tuple[tuple[str, ...], ...]:
    """A stand-in for the shell's tree check: every value is fine, no tensor is used."""
    return ((),) * (tensor_count or 0)


def parse(doc: object, *, offset: int, size: int | None = None) -> Manifest:
    return parse_manifest(
        doc,
        name=NAME,
        size=offset + 100 if size is None else size,
        version=FORMAT_VERSION,
        offset=offset,
        itemsizes=ITEMSIZES,
        check_tree=no_tensor_refs,
    )


def outcome(call: Callable[[], T]) -> T | CheckpointCorrupt:
    """What ``call`` returns, or the CheckpointCorrupt it raises (any other error propagates)."""
    try:
        return call()
    except CheckpointCorrupt as error:
        return error


def assert_valid(manifest: Manifest) -> None:
    """What every manifest the parser returns must satisfy."""
    cursor = HEADER_SIZE
    for blob in manifest.blobs:
        assert blob.offset == align(cursor, ALIGNMENT)
        assert 0 <= blob.crc32 < 1 << 32
        cursor = blob.stop
    assert cursor == manifest.manifest_offset
    assert len(manifest.tensor_paths) == len(manifest.tensors)
    for d in manifest.tensors:
        itemsize = ITEMSIZES[d.dtype]
        assert 0 <= d.blob < len(manifest.blobs)
        assert len(d.shape) == len(d.stride) <= MAX_NDIM
        assert d.offset == d.storage_offset * itemsize
        if d.numel:
            last = sum((n - 1) * s for n, s in zip(d.shape, d.stride, strict=True))
            assert d.offset + (last + 1) * itemsize <= manifest.blobs[d.blob].length
    assert all(type(k) is str for k in manifest.meta)


# --- strategies -------------------------------------------------------------------------------


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[Blob], list[TensorDescriptor], int]:
    """Valid blob and descriptor tables, and where the data region ends."""
    blobs = []
    cursor = HEADER_SIZE
    for _ in range(draw(st.integers(0, 4))):
        offset = align(cursor, ALIGNMENT)
        length = draw(st.integers(0, 300))
        blobs.append(Blob(offset=offset, length=length, crc32=draw(st.integers(0, 2**32 - 1))))
        cursor = offset + length
    tensors = []
    for _ in range(draw(st.integers(0, 5)) if blobs else 0):
        blob = draw(st.integers(0, len(blobs) - 1))
        name = draw(st.sampled_from(sorted(ITEMSIZES)))
        itemsize = ITEMSIZES[name]
        elements = blobs[blob].length // itemsize
        count = draw(st.integers(0, elements))
        storage_offset = draw(st.integers(0, elements - count))
        tensors.append(
            TensorDescriptor(
                blob=blob,
                offset=storage_offset * itemsize,
                dtype=name,
                shape=(count,),
                stride=(1,),
                storage_offset=storage_offset,
            )
        )
    return blobs, tensors, cursor


def document(
    blob_list: list[Blob], tensor_list: list[TensorDescriptor], **changes: object
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "tree": {"x": [1, 2]},
        "tensors": descriptor_table(tensor_list),
        "blobs": blob_table(blob_list),
        "meta": {"step": 7},
    }
    doc.update(changes)
    return doc


plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.text(max_size=4)
    | st.binary(max_size=4),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def mutated_documents(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """A valid document with one field anywhere in it replaced by an arbitrary value."""
    blobs, tensors, end = draw(tables())
    doc = document(blobs, tensors)
    targets: list[tuple[Any, Any]] = [(doc, key) for key in MANIFEST_KEYS]
    for table in ("tensors", "blobs"):
        targets += [(doc[table], i) for i in range(len(doc[table]))]
        for entry in doc[table]:
            targets += [(entry, key) for key in entry]
            for key in ("shape", "stride"):
                if key in entry:
                    targets += [(entry[key], i) for i in range(len(entry[key]))]
    container, key = draw(st.sampled_from(targets))
    if draw(st.booleans()):
        container[key] = draw(plain)
    elif isinstance(container, dict):
        del container[key]
    return doc, end + draw(st.sampled_from([0, 0, 1, -1, 64]))


# --- header and footer ------------------------------------------------------------------------


@given(st.binary(min_size=0, max_size=2 * HEADER_SIZE))
def test_any_header_bytes_give_a_version_or_checkpoint_corrupt(data: bytes) -> None:
    result = outcome(lambda: check_header(data, name=NAME))
    if isinstance(result, CheckpointCorrupt):
        assert NAME in str(result)
    else:
        assert data == pack_header()
        assert result == FORMAT_VERSION


@given(
    st.binary(min_size=0, max_size=2 * FOOTER_SIZE),
    st.integers(0, 2**65),
    st.integers(0, 2**32),
)
def test_any_footer_bytes_give_a_footer_or_checkpoint_corrupt(
    data: bytes, size: int, version: int
) -> None:
    footer = outcome(lambda: check_footer(data, name=NAME, size=size, version=version))
    if isinstance(footer, CheckpointCorrupt):
        assert NAME in str(footer)
    else:
        assert footer.version == version
        assert footer.manifest_offset >= HEADER_SIZE
        assert 1 <= footer.manifest_length <= MAX_MANIFEST_BYTES
        assert footer.manifest_offset + footer.manifest_length == size - FOOTER_SIZE


@given(
    st.integers(HEADER_SIZE, 2**50), st.integers(1, MAX_MANIFEST_BYTES), st.integers(0, 2**32 - 1)
)
def test_a_packed_footer_reads_back(offset: int, length: int, crc: int) -> None:
    size = offset + length + FOOTER_SIZE
    packed = pack_footer(offset, length, crc)
    assert len(packed) == FOOTER_SIZE
    assert check_footer(packed, name=NAME, size=size, version=FORMAT_VERSION) == Footer(
        version=FORMAT_VERSION, manifest_offset=offset, manifest_length=length, manifest_crc32=crc
    )


def test_a_packed_header_reads_back_as_documented() -> None:
    header = pack_header()
    assert len(header) == HEADER_SIZE
    body = struct.pack("<8sII44s", b"PITSTOP\0", FORMAT_VERSION, 0, bytes(44))
    assert header == body + struct.pack("<I", zlib.crc32(body))
    assert check_header(header, name=NAME) == FORMAT_VERSION


@given(st.data())
def test_any_changed_header_byte_is_detected(data: st.DataObject) -> None:
    header = bytearray(pack_header())
    at = data.draw(st.integers(0, HEADER_SIZE - 1), label="offset")
    header[at] = data.draw(st.integers(0, 255).filter(lambda b: b != header[at]), label="byte")
    with pytest.raises(CheckpointCorrupt, match=NAME):
        check_header(bytes(header), name=NAME)


@given(st.data(), st.integers(HEADER_SIZE, 2**40), st.integers(1, 2**20), st.integers(0, 2**32 - 1))
def test_any_changed_footer_byte_is_detected(
    data: st.DataObject, offset: int, length: int, crc: int
) -> None:
    size = offset + length + FOOTER_SIZE
    footer = bytearray(pack_footer(offset, length, crc))
    at = data.draw(st.integers(0, FOOTER_SIZE - 1), label="offset")
    footer[at] = data.draw(st.integers(0, 255).filter(lambda b: b != footer[at]), label="byte")
    with pytest.raises(CheckpointCorrupt, match=NAME):
        check_footer(bytes(footer), name=NAME, size=size, version=FORMAT_VERSION)


@given(st.binary(max_size=64), st.integers(0, 2**32 - 1))
def test_manifest_bytes_must_match_the_footer(data: bytes, crc: int) -> None:
    footer = Footer(
        version=1, manifest_offset=HEADER_SIZE, manifest_length=len(data), manifest_crc32=crc
    )
    if zlib.crc32(data) == crc:
        check_manifest_bytes(data, footer, name=NAME)
    else:
        with pytest.raises(CheckpointCorrupt, match=rf"{NAME}: manifest .* fails its checksum"):
            check_manifest_bytes(data, footer, name=NAME)


def test_a_file_too_small_to_hold_a_checkpoint_is_incomplete() -> None:
    check_size(HEADER_SIZE + FOOTER_SIZE + 1, name=NAME)
    with pytest.raises(CheckpointCorrupt, match=f"{NAME}: 104 bytes .* incomplete"):
        check_size(HEADER_SIZE + FOOTER_SIZE, name=NAME)


# --- the manifest's tables --------------------------------------------------------------------


@given(tables())
def test_tables_round_trip_through_pack_and_parse(
    case: tuple[list[Blob], list[TensorDescriptor], int],
) -> None:
    blobs, tensors, end = case
    packed = msgpack.packb(document(blobs, tensors), use_bin_type=True)
    manifest = parse(msgpack.unpackb(packed, strict_map_key=False), offset=end)
    assert manifest.blobs == tuple(blobs)
    assert manifest.tensors == tuple(tensors)
    assert dict(manifest.meta) == {"step": 7}
    assert manifest.tree == {"x": [1, 2]}
    assert (manifest.path, manifest.manifest_offset) == (NAME, end)
    assert_valid(manifest)


def first_value(data: bytes) -> object:
    """The first msgpack value ``data`` begins with; the bytes themselves if none."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=1 << 16)
    unpacker.feed(data)
    try:
        return next(unpacker)
    except Exception:  # not msgpack (the shell's decoder refuses it): a bytes value, then
        return data


@given(st.binary(max_size=200) | st.binary(max_size=200).map(lambda b: b"\x85" + b))
def test_any_decoded_bytes_give_a_valid_manifest_or_checkpoint_corrupt(data: bytes) -> None:
    doc = first_value(data)
    manifest = outcome(lambda: parse(doc, offset=HEADER_SIZE))
    if isinstance(manifest, CheckpointCorrupt):
        assert str(manifest).startswith(f"{NAME}: manifest: ")
    else:
        assert_valid(manifest)


@given(mutated_documents())
def test_any_changed_field_gives_a_valid_manifest_or_checkpoint_corrupt(
    case: tuple[dict[str, Any], int],
) -> None:
    doc, end = case
    manifest = outcome(lambda: parse(doc, offset=end))
    if isinstance(manifest, CheckpointCorrupt):
        assert str(manifest).startswith(f"{NAME}: manifest: ")
    else:
        assert_valid(manifest)


def _one_tensor(**changes: object) -> dict[str, Any]:
    blob = Blob(offset=HEADER_SIZE, length=8, crc32=0)
    tensor = TensorDescriptor(
        blob=0, offset=0, dtype="float32", shape=(2,), stride=(1,), storage_offset=0
    )
    entry = {**descriptor_table([tensor])[0], **changes}
    return document([blob], [tensor], tensors=[entry])


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], r"expected a map with keys"),
        (document([], [], extra=1), r"expected a map with keys"),
        (document([], [], format=1), r"format 1 disagrees with the header \(2\)"),
        (document([], [], tensors={}), r"tensors must be an array, got dict"),
        (document([], [], meta={1: 2}), r"meta must be a map with str keys"),
        (_one_tensor(dtype="object"), r"tensors\[0\] \(unused\)\.dtype 'object' is not a known"),
        (_one_tensor(blob=1), r"tensors\[0\] \(unused\)\.blob must be an int in \[0, 1\)"),
        (_one_tensor(shape=[-2]), r"tensors\[0\] \(unused\)\.shape must be an int"),
        (_one_tensor(shape=[3]), r"tensors\[0\] \(unused\): needs bytes 0\.\.12 of blob 0"),
        (_one_tensor(offset=2), r"byte offset 2 is not storage_offset 0 x itemsize 4"),
        (_one_tensor(stride=[1, 1]), r"must have the same length"),
        (_one_tensor(shape=[2**62, 2**62], stride=[0, 0]), r"too many elements"),
    ],
)
def test_each_bad_field_is_named_with_the_file(doc: object, message: str) -> None:
    offset = HEADER_SIZE + 8 if isinstance(doc, dict) and doc["blobs"] else HEADER_SIZE
    with pytest.raises(CheckpointCorrupt, match=rf"^{NAME}: manifest: .*{message}"):
        parse(doc, offset=offset)


@pytest.mark.parametrize(
    ("blobs", "end", "message"),
    [
        ([{"offset": 64, "length": 4, "crc32": 0}], 128, r"bytes 68\.\.128 .* unaccounted"),
        ([{"offset": 72, "length": 4, "crc32": 0}], 76, r"blobs\[0\] starts at byte 72, .* 64"),
        ([{"offset": 64, "length": 99, "crc32": 0}], 80, r"blobs\[0\] .* runs past the data"),
        ([{"offset": 64, "length": 4, "crc32": 2**32}], 68, r"blobs\[0\]\.crc32 must be an int"),
        ([{"offset": 64, "length": 4}], 68, r"blobs\[0\] must be a map with keys"),
    ],
)
def test_each_bad_blob_is_named(blobs: list[dict[str, int]], end: int, message: str) -> None:
    with pytest.raises(CheckpointCorrupt, match=rf"^{NAME}: manifest: {message}"):
        parse(document([], [], blobs=blobs), offset=end)


def test_the_tree_check_passed_in_names_the_tensors_in_messages() -> None:
    def named(tree: object, *, root: str, tensor_count: int | None) -> tuple[tuple[str, ...], ...]:
        return (("weights.raw.w", "weights.ema.w"),) * (tensor_count or 0)

    with pytest.raises(
        CheckpointCorrupt, match=r"tensors\[0\] \(weights\.raw\.w, weights\.ema\.w\)"
    ):
        parse_manifest(
            _one_tensor(shape=[3]),
            name=NAME,
            size=1000,
            version=FORMAT_VERSION,
            offset=HEADER_SIZE + 8,
            itemsizes=ITEMSIZES,
            check_tree=named,
        )


def test_a_tree_check_failure_is_named_with_the_file() -> None:
    def refuse(tree: object, *, root: str, tensor_count: int | None) -> tuple[tuple[str, ...], ...]:
        raise CheckpointCorrupt(f"{root or '<root>'}: unexpected value")

    with pytest.raises(CheckpointCorrupt, match=rf"^{NAME}: manifest: <root>: unexpected value"):
        parse_manifest(
            document([], []),
            name=NAME,
            size=1000,
            version=FORMAT_VERSION,
            offset=HEADER_SIZE,
            itemsizes=ITEMSIZES,
            check_tree=refuse,
        )
