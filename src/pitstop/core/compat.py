# Whether a checkpoint fits the live objects it would be restored into.
#
# Rules: restore is all-or-nothing, so every difference is found before any tensor is touched,
# and all of them are reported at once. Hard differences — a tensor missing, unexpected, or of
# another shape or dtype; optimizer parameter groups of another count, size or membership —
# always refuse the restore. Soft differences — a component the checkpoint lacks, a stored
# config value that changed, another world size (per-rank state then starts fresh) — refuse it
# under strict=True and become warnings under strict=False. Components the checkpoint holds
# but the run has not registered are not differences: they wait for a deferred register().
# Config keys the run declares may change (config_may_change: key paths and globs) are compared
# too, but only reported: a change under one of them is a note, never a difference. A pattern
# covers the key path it matches and everything beneath it; `*` matches within one key, `**`
# across keys.
# How: the shell describes both sides as flat {key path: TensorSpec | type name} mappings and
# parameter-name lists; these functions compare values and return Difference records.

"""Compatibility checks: every difference between a checkpoint and the live run."""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from pitstop.core.ranks import per_rank_message
from pitstop.errors import ConfigError

__all__ = [
    "ConfigComparison",
    "Difference",
    "Kind",
    "TensorSpec",
    "compare_config",
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
    "may_change_patterns",
    "may_change_rule",
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
    allowed: str = ""
    """What ``strict=False`` letting it through means (``""``: the message says it)."""

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
    where: str, stored: Sequence[Sequence[str | int]], live: Sequence[Sequence[str]]
) -> list[Difference]:
    """Compare an optimizer's parameter groups, each a list of parameter names in order.

    A stored group of positions (ints: an imported optimizer, whose parameter names were never
    known) is compared by size only, as torch's own load_state_dict matches it.
    """
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
        elif list(was) != list(now) and not all(type(n) is int for n in was):
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


def diff_world_size(stored: int, live: int, per_rank: Sequence[str] = ()) -> list[Difference]:
    """Per-rank state continues only in the world size that wrote it (soft: see strict=False).

    Under ``strict=False`` the replicated state loads and the per-rank state starts fresh.
    """
    if stored == live:
        return []
    return [
        Difference(
            kind=Kind.WORLD_SIZE,
            message=per_rank_message(stored, live, per_rank),
            soft=True,
            allowed=per_rank_message(stored, live, per_rank, allowed=True),
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


_ROOT = "config"


def may_change_patterns(patterns: object) -> tuple[str, ...]:
    """Check ``config_may_change``: an iterable of non-empty key paths or glob patterns.

    A leading ``config.`` is dropped (patterns are relative to the config's root). Raises
    :class:`~pitstop.errors.ConfigError` naming the bad value; a lone string is refused, as it
    would be read as one pattern per character.
    """
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
        raise ConfigError(
            f"config_may_change must be a list of key paths or glob patterns, got {patterns!r}"
        )
    out = []
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern.strip(". "):
            raise ConfigError(
                f"config_may_change entries must be key paths such as 'run.max_steps' or globs "
                f"such as 'run.*', got {pattern!r}"
            )
        out.append(pattern.removeprefix(f"{_ROOT}."))
    return tuple(out)


def may_change_rule(patterns: Iterable[str]) -> re.Pattern[str] | None:
    """One regular expression for ``patterns``, matched in full against relative key paths.

    A pattern matches a key path and every key path beneath it (``run`` covers
    ``run.max_steps``; ``layers[0].size`` is beneath ``layers`` and ``layers[0]``). ``*``
    matches any run of characters within one key (never a ``.``), ``**`` any run at all, ``?``
    one character of a key; everything else, brackets included, is literal. ``None`` when there
    are no patterns.
    """
    parts = []
    for pattern in patterns:
        regex = ""
        for piece in re.split(r"(\*\*|\*|\?)", pattern):
            if piece == "**":
                regex += ".*"
            elif piece == "*":
                regex += "[^.]*"
            elif piece == "?":
                regex += "[^.]"
            else:
                regex += re.escape(piece)
        parts.append(regex)
    if not parts:
        return None
    return re.compile("(?:" + "|".join(parts) + ")(?:[.\\[].*)?", re.DOTALL)


@attrs.frozen(kw_only=True)
class ConfigComparison:
    """The stored config compared with the live one.

    ``differences``: changed key paths no ``may_change`` pattern covers (soft: they refuse a
    strict restore). ``noted``: changed key paths a pattern covers, one message each, to be
    reported and never refused.
    """

    differences: tuple[Difference, ...] = ()
    noted: tuple[str, ...] = ()


def compare_config(
    stored: object, live: object, *, may_change: Iterable[str] = ()
) -> ConfigComparison:
    """Compare the stored run config with the current one, key path by key path.

    Every changed key path — a value changed, added or removed — is either a soft
    :class:`Difference` or, when a ``may_change`` pattern covers it, a note.
    """
    rule = may_change_rule(may_change_patterns(may_change))
    was, now = flatten(stored, _ROOT), flatten(live, _ROOT)
    differences: list[Difference] = []
    noted: list[str] = []
    for key in sorted(was.keys() | now.keys()):
        if key not in now:
            message = f"{key}: {was[key]!r} in the checkpoint, absent now"
        elif key not in was:
            message = f"{key}: absent in the checkpoint, {now[key]!r} now"
        elif not _same(was[key], now[key]):
            message = f"{key}: {was[key]!r} in the checkpoint, {now[key]!r} now"
        else:
            continue
        relative = key[len(_ROOT) + 1 :] if key.startswith(f"{_ROOT}.") else None
        if rule is not None and relative is not None and rule.fullmatch(relative):
            noted.append(message)
        else:
            differences.append(Difference(kind=Kind.CONFIG, message=message, soft=True))
    return ConfigComparison(differences=tuple(differences), noted=tuple(noted))


def diff_config(
    stored: object, live: object, *, may_change: Iterable[str] = ()
) -> list[Difference]:
    """Compare the stored run config with the current one, key path by key path (soft).

    Changes a ``may_change`` pattern covers are left out; :func:`compare_config` has them.
    """
    return list(compare_config(stored, live, may_change=may_change).differences)
