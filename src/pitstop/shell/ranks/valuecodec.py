# The values pitstop's collectives carry between ranks, as msgpack: no pickle, no code run.
#
# Rules: what travels is a closed set, by exact type — None, bool, int, float, str, bytes, list,
# tuple, dict, set, frozenset, a pathlib.Path, and the records and enums of pitstop's own that
# its rounds carry (RECORDS, ENUMS: a call's inputs, outcomes, progress, save decisions, sharded
# layouts, config differences, save statuses). A tuple comes back a tuple, a Path a Path, a
# record the same class (built by its own attrs __init__, so its validators run), an enum the
# same member. Anything else is refused where it is sent: a TypeError naming its type and where
# it sits in the value. A refused value still travels, so that no rank waits for it: a round's
# (outcome, result) pair whose result cannot travel goes as that rank's failure (an Outcome of
# kind TypeError: every rank raises it as the round's error, as any other failure of a round);
# any other value goes as a refusal that every rank that reads it raises as a TypeError naming
# the sending rank. Errors never travel as exceptions: pitstop.shell.ranks.outcomes turns them
# into Outcome records first. Decoding builds only these types: any other bytes (an unknown ext
# code, a mark out of place, a record of the wrong shape, truncated data) raise a ValueError.
# How: native msgpack for None/bool/int (int64/uint64)/float/str/bytes/list/dict; every other
# type is an array whose first item is a mark (an empty ExtType: tuple, set, frozenset, path,
# big int, enum, record, refusal) and whose other items are its contents, so that a large bytes
# value is copied once, not once per level of nesting. Strings pass lone surrogates (a file
# name decoded with surrogateescape).

"""Values between ranks as msgpack (:func:`encode`, :func:`decode`): a closed set of types."""

from __future__ import annotations

import enum
import pathlib
from collections.abc import Callable, Iterable
from typing import Any, Final

import attrs
import msgpack

from pitstop.core.compat import Difference, Kind
from pitstop.core.ranks import CallInput, Outcome
from pitstop.core.records import NoCheckpoint, PointerName, Progress, SaveReason
from pitstop.core.saving.schedule import SaveDecision, ScheduleState
from pitstop.core.session import SaveStatus
from pitstop.core.sharding.sharded import ShardedLayout, ShardFile, StoredChunk, StoredValue

__all__ = ["ENUMS", "RECORDS", "decode", "encode", "plain"]

RECORDS: Final[tuple[type, ...]] = (
    CallInput,
    Difference,
    Outcome,
    Progress,
    SaveDecision,
    ScheduleState,
    ShardFile,
    ShardedLayout,
    StoredChunk,
    StoredValue,
)
"""The attrs records that travel between ranks (every field of each travels, and may only
hold what travels)."""

ENUMS: Final[tuple[type[enum.Enum], ...]] = (
    Kind,
    NoCheckpoint,
    PointerName,
    SaveReason,
    SaveStatus,
)
"""The enums whose members travel between ranks (by name)."""

_PATH_TYPE: Final = type(pathlib.Path())
"""The concrete Path class of this platform (what ``Path(...)`` makes)."""

# The marks: the first item of an array that stands for another type. Never reused for
# another meaning within one version of pitstop (every rank of a job runs the same one).
_TUPLE, _SET, _FROZENSET, _PATH, _BIGINT, _ENUM, _RECORD, _REFUSED = range(1, 9)
_MARKS: Final = {code: msgpack.ExtType(code, b"") for code in range(1, 9)}

_INT_MIN: Final = -(1 << 63)
_INT_MAX: Final = (1 << 64) - 1
_UNICODE_ERRORS: Final = "surrogatepass"


def _named(classes: Iterable[type]) -> dict[str, type]:
    named = {cls.__name__: cls for cls in classes}
    assert len(named) == len(tuple(classes)), "two classes that travel share a name"
    return named


_RECORD_BY_NAME: Final = _named(RECORDS)
_ENUM_BY_NAME: Final = _named(ENUMS)
_RECORD_NAMES: Final = {cls: name for name, cls in _RECORD_BY_NAME.items()}
_ENUM_NAMES: Final = {cls: name for name, cls in _ENUM_BY_NAME.items()}
_FIELDS: Final = {cls: tuple(attrs.fields(cls)) for cls in RECORDS}
assert all(f.init for fields in _FIELDS.values() for f in fields), "a field attrs cannot init"


# --- encoding ---------------------------------------------------------------------------------


def encode(value: object, *, rank: int) -> bytes:
    """``value`` (sent by ``rank``) as bytes for :func:`decode` on any rank of this job.

    A value that cannot travel (a type outside the set above) is encoded as its refusal, so
    that the round it is sent in still completes on every rank: a round's ``(Outcome,
    result)`` pair as that rank's failure (an Outcome of kind ``TypeError``); anything else as
    a refusal that :func:`decode` raises as a ``TypeError`` naming ``rank`` (:func:`plain`
    raises that ``TypeError`` here instead).
    """
    try:
        return _pack(plain(value))
    except TypeError as refused:
        why = str(refused)
    if type(value) is tuple and len(value) == 2 and type(value[0]) is Outcome:
        try:
            plain(value[1], name="the result")
        except TypeError as in_result:  # named within the result, not the pair
            why = str(in_result)
        return _pack(plain((Outcome(kind="TypeError", error=why, rank=rank), None)))
    return _pack([_MARKS[_REFUSED], rank, why])


def plain(value: object, *, name: str = "value") -> Any:
    """``value`` as native msgpack values (marked arrays for the other types that travel).
    Raises ``TypeError`` naming the first part that cannot travel, its type and where it sits
    in ``value`` (called ``name``: ``value[1].metrics['loss']``)."""
    try:
        return _plain(value)
    except _Unsendable as refused:
        where = name + "".join(reversed(refused.path))
        kind = refused.kind
        raise TypeError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which cannot travel between "
            "ranks: pitstop's collectives carry None, bool, int, float, str, bytes, list, "
            "tuple, dict, set, frozenset, pathlib.Path and pitstop's own records and enums "
            "(pitstop.shell.ranks.valuecodec.RECORDS, ENUMS), never a pickle"
        ) from None
    except RecursionError:
        raise TypeError(f"{name} is nested too deeply (or holds itself) to travel") from None


class _Unsendable(Exception):
    """A part of a value that cannot travel: its type, and the way to it (innermost first)."""

    def __init__(self, kind: type) -> None:
        super().__init__(kind)
        self.kind = kind
        self.path: list[str] = []


def _plain(value: object) -> Any:
    kind = type(value)
    if value is None or kind is bool or kind is str or kind is bytes or kind is float:
        return value
    if kind is int:
        number: int = value  # type: ignore[assignment]
        if _INT_MIN <= number <= _INT_MAX:
            return number
        size = number.bit_length() // 8 + 1
        return (_MARKS[_BIGINT], number.to_bytes(size, "little", signed=True))
    if kind is list:
        return _sequence(value)  # type: ignore[arg-type]
    if kind is tuple:
        return (_MARKS[_TUPLE], *_sequence(value))  # type: ignore[arg-type]
    if kind is dict:
        return _mapping(value)  # type: ignore[arg-type]
    if kind is set or kind is frozenset:
        members = _members(value)  # type: ignore[arg-type]
        return (_MARKS[_SET if kind is set else _FROZENSET], *members)
    if kind is _PATH_TYPE:
        return (_MARKS[_PATH], str(value))
    if kind in _ENUM_NAMES:
        return (_MARKS[_ENUM], _ENUM_NAMES[kind], value.name)  # type: ignore[attr-defined]
    if kind in _RECORD_NAMES:
        return (_MARKS[_RECORD], _RECORD_NAMES[kind], *_fields(value, _FIELDS[kind]))
    raise _Unsendable(kind)


def _sequence(items: list[object] | tuple[object, ...]) -> list[Any]:
    out = []
    for i, item in enumerate(items):
        try:
            out.append(_plain(item))
        except _Unsendable as refused:
            refused.path.append(f"[{i}]")
            raise
    return out


def _mapping(items: dict[object, object]) -> dict[Any, Any]:
    out = {}
    for key, item in items.items():
        try:
            plain_key = _plain(key)
        except _Unsendable as refused:
            refused.path.append(" (a key)")
            raise
        try:
            out[plain_key] = _plain(item)
        except _Unsendable as refused:
            refused.path.append(f"[{key!r}]")
            raise
    return out


def _members(items: set[object] | frozenset[object]) -> list[Any]:
    try:
        return [_plain(member) for member in items]
    except _Unsendable as refused:
        refused.path.append(" (a member)")
        raise


def _fields(record: object, fields: tuple[attrs.Attribute[Any], ...]) -> list[Any]:
    out = []
    for field in fields:
        try:
            out.append(_plain(getattr(record, field.name)))
        except _Unsendable as refused:
            refused.path.append(f".{field.name}")
            raise
    return out


def _pack(native: object) -> bytes:
    packed: bytes = msgpack.packb(native, use_bin_type=True, unicode_errors=_UNICODE_ERRORS)
    return packed


# --- decoding ---------------------------------------------------------------------------------


class _Refused(Exception):
    """A refusal :func:`encode` sent (raised as a TypeError outside the hooks)."""


def decode(data: bytes | memoryview | Any) -> Any:
    """The value :func:`encode` made of ``data`` (any bytes-like object). Raises ``TypeError``
    when the sender's value could not travel (naming the sending rank and why), and
    ``ValueError`` on any other bytes: nothing but the types that travel is ever built."""
    size = len(memoryview(data).cast("B"))
    marks = _Marks()
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            unicode_errors=_UNICODE_ERRORS,
            ext_hook=marks.ext,
            list_hook=marks.array,
            max_str_len=size,
            max_bin_len=size,
            max_array_len=size,
            max_map_len=size,
            max_ext_len=0,
        )
        if marks.made != marks.used:
            raise ValueError(f"{marks.made - marks.used} marks out of place")
    except _Refused as refused:
        raise TypeError(str(refused)) from None
    except Exception as error:  # bytes no encode made: whatever msgpack or a hook trips over
        raise ValueError(
            f"a value from another rank ({size} bytes) is not one pitstop encodes "
            f"({type(error).__name__}: {error}); every rank must run the same pitstop"
        ) from None
    return value


class _Marks:
    """The hooks of one decode: every mark read must head an array (which is built as the type
    it marks); counted both ways, so a mark anywhere else is found without looking at every
    item."""

    def __init__(self) -> None:
        self.made = 0
        self.used = 0

    def ext(self, code: int, data: bytes) -> msgpack.ExtType:
        if code not in _MARKS or data:
            raise ValueError(f"unknown ext type {code} ({len(data)} bytes)")
        self.made += 1
        return _MARKS[code]

    def array(self, items: list[Any]) -> Any:
        if not items or type(items[0]) is not msgpack.ExtType:
            return items
        self.used += 1
        return _BUILD[items[0].code](items[1:])


def _enum(rest: list[Any]) -> enum.Enum:
    name, member = rest
    cls: type[enum.Enum] = _ENUM_BY_NAME[name]
    return cls[member]


def _record(rest: list[Any]) -> object:
    cls = _RECORD_BY_NAME[rest[0]]
    fields = _FIELDS[cls]
    if len(rest) - 1 != len(fields):
        raise ValueError(f"{cls.__name__} with {len(rest) - 1} fields, not {len(fields)}")
    return cls(**{f.alias: v for f, v in zip(fields, rest[1:], strict=True)})


def _one(kind: type, rest: list[Any]) -> Any:
    (only,) = rest
    if type(only) is not kind:
        raise ValueError(f"a {type(only).__name__} where a {kind.__name__} belongs")
    return only


def _refused(rest: list[Any]) -> None:
    rank, why = rest
    raise _Refused(f"rank {int(rank)}: {why}")


_BUILD: Final[dict[int, Callable[[list[Any]], Any]]] = {
    _TUPLE: tuple,
    _SET: set,
    _FROZENSET: frozenset,
    _PATH: lambda rest: _PATH_TYPE(_one(str, rest)),
    _BIGINT: lambda rest: int.from_bytes(_one(bytes, rest), "little", signed=True),
    _ENUM: _enum,
    _RECORD: _record,
    _REFUSED: _refused,
}
