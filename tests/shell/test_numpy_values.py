"""NumPy values in a checkpoint tree: stored as bytes, dtype and shape; refused and checked."""

from __future__ import annotations

import itertools
import random
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pitstop
from pitstop.core.file.arrays import NUMPY_DTYPE_NAMES
from pitstop.errors import CheckpointCorrupt, ConfigError, SaveError
from pitstop.shell.format import fileformat as ff
from pitstop.shell.format.treewalk import walk

_names = itertools.count()


def round_trip(directory: Path, tree: object) -> object:
    path = directory / f"n{next(_names)}.pitstop"
    prepared = ff.prepare(tree)
    with open(path, "wb") as file:
        ff.write(file, prepared, {})
    ff.verify(path)
    return ff.load(path)


def assert_same_array(expected: np.ndarray, actual: object) -> None:
    assert type(actual) is np.ndarray
    assert actual.dtype == expected.dtype.newbyteorder("=")
    assert actual.shape == expected.shape
    assert actual.tobytes() == np.ascontiguousarray(expected, actual.dtype).tobytes()
    assert actual.flags.c_contiguous
    assert actual.flags.writeable


def test_numpys_global_random_state_round_trips_exactly(tmp_path: Path) -> None:
    np.random.seed(5)
    np.random.rand(3)
    np.random.standard_normal()  # a cached Gaussian in the state
    state = np.random.get_state()
    loaded = round_trip(tmp_path, {"numpy": state})
    assert isinstance(loaded, dict)
    stored = loaded["numpy"]
    assert type(stored) is tuple
    assert stored[0] == "MT19937"
    assert_same_array(state[1], stored[1])
    assert stored[2:] == state[2:]
    expected = np.random.standard_normal(5)
    np.random.set_state(stored)
    assert np.random.standard_normal(5).tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", NUMPY_DTYPE_NAMES)
def test_every_dtype_round_trips_as_array_and_scalar(name: str, tmp_path: Path) -> None:
    dtype = np.dtype(name)
    raw = np.random.default_rng(0).integers(0, 256, size=24 * dtype.itemsize, dtype=np.uint8)
    if name == "bool":
        raw = raw % 2
    array = raw.view(dtype).reshape(2, 3, -1)
    scalar = array.reshape(-1)[1]
    arrays = {
        "c": array,
        "f": np.asfortranarray(array),
        "strided": array[:, ::2],
        "empty": np.zeros((0, 3), dtype),
        "zero_d": np.array(scalar),
        "swapped": array.astype(dtype.newbyteorder(">")),
    }
    loaded = round_trip(tmp_path, {**arrays, "scalar": scalar})
    assert isinstance(loaded, dict)
    for key, value in arrays.items():
        assert_same_array(value, loaded[key])
    assert type(loaded["scalar"]) is type(scalar)
    assert loaded["scalar"].tobytes() == scalar.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    hnp.arrays(
        st.sampled_from(NUMPY_DTYPE_NAMES).map(np.dtype),
        hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
    )
)
def test_any_array_round_trips_bitwise(
    tmp_path_factory: pytest.TempPathFactory, array: np.ndarray
) -> None:
    loaded = round_trip(tmp_path_factory.mktemp("np"), {"x": [array, (array,)]})
    assert isinstance(loaded, dict)
    assert_same_array(array, loaded["x"][0])
    assert_same_array(array, loaded["x"][1][0])


def test_a_snapshot_walk_copies_arrays() -> None:
    array = np.arange(4)
    copied = walk({"a": array, "s": np.int64(3)}, on_tensor=None)
    array[0] = 99
    assert isinstance(copied, dict)
    assert copied["a"].tolist() == [0, 1, 2, 3]
    assert copied["s"] == 3


@pytest.mark.parametrize(
    ("tree", "message"),
    [
        ({"a": np.array([object()])}, r"a: NumPy arrays of dtype object cannot be stored"),
        ({"b": {"c": np.array(["x"])}}, r"b\.c: NumPy arrays of dtype <U1 cannot be stored"),
        ({"m": np.ma.masked_array([1])}, r"m: cannot store a NumPy value of type .*MaskedArray"),
        ({"t": np.datetime64("2020-01-01")}, r"t: cannot store a NumPy value of type .*datetime64"),
        ({"r": np.zeros(2, dtype=[("x", "i4")])}, r"r: NumPy arrays of dtype .* cannot be stored"),
        ({"g": np.random.default_rng(0)}, r"g: cannot store a NumPy value of type .*Generator"),
    ],
)
def test_unstorable_numpy_values_are_refused_by_key_path(
    tree: object, message: str, tmp_path: Path
) -> None:
    with pytest.raises(SaveError, match=message):
        ff.prepare(tree)


def test_numpy_values_in_the_config_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.lr: NumPy values are not allowed here"):
        pitstop.Checkpointer(
            tmp_path / "c", model=torch.nn.Linear(1, 1), config={"lr": np.float64(0.1)}
        )


class NumpyRandom:
    """A component holding NumPy's and Python's random state."""

    def state_dict(self) -> dict[str, object]:
        return {"numpy": np.random.get_state(), "python": random.getstate()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        np.random.set_state(state["numpy"])  # type: ignore[arg-type]
        random.setstate(state["python"])  # type: ignore[arg-type]


def test_a_component_with_numpy_state_saves_and_resumes(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    np.random.seed(1)
    np.random.rand(7)
    with pitstop.Checkpointer(tmp_path / "c", model=model, state={"rng": NumpyRandom()}) as ckpt:
        ckpt.save(pitstop.Progress(step=1))
    expected = np.random.rand(4)
    np.random.seed(123)
    with pitstop.Checkpointer(tmp_path / "c", model=model, state={"rng": NumpyRandom()}) as ckpt:
        assert ckpt.resume().step == 1
    assert np.random.rand(4).tobytes() == expected.tobytes()


# --- hostile payloads, in files assembled from docs/file-format.md --------------------------


def assemble(path: Path, tree: object) -> Path:
    manifest = msgpack.packb(
        {"format": 2, "tree": tree, "tensors": [], "blobs": [], "meta": {}}, use_bin_type=True
    )
    head = struct.pack("<8sII44s", b"PITSTOP\0", 2, 0, bytes(44))
    foot = struct.pack("<8sIIQQI", b"\0POTSTIP", 2, 0, 64, len(manifest), zlib.crc32(manifest))
    path.write_bytes(
        head
        + struct.pack("<I", zlib.crc32(head))
        + manifest
        + foot
        + struct.pack("<I", zlib.crc32(foot))
    )
    return path


def ext(code: int, payload: object) -> msgpack.ExtType:
    return msgpack.ExtType(code, msgpack.packb(payload, use_bin_type=True))


def test_a_documented_array_and_scalar_load(tmp_path: Path) -> None:
    tree = {
        "a": ext(8, ["uint32", [2], struct.pack("<2I", 7, 2**32 - 1)]),
        "s": ext(9, ["float64", struct.pack("<d", 0.25)]),
    }
    loaded = ff.load(assemble(tmp_path / "ok.pitstop", tree))
    assert isinstance(loaded, dict)
    assert loaded["a"].dtype == np.uint32
    assert loaded["a"].tolist() == [7, 2**32 - 1]
    assert type(loaded["s"]) is np.float64
    assert loaded["s"] == 0.25


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (ext(8, ["object", [1], bytes(8)]), "dtype 'object' is not one"),
        (ext(8, ["float32", [2**40, 2**40], bytes(4)]), "needs .* bytes, holds 4"),
        (ext(8, ["float32", [-1], b""]), "bad dimension"),
        (ext(8, ["float32", [3], bytes(8)]), "needs 12 bytes, holds 8"),
        (ext(8, {"dtype": "float32"}), "must be"),
        (ext(9, ["int64", bytes(3)]), "int64 needs 8 bytes"),
        (ext(8, ["float32", [1], ext(7, 0)]), "data must be bytes"),
    ],
)
def test_hostile_numpy_payloads_are_corrupt(
    payload: msgpack.ExtType, message: str, tmp_path: Path
) -> None:
    path = assemble(tmp_path / "bad.pitstop", {"x": payload})
    with pytest.raises(CheckpointCorrupt, match=message):
        ff.load(path)
    with pytest.raises(CheckpointCorrupt, match=message):
        ff.read_manifest(path)
