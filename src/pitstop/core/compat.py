# Whether a checkpoint fits the live objects it would be restored into.
#
# Rules: restore is all-or-nothing, so every difference is found before any tensor is touched,
# and all of them are reported at once. Hard differences — a tensor missing, unexpected, or of
# another shape or dtype; optimizer parameter groups of another count, size or membership; a
# different world size — always refuse the restore. Soft differences — a component the
# checkpoint lacks, a stored config value that changed — refuse it under strict=True and become
# warnings under strict=False. Components the checkpoint holds but the run has not registered
# are not differences: they wait for a deferred register().
# How: the shell describes both sides as flat {key path: TensorSpec | type name} mappings and
# parameter-name lists; these functions compare values and return Difference records.

"""Compatibility checks: every difference between a checkpoint and the live run."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = [
    "Difference",
    "Kind",
    "TensorSpec",
    "diff_components",
    "diff_config",
    "diff_ema",
    "diff_hyperparameters",
    "diff_param_groups",
    "diff_tensors",
    "diff_world_size",
    "flatten",
    "judge",
    "layout_differences",
]


@attrs.frozen(kw_only=True)
class TensorSpec:
    """What a compatibility check needs to know about one tensor."""

    dtype: str
    shape: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


class Kind(str, enum.Enum):
    """What sort of difference a :class:`Difference` is."""

    MISSING = "missing"  # in the run, not in the checkpoint
    UNEXPECTED = "unexpected"  # in the checkpoint, not in the run
    SHAPE = "shape"
    DTYPE = "dtype"
    GROUPS = "groups"  # optimizer parameter groups
    COMPONENT = "component"  # a component the checkpoint lacks, or that judges itself
    CONFIG = "config"
    WORLD_SIZE = "world_size"


@attrs.frozen(kw_only=True)
class Difference:
    """One way a checkpoint does not fit; ``soft`` ones are allowed under ``strict=False``."""

    kind: Kind
    message: str
    soft: bool = False

    def __str__(self) -> str:
        return self.message


def diff_tensors(
    where: str, stored: Mapping[str, TensorSpec], live: Mapping[str, TensorSpec]
) -> list[Difference]:
    """Compare tensors by name: missing, unexpected, shape and dtype differences."""
    out = [
        Difference(
            kind=Kind.MISSING, message=f"{where}: {name!r} is in the run but not in the checkpoint"
        )
        for name in live
        if name not in stored
    ]
    out += [
        Difference(
            kind=Kind.UNEXPECTED,
            message=f"{where}: {name!r} is in the checkpoint but not in the run",
        )
        for name in stored
        if name not in live
    ]
    for name, spec in stored.items():
        now = live.get(name)
        if now is None:
            continue
        if spec.shape != now.shape:
            out.append(
                Difference(
                    kind=Kind.SHAPE,
                    message=f"{where}: {name!r} has shape {list(spec.shape)} in the checkpoint, "
                    f"{list(now.shape)} in the run",
                )
            )
        if spec.dtype != now.dtype:
            out.append(
                Difference(
                    kind=Kind.DTYPE,
                    message=f"{where}: {name!r} has dtype {spec.dtype} in the checkpoint, "
                    f"{now.dtype} in the run",
                )
            )
    return out


def diff_param_groups(
    where: str, stored: Sequence[Sequence[str]], live: Sequence[Sequence[str]]
) -> list[Difference]:
    """Compare an optimizer's parameter groups, each a list of parameter names in order."""
    if len(stored) != len(live):
        return [
            Difference(
                kind=Kind.GROUPS,
                message=f"{where}: {len(stored)} parameter group(s) in the checkpoint, "
                f"{len(live)} in the run",
            )
        ]
    out = []
    for index, (was, now) in enumerate(zip(stored, live, strict=True)):
        if len(was) != len(now):
            out.append(
                Difference(
                    kind=Kind.GROUPS,
                    message=f"{where}: parameter group {index} holds {len(was)} parameter(s) in "
                    f"the checkpoint, {len(now)} in the run",
                )
            )
        elif list(was) != list(now):
            changed = [f"{a!r} -> {b!r}" for a, b in zip(was, now, strict=True) if a != b]
            out.append(
                Difference(
                    kind=Kind.GROUPS,
                    message=f"{where}: parameter group {index} holds other parameters: "
                    + ", ".join(changed[:5])
                    + (f" and {len(changed) - 5} more" if len(changed) > 5 else ""),
                )
            )
    return out


def diff_components(
    stored: Iterable[str], live: Iterable[str]
) -> tuple[list[Difference], frozenset[str]]:
    """Compare component names; return the differences and the components left for later.

    A live component the checkpoint lacks is a soft difference (it would start fresh). A
    stored component the run has not registered is deferred: ``register()`` applies it later.
    """
    stored_names, live_names = set(stored), set(live)
    missing = [
        Difference(
            kind=Kind.COMPONENT,
            message=f"component {name!r} is not in the checkpoint; it would start fresh",
            soft=True,
        )
        for name in sorted(live_names - stored_names)
    ]
    return missing, frozenset(stored_names - live_names)


def diff_ema(*, stored: bool, live: bool) -> list[Difference]:
    """EMA weights on one side only: the run's EMA needs them (hard); extras are dropped (soft)."""
    if live and not stored:
        return [Difference(kind=Kind.MISSING, message="ema: the checkpoint holds no EMA weights")]
    if stored and not live:
        return [
            Difference(
                kind=Kind.UNEXPECTED,
                message="ema: the checkpoint holds EMA weights, the run has no EMA",
                soft=True,
            )
        ]
    return []


def diff_hyperparameters(
    where: str, stored: Sequence[Iterable[str]], live: Sequence[Iterable[str]]
) -> list[Difference]:
    """Compare the setting names of each optimizer parameter group (``params`` excluded).

    Settings only on one side are a newer torch's additions; settings on both sides that the
    other lacks mean another optimizer type.
    """
    out = []
    for index, (was, now) in enumerate(zip(stored, live, strict=False)):
        was_keys, now_keys = set(was) - {"params"}, set(now) - {"params"}
        if was_keys - now_keys and now_keys - was_keys:
            out.append(
                Difference(
                    kind=Kind.GROUPS,
                    message=f"{where}: parameter group {index} has settings "
                    f"{sorted(was_keys - now_keys)} only in the checkpoint and "
                    f"{sorted(now_keys - was_keys)} only in the run (another optimizer type?)",
                )
            )
    return out


def layout_differences(differences: Iterable[Difference]) -> list[Difference]:
    """Of a generic component's tensor differences, the ones that refuse a restore.

    Keys that come and go are the component's business; a tensor under the same key path
    must keep its shape and dtype.
    """
    return [d for d in differences if d.kind in {Kind.SHAPE, Kind.DTYPE}]


def judge(differences: Sequence[Difference], *, strict: bool) -> bool:
    """Whether ``differences`` refuse the restore: any hard one, or any at all when strict."""
    return any(not d.soft for d in differences) or (strict and bool(differences))


def diff_world_size(stored: int, live: int) -> list[Difference]:
    """A checkpoint restores only into the world size that wrote it."""
    if stored == live:
        return []
    return [
        Difference(
            kind=Kind.WORLD_SIZE,
            message=f"world size is {stored} in the checkpoint, {live} in the run "
            "(per-rank RNG and data sharding would not continue exactly)",
        )
    ]


def flatten(value: object, prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings and sequences into ``{"a.b[0]": leaf}``.

    Empty containers vanish: an empty section and a missing one compare equal.
    """
    out: dict[str, Any] = {}
    if isinstance(value, Mapping):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{index}]"))
    else:
        out[prefix] = value
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return (type(a) is type(b) and a == b) or (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
        and a == b
    )


def diff_config(stored: object, live: object) -> list[Difference]:
    """Compare the stored run config with the current one, key path by key path (soft)."""
    was, now = flatten(stored, "config"), flatten(live, "config")
    out = []
    for key in sorted(was.keys() | now.keys()):
        if key not in now:
            out.append(
                Difference(
                    kind=Kind.CONFIG,
                    message=f"{key}: {was[key]!r} in the checkpoint, absent now",
                    soft=True,
                )
            )
        elif key not in was:
            out.append(
                Difference(
                    kind=Kind.CONFIG,
                    message=f"{key}: absent in the checkpoint, {now[key]!r} now",
                    soft=True,
                )
            )
        elif not _same(was[key], now[key]):
            out.append(
                Difference(
                    kind=Kind.CONFIG,
                    message=f"{key}: {was[key]!r} in the checkpoint, {now[key]!r} now",
                    soft=True,
                )
            )
    return out
