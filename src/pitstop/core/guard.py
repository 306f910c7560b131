# What must stop a run, or be said to it, before it writes into a checkpoint directory.
#
# Rules: (1) an entry pitstop must be able to replace at every save — the pointers `last`,
# `best`, `final` and `latest.json` — may not be a directory: a rename cannot replace one, so
# every save would fail deep into the run; the directory is refused when it is opened, with the
# path and what to do. (2) A run that did not resume never changes what another run published:
# a directory that held checkpoints when it was opened refuses the first save of a run that did
# not resume (or ask to overwrite) — before a byte is written — naming the directory, its newest
# step and the three ways out. (3) A component the resumed checkpoint holds but the run never
# registered is carried forward into every save unchanged; the first save says so, by name.
# (4) An import writes only into a directory that holds no checkpoint: over a run's checkpoints
# it would move `last` off that run's newest and let retention delete what it kept — so it is
# refused under the lock, before a byte is written, naming the directory and its newest step.
# How: pure functions over names, kinds and catalog entries; the shell looks, asks and raises.

"""Guards before writing: reserved names, another run's checkpoints, unregistered components."""

from __future__ import annotations

from collections.abc import Collection

from pitstop.core.naming import LATEST_JSON, POINTER_NAMES

__all__ = [
    "OVERWRITE_FLAG",
    "RESERVED_NAMES",
    "carried_forward_warning",
    "foreign_save_problem",
    "import_target_problem",
    "reserved_entry_problem",
]

RESERVED_NAMES = frozenset({*POINTER_NAMES, LATEST_JSON})
"""Entries every save replaces: they must be symlinks or regular files, never directories."""

OVERWRITE_FLAG = "overwrite=True"
"""How a Checkpointer is told that replacing another run's checkpoints is what is wanted."""


def reserved_entry_problem(name: str, kind: str, path: str) -> str | None:
    """Why the entry ``name`` (at ``path``, a ``kind`` such as ``"directory"``) stops a writer.

    ``None`` when it does not: only a directory in a reserved name's place does.
    """
    if name not in RESERVED_NAMES or kind != "directory":
        return None
    what = "pointer" if name in POINTER_NAMES else "pointer file"
    return (
        f"{path} is a directory, but pitstop keeps its {name!r} {what} there and replaces it at "
        f"every save, which a directory prevents; move it out of the way "
        f"(mv {path} {path}.old) or use another checkpoint directory"
    )


def foreign_save_problem(
    newest: tuple[int, str] | None,
    *,
    directory: str,
    count: int,
    resume: str = "call resume() first",
    overwrite: str = f"pass Checkpointer(..., {OVERWRITE_FLAG})",
) -> str | None:
    """Why a run that did not resume may not save into ``directory`` (``None``: it may).

    ``newest`` is the step and file name of the newest checkpoint the directory held when it
    was opened (``None``: it held none), ``count`` how many it held; ``resume`` and
    ``overwrite`` say how the caller's user resumes or asks to replace them (a library call
    by default; the trainer names its flags).
    """
    if newest is None:
        return None
    step, name = newest
    return (
        f"{directory} already holds {count} checkpoint(s) (the newest is step {step}, "
        f"{name}) and this run did not resume from them: saving would replace them. To "
        f"continue from them, {resume}; to start over, use another checkpoint directory or "
        f"{overwrite}"
    )


def import_target_problem(
    newest: tuple[int, str] | None, *, directory: str, count: int
) -> str | None:
    """Why an import may not write into ``directory`` (``None``: it may).

    ``newest`` is the step and name of the newest checkpoint the directory holds (``None``: it
    holds none), ``count`` how many it holds.
    """
    if newest is None:
        return None
    step, name = newest
    return (
        f"{directory} already holds {count} checkpoint(s) (the newest is step {step}, {name}); "
        f"an import there would move its 'last' pointer off that run and let its retention "
        f"delete checkpoints, so pitstop refuses it and changes nothing. Import into a new or "
        f"empty checkpoint directory"
    )


def carried_forward_warning(names: Collection[str], source: str) -> str | None:
    """The warning for components ``names`` held by checkpoint ``source`` and never registered.

    ``None`` when there are none.
    """
    if not names:
        return None
    listed = ", ".join(repr(n) for n in sorted(names))
    return (
        f"{source} holds component(s) {listed}, which this run never registered: each save "
        f"carries their stored state forward unchanged. Pass them in state= (or register() "
        f"them) so they are restored and saved live"
    )
