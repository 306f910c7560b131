# The records every decision works on.
#
# Rules: records are frozen attrs classes with keyword-only fields, changed with attrs.evolve;
# validators reject bad values at construction with a ConfigError naming the field and value.
# "No checkpoint" is the NO_CHECKPOINT sentinel, never None or -1. Save reasons, pointer names
# and retention reasons are enums. Metrics are read-only mappings of str to float.
# How: small validator factories below; derived facts (a checkpoint's name and step) are
# properties, never stored twice.

"""Frozen records shared by the planning core: progress, policy, catalog, pointers."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Final, Literal

import attrs

from pitstop.core.naming import checkpoint_name, sharded_name
from pitstop.core.validators import (
    count,
    fail,
    is_bool,
    is_int,
    is_real,
    mode,
    non_empty_str,
    positive_int_or_none,
    positive_seconds_or_none,
)
from pitstop.errors import ConfigError

__all__ = [
    "NO_CHECKPOINT",
    "Best",
    "Catalog",
    "CheckpointEntry",
    "KeepReason",
    "Metrics",
    "NoCheckpoint",
    "PointerName",
    "Pointers",
    "Policy",
    "Progress",
    "SaveReason",
    "freeze_metrics",
]

Metrics = Mapping[str, float]


class NoCheckpoint(enum.Enum):
    """Sentinel for "there is no checkpoint here" (a pointer that points nowhere, ...)."""

    NO_CHECKPOINT = "no checkpoint"

    def __repr__(self) -> str:
        return "NO_CHECKPOINT"

    __str__ = __repr__


NO_CHECKPOINT: Final = NoCheckpoint.NO_CHECKPOINT


class SaveReason(str, enum.Enum):
    """Why a checkpoint was written."""

    INTERVAL = "interval"  # step is a multiple of Policy.every_steps
    TIME = "time"  # Policy.every_seconds passed since the last save
    BEST = "best"  # the Best metric improved
    STOP = "stop"  # a stop was requested (signal, preemption, deliberate)
    FINAL = "final"  # the normal end of the run
    MANUAL = "manual"  # Checkpointer.save() called by the user


# When one save has several reasons, the one recorded is the first of these present.
REASON_PRIORITY: Final = (
    SaveReason.STOP,
    SaveReason.FINAL,
    SaveReason.MANUAL,
    SaveReason.BEST,
    SaveReason.INTERVAL,
    SaveReason.TIME,
)


class PointerName(str, enum.Enum):
    """The named pointers of a checkpoint directory."""

    LAST = "last"
    BEST = "best"
    FINAL = "final"


class KeepReason(str, enum.Enum):
    """Why retention keeps a checkpoint (shown by ``pitstop ls``)."""

    NEWEST = "newest"  # the most recently published checkpoint
    RECENT = "recent"  # within Policy.keep_last most recent
    KEEP_ALL = "keep_all"  # Policy.keep_last is None
    KEEP_EVERY = "keep_every"  # step is a multiple of Policy.keep_every
    POINTER_LAST = "pointer:last"
    POINTER_BEST = "pointer:best"
    POINTER_FINAL = "pointer:final"


def _checkpoint_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not NO_CHECKPOINT and not (isinstance(value, str) and value):
        raise fail(
            instance, attribute, f"must be a checkpoint name or NO_CHECKPOINT, got {value!r}"
        )


def freeze_metrics(metrics: Mapping[str, float] | None) -> Metrics:
    """Return ``metrics`` as a read-only ``{str: float}`` mapping (``None`` → empty).

    Raises :class:`~pitstop.errors.ConfigError` naming the key of any value that is not a real
    number (bools are not numbers here).
    """
    if metrics is None:
        return MappingProxyType({})
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"metrics must be a mapping of str to float, got {metrics!r}")
    frozen: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ConfigError(f"metrics keys must be str, got {key!r}")
        if not is_real(value):
            raise ConfigError(f"metrics[{key!r}] must be a real number, got {value!r}")
        frozen[key] = float(value)
    return MappingProxyType(frozen)


# --- progress ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Progress:
    """Where a run is: optimizer updates, epochs, and cumulative counters.

    ``step`` counts optimizer updates since the run began (absolute, never reset by a resume);
    ``batch_in_epoch`` counts updates within the current epoch and positions the data sampler.
    """

    step: int = attrs.field(default=0, validator=count)
    epoch: int = attrs.field(default=0, validator=count)
    batch_in_epoch: int = attrs.field(default=0, validator=count)
    samples: int = attrs.field(default=0, validator=count)
    tokens: int = attrs.field(default=0, validator=count)

    def advance(self, *, samples: int = 0, tokens: int = 0) -> Progress:
        """Return the progress after one optimizer update that consumed ``samples``/``tokens``."""
        return attrs.evolve(
            self,
            step=self.step + 1,
            batch_in_epoch=self.batch_in_epoch + 1,
            samples=self.samples + samples,
            tokens=self.tokens + tokens,
        )

    def next_epoch(self) -> Progress:
        """Return the progress at the start of the next epoch."""
        return attrs.evolve(self, epoch=self.epoch + 1, batch_in_epoch=0)


# --- policy -----------------------------------------------------------------------------------


@attrs.frozen
class Best:
    """Which reported metric makes a checkpoint "best", and whether lower or higher is better."""

    metric: str = attrs.field(validator=non_empty_str)
    mode: Literal["min", "max"] = attrs.field(default="min", validator=mode, kw_only=True)

    def improves(self, candidate: float, incumbent: float | None) -> bool:
        """Return whether ``candidate`` strictly beats ``incumbent`` (``None``: nothing yet).

        NaN never improves; ties keep the incumbent.
        """
        if math.isnan(candidate):
            return False
        if incumbent is None or math.isnan(incumbent):
            return True
        return candidate < incumbent if self.mode == "min" else candidate > incumbent

    def rank_key(self, value: float) -> float:
        """Return a sort key under which better values sort first (NaN last)."""
        if math.isnan(value):
            return math.inf
        return value if self.mode == "min" else -value


def _best_or_none(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not isinstance(value, Best):
        raise fail(instance, attribute, f"must be a Best or None, got {value!r}")


@attrs.frozen(kw_only=True)
class Policy:
    """When to save and what to keep.

    * ``every_steps``: save when the step is an exact multiple; ``every_seconds``: save when
      this much wall time passed since the last save.
    * ``keep_last``: keep the N most recently published checkpoints (``None``: keep all);
      ``keep_every``: also keep every checkpoint whose step is a multiple of K, forever.
    * ``best``: save, and move the ``best`` pointer, when this metric improves.
    * ``save_final``: save the final step at a normal end even when it is off-interval.

    Pointer targets (last, best, final) and the newest checkpoint are always kept.
    """

    every_steps: int | None = attrs.field(default=None, validator=positive_int_or_none)
    every_seconds: float | None = attrs.field(default=None, validator=positive_seconds_or_none)
    keep_last: int | None = attrs.field(default=3, validator=positive_int_or_none)
    keep_every: int | None = attrs.field(default=None, validator=positive_int_or_none)
    best: Best | None = attrs.field(default=None, validator=_best_or_none)
    save_final: bool = attrs.field(default=True, validator=is_bool)


# --- what is on disk --------------------------------------------------------------------------


def _seq(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not is_int(value) or value < 1:
        raise fail(instance, attribute, f"must be an int >= 1, got {value!r}")


def _progress(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, Progress):
        raise fail(instance, attribute, f"must be a Progress, got {value!r}")


@attrs.frozen(kw_only=True)
class CheckpointEntry:
    """One published checkpoint, as its file describes itself.

    ``seq`` is the save sequence number: strictly increasing across saves into one directory,
    it alone defines "most recent" (never mtime or wall clock).
    """

    progress: Progress = attrs.field(validator=_progress)
    seq: int = attrs.field(validator=_seq)
    reason: SaveReason = attrs.field(converter=SaveReason)
    detail: str = ""  # e.g. the signal behind a stop: "SIGTERM"
    metrics: Metrics = attrs.field(factory=dict, converter=freeze_metrics, hash=False)
    sharded: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """A sharded checkpoint: a directory of DCP files and pitstop's manifest, not one file."""

    @property
    def step(self) -> int:
        """The optimizer step this checkpoint holds."""
        return self.progress.step

    @property
    def name(self) -> str:
        """The checkpoint's name: its file's, or a sharded checkpoint's directory's."""
        step = self.progress.step
        return sharded_name(step) if self.sharded else checkpoint_name(step)


def _by_seq(entries: Iterable[CheckpointEntry]) -> tuple[CheckpointEntry, ...]:
    return tuple(sorted(entries, key=lambda e: (e.seq, e.step)))


@attrs.frozen(kw_only=True)
class Catalog:
    """The published checkpoints of one directory, oldest (lowest ``seq``) first.

    One entry per file name. Built by the shell from a directory scan; every decision about the
    directory takes a catalog as input.
    """

    entries: tuple[CheckpointEntry, ...] = attrs.field(default=(), converter=_by_seq)
    _by_name: Mapping[str, CheckpointEntry] = attrs.field(
        init=False, repr=False, eq=False, hash=False
    )

    def __attrs_post_init__(self) -> None:
        by_name = {e.name: e for e in self.entries}
        if len(by_name) != len(self.entries):
            names = [e.name for e in self.entries]
            dupes = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"Catalog.entries holds more than one entry for {dupes}")
        object.__setattr__(self, "_by_name", MappingProxyType(by_name))

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[CheckpointEntry]:
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def get(self, name: str | NoCheckpoint) -> CheckpointEntry | NoCheckpoint:
        """Return the entry called ``name``, or ``NO_CHECKPOINT``."""
        if name is NO_CHECKPOINT:
            return NO_CHECKPOINT
        return self._by_name.get(name, NO_CHECKPOINT)

    def newest(self) -> CheckpointEntry | NoCheckpoint:
        """Return the most recently published entry (highest ``seq``), or ``NO_CHECKPOINT``."""
        return self.entries[-1] if self.entries else NO_CHECKPOINT

    def next_seq(self) -> int:
        """Return the sequence number the next save gets: the highest present plus one."""
        return self.entries[-1].seq + 1 if self.entries else 1

    def with_entry(self, entry: CheckpointEntry) -> Catalog:
        """Return the catalog with ``entry`` added, replacing any entry of the same name."""
        return Catalog(entries=(*(e for e in self.entries if e.name != entry.name), entry))

    def without(self, names: Iterable[str]) -> Catalog:
        """Return the catalog without the entries called ``names``."""
        drop = frozenset(names)
        return Catalog(entries=tuple(e for e in self.entries if e.name not in drop))


def _best_value(instance: Pointers, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not is_real(value):
        raise fail(instance, attribute, f"must be a real number or None, got {value!r}")
    if instance.best is NO_CHECKPOINT:
        raise fail(instance, attribute, f"is {value!r} but there is no best checkpoint")


@attrs.frozen(kw_only=True)
class Pointers:
    """Where the named pointers go: a checkpoint file name each, or ``NO_CHECKPOINT``.

    ``best_value`` is the metric value of the ``best`` checkpoint when known.
    """

    last: str | NoCheckpoint = attrs.field(default=NO_CHECKPOINT, validator=_checkpoint_or_none)
    best: str | NoCheckpoint = attrs.field(default=NO_CHECKPOINT, validator=_checkpoint_or_none)
    final: str | NoCheckpoint = attrs.field(default=NO_CHECKPOINT, validator=_checkpoint_or_none)
    best_value: float | None = attrs.field(default=None, validator=_best_value)

    def target(self, pointer: PointerName) -> str | NoCheckpoint:
        """Return where ``pointer`` goes."""
        target: str | NoCheckpoint = getattr(self, PointerName(pointer).value)
        return target

    def items(self) -> tuple[tuple[PointerName, str], ...]:
        """Return ``(pointer, target)`` for each pointer that points somewhere."""
        return tuple((p, t) for p in PointerName if (t := self.target(p)) is not NO_CHECKPOINT)

    def targets(self) -> frozenset[str]:
        """Return the names of every checkpoint some pointer goes to."""
        return frozenset(t for _, t in self.items())
