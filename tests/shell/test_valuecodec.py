"""The values pitstop's collectives carry between ranks (pitstop.shell.ranks.valuecodec): every
type that travels comes back equal and of the same type (a tuple a tuple, a Path a Path, a record
the same class), anything else is refused where it is sent with a TypeError naming it, and no
bytes — random, truncated, crafted or a pickle — run code or build anything else."""

from __future__ import annotations

import collections
import enum
import math
import pathlib
from pathlib import Path
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pitstop.core.compat import Difference, Kind
from pitstop.core.ranks import OK, CallInput, Outcome, entry_from_wire, entry_to_wire
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, PointerName, Progress, SaveReason
from pitstop.core.saving.pointers import Tier
from pitstop.core.saving.schedule import SaveDecision, ScheduleState
from pitstop.core.sharding.sharded import ShardedLayout, ShardFile, StoredChunk, StoredValue
from pitstop.shell.ranks.valuecodec import ENUMS, RECORDS, decode, encode, plain
from strategies import progresses

members = st.sampled_from([m for cls in ENUMS for m in cls])
text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, blacklist_categories=()))
ints = st.integers() | st.integers(-(1 << 200), 1 << 200)  # past int64/uint64 too
floats = st.floats(allow_nan=False)  # NaN: its own test (NaN != NaN)
names = st.text(st.characters(blacklist_characters="\0/", blacklist_categories=("Cs",)), min_size=1)
paths = st.lists(names, max_size=3).map(lambda parts: Path("/", *parts))
small_ints = st.integers(0, 1 << 20)
shapes = st.tuples(small_ints, small_ints) | st.just(())

outcomes = st.builds(Outcome, kind=text, error=text, rank=small_ints)
inputs = st.builds(
    CallInput,
    stop=st.booleans(),
    reason=text,
    metrics=st.none() | st.dictionaries(text, floats),
    now=floats,
)
schedule_states = st.builds(
    ScheduleState,
    timer_start=floats,
    last_saved_step=st.just(NO_CHECKPOINT) | small_ints,
    reached_step=small_ints,
)
decisions = st.builds(
    SaveDecision,
    write=st.booleans(),
    reasons=st.frozensets(st.sampled_from(list(SaveReason))),
    moves=st.frozensets(st.sampled_from(list(PointerName))),
    best_value=st.none() | floats,
    state=schedule_states,
)
differences = st.builds(
    Difference, kind=st.sampled_from(list(Kind)), message=text, soft=st.booleans(), allowed=text
)
chunks = st.builds(
    StoredChunk, offsets=shapes, sizes=shapes, file=names, start=small_ints, length=small_ints
)
stored = st.builds(
    StoredValue,
    fqn=names,
    path=st.tuples(names) | st.tuples(names, small_ints),
    dtype=st.none() | st.just("float32"),
    shape=shapes,
    chunks=st.lists(chunks, max_size=2).map(tuple),
)
files = st.builds(
    ShardFile,
    name=st.sampled_from(["__0_0.distcp", ".metadata"]),
    size=small_ints,
    crc32=st.integers(0, 0xFFFFFFFF),
    rank=small_ints,
)


def layout() -> ShardedLayout:
    """A 2-rank save of a 3x2 weight, all on rank 0, and an lr on rank 1."""
    whole = StoredChunk(offsets=(0, 0), sizes=(3, 2), file="__0_0.distcp", start=0, length=24)
    weight = StoredValue(
        fqn="model.w", path=("model", "w"), dtype="float32", shape=(3, 2), chunks=(whole,)
    )
    lr = StoredValue(
        fqn="optimizer.param_groups.0.lr",
        path=("optimizer", "param_groups", 0, "lr"),
        dtype=None,
        shape=(),
        chunks=(StoredChunk(offsets=(), sizes=(), file="__1_0.distcp", start=0, length=30),),
    )
    sizes = {"__0_0.distcp": 24, "__1_0.distcp": 30}
    made = tuple(
        ShardFile(name=n, size=s, crc32=i, rank=i) for i, (n, s) in enumerate(sizes.items())
    )
    return ShardedLayout(world_size=2, dcp_version="1.0.0", files=made, values=(weight, lr))


records = st.one_of(
    outcomes,
    inputs,
    progresses(),
    decisions,
    schedule_states,
    differences,
    chunks,
    stored,
    files,
    st.just(layout()),
)
RECORD_STRATEGIES = (
    Outcome,
    CallInput,
    Progress,
    SaveDecision,
    ScheduleState,
    Difference,
    StoredChunk,
    StoredValue,
    ShardFile,
    ShardedLayout,
)

hashable = st.recursive(
    st.none() | st.booleans() | ints | floats | text | st.binary() | paths | members | progresses(),
    lambda inner: st.lists(inner, max_size=3).map(tuple) | st.frozensets(inner, max_size=3),
    max_leaves=6,
)
values = st.recursive(
    hashable | records,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(hashable, inner, max_size=4)
        | st.sets(hashable, max_size=3)
        | st.frozensets(hashable, max_size=3)
    ),
    max_leaves=12,
)


def same(got: object, sent: object) -> None:
    """``got`` equals ``sent`` and is of the same type, all the way down."""
    assert type(got) is type(sent), (got, sent)
    assert got == sent
    if isinstance(sent, (list, tuple)):
        for a, b in zip(got, sent, strict=True):  # type: ignore[call-overload]
            same(a, b)
    elif isinstance(sent, dict):
        assert isinstance(got, dict)
        keys = {k: k for k in got}
        for key, item in sent.items():
            same(keys[key], key)
            same(got[key], item)
    elif isinstance(sent, (set, frozenset)):
        kinds = sorted(map(repr, map(type, sent)))
        assert sorted(map(repr, map(type, got))) == kinds  # type: ignore[call-overload]
    elif attrs.has(type(sent)):
        for field in attrs.fields(type(sent)):
            same(getattr(got, field.name), getattr(sent, field.name))
    elif isinstance(sent, enum.Enum):
        assert got is sent


def test_every_record_and_enum_that_travels_has_a_strategy_here() -> None:
    assert set(RECORD_STRATEGIES) == set(RECORDS)


@given(values)
def test_every_value_that_travels_comes_back_equal_and_of_the_same_type(value: object) -> None:
    data = encode(value, rank=0)
    same(decode(data), value)
    box = torch.zeros(len(data) + 16, dtype=torch.uint8)  # as pitstop.shell.ranks.boxes reads it
    box[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    same(decode(box[: len(data)].numpy()), value)


def test_odd_values_come_back_exactly() -> None:
    nan = decode(encode((float("nan"), -0.0, math.inf), rank=0))
    assert math.isnan(nan[0])
    assert math.copysign(1.0, nan[1]) == -1.0
    assert nan[2] == math.inf
    odd = Path("/tmp/caf\udce9")  # a file name decoded with surrogateescape
    same(
        decode(encode([odd, "\ud800", 1 << 64, -(1 << 63) - 1, b"\0" * 100_000], rank=0)),
        [
            odd,
            "\ud800",
            1 << 64,
            -(1 << 63) - 1,
            b"\0" * 100_000,
        ],
    )
    assert decode(encode(NO_CHECKPOINT, rank=0)) is NO_CHECKPOINT


def test_an_entry_travels_as_its_wire_form() -> None:
    entry = CheckpointEntry(
        progress=Progress(step=3, samples=12),
        seq=4,
        reason=SaveReason.STOP,
        detail="SIGTERM",
        metrics={"loss": 0.5},
        sharded=True,
    )
    same(decode(encode(entry_to_wire(entry), rank=0)), entry_to_wire(entry))
    assert entry_from_wire(decode(encode(entry_to_wire(entry), rank=0))) == entry


class _Plain:
    pass


REFUSED = [
    (object(), "builtins.object", "value"),
    ([1, {"k": (2, lambda: 3)}], "builtins.function", "value[1]['k'][1]"),
    (CheckpointEntry(progress=Progress(), seq=1, reason="manual"), "CheckpointEntry", "value"),
    ({"tier": Tier.LOCAL}, "pitstop.core.saving.pointers.Tier", "value['tier']"),
    (collections.OrderedDict(a=1), "collections.OrderedDict", "value"),
    (collections.namedtuple("Pair", "a b")(1, 2), "Pair", "value"),
    (torch.zeros(2), "torch.Tensor", "value"),
    ([np.float32(1.0)], "numpy.float32", "value[0]"),
    (bytearray(b"x"), "builtins.bytearray", "value"),
    (pathlib.PurePosixPath("/x"), "PurePosixPath", "value"),
    (ValueError("boom"), "builtins.ValueError", "value"),
    ({_Plain(): 1}, "_Plain", "value (a key)"),
    (Outcome(kind=_Plain()), "_Plain", "value.kind"),  # type: ignore[arg-type]
]


@pytest.mark.parametrize(("value", "kind", "where"), REFUSED)
def test_a_value_that_cannot_travel_is_refused_where_it_is_sent(
    value: object, kind: str, where: str
) -> None:
    with pytest.raises(TypeError, match="cannot travel between ranks") as raised:
        plain(value)
    said = str(raised.value)
    assert said.startswith(f"{where} is a "), said
    assert kind in said, said
    # sent anyway (its round completes on every rank), every rank that reads it raises it
    with pytest.raises(TypeError) as heard:
        decode(encode(value, rank=3))
    assert str(heard.value) == f"rank 3: {said}"


def test_a_rounds_result_that_cannot_travel_goes_as_that_ranks_failure() -> None:
    sent = decode(encode((OK, {"result": object()}), rank=2))
    outcome, result = sent
    assert result is None
    assert (outcome.kind, outcome.rank) == ("TypeError", 2)
    assert outcome.error.startswith("the result['result'] is a builtins.object, which cannot")
    failed = Outcome(kind="SaveError", error="disk full", rank=1)
    assert decode(encode((failed, None), rank=1)) == (failed, None)


def test_a_value_nested_too_deeply_is_refused() -> None:
    deep: list[Any] = []
    for _ in range(5_000):
        deep = [deep]
    with pytest.raises(TypeError, match="nested too deeply"):
        plain(deep)


BUILT = (type(None), bool, int, float, str, bytes, list, tuple, dict, set, frozenset, type(Path()))


def built_only(value: object) -> None:
    """``value`` holds nothing but the types that travel."""
    kind = type(value)
    assert kind in BUILT or kind in RECORDS or kind in ENUMS, kind
    if kind in (list, tuple, set, frozenset):
        for item in value:  # type: ignore[attr-defined]
            built_only(item)
    elif kind is dict:
        for key, item in value.items():  # type: ignore[attr-defined]
            built_only(key)
            built_only(item)


@given(st.binary(max_size=200))
def test_random_bytes_build_nothing_else_and_fail_clearly(data: bytes) -> None:
    said = ""
    try:
        built_only(decode(data))
    except TypeError as refused:  # a refusal, well formed by chance
        said = "refused: " + str(refused)
    except ValueError as error:
        said = str(error)
    assert not said or said.startswith("refused: rank ") or "is not one pitstop encodes" in said


@settings(max_examples=50)
@given(hashable | records, st.data())
def test_truncated_bytes_fail_clearly(value: object, data: st.DataObject) -> None:
    encoded = encode(value, rank=0)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(ValueError, match="is not one pitstop encodes"):
        decode(encoded[:cut])


def _marked(code: int, *rest: object) -> bytes:
    packed: bytes = msgpack.packb([msgpack.ExtType(code, b""), *rest], use_bin_type=True)
    return packed


CRAFTED = {
    "a pickle": b"cos\nmkdir\n(S'/tmp/pitstop-codec-canary'\ntR.",
    "an unknown ext type": msgpack.packb(msgpack.ExtType(42, b"")),
    "a mark with a payload": msgpack.packb([msgpack.ExtType(1, b"x")]),
    "a mark out of place": msgpack.packb([1, msgpack.ExtType(1, b"")]),
    "a mark alone": msgpack.packb(msgpack.ExtType(1, b"")),
    "a mark as a map value": msgpack.packb({"k": msgpack.ExtType(1, b"")}),
    "a record not registered": _marked(7, "CheckpointEntry", 1, 2),
    "a record named after a function": _marked(7, "os.system", "echo hi"),
    "a record with a field missing": _marked(7, "Outcome", "kind", "error"),
    "a record its validators refuse": _marked(7, "ShardFile", "../x", 1, 2, 3),
    "an enum not registered": _marked(6, "Tier", "LOCAL"),
    "an enum member unknown": _marked(6, "SaveReason", "NOPE"),
    "a path that is no str": _marked(4, b"/x"),
    "a set of lists": _marked(2, [1], [2]),
    "a map with a list key": b"\x81\x91\x01\x02",
    "trailing bytes": msgpack.packb(1) + b"\x00",
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_crafted_bytes_are_refused_and_run_nothing(name: str) -> None:
    with pytest.raises(ValueError, match="is not one pitstop encodes"):
        decode(CRAFTED[name])
    assert not Path("/tmp/pitstop-codec-canary").exists()
