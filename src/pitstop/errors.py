"""Every exception pitstop raises.

All of them derive from :class:`PitstopError`, so ``except pitstop.PitstopError`` catches
anything pitstop reports on purpose. Each message names the offending key, path, step or value.
This module imports nothing, so the pure core may use it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CheckpointCorrupt",
    "CheckpointNotFound",
    "CollectiveError",
    "ConfigError",
    "DirectoryLocked",
    "ImportRefused",
    "IncompatibleCheckpoint",
    "InvalidValue",
    "PitstopError",
    "ResumeWarning",
    "SaveError",
]


class PitstopError(Exception):
    """Base class of every error pitstop raises on purpose."""


class CheckpointCorrupt(PitstopError):
    """A checkpoint file is incomplete, truncated, or fails an integrity check."""


class CheckpointNotFound(PitstopError, FileNotFoundError):
    """No checkpoint matches a path, pointer or directory."""


class IncompatibleCheckpoint(PitstopError):
    """A checkpoint does not fit the live objects it would be restored into.

    ``differences`` lists every mismatch found, not only the first.
    """

    def __init__(self, differences: Iterable[str]) -> None:
        self.differences: tuple[str, ...] = tuple(differences)
        lines = "\n".join(f"  - {d}" for d in self.differences)
        super().__init__(
            f"checkpoint is incompatible ({len(self.differences)} difference(s)):\n{lines}"
        )


class ConfigError(PitstopError, ValueError):
    """A configuration value or record field is invalid.

    ``problems`` lists every bad key path with what is wrong with it. It is also a
    :class:`ValueError`, so code that validates arguments generically still catches it.
    """

    def __init__(self, problems: str | Iterable[str]) -> None:
        self.problems: tuple[str, ...] = (
            (problems,) if isinstance(problems, str) else tuple(problems)
        )
        if len(self.problems) == 1:
            message = self.problems[0]
        else:
            message = f"{len(self.problems)} configuration problems:\n" + "\n".join(
                f"  - {p}" for p in self.problems
            )
        super().__init__(message)


class InvalidValue(ConfigError):
    """One field of a record holds an invalid value.

    ``field`` names it (``Policy.keep_last``); ``requirement`` says what is wrong
    (``must be a positive int or None, got 0``).
    """

    def __init__(self, field: str, requirement: str) -> None:
        self.field = field
        self.requirement = requirement
        super().__init__(f"{field} {requirement}")


class DirectoryLocked(PitstopError):
    """Another writer holds the checkpoint directory's lock."""


class ImportRefused(PitstopError):
    """A checkpoint from elsewhere that pitstop will not import, and why.

    Raised by :func:`pitstop.import_checkpoint` for a file that only unpickling could read
    (pitstop never unpickles) or that is no checkpoint format pitstop knows.
    """


class SaveError(PitstopError):
    """A checkpoint could not be written or published; nothing was published."""


class CollectiveError(PitstopError):
    """A collective between ranks did not complete: a rank did not arrive within the timeout,
    or its connection closed.

    The message names the call and round (``maybe_save at step 12, round 1``), the ranks that did
    not arrive, and what to check. ``missing`` holds those ranks (empty: not known).
    """

    def __init__(self, message: str, missing: Iterable[int] = ()) -> None:
        self.missing: tuple[int, ...] = tuple(missing)
        super().__init__(message)


class ResumeWarning(UserWarning):
    """A resume that goes through inexactly: ``strict=False`` let a difference through that it
    would otherwise refuse (another world size: the per-rank state starts fresh; a stream
    without state), or a plain ``DataLoader`` given in ``state=`` whose data is not restored."""
