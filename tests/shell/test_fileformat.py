"""The checkpoint file format: round trips, sharing, corruption, hostile files, save errors.

Hostile files are assembled here from docs/file-format.md's byte layout (not from the module's
constants), so these tests also check that the document and the code agree.
"""

from __future__ import annotations

import collections
import importlib.util
import io
import itertools
import math
import os
import pickle  # noqa: TID251  # only to craft payloads that must never be unpickled
import random
import struct
import sys
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from filebytes import DATA, assemble, document, packed, tensor_ref
from pitstop.errors import CheckpointCorrupt, IncompatibleCheckpoint, SaveError
from pitstop.shell.format import fileformat as ff
from pitstop.shell.format.treecheck import check_tree
from pitstop.shell.format.treecodec import MAX_DEPTH, dtypes, tensor_dtypes

ALL_DTYPES = sorted(tensor_dtypes().values(), key=str)
INT_MIN, INT_MAX = -(2**63), 2**64 - 1
_names = itertools.count()


# --- helpers ----------------------------------------------------------------------------------


def save(path: Path, tree: object, meta: dict[str, object] | None = None) -> int:
    prepared = ff.prepare(tree)
    with open(path, "wb") as file:
        return ff.write(file, prepared, meta or {})


def fresh(directory: Path) -> Path:
    # A new name per example: loaded tensors map their file, which must never be truncated.
    return directory / f"c{next(_names)}.pitstop"


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of each element, shape (*t.shape, itemsize): a dtype-free bitwise view."""
    size = t.element_size()
    if t.numel() == 0:
        return torch.empty((*t.shape, size), dtype=torch.uint8)
    raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
    strides = (*(s * size for s in t.stride()), 1)
    return raw.as_strided((*t.shape, size), strides, t.storage_offset() * size)


def assert_same_tensor(expected: torch.Tensor, actual: torch.Tensor, path: str) -> None:
    assert type(actual) is torch.Tensor, path
    assert actual.device.type == "cpu", path
    assert actual.dtype == expected.dtype, path
    assert actual.shape == expected.shape, path
    assert actual.stride() == expected.stride(), path
    assert torch.equal(element_bytes(expected).cpu(), element_bytes(actual)), path


def assert_same_tree(expected: object, actual: object, path: str = "<root>") -> None:
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert_same_tensor(expected, actual, path)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert [repr(k) for k in actual] == [repr(k) for k in expected], path
        for (key, value), other in zip(expected.items(), actual.values(), strict=True):
            assert_same_tree(value, other, f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        assert isinstance(actual, (list, tuple))
        assert len(actual) == len(expected), path
        for i, (value, other) in enumerate(zip(expected, actual, strict=True)):
            assert_same_tree(value, other, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert struct.pack("<d", expected) == struct.pack("<d", actual), path
    elif isinstance(expected, (set, frozenset)):
        assert isinstance(actual, (set, frozenset))
        assert sorted(map(repr, actual)) == sorted(map(repr, expected)), path
    else:
        assert actual == expected, path


def tensor_leaves(tree: object) -> Iterator[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from tensor_leaves(value)
    elif isinstance(tree, (list, tuple)) and not isinstance(tree, torch.Size):
        for value in tree:
            yield from tensor_leaves(value)


def relations(tensors: list[torch.Tensor]) -> set[tuple[int, int, str, int]]:
    """Which tensors are the same object, and which share memory at what byte distance."""
    found = set()
    for (i, a), (j, b) in itertools.combinations(enumerate(tensors), 2):
        if a is b:
            found.add((i, j, "same object", 0))
        shared = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        if a.numel() and b.numel() and shared:
            delta = (
                int(a.storage_offset()) * a.element_size()
                - int(b.storage_offset()) * b.element_size()
            )
            found.add((i, j, "shared storage", delta))
    return found


def assert_round_trip(tree: object, path: Path) -> object:
    written = save(path, tree, {"note": "round trip"})
    assert written == path.stat().st_size
    ff.verify(path)
    loaded = ff.load(path)
    assert_same_tree(tree, loaded)
    assert relations(list(tensor_leaves(loaded))) == relations(list(tensor_leaves(tree)))
    return loaded


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    count = math.prod(shape) * dtype.itemsize
    data = random.Random(seed).randbytes(count)
    return torch.tensor(list(data), dtype=torch.uint8).view(dtype).reshape(shape)


# --- strategies -------------------------------------------------------------------------------


@st.composite
def base_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    count = math.prod(shape) * dtype.itemsize
    data = draw(st.binary(min_size=count, max_size=count))
    return torch.tensor(list(data), dtype=torch.uint8).view(dtype).reshape(shape)


def _view_ops(t: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor]]:
    ops: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x: x,  # the same object again (tied weights)
        lambda x: x.detach(),  # another tensor over the same storage
        lambda x: x.unsqueeze(0).expand(2, *x.shape),  # stride 0
    ]
    same_size = [d for d in ALL_DTYPES if d.itemsize == t.element_size() and d != t.dtype]
    if same_size:
        ops.append(lambda x: x.view(same_size[0]))
    if t.dim() >= 2:
        ops.append(lambda x: x.transpose(0, -1))
    if t.dim() >= 1 and t.shape[0] > 1:
        ops += [lambda x: x[::2], lambda x: x[1:], lambda x: x[0]]
    return ops


@st.composite
def tensor_pools(draw: st.DrawFn) -> list[torch.Tensor]:
    pool = draw(st.lists(base_tensors(), min_size=1, max_size=3))
    for _ in range(draw(st.integers(0, 4))):
        source = pool[draw(st.integers(0, len(pool) - 1))]  # indices: tensor reprs can fail
        pool.append(draw(st.sampled_from(_view_ops(source)))(source))
    return pool


HASHABLES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(INT_MIN, INT_MAX),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.tuples(st.integers(-5, 5), st.text(max_size=2)),
    st.sampled_from(sorted(dtypes().values(), key=str)),
)


@st.composite
def trees(draw: st.DrawFn) -> object:
    pool = draw(tensor_pools())

    def pick(index: int) -> torch.Tensor:
        return pool[index]

    leaves = st.one_of(
        HASHABLES,
        st.floats(),  # NaN and infinities too
        st.lists(st.integers(0, 9), max_size=3).map(torch.Size),
        st.sets(HASHABLES, max_size=3),
        st.frozensets(HASHABLES, max_size=3),
        st.integers(0, len(pool) - 1).map(pick),
    )
    return draw(
        st.recursive(
            leaves,
            lambda kids: st.one_of(
                st.lists(kids, max_size=3),
                st.lists(kids, max_size=3).map(tuple),
                st.dictionaries(st.text(max_size=4), kids, max_size=3),
                st.dictionaries(st.integers(-3, 2**40), kids, max_size=3),
                st.dictionaries(HASHABLES, kids, max_size=3).map(collections.OrderedDict),
            ),
            max_leaves=12,
        )
    )


# --- round trips ------------------------------------------------------------------------------


@given(tree=trees())
def test_any_tree_round_trips_bitwise_with_types_and_sharing(
    tree: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert_round_trip(tree, fresh(_shared_dir(tmp_path_factory)))


_DIRS: dict[str, Path] = {}


def _shared_dir(factory: pytest.TempPathFactory) -> Path:
    # One directory for all examples (a function-scoped tmp_path does not reset per example).
    if "roundtrip" not in _DIRS:
        _DIRS["roundtrip"] = factory.mktemp("roundtrip")
    return _DIRS["roundtrip"]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_in_every_shape(dtype: torch.dtype, tmp_path: Path) -> None:
    base = random_tensor((3, 4), dtype, seed=7)
    tree = {
        "scalar": random_tensor((), dtype, seed=1),
        "empty": random_tensor((0,), dtype),
        "empty_2d": random_tensor((2, 0, 3), dtype),
        "matrix": base,
        "transposed": base.T,
        "strided": random_tensor((5, 6), dtype, seed=3)[::2, 1::2],
        "expanded": random_tensor((3,), dtype, seed=4).expand(4, 3),
    }
    loaded = assert_round_trip(tree, tmp_path / "all.pitstop")
    assert isinstance(loaded, dict)
    assert loaded["transposed"].untyped_storage().data_ptr() == (
        loaded["matrix"].untyped_storage().data_ptr()
    )


def test_the_readers_dtype_sizes_are_torchs() -> None:
    # Reading a manifest checks sizes by name without torch: the table must say what torch does.
    for name, size in ff.ITEMSIZES.items():
        dtype = getattr(torch, name, None)
        if isinstance(dtype, torch.dtype):
            assert dtype.itemsize == size, name
            assert tensor_dtypes()[name] is dtype
    assert set(tensor_dtypes()) <= set(ff.ITEMSIZES)
    assert set(tensor_dtypes()) < set(dtypes())  # quantized dtypes: values only


def test_python_values_come_back_with_their_exact_types(tmp_path: Path) -> None:
    tree = {
        "optimizer": {
            "state": {0: {"step": 3}, 1: {"step": 4}},
            "param_groups": [{"params": [0, 1], "betas": (0.9, 0.999), "lr": 1e-3}],
        },
        "tuple": (1, (2, 3), [4]),
        "set": {1, "a", (2, 3)},
        "frozenset": frozenset({b"x", None}),
        "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
        "size": torch.Size([2, 3]),
        "dtypes": [torch.bfloat16, torch.float8_e5m2, torch.qint8, torch.complex64],
        "ints": [INT_MIN, INT_MAX, -1, 0, True, False],
        "floats": [math.nan, -0.0, math.inf, -math.inf, 1e-310],
        "keys": {(1, "a"): 1, 2.5: 2, None: 3, b"k": 4, True: 5, frozenset({1}): 6},
        "text": "ünïcode ✓",
        "bytes": b"\x00\xff",
        "empty": [{}, [], (), set(), frozenset()],
    }
    assert_round_trip(tree, tmp_path / "types.pitstop")


def test_tied_weights_and_views_are_stored_once_and_come_back_shared(tmp_path: Path) -> None:
    weight = torch.randn(64, 32)
    tree = {
        "encoder.weight": weight,
        "decoder.weight": weight,  # the same object twice
        "decoder.weight_t": weight.T,
        "half": weight[32:],
        "as_int": weight.view(torch.int32),
    }
    path = tmp_path / "tied.pitstop"
    loaded = assert_round_trip(tree, path)
    assert isinstance(loaded, dict)
    manifest = ff.read_manifest(path)
    assert len(manifest.blobs) == 1
    assert manifest.blobs[0].length == weight.numel() * 4
    assert loaded["encoder.weight"] is loaded["decoder.weight"]
    storage = loaded["encoder.weight"].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in loaded.values())
    loaded["encoder.weight"][0, 0] = 123.0  # writes reach every view, as before saving
    assert loaded["decoder.weight_t"][0, 0].item() == 123.0
    assert loaded["as_int"][0, 0].item() == torch.tensor(123.0).view(torch.int32).item()


def test_a_small_view_of_a_large_storage_stores_only_its_span(tmp_path: Path) -> None:
    big = torch.arange(100_000, dtype=torch.float32)
    path = tmp_path / "view.pitstop"
    assert_round_trip({"slice": big[5000:5010]}, path)
    assert path.stat().st_size < 2000


def test_alignment_padding_and_layout_follow_the_core(tmp_path: Path) -> None:
    tree = {"a": torch.ones(3, dtype=torch.uint8), "b": torch.ones(5, dtype=torch.float64)}
    path = tmp_path / "aligned.pitstop"
    save(path, tree)
    manifest = ff.read_manifest(path)
    raw = path.read_bytes()
    assert [b.offset for b in manifest.blobs] == [64, 128]
    assert raw[67:128] == bytes(61)  # zero padding between the spans
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    assert all(t.data_ptr() % 64 == 0 for t in loaded.values())


def test_conjugate_and_negative_views_are_stored_resolved(tmp_path: Path) -> None:
    z = torch.randn(3, dtype=torch.complex64)
    path = tmp_path / "conj.pitstop"
    save(path, {"conj": z.conj(), "neg": z.conj().imag})
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    assert torch.equal(loaded["conj"], z.conj().resolve_conj())
    assert torch.equal(loaded["neg"], z.conj().imag.resolve_neg())


def test_parameters_are_stored_as_plain_tensors(tmp_path: Path) -> None:
    layer = torch.nn.Linear(3, 2)
    path = tmp_path / "param.pitstop"
    save(path, {"weight": layer.weight, "state": layer.state_dict()})
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    assert type(loaded["weight"]) is torch.Tensor
    assert torch.equal(loaded["weight"], layer.weight.detach())
    assert loaded["weight"].untyped_storage().data_ptr() == (
        loaded["state"]["weight"].untyped_storage().data_ptr()
    )


def test_writing_is_deterministic(tmp_path: Path) -> None:
    tree = {"tags": {"b", "a", "c"}, "x": torch.arange(10), "meta": frozenset({"q", "p"})}
    save(tmp_path / "one.pitstop", tree, {"k": {"z", "y"}})
    save(tmp_path / "two.pitstop", tree, {"k": {"z", "y"}})
    assert (tmp_path / "one.pitstop").read_bytes() == (tmp_path / "two.pitstop").read_bytes()


class _ShortWrites(io.RawIOBase):
    """A raw file that takes at most 1000 bytes per write call."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        chunk = bytes(memoryview(b)[:1000])
        self.data += chunk
        return len(chunk)


def test_large_tensors_are_checksummed_on_the_pool_and_short_writes_are_finished(
    tmp_path: Path,
) -> None:
    big = torch.randn(1_200_000)  # 4.8 MB: more than one chunk, checksummed on the thread pool
    tree = {"big": big, "small": torch.arange(3)}
    short = _ShortWrites()
    written = ff.write(short, ff.prepare(tree), {})  # type: ignore[arg-type]
    path = tmp_path / "big.pitstop"
    assert save(path, tree) == written == len(short.data)
    assert path.read_bytes() == bytes(short.data)
    manifest = ff.read_manifest(path)
    blob = manifest.blobs[0]
    assert blob.crc32 == zlib.crc32(bytes(short.data)[blob.offset : blob.stop])
    ff.verify(path)
    assert_same_tree(tree, ff.load(path))


def test_meta_comes_back_from_read_manifest_with_the_size(tmp_path: Path) -> None:
    path = tmp_path / "meta.pitstop"
    meta = {"step": 100, "reason": "interval", "metrics": {"loss": 0.5}, "ranks": (0, 1)}
    written = save(path, {"x": torch.ones(2)}, meta)
    manifest = ff.read_manifest(path)
    assert dict(manifest.meta) == meta
    assert type(manifest.meta["ranks"]) is tuple
    assert manifest.size == written == path.stat().st_size
    # No NumPy value: written as version 1, which every pitstop reads; NumPy values need 2.
    assert manifest.version == 1
    save(tmp_path / "np.pitstop", {"x": np.arange(3)}, {})
    assert ff.read_manifest(tmp_path / "np.pitstop").version == ff.FORMAT_VERSION == 2
    assert manifest.tensor_paths == (("x",),)
    assert manifest.tensors[0].dtype == "float32"


def test_loaded_tensors_are_copy_on_write_and_outlive_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cow.pitstop"
    save(path, {"x": torch.zeros(1000)})
    before = path.read_bytes()
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    loaded["x"] += 1
    assert path.read_bytes() == before
    ff.verify(path)
    path.unlink()
    assert loaded["x"].sum().item() == 1000


def test_an_empty_tree_and_a_bare_tensor_round_trip(tmp_path: Path) -> None:
    assert_round_trip({}, tmp_path / "empty.pitstop")
    assert_round_trip(torch.tensor(1.5), tmp_path / "bare.pitstop")
    assert_round_trip([], tmp_path / "list.pitstop")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_written_from_the_device_and_load_on_the_cpu(tmp_path: Path) -> None:
    weight = torch.randn(1024, 700, device="cuda")
    tree = {"w": weight, "wt": weight.T, "bias": torch.randn(5, device="cuda")}
    path = tmp_path / "cuda.pitstop"
    save(path, tree)
    ff.verify(path)
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    for key, value in tree.items():
        assert_same_tensor(value, loaded[key], key)
    assert loaded["w"].untyped_storage().data_ptr() == loaded["wt"].untyped_storage().data_ptr()


# --- save errors ------------------------------------------------------------------------------


class _Opaque:
    pass


class _SubTensor(torch.Tensor):
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        (
            {"state": {"scheduler": {"lr_lambdas": [lambda e: 0.9**e]}}},
            r"state\.scheduler\.lr_lambdas\[0\]",
        ),
        ({"a": [1, {"b": _Opaque()}]}, r"a\[1\]\.b: cannot store a value of type .*_Opaque"),
        ({"big": 2**64}, r"big: int .* outside the int64/uint64 range"),
        ({"small": [-(2**63) - 1]}, r"small\[0\]: int"),
        ({"layer.0.weight": bytearray(b"x")}, r"\['layer\.0\.weight'\]: cannot store .*bytearray"),
        ({"d": collections.defaultdict(list)}, r"d: cannot store .*defaultdict"),
        ({"s": {torch.ones(1)}}, r"s\{.*\}: a tensor cannot be stored as a set member"),
        ({"k": {torch.ones(1): 1}}, r"k \(key .*\): a tensor cannot be stored as a dict key"),
        ({"q": _quantized()}, r"q: quantized"),
        ({"sp": torch.ones(2).to_sparse()}, r"sp: torch\.sparse_coo tensors are not supported"),
        ({"m": torch.empty(2, device="meta")}, r"m: a tensor on the meta device"),
        ({"sub": torch.ones(2).as_subclass(_SubTensor)}, r"sub: tensor subclass _SubTensor"),
        ({"g": (i for i in range(2))}, r"g: cannot store .*generator"),
    ],
)
def test_unstorable_values_raise_save_error_naming_the_key_path_before_writing(
    tree: object, message: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.pitstop"
    with open(path, "wb") as file, pytest.raises(SaveError, match=message):
        ff.write(file, ff.prepare(tree), {})
    assert path.stat().st_size == 0


def test_a_tree_nested_too_deeply_is_refused() -> None:
    tree: list[object] = []
    node = tree
    for _ in range(MAX_DEPTH + 5):
        child: list[object] = []
        node.append(child)
        node = child
    with pytest.raises(SaveError, match="nested deeper"):
        ff.prepare(tree)


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"w": torch.ones(1)}, r"meta\.w: tensors are not allowed here"),
        ({1: "x"}, r"meta keys must be str"),
        ({"f": print}, r"meta\.f: cannot store"),
    ],
)
def test_bad_meta_raises_before_a_byte_is_written(
    meta: dict[Any, object], message: str, tmp_path: Path
) -> None:
    prepared = ff.prepare({"x": torch.ones(2)})
    path = tmp_path / "meta.pitstop"
    with open(path, "wb") as file, pytest.raises(SaveError, match=message):
        ff.write(file, prepared, meta)
    assert path.stat().st_size == 0


def test_big_endian_hosts_refuse_to_write_and_to_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "le.pitstop"
    save(path, {"x": torch.ones(2)})
    monkeypatch.setattr(sys, "byteorder", "big")
    with pytest.raises(SaveError, match="big-endian"):
        ff.prepare({"x": torch.ones(2)})
    with pytest.raises(IncompatibleCheckpoint, match="big-endian"):
        ff.load(path)


# --- corruption -------------------------------------------------------------------------------


def _sample_tree() -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(5, 3, generator=generator)
    return {
        "weights": {
            "raw": {"w": weight, "w_t": weight.T, "b": torch.randn(3, generator=generator)},
            "ema": {"w": weight.clone(), "b": torch.zeros(3, dtype=torch.bfloat16)},
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5, 3)}},
            "param_groups": [{"params": [0], "lr": 0.1, "betas": (0.9, 0.99)}],
        },
        "progress": {"step": 3, "epoch": 0},
    }


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "sample.pitstop"
    save(path, _sample_tree(), {"step": 3, "reason": "interval"})
    return path


def _regions(path: Path) -> dict[str, list[int]]:
    manifest = ff.read_manifest(path)
    regions: dict[str, list[int]] = {"header": list(range(64)), "blob": [], "padding": []}
    cursor = 64
    for blob in manifest.blobs:
        regions["padding"] += range(cursor, blob.offset)
        regions["blob"] += range(blob.offset, blob.stop)
        cursor = blob.stop
    regions["manifest"] = list(range(manifest.manifest_offset, manifest.size - 40))
    regions["footer"] = list(range(manifest.size - 40, manifest.size))
    return regions


def _flip_offsets(path: Path, per_region: int) -> list[tuple[str, int]]:
    chosen = []
    rng = random.Random(1234)
    for region, offsets in _regions(path).items():
        assert offsets, f"the sample file has no {region}"
        picked = offsets if len(offsets) <= per_region else rng.sample(offsets, per_region)
        chosen += [(region, o) for o in sorted({offsets[0], offsets[-1], *picked})]
    return chosen


def _assert_every_change_detected(path: Path, changes: list[tuple[str, int, int]]) -> None:
    original = path.read_bytes()
    for region, offset, new in changes:
        corrupt = bytearray(original)
        assert corrupt[offset] != new
        corrupt[offset] = new
        path.write_bytes(bytes(corrupt))
        with pytest.raises(CheckpointCorrupt, match=str(path)):
            ff.verify(path)
        if region in ("header", "manifest", "footer"):
            with pytest.raises(CheckpointCorrupt):
                ff.read_manifest(path)
    path.write_bytes(original)
    ff.verify(path)


def test_flipping_a_byte_anywhere_is_detected_by_verify(sample: Path) -> None:
    flips = _flip_offsets(sample, per_region=200)
    assert len(flips) >= 500
    assert {region for region, _ in flips} == {"header", "blob", "padding", "manifest", "footer"}
    original = sample.read_bytes()
    _assert_every_change_detected(sample, [(r, o, original[o] ^ 0xFF) for r, o in flips])


@pytest.mark.slow
def test_every_single_bit_flip_of_every_byte_is_detected_by_verify(sample: Path) -> None:
    original = sample.read_bytes()
    changes = [
        (region, offset, original[offset] ^ (1 << bit))
        for region, offsets in _regions(sample).items()
        for offset in offsets
        for bit in range(8)
    ]
    _assert_every_change_detected(sample, changes)


def _truncations(size: int, count: int) -> list[int]:
    must = {0, 1, 8, 63, 64, 65, 103, 104, size - 41, size - 40, size - 39, size - 1}
    rest = random.Random(99).sample(range(size), min(size, count))
    return sorted({n for n in must | set(rest) if 0 <= n < size})


@pytest.mark.parametrize("slow", [pytest.param(True, marks=pytest.mark.slow), False])
def test_truncation_at_any_length_is_detected(sample: Path, slow: bool) -> None:
    original = sample.read_bytes()
    lengths = range(len(original)) if slow else _truncations(len(original), 120)
    assert len(lengths) >= 100
    for length in lengths:
        sample.write_bytes(original[:length])
        for check in (ff.verify, ff.read_manifest, ff.load):
            with pytest.raises(CheckpointCorrupt, match=r"incomplete|footer|too small"):
                check(sample)
    sample.write_bytes(original + b"\0")
    with pytest.raises(CheckpointCorrupt):
        ff.verify(sample)


def test_read_manifest_does_not_read_tensor_bytes(sample: Path) -> None:
    manifest = ff.read_manifest(sample)
    raw = bytearray(sample.read_bytes())
    raw[manifest.blobs[0].offset] ^= 0xFF
    sample.write_bytes(bytes(raw))
    assert dict(ff.read_manifest(sample).meta) == {"step": 3, "reason": "interval"}
    with pytest.raises(CheckpointCorrupt, match=r"blob 0 .*weights\.raw\.w"):
        ff.verify(sample)


# --- partial loads ----------------------------------------------------------------------------


def test_a_subtree_load_touches_only_the_blobs_it_needs(sample: Path) -> None:
    manifest = ff.read_manifest(sample)
    raw_blob = manifest.tensors[manifest.tensor_paths.index(("weights.raw.w",))].blob
    corrupt = bytearray(sample.read_bytes())
    corrupt[manifest.blobs[raw_blob].offset + 5] ^= 0x01
    sample.write_bytes(bytes(corrupt))

    ema = ff.load(sample, select=("weights", "ema"))
    assert_same_tree(_sample_tree()["weights"]["ema"], ema)  # type: ignore[index]
    state = ff.load(sample, select=("optimizer", "state", 0))
    assert isinstance(state, dict)
    assert state["step"].item() == 3.0
    assert ff.load(sample, select=("optimizer", "param_groups", 0, "betas")) == (0.9, 0.99)

    for select in (None, ("weights",), ("weights", "raw")):
        with pytest.raises(CheckpointCorrupt, match=r"weights\.raw\.w.* fails its checksum"):
            ff.load(sample, select=select)
    unchecked = ff.load(sample, select=("weights", "raw"), verify=False)
    assert isinstance(unchecked, dict)
    assert not torch.equal(unchecked["w"], _sample_tree()["weights"]["raw"]["w"])  # type: ignore[index]


def test_selecting_a_missing_key_raises_incompatible_checkpoint(sample: Path) -> None:
    with pytest.raises(IncompatibleCheckpoint, match=r"no weights\.swa"):
        ff.load(sample, select=("weights", "swa"))
    with pytest.raises(IncompatibleCheckpoint, match=r"optimizer\.state\['0'\]"):
        ff.load(sample, select=("optimizer", "state", "0"))
    with pytest.raises(TypeError, match="sequence of keys"):
        ff.load(sample, select="weights")


# --- hostile files ----------------------------------------------------------------------------
# Built from the documented layout: header <8sII44sI>, footer <8sIIQQII>, crc32 everywhere.


def with_tensor(**changes: object) -> dict[str, object]:
    tensors = document()["tensors"]
    assert isinstance(tensors, list)
    return document(tensors=[{**tensors[0], **changes}])


def test_the_documented_layout_loads(tmp_path: Path) -> None:
    path = assemble(tmp_path / "ok.pitstop", packed(document()), DATA)
    ff.verify(path)
    loaded = ff.load(path)
    assert isinstance(loaded, dict)
    assert loaded["x"].tolist() == [1.5, -2.0]


def _deep_tuple(depth: int) -> msgpack.ExtType:
    node = msgpack.ExtType(1, packed([]))
    for _ in range(depth):
        node = msgpack.ExtType(1, packed([node]))
    return node


HOSTILE: dict[str, tuple[dict[str, Any], str]] = {
    "manifest of 2**62 bytes": ({"manifest_length": 2**62}, "claims a"),
    "manifest of 1 GiB": ({"manifest_length": 2**30}, "places the manifest"),
    "manifest offset past EOF": ({"manifest_offset": 2**40}, "places the manifest"),
    "manifest inside the header": ({"manifest_offset": 10}, "places the manifest"),
    "newer format version": ({"version": 3}, "format version 3"),
    "header flags": ({"flags": 1}, "flags"),
    "blob past EOF": (
        {"manifest": document(blobs=[{"offset": 2**40, "length": 8, "crc32": 0}])},
        "must start at 64",
    ),
    "blob longer than the file": (
        {"manifest": document(blobs=[{"offset": 64, "length": 2**50, "crc32": 0}])},
        "runs past the data region",
    ),
    "overlapping blobs": (
        {
            "manifest": document(
                blobs=[
                    {"offset": 64, "length": 8, "crc32": zlib.crc32(DATA)},
                    {"offset": 66, "length": 2, "crc32": 0},
                ]
            )
        },
        "must start at 128",
    ),
    "unaccounted bytes": (
        {"manifest": document(blobs=[{"offset": 64, "length": 4, "crc32": 0}])},
        "unaccounted",
    ),
    "negative shape": ({"manifest": with_tensor(shape=[-2], stride=[1])}, r"shape must be an int"),
    "negative stride": ({"manifest": with_tensor(stride=[-1])}, r"stride must be an int"),
    "negative offset": ({"manifest": with_tensor(offset=-4, storage_offset=-1)}, "offset"),
    "shape past the blob": ({"manifest": with_tensor(shape=[3])}, "needs bytes 0..12"),
    "stride past the blob": (
        {"manifest": with_tensor(stride=[2])},
        "needs bytes 0..12 of blob 0, which holds 8",
    ),
    "huge expanded shape": (
        {"manifest": with_tensor(shape=[2**62, 2**62], stride=[0, 0])},
        "too many elements",
    ),
    "too many dimensions": (
        {"manifest": with_tensor(shape=[1] * 65, stride=[1] * 65)},
        "at most 64",
    ),
    "shape and stride disagree": ({"manifest": with_tensor(stride=[1, 1])}, "same length"),
    "offset not storage_offset x itemsize": ({"manifest": with_tensor(offset=2)}, "itemsize"),
    "unknown dtype name": ({"manifest": with_tensor(dtype="object")}, "not a known tensor dtype"),
    "code as a dtype name": (
        {"manifest": with_tensor(dtype="__import__('os').system('touch pwned')")},
        "not a known tensor dtype",
    ),
    "quantized dtype for a tensor": ({"manifest": with_tensor(dtype="qint8")}, "dtype"),
    "blob index out of range": ({"manifest": with_tensor(blob=1)}, r"blob must be an int"),
    "unknown ext code": (
        {"manifest": document(tree={"x": msgpack.ExtType(42, b"\x00")})},
        "unknown msgpack ext code 42",
    ),
    "unknown dtype value": (
        {"manifest": document(tree={"x": msgpack.ExtType(6, b"float128")})},
        "unknown dtype name",
    ),
    "timestamp ext": (
        {"manifest": document(tree={"x": msgpack.Timestamp(0)})},
        "unexpected value of type",
    ),
    "tensor index out of range": (
        {"manifest": document(tree={"x": tensor_ref(5)})},
        "not in the tensor table",
    ),
    "tensor in a set": (
        {"manifest": document(tree={"x": msgpack.ExtType(2, packed([tensor_ref(0)]))})},
        "set member",
    ),
    "tensor in meta": ({"manifest": document(meta={"x": tensor_ref(0)})}, "none is allowed"),
    "meta with int keys": ({"manifest": document(meta={1: 2})}, "str keys"),
    "nesting too deep": (
        {"manifest": document(tree={"x": _deep_tuple(MAX_DEPTH + 5)})},
        "nested deeper",
    ),
    "bad ext payload": (
        {"manifest": document(tree={"x": msgpack.ExtType(1, b"\xc1")})},
        "not a valid manifest",
    ),
    "unhashable set member": (
        {"manifest": document(tree={"x": msgpack.ExtType(2, packed([[1]]))})},
        "not a valid manifest",
    ),
    "manifest is not a map": ({"manifest": [1, 2, 3]}, "expected a map"),
    "extra manifest key": ({"manifest": document(code="print('hi')")}, "expected a map"),
    "format disagrees with header": ({"manifest": document(format=2)}, "disagrees"),
    "array header claiming 2**32 items": ({"raw": b"\xdd\xff\xff\xff\xff"}, "not a valid"),
    "invalid utf-8": ({"raw": b"\x81\xa1\xff\x00"}, "not a valid"),
    "trailing bytes after the manifest": ({"raw": packed(document()) + b"\x00"}, "not a valid"),
}


def _nested(depth: int, leaf: Callable[[object], object]) -> object:
    """A leaf under ``depth`` levels of one-item containers (``leaf`` wraps the last)."""
    node = leaf(0)
    for _ in range(depth - 1):
        node = [node]
    return node


@pytest.mark.parametrize(
    "leaf",
    [lambda x: [x], lambda x: {"k": x}, lambda x: {x: "v"}, lambda x: {x}],
    ids=["list item", "dict value", "dict key", "set member"],
)
@pytest.mark.parametrize("depth", range(MAX_DEPTH - 2, MAX_DEPTH + 3))
def test_a_read_tree_s_leaves_count_towards_its_depth_wherever_they_are(
    leaf: Callable[[object], object], depth: int
) -> None:
    # A leaf at depth ``depth`` (the root at 0) passes only up to MAX_DEPTH, whether or not
    # the walk visits it (the check skips leaves it can pass without a visit).
    tree = _nested(depth, leaf)
    if depth <= MAX_DEPTH:
        assert check_tree(tree, root="", tensor_count=0) == ()
    else:
        with pytest.raises(CheckpointCorrupt, match=f"nested deeper than {MAX_DEPTH} levels"):
            check_tree(tree, root="", tensor_count=0)


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_hostile_files_raise_checkpoint_corrupt(case: str, tmp_path: Path) -> None:
    options, message = HOSTILE[case]
    options = dict(options)
    manifest = options.pop("raw", None)
    if manifest is None:
        manifest = packed(options.pop("manifest", document()))
    path = assemble(tmp_path / "hostile.pitstop", manifest, DATA, **options)
    for check in (ff.read_manifest, ff.load, ff.verify):
        with pytest.raises(CheckpointCorrupt, match=message):
            check(path)


@st.composite
def hostile_manifests(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, or a valid manifest with a few bytes changed, inserted or cut."""
    if draw(st.booleans()):
        return draw(st.binary(min_size=1, max_size=300))
    data = bytearray(packed(document()))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["change", "insert", "cut"]))
        if action == "change":
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif len(data) > 1:
            del data[at]
    return bytes(data)


@given(manifest=hostile_manifests())
def test_any_manifest_bytes_load_or_raise_checkpoint_corrupt(
    manifest: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # Header, footer and checksums valid: every check of the manifest itself is exercised.
    path = assemble(fresh(_shared_dir(tmp_path_factory)), manifest, DATA)
    for check in (ff.read_manifest, ff.load, ff.verify, ff.read_meta):
        try:
            check(path)
        except CheckpointCorrupt as error:
            assert str(error).startswith(f"{path}: ")  # noqa: PT017  # named, never another kind
    # A scan reads the meta alone: it never refuses a file a full reader accepts, and finds the
    # same meta in it.
    try:
        meta = ff.read_manifest(path).meta
    except CheckpointCorrupt:
        return
    assert ff.read_meta(path) == meta


@given(data=st.binary(max_size=400))
def test_any_file_bytes_load_or_raise_checkpoint_corrupt(
    data: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = fresh(_shared_dir(tmp_path_factory))
    path.write_bytes(data)
    for check in (ff.read_manifest, ff.load, ff.verify, ff.read_meta):
        with pytest.raises(CheckpointCorrupt, match=str(path)):
            check(path)


class _Canary:
    """Unpickling this creates the directory ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.mkdir, (str(self.path),))


def test_pickle_payloads_are_never_executed(tmp_path: Path) -> None:
    live = tmp_path / "live-canary"
    pickle.loads(pickle.dumps(_Canary(live)))  # the payload is live
    assert live.exists()

    canary = tmp_path / "canary"
    payload = pickle.dumps(_Canary(canary))

    as_bytes = assemble(tmp_path / "bytes.pitstop", packed(document(tree={"p": payload})), DATA)
    assert ff.load(as_bytes) == {"p": payload}  # returned as plain bytes, harmlessly
    ff.verify(as_bytes)

    as_manifest = assemble(tmp_path / "manifest.pitstop", payload)
    as_ext = assemble(
        tmp_path / "ext.pitstop", packed(document(tree={"p": msgpack.ExtType(80, payload)}))
    )
    as_meta = assemble(
        tmp_path / "meta.pitstop", packed(document(meta={"p": msgpack.ExtType(2, payload)}))
    )
    torch_file = tmp_path / "torch.pitstop"
    torch.save({"p": _Canary(canary)}, torch_file)
    for path in (as_manifest, as_ext, as_meta, torch_file):
        for check in (ff.read_manifest, ff.load, ff.verify):
            with pytest.raises(CheckpointCorrupt):
                check(path)
    assert not canary.exists()


def test_a_file_that_is_not_a_checkpoint_is_named_as_such(tmp_path: Path) -> None:
    path = tmp_path / "notes.pitstop"
    path.write_bytes(b"hello world, this is not a checkpoint at all" * 5)
    with pytest.raises(CheckpointCorrupt, match=r"notes\.pitstop: not a pitstop checkpoint"):
        ff.read_manifest(path)


# --- benchmark --------------------------------------------------------------------------------


def test_checksum_benchmark_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "checksum_speed.py"
    spec = importlib.util.spec_from_file_location("benchmarks_checksum_speed", script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out_json = tmp_path / "speed.json"
    assert (
        module.main(
            ["--mib", "1", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out_json)]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "zlib.crc32 (one call)" in out
    assert "fileformat verify" in out
    assert out_json.exists()


# --- what is not a regular file, and manifests claimed but not there ---------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory"])
def test_something_else_in_a_checkpoints_place_is_refused_before_it_is_read(
    tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "step_000000000001.pitstop"
    if kind == "fifo":
        os.mkfifo(path)  # an open for reading would block until a writer came
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)  # a read would never end
    else:
        path.mkdir()
    # a checkpoint file is never reached through a link: the link itself is refused
    why = "is a symlink; it is not followed" if kind == "dev-zero" else "not a regular file"
    for check in (ff.read_manifest, ff.load, ff.verify):
        with pytest.raises(CheckpointCorrupt, match=rf"not a checkpoint: .* {why}"):
            check(path)


def test_a_footer_claiming_a_huge_manifest_is_refused_without_holding_it(tmp_path: Path) -> None:
    """A 1 GiB manifest claimed over a sparse file: its start is checked first, then its
    checksum a piece at a time; the claim costs neither seconds nor memory."""
    from reliability.bounds import bounded

    path = tmp_path / "claims.pitstop"
    size = (2 << 30) + 4096
    assemble(path, b"", manifest_offset=size - 40 - (1 << 30), manifest_length=1 << 30)
    with open(path, "r+b") as file:  # move the footer to the end of a sparse 2 GiB file
        file.seek(64)
        footer = file.read(40)
        file.truncate(64)
        file.truncate(size - 40)
        file.seek(size - 40)
        file.write(footer)
    for check in (ff.read_manifest, ff.verify):
        _, error, _ = bounded(lambda check=check: check(path), seconds=5)
        assert isinstance(error, CheckpointCorrupt)
        assert "no manifest starts there" in str(error)
