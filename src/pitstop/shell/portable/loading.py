# Loading a checkpoint's whole stored tree (pitstop.load).
#
# Rules: the argument means what every checkpoint argument means (pitstop.shell.store.resolve):
# a file, a pointer or a directory (its `last`); with a pointer, a corrupt target falls back
# along the core's resume order, and each candidate is checked whole as it is loaded, so each
# file is read once. Tensors come back on the CPU; nothing is unpickled. A sharded checkpoint
# is the manifest's replicated tree with each component DCP stored, full and unsharded, under
# "sharded" (the installed torch must be able to read it).
# How: resolve_checkpoint with a verify that loads; fileformat.load, or the sharded engine's
# full_state_dict (imported only for a sharded checkpoint).

"""load: the whole stored tree of a checkpoint, with CPU tensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pitstop.core.settings.arguments import CHECKPOINT_PATH, check_path
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.shell.format import fileformat
from pitstop.shell.sharded.support import require_sharded
from pitstop.shell.store.directory import is_sharded_path, verify_any
from pitstop.shell.store.resolve import resolve_checkpoint

__all__ = ["load"]


def load(checkpoint: str | os.PathLike[str]) -> Any:
    """Return the whole stored tree of ``checkpoint`` with CPU tensors; never unpickles.

    ``checkpoint`` is a file, a pointer (``run/checkpoints/best``) or a directory (its
    ``last``); a corrupt pointer target falls back to the previous valid checkpoint. Each
    file is read once: a pointer's candidates are checked whole as they are loaded.
    """
    check_path(checkpoint, argument="load checkpoint", to=CHECKPOINT_PATH)
    loaded: dict[Path, Any] = {}

    def check_and_load(path: Path) -> None:
        loaded.clear()
        if is_sharded_path(path):
            verify_any(path)
            loaded[path] = _load_sharded(path)
        else:
            loaded[path] = fileformat.load(path, verify="file")

    path = resolve_checkpoint(checkpoint, fallback=True, verify=check_and_load)
    if path in loaded:
        return loaded[path]
    return _load_sharded(path) if is_sharded_path(path) else fileformat.load(path)


def _load_sharded(path: Path) -> Any:
    """A sharded checkpoint's whole tree: the manifest's replicated tree, and under
    ``"sharded"`` each component DCP stored, full and unsharded (``"model"``, optimizers)."""
    require_sharded(f"reading the sharded checkpoint {path}")
    from pitstop.shell.sharded.engine import full_state_dict
    from pitstop.shell.store.sharddir import read_layout

    stored: Any = fileformat.load(path / MANIFEST_NAME)
    tree: dict[str, Any] = dict(stored)
    layout, _ = read_layout(path)
    components = sorted({str(v.path[0]) for v in layout.values if v.path})
    tree["sharded"] = {name: full_state_dict(path, name) for name in components}
    return tree
