# Names in a checkpoint directory.
#
# Rules: a checkpoint is `step_<12 digits>.pitstop`, the step zero-padded, or — a sharded
# checkpoint, a directory — `step_<12 digits>` without the suffix; nothing else is one.
# Steps that need more than 12 digits are an error (names must sort the way steps do).
# Every other name is classified — temp file of a writer, pointer, latest.json, lock, or
# foreign — so the shell can scan a directory without ever guessing. A sharded checkpoint that a
# save of its step replaces is moved aside first (a directory cannot be renamed over another):
# `.tmp-<token>.old-step_<12 digits>`, a temp name too, but one that says which checkpoint it
# holds (tokens have no `.`, so no writer's temp name reads as one). Each attempt at a publish
# has a token of its own (`<run id>_<attempt>`), so what a failed attempt could not remove
# never blocks a later one of the same run; open() removes it.
# Inside a checkpoint directory only the pointers (`last`, `best`, `final`) may be symlinks, and
# only to entries of that directory: a checkpoint file, a sharded checkpoint directory and every
# entry of one are never links (`entry_components` says which trailing components of a path to
# open without following; pitstop.shell.format.untrusted applies it to every file read).
# How: a strict regular expression for parsing; formatting is the exact inverse.

"""Checkpoint file names: formatting, parsing and classifying directory entries."""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Final

from pitstop.errors import SaveError

__all__ = [
    "LATEST_JSON",
    "LOCK_NAME",
    "MAX_STEP",
    "SUFFIX",
    "TEMP_PREFIX",
    "EntryKind",
    "NotACheckpoint",
    "aside_name",
    "attempt_token",
    "checkpoint_name",
    "classify",
    "entry_components",
    "is_checkpoint_name",
    "is_file_name",
    "is_sharded_name",
    "parse_aside",
    "parse_checkpoint",
    "parse_name",
    "parse_sharded_name",
    "sharded_name",
    "temp_name",
    "temp_token",
]

SUFFIX: Final = ".pitstop"
STEP_DIGITS: Final = 12
MAX_STEP: Final = 10**STEP_DIGITS - 1
LATEST_JSON: Final = "latest.json"
LOCK_NAME: Final = ".lock"
TEMP_PREFIX: Final = ".tmp-"
POINTER_NAMES: Final = frozenset({"last", "best", "final"})

_CHECKPOINT_RE: Final = re.compile(rf"step_([0-9]{{{STEP_DIGITS}}}){re.escape(SUFFIX)}")
_SHARDED_RE: Final = re.compile(rf"step_([0-9]{{{STEP_DIGITS}}})")
_TOKEN_RE: Final = re.compile(r"[A-Za-z0-9_-]+")
ASIDE_MARK: Final = ".old-"
_ASIDE_RE: Final = re.compile(
    rf"{re.escape(TEMP_PREFIX)}[A-Za-z0-9_-]+{re.escape(ASIDE_MARK)}(step_[0-9]{{{STEP_DIGITS}}})"
)


class NotACheckpoint(enum.Enum):
    """Sentinel returned by :func:`parse_name` for a name that is not a checkpoint."""

    NOT_A_CHECKPOINT = "not a checkpoint"

    def __repr__(self) -> str:
        return "NOT_A_CHECKPOINT"

    __str__ = __repr__


NOT_A_CHECKPOINT: Final = NotACheckpoint.NOT_A_CHECKPOINT


class EntryKind(enum.Enum):
    """What a name in a checkpoint directory is."""

    CHECKPOINT = "checkpoint"
    TEMP = "temp"
    POINTER = "pointer"
    LATEST_JSON = "latest.json"
    LOCK = "lock"
    FOREIGN = "foreign"


def checkpoint_name(step: int) -> str:
    """Return the file name of the checkpoint at ``step``: ``step_000000000100.pitstop``.

    Raises :class:`~pitstop.errors.SaveError` for a negative step or one of more than
    12 digits, naming the step.
    """
    if isinstance(step, bool) or not isinstance(step, int):
        raise SaveError(f"checkpoint step must be an int, got {step!r}")
    if step < 0:
        raise SaveError(f"checkpoint step must be >= 0, got {step}")
    if step > MAX_STEP:
        raise SaveError(
            f"step {step} needs more than {STEP_DIGITS} digits; checkpoint names hold steps "
            f"up to {MAX_STEP}"
        )
    return f"step_{step:0{STEP_DIGITS}d}{SUFFIX}"


def parse_name(name: str) -> int | NotACheckpoint:
    """Return the step a checkpoint file name encodes, or ``NOT_A_CHECKPOINT``.

    The exact inverse of :func:`checkpoint_name`: ``step_2.pitstop``, temp files, pointers and
    any other name are not checkpoints.
    """
    match = _CHECKPOINT_RE.fullmatch(name)
    if match is None:
        return NOT_A_CHECKPOINT
    return int(match.group(1))


def entry_components(parts: Sequence[str]) -> int:
    """How many trailing components of the path ``parts`` must not be symlinks: the one rule of
    which entries of a checkpoint directory may be links (only the pointers may).

    ``2``: an entry of a sharded checkpoint directory (its manifest, a DCP file) — it and the
    directory; ``1``: a checkpoint file or a sharded checkpoint directory itself; ``0``: any
    other path (a pointer, ``latest.json``, a file outside a checkpoint directory), whose
    symlinks the caller follows or refuses as it says.
    """
    if len(parts) >= 2 and parse_sharded_name(parts[-2]) is not NOT_A_CHECKPOINT:
        return 2
    if parts and parse_checkpoint(parts[-1]) is not NOT_A_CHECKPOINT:
        return 1
    return 0


def sharded_name(step: int) -> str:
    """The directory name of the sharded checkpoint at ``step``: ``step_000000000100``."""
    return checkpoint_name(step).removesuffix(SUFFIX)


def parse_sharded_name(name: str) -> int | NotACheckpoint:
    """The step a sharded checkpoint directory name encodes, or ``NOT_A_CHECKPOINT``."""
    match = _SHARDED_RE.fullmatch(name)
    return NOT_A_CHECKPOINT if match is None else int(match.group(1))


def parse_checkpoint(name: str) -> int | NotACheckpoint:
    """The step a checkpoint name encodes — a file's or a sharded directory's — or
    ``NOT_A_CHECKPOINT``."""
    step = parse_name(name)
    return parse_sharded_name(name) if step is NOT_A_CHECKPOINT else step


def is_file_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint file's name."""
    return parse_name(name) is not NOT_A_CHECKPOINT


def is_sharded_name(name: str) -> bool:
    """Whether ``name`` is a sharded checkpoint's name."""
    return parse_sharded_name(name) is not NOT_A_CHECKPOINT


def is_checkpoint_name(name: str) -> bool:
    """Whether ``name`` is a checkpoint's name, a file's or a sharded one's."""
    return parse_checkpoint(name) is not NOT_A_CHECKPOINT


def temp_name(final_name: str, token: str) -> str:
    """Return the name of a writer's temp file for ``final_name``.

    ``token`` identifies the writer (e.g. a run id); it must be non-empty and made of
    letters, digits, ``_`` and ``-``, so the temp name is unambiguous.
    """
    if not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"temp token must match [A-Za-z0-9_-]+, got {token!r}")
    return f"{TEMP_PREFIX}{token}-{final_name}"


def temp_token(temp: str, final_name: str) -> str:
    """The token that :func:`temp_name` made the temp name ``temp`` of ``final_name`` with;
    ``ValueError`` when ``temp`` is no temp name of ``final_name``."""
    token = temp[len(TEMP_PREFIX) : -len(final_name) - 1]
    if temp != f"{TEMP_PREFIX}{token}-{final_name}" or not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"{temp} is not a temp name of {final_name}")
    return token


def attempt_token(run_id: str, attempt: int) -> str:
    """The temp-name token of a run's ``attempt``-th publish: ``<run id>_<attempt>``.

    No two attempts of a run share one (the attempt is the part after the last ``_``), so a
    temp name a failed attempt left never blocks a later one. Raises ``ValueError`` for a run
    id that is no token, or an attempt that is not a positive int.
    """
    if not _TOKEN_RE.fullmatch(run_id):
        raise ValueError(f"run id must match [A-Za-z0-9_-]+, got {run_id!r}")
    if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 1:
        raise ValueError(f"attempt must be an int >= 1, got {attempt!r}")
    return f"{run_id}_{attempt}"


def aside_name(final_name: str, token: str) -> str:
    """The name the sharded checkpoint ``final_name`` is moved to while a save of its step puts
    the new one in its place: ``.tmp-<token>.old-step_000000000100``.

    Raises ``ValueError`` for a ``final_name`` that is no sharded checkpoint's or a bad token.
    """
    if parse_sharded_name(final_name) is NOT_A_CHECKPOINT:
        raise ValueError(f"only a sharded checkpoint is moved aside, not {final_name!r}")
    if not _TOKEN_RE.fullmatch(token):
        raise ValueError(f"temp token must match [A-Za-z0-9_-]+, got {token!r}")
    return f"{TEMP_PREFIX}{token}{ASIDE_MARK}{final_name}"


def parse_aside(name: str) -> str | NotACheckpoint:
    """The sharded checkpoint's name that :func:`aside_name` made ``name`` from, or
    ``NOT_A_CHECKPOINT`` (every other name: a writer's temp name, a checkpoint, ...)."""
    match = _ASIDE_RE.fullmatch(name)
    return NOT_A_CHECKPOINT if match is None else match.group(1)


def classify(name: str) -> EntryKind:
    """Say what the directory entry ``name`` is; unknown names are ``FOREIGN``."""
    if parse_checkpoint(name) is not NOT_A_CHECKPOINT:
        return EntryKind.CHECKPOINT
    if name.startswith(TEMP_PREFIX):
        return EntryKind.TEMP
    if name in POINTER_NAMES:
        return EntryKind.POINTER
    if name == LATEST_JSON:
        return EntryKind.LATEST_JSON
    if name == LOCK_NAME:
        return EntryKind.LOCK
    return EntryKind.FOREIGN
