"""``pitstop ls`` and ``pitstop verify``: inspect checkpoint directories and files."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from pitstop.core.records import NO_CHECKPOINT, PointerName
from pitstop.core.retention import plan_retention
from pitstop.errors import CheckpointCorrupt, CheckpointNotFound
from pitstop.formatting import format_size
from pitstop.shell import fileformat
from pitstop.shell.directory import choose_resume, scan
from pitstop.shell.resolve import recorded_policy, verify
from pitstop.shell.storage import LocalStorage

__all__ = ["list_directory", "verify_checkpoint"]


def list_directory(console: Console, directory: str, *, check: bool = False) -> int:
    """Print a table of the checkpoints in ``directory``; with ``check``, verify each one.

    Returns 0, or 1 when ``check`` finds a corrupt or unreadable checkpoint.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointNotFound(f"{path} is not a directory")
    storage = LocalStorage(path)
    policy = recorded_policy(path)
    found = scan(storage, None if policy is None else policy.best)
    retention = None if policy is None else plan_retention(found.catalog, found.pointers, policy)

    table = Table(title=str(path), title_justify="left")
    for column in ("step", "epoch", "samples", "tokens", "reason", "size", "seq", "pointers"):
        table.add_column(column, justify="right" if column != "reason" else "left")
    table.add_column("kept because")
    if check:
        table.add_column("check")

    failures: dict[str, str] = dict(found.unreadable)
    for entry in found.catalog:
        pointers = [p.value for p in PointerName if found.pointers.target(p) == entry.name]
        why = (
            "policy unknown"
            if retention is None
            else ", ".join(sorted(r.value for r in retention.why(entry.name)))
        )
        reason = entry.reason.value + (f" ({entry.detail})" if entry.detail else "")
        row = [
            str(entry.step),
            str(entry.progress.epoch),
            str(entry.progress.samples),
            str(entry.progress.tokens),
            reason,
            format_size(found.sizes[entry.name]),
            str(entry.seq),
            ", ".join(pointers) or "-",
            why or "-",
        ]
        if check:
            try:
                fileformat.verify(storage.path(entry.name))
                row.append("[green]ok[/green]")
            except CheckpointCorrupt as exc:
                failures[entry.name] = str(exc)
                row.append("[red]CORRUPT[/red]")
        table.add_row(*row)
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
            *(["[red]UNREADABLE[/red]"] if check else []),
        )
    console.print(table)
    if not found.catalog and not found.unreadable:
        console.print("no checkpoints")
    for warning in found.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}", highlight=False)
    if not check:
        return 0

    for name, why in failures.items():
        console.print(f"[red]corrupt:[/red] {escape(why if name in why else f'{name}: {why}')}")
    choice = choose_resume(
        storage,
        found,
        PointerName.LAST,
        verify=lambda p: None if p.name not in failures else (_raise(failures[p.name])),
    )
    if choice.entry is NO_CHECKPOINT:
        console.print("a resume would start fresh: no valid checkpoint")
    else:
        skipped = f", after skipping {', '.join(choice.skipped)}" if choice.skipped else ""
        console.print(
            f"a resume from last would use {choice.entry.name} (step {choice.entry.step}): the "
            f"most recently published valid checkpoint (seq {choice.entry.seq}){skipped}",
            highlight=False,
        )
    return 1 if failures else 0


def _raise(message: str) -> None:
    raise CheckpointCorrupt(message)


def verify_checkpoint(console: Console, checkpoint: str) -> int:
    """Verify ``checkpoint`` (file, pointer or directory); 0 when valid, 1 when corrupt."""
    try:
        path = verify(checkpoint)
    except CheckpointCorrupt as exc:
        console.print(f"[red]CORRUPT[/red] {escape(str(exc))}", highlight=False)
        return 1
    manifest = fileformat.read_manifest(path)
    console.print(
        f"[green]OK[/green] {path}: {len(manifest.tensors)} tensors, {format_size(manifest.size)}",
        highlight=False,
    )
    return 0
