"""Staging: bounded memory, buffers reused, and the same tree rules as a synchronous save."""

from __future__ import annotations

import collections
import io
import math
import struct
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import pitstop
from pitstop.errors import SaveError
from pitstop.shell.format import fileformat
from pitstop.shell.format.treewalk import MAX_DEPTH, dtypes
from pitstop.shell.state.staging import StagingPool, slack

KIB = 1 << 10


def _snapshot(pool: StagingPool, tree: object) -> Any:
    staged, finish = pool.snapshot(tree)
    finish()
    pool.ready()
    return staged


def _storages(tree: object) -> set[int]:
    """The data pointers of the storages behind the tensors of ``tree``."""
    found: set[int] = set()

    def visit(node: object) -> None:
        if isinstance(node, torch.Tensor):
            if node.numel():
                found.add(node.untyped_storage().data_ptr())
        elif isinstance(node, dict):
            for value in node.values():
                visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(tree)
    return found


# --- bounded memory ---------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "step"), [(64 * KIB, 4 * KIB), (260 * KIB, -4 * KIB)])
def test_staging_holds_one_copy_of_the_current_state_plus_the_slack(start: int, step: int) -> None:
    # One component that changes size by 4 KB a save (as a growing history buffer would), beside
    # a model that does not change: after 50 saves the pool holds what the last save needs.
    pool = StagingPool()
    weights = {"w": torch.randn(1000), "b": torch.randn(10)}
    fixed = sum(t.numel() * t.element_size() for t in weights.values())
    for save in range(50):
        nbytes = start + save * step
        history = torch.arange(nbytes // 4, dtype=torch.float32)
        tree = {"weights": weights, "state": {"history": {"values": history}}}
        staged = _snapshot(pool, tree)
        assert torch.equal(staged["state"]["history"]["values"], history)
        # The documented bound: each storage's size plus slack(size), while in use and after.
        bound = nbytes + slack(nbytes) + sum(slack(t.numel() * 4) for t in weights.values())
        assert pool.allocated_bytes <= fixed + bound, f"save {save}"
        pool.release()
        assert pool.allocated_bytes <= fixed + bound, f"save {save}, released"
    assert pool.allocated_bytes < 2 * (fixed + nbytes)


def test_an_unchanged_state_reuses_every_buffer() -> None:
    pool = StagingPool()
    weight = torch.randn(64, 32)
    tree = {
        "weights": {"raw": {"w": weight, "w_t": weight.T, "b": torch.randn(32)}},
        "state": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(64, 32)}}}},
        "rng": {
            0: {"python": (3, tuple(range(625)), None), "torch": torch.randint(0, 255, (5056,))}
        },
    }
    first = _snapshot(pool, tree)
    held, storages = pool.allocated_bytes, _storages(first)
    assert held == 64 * 32 * 4 + 32 * 4 + 64 * 32 * 4 + 5056 * 8  # exactly one copy
    pool.release()
    for _ in range(5):
        again = _snapshot(pool, tree)
        assert pool.allocated_bytes == held
        assert _storages(again) == storages  # the same buffers, not new ones of the same size
        pool.release()


def test_a_failed_snapshot_takes_no_buffer_and_leaves_the_pool_usable() -> None:
    pool = StagingPool()
    tree = {"w": torch.randn(256)}
    _snapshot(pool, tree)
    pool.release()
    held = pool.allocated_bytes
    with pytest.raises(SaveError, match=r"bad: cannot store .*defaultdict"):
        pool.snapshot({"w": tree["w"], "bad": collections.defaultdict(list)})
    assert pool.allocated_bytes == held
    assert torch.equal(_snapshot(pool, tree)["w"], tree["w"])  # not "still in use"


# --- one set of rules for both paths ----------------------------------------------------------


class _Point(NamedTuple):
    x: int
    y: int


class _Config(dict[str, Any]):
    pass


class _SubTensor(torch.Tensor):
    pass


def _quantized() -> torch.Tensor:
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)


def _deep() -> list[object]:
    tree: list[object] = []
    node = tree
    for _ in range(MAX_DEPTH + 5):
        child: list[object] = []
        node.append(child)
        node = child
    return tree


REFUSED = {
    "defaultdict": lambda: collections.defaultdict(list, {"a": [1]}),
    "Counter": lambda: collections.Counter("aab"),
    "dict subclass": lambda: _Config(lr=0.1),
    "namedtuple": lambda: _Point(1, 2),
    "bytearray": lambda: bytearray(b"x"),
    "int too large": lambda: [2**64],
    "int too small": lambda: {"n": -(2**63) - 1},
    "tensor as a set member": lambda: {torch.ones(1)},
    "tensor in a dict key": lambda: {(1, torch.ones(1)): 1},
    "sparse tensor": lambda: torch.ones(2).to_sparse(),
    "quantized tensor": _quantized,
    "meta tensor": lambda: torch.empty(2, device="meta"),
    "tensor subclass": lambda: torch.ones(2).as_subclass(_SubTensor),
    "lambda": lambda: [lambda e: 0.9**e],
    "nested too deeply": _deep,
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_a_synchronous_and_a_staged_save_refuse_the_same_value_with_the_same_message(
    case: str,
) -> None:
    tree = {
        "weights": {"raw": {"w": torch.randn(64)}},
        "state": {"scheduler": {"history": REFUSED[case]()}},
    }
    with pytest.raises(SaveError) as synchronous:
        fileformat.prepare(tree)
    pool = StagingPool()
    with pytest.raises(SaveError) as staged:
        pool.snapshot(tree)
    assert str(staged.value) == str(synchronous.value)
    assert str(synchronous.value).startswith("state.scheduler.history")
    assert pool.allocated_bytes == 0  # refused before anything was copied


ALLOWED: dict[str, Any] = {
    "dict": lambda: {"a": 1, 2: "b", (3, "c"): None},
    "OrderedDict": lambda: collections.OrderedDict([("b", 1), ("a", [2])]),
    "list": lambda: [1, [2, (3,)]],
    "tuple": lambda: (1, (2, [3])),
    "set": lambda: {1, "a", (2, 3)},
    "frozenset": lambda: frozenset({b"x", None}),
    "torch.Size": lambda: torch.Size([2, 3]),
    "str": lambda: "ünïcode",
    "bytes": lambda: b"\x00\xff",
    "int": lambda: [-(2**63), 2**64 - 1, 0],
    "float": lambda: [math.nan, -0.0, math.inf, 1e-310],
    "bool": lambda: [True, False],
    "None": lambda: None,
    "torch.dtype": lambda: sorted(dtypes().values(), key=str),
    "tensor": lambda: torch.arange(12, dtype=torch.float64).reshape(3, 4).T,
    "empty tensor": lambda: torch.empty(3, 0, 5).transpose(0, 2),
    "complex conj": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "empty containers": lambda: [{}, [], (), set(), frozenset(), collections.OrderedDict()],
    "rng state": lambda: (3, tuple(range(625)), None),
}


def _same(expected: object, actual: object, path: str = "<root>") -> None:
    """Equal, with exactly the same type at every node (tensors: dtype, shape, strides, bits)."""
    assert type(actual) is type(expected), f"{path}: {type(actual)} is not {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        assert (actual.dtype, actual.shape, actual.stride()) == (
            expected.dtype,
            expected.shape,
            expected.stride(),
        ), path
        assert torch.equal(actual.resolve_conj(), expected.resolve_conj()), path
    elif isinstance(expected, dict):
        assert isinstance(actual, dict)
        assert list(actual) == list(expected), path
        for key in expected:
            _same(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        assert isinstance(actual, (list, tuple))
        assert len(actual) == len(expected), path
        for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
            _same(a, b, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert struct.pack("<d", expected) == struct.pack("<d", actual), path
    else:
        assert actual == expected, path


def _file(tree: object) -> bytes:
    out = io.BytesIO()
    fileformat.write(out, fileformat.prepare(tree), {})
    return out.getvalue()


@pytest.mark.parametrize("case", list(ALLOWED), ids=list(ALLOWED))
def test_both_paths_store_every_allowed_type_with_its_exact_type(case: str, tmp_path: Path) -> None:
    value = ALLOWED[case]()
    tree = {"state": {"component": {"value": value}}}
    written = _file(tree)
    path = tmp_path / "sync.pitstop"
    path.write_bytes(written)
    _same(tree, fileformat.load(path))

    pool = StagingPool()
    staged = _snapshot(pool, tree)
    _same(tree, staged)
    assert _file(staged) == written  # the background save writes the very same file


def test_parameters_are_staged_and_stored_as_plain_tensors(tmp_path: Path) -> None:
    layer = nn.Linear(3, 2)
    tree = {"weight": layer.weight, "state": layer.state_dict()}
    staged = _snapshot(StagingPool(), tree)
    assert type(staged["weight"]) is torch.Tensor
    assert staged["weight"].data_ptr() == staged["state"]["weight"].data_ptr()  # still tied
    assert _file(staged) == _file(tree)


# --- through the Checkpointer -----------------------------------------------------------------


class _Counts:
    """A component whose state is a defaultdict, as a hand-written one often is."""

    def __init__(self) -> None:
        self.counts: collections.defaultdict[str, int] = collections.defaultdict(int)
        self.counts["seen"] += 1

    def state_dict(self) -> dict[str, Any]:
        return {"counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts.update(state["counts"])


@pytest.mark.parametrize("mode", [False, True, "overlap"])
def test_a_defaultdict_in_a_component_is_refused_by_every_save_mode_before_writing(
    mode: bool | str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        pitstop.Checkpointer(
            tmp_path,
            model=model,
            state={"optimizer": optimizer, "counts": _Counts()},
            async_save=mode,  # type: ignore[arg-type]
        ) as ckpt,
        pytest.raises(SaveError) as refused,
    ):
        ckpt.save(pitstop.Progress(step=1))
    assert str(refused.value).startswith(
        "state.counts.counts: cannot store a value of type collections.defaultdict"
    )
    assert not list(tmp_path.glob("step_*"))
