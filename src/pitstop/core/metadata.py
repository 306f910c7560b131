# What a checkpoint file says about itself, and what latest.json says about the directory.
#
# Rules: a checkpoint's manifest carries its catalog entry (progress, save sequence number,
# reason, detail, metrics) under fixed keys; a file whose entry is missing, mistyped, or names a
# different step than its file name is not a checkpoint of this directory, and neither is one
# whose recorded world size is not an int >= 1. latest.json repeats
# the pointers (and the best value, which symlinks cannot hold) for tools and for filesystems
# without symlinks. Both are untrusted input when read: every field is type-checked, a pointer
# must be a checkpoint file name (no path, no "..", nothing absolute), and each problem becomes
# a message naming the file and the key, never an exception from deep inside. The best value
# latest.json repeats is checked against what its checkpoint recorded (its manifest is
# checksummed; latest.json is not): a value the checkpoint did not record is dropped.
# How: plain dict building and checking; the shell does the msgpack/JSON bytes.

"""Checkpoint metadata and ``latest.json``: building them, and reading them back safely."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Mapping
from typing import Any

import attrs

from pitstop.core.naming import NOT_A_CHECKPOINT, parse_checkpoint, parse_sharded_name
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    CheckpointEntry,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.errors import CheckpointCorrupt, ConfigError

__all__ = [
    "LATEST_FORMAT",
    "checked_best_value",
    "entry_from_meta",
    "entry_meta",
    "latest_json",
    "pointers_from_latest_json",
    "policy_from_latest_json",
]

LATEST_FORMAT = 1
_PROGRESS_KEYS = ("step", "epoch", "batch_in_epoch", "samples", "tokens")


def entry_meta(entry: CheckpointEntry) -> dict[str, Any]:
    """Return the manifest fields that describe ``entry``."""
    return {
        "progress": {key: getattr(entry.progress, key) for key in _PROGRESS_KEYS},
        "seq": entry.seq,
        "reason": entry.reason.value,
        "detail": entry.detail,
        "metrics": dict(entry.metrics),
    }


def entry_from_meta(name: str, meta: Mapping[str, Any]) -> CheckpointEntry:
    """Rebuild the catalog entry of the file ``name`` from its manifest ``meta``.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming the file and the bad key.
    """

    def bad(key: str, why: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(f"{name}: manifest key {key!r} {why}")

    world_size = meta.get("world_size", 1)
    if type(world_size) is not int or world_size < 1:
        raise bad("world_size", f"must be an int >= 1, got {reprlib.repr(world_size)}")
    progress_meta = meta.get("progress")
    if not isinstance(progress_meta, Mapping):
        raise bad("progress", f"must be a mapping, got {progress_meta!r}")
    unknown = sorted(str(k) for k in progress_meta if k not in _PROGRESS_KEYS)
    if unknown:
        raise bad("progress", f"has unknown keys {unknown}")
    try:
        progress = Progress(**{str(k): v for k, v in progress_meta.items()})
        reason = meta.get("reason")
        if reason not in {r.value for r in SaveReason}:
            raise bad("reason", f"must be one of {[r.value for r in SaveReason]}, got {reason!r}")
        detail = meta.get("detail", "")
        if not isinstance(detail, str):
            raise bad("detail", f"must be a str, got {detail!r}")
        entry = CheckpointEntry(
            progress=progress,
            seq=meta.get("seq"),  # type: ignore[arg-type]  # validated by the record
            reason=reason,
            detail=detail,
            metrics=meta.get("metrics", {}),
            sharded=parse_sharded_name(name) is not NOT_A_CHECKPOINT,
        )
    except ConfigError as exc:
        raise CheckpointCorrupt(f"{name}: manifest entry is invalid: {exc}") from None
    if entry.name != name:
        raise bad("progress", f"holds step {entry.step}, which is not the step of {name}")
    return entry


def latest_json(catalog: Catalog, pointers: Pointers, policy: Policy) -> dict[str, Any]:
    """Return the contents of ``latest.json`` for ``pointers`` over ``catalog``.

    Besides the pointers it records the retention policy and the Best metric, so tools that
    only read the directory (``pitstop ls``) can explain it.
    """
    last = catalog.get(pointers.last)
    value = pointers.best_value
    best = policy.best
    return {
        "format": LATEST_FORMAT,
        "path": None if last is NO_CHECKPOINT else last.name,
        "step": None if last is NO_CHECKPOINT else last.step,
        "seq": None if last is NO_CHECKPOINT else last.seq,
        "pointers": {
            p.value: (None if (t := pointers.target(p)) is NO_CHECKPOINT else t)
            for p in PointerName
        },
        "best": None if best is None else {"metric": best.metric, "mode": best.mode},
        # JSON has no NaN/inf; a best value is finite (NaN never improves) but be safe.
        "best_value": value if value is not None and math.isfinite(value) else None,
        "retention": {"keep_last": policy.keep_last, "keep_every": policy.keep_every},
    }


def policy_from_latest_json(data: object) -> Policy | None:
    """Return the retention part of the policy recorded in ``latest.json`` (``None``: unknown).

    Only ``keep_last``, ``keep_every`` and ``best`` are recorded; anything malformed is unknown.
    """
    if not isinstance(data, Mapping):
        return None
    retention, best = data.get("retention"), data.get("best")
    if not isinstance(retention, Mapping):
        return None
    try:
        return Policy(
            keep_last=retention.get("keep_last"),
            keep_every=retention.get("keep_every"),
            best=None
            if not isinstance(best, Mapping)
            else Best(best.get("metric"), mode=best.get("mode", "min")),  # type: ignore[arg-type]
        )
    except ConfigError:
        return None


def pointers_from_latest_json(data: object) -> tuple[Pointers, tuple[str, ...]]:
    """Read the pointers out of a decoded, untrusted ``latest.json``.

    Returns the pointers that are well-formed and a warning for everything ignored.
    """
    warnings: list[str] = []
    if not isinstance(data, Mapping):
        return Pointers(), (f"latest.json must hold a JSON object, got {type(data).__name__}",)
    found = data.get("pointers")
    if not isinstance(found, Mapping):
        return Pointers(), ("latest.json key 'pointers' must be an object; ignored",)
    targets: dict[PointerName, str | NoCheckpoint] = dict.fromkeys(PointerName, NO_CHECKPOINT)
    for pointer in PointerName:
        target = found.get(pointer.value)
        if target is None:
            continue
        if not isinstance(target, str) or parse_checkpoint(target) is NOT_A_CHECKPOINT:
            warnings.append(
                f"latest.json pointer {pointer.value} -> {target!r} is not a checkpoint file "
                "name in this directory; ignored"
            )
            continue
        targets[pointer] = target
    value = data.get("best_value")
    best_value: float | None = None
    if targets[PointerName.BEST] is not NO_CHECKPOINT and value is not None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            best_value = float(value)
        else:
            warnings.append(f"latest.json best_value {value!r} is not a number; ignored")
    pointers = Pointers(
        last=targets[PointerName.LAST],
        best=targets[PointerName.BEST],
        final=targets[PointerName.FINAL],
        best_value=best_value,
    )
    return pointers, tuple(warnings)


def checked_best_value(
    pointers: Pointers, catalog: Catalog, best: Best | None
) -> tuple[Pointers, tuple[str, ...]]:
    """Drop ``latest.json``'s best value when its best checkpoint recorded another one.

    The checkpoint's own metrics are checksummed; ``latest.json`` is not, so a value that is
    not the one recorded (the ``best.metric`` one, or with no ``best`` any recorded value) is
    corruption: it is dropped with a warning, and reconciling takes the recorded value.
    """
    value, target = pointers.best_value, pointers.best
    if value is None or target is NO_CHECKPOINT:
        return pointers, ()
    entry = catalog.get(target)
    if entry is NO_CHECKPOINT:
        return pointers, ()
    if best is not None and best.metric in entry.metrics:
        recorded: tuple[float, ...] = (entry.metrics[best.metric],)
    else:
        recorded = tuple(entry.metrics.values())
    if not recorded or value in recorded:
        return pointers, ()
    shown = recorded[0] if len(recorded) == 1 else list(recorded)
    return attrs.evolve(pointers, best_value=None), (
        f"latest.json best_value {value!r} is not what {target} recorded ({shown!r}); "
        "ignored, the recorded value is used",
    )
