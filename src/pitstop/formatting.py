"""How pitstop shows numbers to people, shared by the CLI and the trainer's reports.

A neutral module (pure Python, no torch, no I/O), so that ``pitstop.train`` needs nothing from
``pitstop.cli``: the dependency goes one way, cli → train.
"""

from __future__ import annotations

__all__ = ["format_size"]


def format_size(size: int) -> str:
    """Return ``size`` bytes for people: ``512 B``, ``1.5 KiB``, ``2.0 GiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
