# How a resume reads its checkpoint: from disk once, every byte checked as it is read.
#
# Rules: rank 0 tries the core's resume order, and each candidate is checked — every byte, as
# fileformat.verify checks it — in the same pass that loads it (load(verify="file")): a
# corrupt newest file is found, and skipped with a warning, before anything live is touched,
# and the file chosen is read from disk once. Where each stored tensor goes: an optimizer's
# state is read straight onto its parameter's device (torch's own Optimizer.load_state_dict
# keeps a tensor that is already on the parameter's device with its dtype, so it is never
# copied again) — new private memory on the CPU, pinned bounce buffers and a side stream on
# CUDA; everything else (the model's and the EMA's weights, other components) stays mapped:
# the checking pass leaves it in the page cache and the restore copies it from there into the
# live tensors at memory speed. No second copy of the state is made in anonymous memory.
# Other ranks load the file rank 0 chose without checking it again (rank 0 did). In a job of
# one process, the optimizer's bytes leave the page cache as they are read, or are read past
# it where the pass runs on several threads (the core's drop_behind; pitstop.shell.format.blobfile):
# the file's copy of the state is not held beside the state itself.
# A sharded checkpoint's manifest is read beside DCP's read of its shards (read_beside: rank 0
# checks it whole, the others load it), on a thread of its own, joined before the read ends.
# How: an object whose verify() is choose_resume's check and keeps what it loaded for load().

"""The resume's read: check and load a checkpoint in one pass, each tensor where it ends."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pitstop.core.saving.pointers import drop_behind
from pitstop.core.schema import RANKED, STATE
from pitstop.core.sharding.sharded import MANIFEST_NAME
from pitstop.errors import CheckpointCorrupt
from pitstop.shell.format.fileread import KeyPath, load
from pitstop.shell.format.untrusted import checked
from pitstop.shell.state.capture import LiveState
from pitstop.shell.store.directory import is_sharded_path

__all__ = ["ResumeRead", "placement"]


def placement(live: LiveState) -> dict[tuple[str, int], torch.device]:
    """The device of parameter ``i`` of each optimizer component ``name`` that keeps the state
    tensors it loads, by ``(name, i)``: where that optimizer's stored state is read to."""
    devices: dict[tuple[str, int], torch.device] = {}
    for name, obj in live.components.items():
        if not isinstance(obj, torch.optim.Optimizer):
            continue
        if type(obj).load_state_dict is not torch.optim.Optimizer.load_state_dict:
            continue  # its own load may copy: leave its state mapped
        params = [p for group in obj.param_groups for p in group["params"]]
        for index, param in enumerate(params):
            devices[name, index] = param.device
    return devices


class ResumeRead:
    """One resume's reading: :meth:`verify` for choosing, then :meth:`load` on every rank."""

    def __init__(self, live: LiveState, rank: int = 0, world_size: int = 1) -> None:
        self._devices = placement(live)
        self._rank = rank
        self._drop = drop_behind(world_size)
        self._path: Path | None = None
        self._tree: Any = None

    def place(self, path: KeyPath) -> torch.device | None:
        """Where the stored tensor at key path ``path`` is read: ``None`` keeps it mapped."""
        if len(path) >= 5 and path[0] == STATE:
            name, rest = path[1], path[2:]
        elif len(path) >= 6 and path[0] == RANKED and path[1] == self._rank:
            name, rest = path[2], path[3:]
        else:
            return None
        if rest[0] != "state" or rest[2] == "step" or not isinstance(name, str):
            return None  # param groups; a step count stays where torch's load leaves it
        index = rest[1]
        return self._devices.get((name, index)) if isinstance(index, int) else None

    def verify(
        self,
        path: Path,
        *,
        shards: bool = True,
        known_as: Path | None = None,
        arrived: bool = False,
    ) -> None:
        """Check every byte of ``path`` and load it, in one pass; raise CheckpointCorrupt.
        ``known_as``: the path :meth:`load` will ask for (a temp file checked before it is
        published there: the tree loaded from it stays valid once it is renamed).
        ``arrived``: every byte was checked as it arrived from a peer (the catch-up's
        receive, pitstop.shell.ranks.arrival): loaded without checking it again.

        A sharded checkpoint directory: its manifest is checked whole and its replicated
        tree loaded, and with ``shards`` every DCP file it lists is checked too (a resume's
        collective choice has each rank check the files it reads instead).
        """
        self._path = self._tree = None
        if is_sharded_path(path):
            from pitstop.shell.store.sharddir import read_layout, verify_sharded

            self._tree = load(path / MANIFEST_NAME, verify="file")
            if shards:
                verify_sharded(path, read_layout(path)[0])
        elif arrived or checked(path):  # every byte checked as it arrived (a peer; object storage)
            self._tree = load(path, verify=False, place=self.place)
        else:
            self._tree = load(path, verify="file", place=self.place, drop_placed=self._drop)
        self._path = known_as or path

    def read_beside(self, path: Path) -> Callable[[], str | None]:
        """Start reading the manifest of the sharded checkpoint ``path`` on a thread (rank 0:
        checked whole, as :meth:`verify` with ``shards=False``; another rank: loaded as
        :meth:`load` would); the function returned waits for it and says what was wrong
        (rank 0's check; another rank's failure is left for :meth:`load` to raise)."""
        problem: list[str] = []

        def read() -> None:
            try:
                if self._rank == 0:
                    self.verify(path, shards=False)
                else:
                    tree = load(path / MANIFEST_NAME, verify=False)
                    self._path, self._tree = path, tree
            except (CheckpointCorrupt, OSError) as exc:
                problem.append(str(exc))

        self._path = self._tree = None
        thread = threading.Thread(target=read, name="pitstop-manifest", daemon=True)
        thread.start()

        def join() -> str | None:
            thread.join()
            return problem[0] if problem and self._rank == 0 else None

        return join

    def load(self, path: Path) -> Any:
        """The tree of ``path``: as :meth:`verify` loaded it, or (on another rank) unchecked."""
        if self._path == path:
            tree, self._path, self._tree = self._tree, None, None
            return tree
        if is_sharded_path(path):
            return load(path / MANIFEST_NAME, verify=False)
        # rank 0 checked it when choosing it
        return load(path, verify=False, place=self.place, drop_placed=self._drop)
