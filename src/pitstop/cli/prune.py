"""``pitstop prune``: retention by hand, with the core's reasons.

``pitstop prune DIR --keep-last N [--dry-run]`` plans retention with
:func:`pitstop.core.saving.retention.plan_retention` over the directory's checkpoints and pointers:
``keep_last=N``, the ``keep_every`` and ``best`` metric the directory's ``latest.json`` records,
every pointer target (``last``, ``best``, ``final``) and the newest checkpoint are kept, and so
is the checkpoint a resume from ``last`` would use (the newest that verifies). It takes the
directory lock (an ``s3://`` prefix: its lease), so it never races a live run (a locked
directory is an error naming its holder); ``--dry-run`` only scans and prints the plan,
without the lock.
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["add_parser", "run_prune"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``prune`` subcommand to ``commands``."""
    prune = commands.add_parser(
        "prune",
        help="delete old checkpoints by hand: keep the last N, every pointer target and the "
        "resume point",
    )
    prune.add_argument(
        "directory",
        help="a checkpoint directory (e.g. runs/demo/resumed/checkpoints, which the demo writes)",
    )
    prune.add_argument(
        "--keep-last",
        type=_positive,
        required=True,
        metavar="N",
        help="keep the N most recently published checkpoints",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="print what would be deleted; delete nothing"
    )


def run_prune(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop prune``; 0 after pruning (or a dry run), 1 when the directory is missing."""
    from pitstop.cli.common import open_directory
    from pitstop.cli.progress import progress_bars
    from pitstop.core.records import NO_CHECKPOINT, PointerName, Policy
    from pitstop.core.saving.retention import plan_retention
    from pitstop.formatting import format_size
    from pitstop.shell.store.directory import Scan, choose_resume, scan
    from pitstop.shell.store.location import checkpoint_directory
    from pitstop.shell.store.publish import delete_checkpoints
    from pitstop.shell.store.storage import Storage

    storage, recorded, title = open_directory(args.directory, lambda p: f"{p} is not a directory")
    policy = Policy(
        keep_last=args.keep_last,
        keep_every=None if recorded is None else recorded.keep_every,
        best=None if recorded is None else recorded.best,
    )

    def plan(found: Scan, storage: Storage) -> tuple[list[str], dict[str, str]]:
        retention = plan_retention(found.catalog, found.pointers, policy)
        why = {
            name: ", ".join(sorted(r.value for r in reasons))
            for name, reasons in retention.keep.items()
        }
        delete = list(retention.delete)
        with progress_bars(console):
            choice = choose_resume(storage, found, PointerName.LAST, policy.best)
        if choice.entry is not NO_CHECKPOINT and choice.entry.name in delete:
            delete.remove(choice.entry.name)  # newer ones do not verify: keep the resume point
            why[choice.entry.name] = "resume point (the newest checkpoint that verifies)"
        return delete, why

    def show(found: Scan, delete: list[str], why: dict[str, str], done: bool) -> None:
        table = Table(title=title, title_justify="left")
        for column in ("step", "seq", "size", "action", "why"):
            table.add_column(
                column, justify="right" if column in ("step", "seq", "size") else "left"
            )
        for entry in found.catalog:
            gone = entry.name in delete
            action = ("deleted" if done else "would delete") if gone else "keep"
            table.add_row(
                str(entry.step),
                str(entry.seq),
                format_size(found.sizes[entry.name]),
                f"[red]{action}[/red]" if gone else action,
                "-" if gone else escape(why.get(entry.name, "")),
            )
        console.print(table)
        freed = format_size(sum(found.sizes[name] for name in delete))
        verb = "deleted" if done else "would delete"
        console.print(
            f"{verb} {len(delete)} of {len(found.catalog)} checkpoints ({freed}) with "
            f"keep_last={policy.keep_last}"
            + (f", keep_every={policy.keep_every}" if policy.keep_every else ""),
            highlight=False,
        )

    if args.dry_run:
        found = scan(storage, policy.best)
        delete, why = plan(found, storage)
        show(found, delete, why, done=False)
        return 0
    directory = checkpoint_directory(args.directory, policy, None, None, False)
    found = directory.open()  # takes the lock (an s3:// prefix: its lease): never races a writer
    try:
        delete, why = plan(found, directory.storage)
        deleted = delete_checkpoints(directory.storage, delete)
    finally:
        directory.close()
    show(found, deleted, why, done=True)
    return 0
