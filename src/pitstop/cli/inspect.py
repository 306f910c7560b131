"""``pitstop inspect``: what one checkpoint records, from its manifest alone.

Progress, reason, metrics, config, versions, world size, components and the tensor tree (key
path, dtype, shape, bytes) — read from the footer and the manifest, never the tensor bytes, so
it is instant on any size. ``--json`` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

__all__ = ["add_parser", "run_inspect"]


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``inspect`` subcommand to ``commands``."""
    inspect = commands.add_parser(
        "inspect",
        help="show what a checkpoint records (progress, metrics, config, tensors); no tensor "
        "bytes are read",
    )
    inspect.add_argument(
        "checkpoint", help="a checkpoint file, a pointer (DIR/best) or a directory (its last)"
    )
    inspect.add_argument("--json", action="store_true", help="one JSON object instead of text")


def _group(name: str) -> str:
    """The part of a key path a tensor is listed under: ``weights.raw``, ``state.optimizer``."""
    parts = name.replace("[", ".[").split(".")
    return ".".join(parts[:2]).replace(".[", "[")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _plain(value: object) -> object:
    """``value`` as JSON can hold it (tuples as lists, other objects by repr)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    return repr(value)


def run_inspect(console: Console, args: argparse.Namespace) -> int:
    """Run ``pitstop inspect``; 0, or 1 when the checkpoint is missing or unreadable."""
    from pitstop.cli.listing import format_metrics
    from pitstop.core.compat import flatten
    from pitstop.formatting import format_size
    from pitstop.shell.checkpoint import TensorInfo
    from pitstop.shell.format import fileformat
    from pitstop.shell.portable.info import info
    from pitstop.shell.store.resolve import manifest_path

    record = info(args.checkpoint)
    manifest = fileformat.read_manifest(manifest_path(record.path))
    meta = manifest.meta
    versions = {key: meta.get(key) for key in ("pitstop", "torch", "python") if key in meta}
    stored = meta.get("components")
    components = [str(c) for c in stored] if isinstance(stored, (list, tuple)) else []
    progress = record.progress
    if args.json:
        out: dict[str, Any] = {
            "path": str(record.path),
            "size": record.size_bytes,
            "progress": {
                "step": progress.step,
                "epoch": progress.epoch,
                "batch_in_epoch": progress.batch_in_epoch,
                "samples": progress.samples,
                "tokens": progress.tokens,
            },
            "seq": record.seq,
            "reason": record.reason.value,
            "detail": record.detail,
            "metrics": _plain(dict(record.metrics)),
            "config": _plain(record.config),
            "versions": _plain(versions),
            "world_size": meta.get("world_size", 1),
            "components": _plain(components),
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
                for t in record.tensors
            ],
        }
        if "imported" in meta:
            out["imported"] = _plain(meta["imported"])
        console.file.write(json.dumps(out, indent=2) + "\n")
        return 0

    reason = record.reason.value + (f" ({record.detail})" if record.detail else "")
    facts = [
        (
            "progress",
            f"step {progress.step}, epoch {progress.epoch}, batch in epoch "
            f"{progress.batch_in_epoch}, {progress.samples} samples, {progress.tokens} tokens",
        ),
        ("reason", f"{reason} (save sequence number {record.seq})"),
        ("metrics", format_metrics(record.metrics)),
        ("versions", ", ".join(f"{k} {v}" for k, v in versions.items()) or "-"),
        ("world size", str(meta.get("world_size", 1))),
        ("components", ", ".join(components) or "-"),
    ]
    if "imported" in meta and isinstance(meta["imported"], Mapping):
        imported = meta["imported"]
        facts.append(("imported", f"from {imported.get('from')} ({imported.get('format')})"))
    console.print(
        f"[bold]{escape(str(record.path))}[/bold] ({format_size(record.size_bytes or 0)})",
        highlight=False,
    )
    for label, text in facts:
        console.print(f"  {label:<11} {escape(text)}", highlight=False)
    flat = flatten(record.config) if record.config else {}
    console.print(f"  {'config':<11} {'-' if not flat else ''}", highlight=False)
    for key, value in flat.items():
        console.print(f"    {escape(key)}: {escape(repr(value))}", highlight=False)

    stored_bytes = sum(blob.length for blob in manifest.blobs)
    table = Table(
        title=f"tensors: {_count(len(record.tensors), 'key path')}, "
        f"{_count(len(manifest.tensors), 'tensor')} stored ({format_size(stored_bytes)})",
        title_justify="left",
        show_edge=False,
    )
    for column in ("name", "dtype", "shape", "bytes"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    groups: dict[str, list[TensorInfo]] = {}
    for tensor in record.tensors:  # grouped in order of first appearance
        groups.setdefault(_group(tensor.name), []).append(tensor)
    for group, members in groups.items():
        size = format_size(sum(t.nbytes for t in members))
        table.add_row(f"[bold]{escape(group)}[/bold]", "", _count(len(members), "tensor"), size)
        for tensor in members:
            table.add_row(
                f"  {escape(tensor.name)}",
                tensor.dtype,
                str(list(tensor.shape)),
                format_size(tensor.nbytes),
            )
    console.print(table)
    return 0
