"""``pitstop ls`` and ``pitstop verify``: inspect checkpoint directories and files."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pitstop.cli.common import Target, named_target, open_directory
from pitstop.cli.progress import progress_bars
from pitstop.core.records import NO_CHECKPOINT, CheckpointEntry, PointerName
from pitstop.core.saving.pointers import resume_order
from pitstop.core.saving.retention import plan_retention
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.formatting import format_size
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import (
    ResumeChoice,
    choose_resume,
    gone_while_read,
    is_sharded_path,
    scan,
    vanished,
    verify_any,
)
from pitstop.shell.store.resolve import RESOLVE_ATTEMPTS, manifest_path
from pitstop.shell.store.sharddir import part_held, read_layout, verify_sharded
from pitstop.shell.store.storage import RemoteStorage, fetch

__all__ = ["format_metrics", "list_directory", "verify_checkpoint"]

_COLUMNS = ("step", "epoch", "samples", "tokens", "reason", "metrics", "size", "seq", "pointers")


def format_metrics(metrics: Mapping[str, float]) -> str:
    """``val_loss=0.48, accuracy=0.91`` (6 significant digits), or ``-`` when there are none."""
    return ", ".join(f"{k}={v:.6g}" for k, v in sorted(metrics.items())) or "-"


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None  # JSON has no NaN or infinity


def list_directory(
    console: Console, directory: str, *, check: bool = False, as_json: bool = False
) -> int:
    """Print a table (or, with ``as_json``, a JSON array) of the checkpoints in ``directory``.

    With ``check``, verify each one. Returns 0, or 1 when ``check`` finds a corrupt or
    unreadable checkpoint. A checkpoint a live run's retention deletes while it is checked is
    gone: left out of the listing, no failure.
    """
    storage, policy, title = open_directory(directory, _not_a_directory)
    remote = isinstance(storage, RemoteStorage)  # an s3:// prefix: each checkpoint fetched
    found = scan(storage, None if policy is None else policy.best)
    retention = None if policy is None else plan_retention(found.catalog, found.pointers, policy)

    def where(name: str) -> str:
        return f"{title}/{name}" if remote else str(storage.path(name))

    failures: dict[str, str] = dict(found.unreadable)
    checked: dict[str, str | None] = {}  # name -> None (ok) or the problem
    gone: set[str] = set()  # deleted while being checked (a live run's retention)
    partial_here: set[str] = set()  # whole here, but other nodes' ranks' files elsewhere
    if check:
        with progress_bars(console, enabled=not as_json):
            for entry in found.catalog:
                local = storage.path(entry.name)
                try:
                    local = fetch(storage, entry.name)
                    verify_any(local)
                    checked[entry.name] = None
                except (CheckpointCorrupt, OSError) as exc:
                    if gone_while_read(storage, local, exc):
                        gone.add(entry.name)
                        continue
                    part = None if remote else _partial(local)  # a node's part: not corrupt
                    if part is not None:
                        partial_here.add(entry.name)
                    failures[entry.name] = checked[entry.name] = part or str(exc)
                finally:
                    if isinstance(storage, RemoteStorage) and local.is_dir():  # a sharded one's
                        shutil.rmtree(local, ignore_errors=True)  # fetched folder
                    elif isinstance(storage, RemoteStorage):  # fetched: checked, not kept
                        storage.release()
    entries = [entry for entry in found.catalog if entry.name not in gone]

    def resume_choice() -> ResumeChoice:  # what a resume would use, from the checks just made
        if remote:  # every candidate was checked above: none is fetched again
            order = resume_order(found.catalog, found.pointers, PointerName.LAST, None)
            tried = [n for n in order if n not in gone]
            skipped = {n: failures[n] for n in itertools.takewhile(failures.__contains__, tried)}
            chosen = tried[len(skipped)] if len(skipped) < len(tried) else None
            return ResumeChoice(
                entry=NO_CHECKPOINT if chosen is None else found.catalog.get(chosen),
                path=None if chosen is None else storage.path(chosen),
                skipped=skipped,
                gone=frozenset(gone),
            )

        def checked_before(path: Path) -> None:
            if path.name in gone:
                raise FileNotFoundError(f"{path} was deleted while it was checked")
            if path.name in failures:
                _raise(failures[path.name])

        return choose_resume(storage, found, PointerName.LAST, verify=checked_before)

    heres = {entry.name: _here(storage, entry, remote) for entry in entries}
    partial = any(not h["complete"] for h in heres.values())

    def pointers_of(entry: CheckpointEntry) -> list[str]:
        return [p.value for p in PointerName if found.pointers.target(p) == entry.name]

    def kept(entry: CheckpointEntry) -> list[str] | None:
        if retention is None:
            return None
        return sorted(r.value for r in retention.why(entry.name))

    if as_json:
        choice = resume_choice() if check else None
        rows: list[dict[str, Any]] = []
        for entry in entries:
            row: dict[str, Any] = {
                "name": entry.name,
                "path": where(entry.name),
                "step": entry.step,
                "epoch": entry.progress.epoch,
                "batch_in_epoch": entry.progress.batch_in_epoch,
                "samples": entry.progress.samples,
                "tokens": entry.progress.tokens,
                "reason": entry.reason.value,
                "detail": entry.detail,
                "metrics": {k: _json_number(v) for k, v in entry.metrics.items()},
                "size": found.sizes[entry.name],
                "seq": entry.seq,
                "pointers": pointers_of(entry),
                "kept_because": kept(entry),
                "here": heres[entry.name],
            }
            if check:
                problem = checked.get(entry.name)
                row["check"] = "ok" if problem is None else "corrupt"
                if entry.name in partial_here:  # whole here, other ranks' files elsewhere
                    row["check"] = "partial"
                row["problem"] = problem
                row["resume_from_last"] = choice is not None and choice.entry == entry
            rows.append(row)
        for name, why in found.unreadable.items():
            rows.append(
                {"name": name, "path": where(name), "unreadable": why}
                | ({"check": "unreadable", "problem": why} if check else {})
            )
        console.file.write(json.dumps(rows, indent=2) + "\n")
        errors = Console(stderr=True, highlight=False, soft_wrap=True)
        for warning in found.warnings:
            errors.print(f"[yellow]warning:[/yellow] {escape(warning)}")
        return 1 if check and failures else 0

    table = Table(title=title, title_justify="left")
    for column in _COLUMNS:
        table.add_column(column, justify="left" if column in ("reason", "metrics") else "right")
    table.add_column("kept because")
    if partial:  # a node's directory of a job whose ranks shared none
        table.add_column("here")
    if check:
        table.add_column("check")
    for entry in entries:
        kept_for = kept(entry)
        reason = entry.reason.value + (f" ({entry.detail})" if entry.detail else "")
        row_cells = [
            str(entry.step),
            str(entry.progress.epoch),
            str(entry.progress.samples),
            str(entry.progress.tokens),
            reason,
            format_metrics(entry.metrics),
            format_size(found.sizes[entry.name]),
            str(entry.seq),
            ", ".join(pointers_of(entry)) or "-",
            "policy unknown" if kept_for is None else ", ".join(kept_for) or "-",
            *([_here_cell(heres[entry.name])] if partial else []),
        ]
        if check:
            ok = checked.get(entry.name) is None
            bad = "[yellow]PARTIAL[/yellow]" if entry.name in partial_here else "[red]CORRUPT[/red]"
            row_cells.append("[green]ok[/green]" if ok else bad)
        table.add_row(*row_cells)
    for name in found.unreadable:
        table.add_row(
            "?",
            "",
            "",
            "",
            f"[red]unreadable[/red]: {name}",
            "",
            "",
            "",
            "",
            "",
            *([""] if partial else []),
            *(["[red]UNREADABLE[/red]"] if check else []),
        )
    console.print(table)
    if not entries and not found.unreadable:
        console.print("no checkpoints")
    for warning in found.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    if not check:
        return 0
    for name, why in failures.items():
        label = "[yellow]partial:[/yellow]" if name in partial_here else "[red]corrupt:[/red]"
        console.print(f"{label} {escape(why if name in why else f'{name}: {why}')}")
    _print_resume(console, resume_choice())
    return 1 if failures else 0


def _here(storage: Any, entry: CheckpointEntry, remote: bool) -> dict[str, Any]:
    """What this directory holds of ``entry``: a file is whole here; a sharded checkpoint of a
    job whose ranks shared no directory may hold only this node's ranks' files (partial)."""
    if remote or not entry.sharded:
        return {"complete": True, "files_here": 1, "files": 1, "missing_ranks": []}
    try:
        here, listed, ranks, _ = part_held(storage.path(entry.name))
    except (CheckpointCorrupt, OSError):
        return {"complete": False, "files_here": None, "files": None, "missing_ranks": None}
    return {
        "complete": here == listed,
        "files_here": here,
        "files": listed,
        "missing_ranks": list(ranks),
    }


def _here_cell(here: dict[str, Any]) -> str:
    if here["complete"]:
        return "complete"
    if here["files"] is None:
        return "unreadable manifest"
    ranks = ", ".join(map(str, here["missing_ranks"]))
    return f"partial: {here['files_here']} of {here['files']} files (rank {ranks}'s elsewhere)"


def _not_a_directory(path: Path) -> str:
    """Why ``pitstop ls PATH`` cannot list ``path``, and what to run instead."""
    if not path.exists():
        return f"{path} does not exist; pitstop ls lists a checkpoint directory"
    if path.suffix == ".pitstop" or path.name in {p.value for p in PointerName}:
        return (
            f"{path} is one checkpoint, not a directory; pitstop ls lists a directory (such as "
            f"{path.parent}). For this checkpoint: pitstop inspect {path} (what it records) or "
            f"pitstop verify {path} (check every byte)"
        )
    return f"{path} is a file, not a directory; pitstop ls lists a checkpoint directory"


def _print_resume(console: Console, choice: ResumeChoice) -> None:
    if choice.entry is NO_CHECKPOINT:
        console.print("a resume would start fresh: no valid checkpoint")
        return
    skipped = f", after skipping {', '.join(choice.skipped)}" if choice.skipped else ""
    console.print(
        f"a resume from last would use {choice.entry.name} (step {choice.entry.step}): the "
        f"most recently published valid checkpoint (seq {choice.entry.seq}){skipped}",
        highlight=False,
    )


def _raise(message: str) -> None:
    raise CheckpointCorrupt(message)


def verify_checkpoint(console: Console, checkpoint: str) -> int:
    """Verify ``checkpoint`` (file, pointer or directory); 0 when valid, 1 when corrupt.

    A pointer is checked at the file it names on disk, never at a fallback: a truncated
    ``last`` is CORRUPT even when an older checkpoint is valid. The line says what was checked.
    """
    for attempt in range(RESOLVE_ATTEMPTS):
        target = named_target(checkpoint)
        via = f" ({target.via})" if target.via else ""
        try:
            with progress_bars(console):
                verify_any(target.path)
            checked = _checked(target.path, fileformat.read_manifest(manifest_path(target.path)))
            break
        except (CheckpointCorrupt, FileNotFoundError) as exc:
            if _moved_on(checkpoint, target) and attempt + 1 < RESOLVE_ATTEMPTS:
                continue  # pruned by a live run after its pointer moved on: check the new one
            if isinstance(exc, FileNotFoundError):
                message = "the file does not exist"
            else:
                message = str(exc).removeprefix(f"{target.path}: ")
            partial = _partial(target.path)
            label = "CORRUPT" if partial is None else "PARTIAL"
            console.print(
                f"[red]{label}[/red] {escape(str(target.path))}{escape(via)}: "
                f"{escape(partial or message)}",
                highlight=False,
                soft_wrap=True,
            )
            return 1
    console.print(
        f"[green]OK[/green] {escape(str(target.path))}{escape(via)}: {escape(checked)}",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def _partial(path: Path) -> str | None:
    """Why a sharded checkpoint that does not verify here is a node's part of it (the files
    of other ranks absent, every file here whole), or ``None`` when it is not."""
    if not is_sharded_path(path):
        return None
    try:
        here, listed, ranks, absent = part_held(path)
        if not absent:
            return None
        layout, _ = read_layout(path, fileformat.verify(path / MANIFEST_NAME))
        verify_sharded(path, layout, [f.name for f in layout.files if f.name not in absent])
    except (CheckpointCorrupt, OSError):
        return None
    return (
        f"partial: this directory holds {here} of its {listed} files, each whole; missing here: "
        f"{', '.join(absent)} (written by rank {', '.join(map(str, ranks))}: on another node's "
        "directory when the ranks shared none — verify it there; a resume fetches what each "
        "node reads)"
    )


def _checked(path: Path, manifest: fileformat.Manifest) -> str:
    """What a verify of ``path`` checked: a file's tensors and bytes; a sharded checkpoint's
    files (its manifest one of them), their bytes, its sharded values and the manifest's own
    tensors."""
    if not is_sharded_path(path):
        return f"{len(manifest.tensors)} tensors, {format_size(manifest.size)}"
    layout, _ = read_layout(path)
    size = manifest.size + sum(f.size for f in layout.files)
    return (
        f"sharded, {len(layout.files) + 1} files, {format_size(size)}: "
        f"{len(layout.values)} sharded values, {len(manifest.tensors)} tensors in the manifest"
    )


def _moved_on(checkpoint: str, target: Target) -> bool:
    """Whether ``target``, what the pointer ``checkpoint`` named, is gone and the pointer now
    names another checkpoint (a live run published a newer one and pruned this one)."""
    if target.pointer is None or not vanished(target.path):
        return False
    try:
        return named_target(checkpoint).path != target.path
    except CheckpointNotFound:
        return False
