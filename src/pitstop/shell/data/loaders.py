# Which components are data loaders whose state is per rank, and what a plain DataLoader keeps.
#
# Rules: a torchdata StatefulDataLoader's state (its sampler's or stream's position, each
# worker's dataset state) is this rank's own, as every ResumableSampler's is, so it is saved per
# rank. torchdata is an optional extra: nothing here imports it; an object can only be a
# StatefulDataLoader when the user's code has imported torchdata already. A plain
# torch.utils.data.DataLoader given as a component has no state; it is kept as a PlainLoader
# whose state is what pitstop can see of it (num_workers, whether a ResumableSampler orders it)
# and whose load warns once per resume (ResumeWarning) when the resumed data is not exact: the
# order is exact only through a ResumableSampler, and its workers' random state is not restored.
# The warning names the fix: StatefulDataLoader with pitstop.WorkerRNG. A loader not given to
# the Checkpointer is invisible to pitstop and is never warned about.
# How: an isinstance check against the class of an already-imported torchdata; a small wrapper
# with state_dict()/load_state_dict() around a plain DataLoader.

"""Which components are data loaders, and the stand-in for a plain DataLoader's state."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from pitstop.errors import ResumeWarning

__all__ = ["PlainLoader", "is_plain_loader", "is_stateful_loader"]


def is_stateful_loader(obj: object) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader``."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    loader = getattr(module, "StatefulDataLoader", None)
    return isinstance(loader, type) and isinstance(obj, loader)


def is_plain_loader(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.utils.data.DataLoader`` with no state of its own."""
    return isinstance(obj, DataLoader) and not hasattr(obj, "state_dict")


class PlainLoader:
    """A plain DataLoader given as component ``name``: it has no state to save or restore.

    Its state records what pitstop can see (``num_workers``, and ``ordered``: whether a
    ``ResumableSampler`` is its ``batch_sampler``, which the caller tells). Loading it (on
    resume) warns once with a :class:`~pitstop.errors.ResumeWarning` unless the resumed data
    is exact anyway (no workers and a ``ResumableSampler``).
    """

    def __init__(self, name: str, loader: DataLoader[Any], *, ordered: bool) -> None:
        self.name = name
        self.loader = loader
        self.ordered = ordered

    def state_dict(self) -> dict[str, Any]:
        """What pitstop can see of the loader; nothing of it is restored."""
        return {"num_workers": self.loader.num_workers, "resumable_sampler": self.ordered}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Warn once that the resumed data is not exact, naming the fix; change nothing."""
        workers, ordered = self.loader.num_workers, self.ordered
        if workers == 0 and ordered:
            return
        problems = []
        if not ordered:
            problems.append(
                "its order is not resumed: data order is exact only through "
                "pitstop.ResumableSampler (pass it as batch_sampler=)"
            )
        if workers > 0:
            problems.append(
                f"its {workers} worker(s)' random state (random transforms, streams) is not "
                "restored"
            )
        warnings.warn(
            f"resume: component {self.name!r} is a plain torch DataLoader with no state: "
            + "; ".join(problems)
            + ". For exact data use torchdata's StatefulDataLoader (pip install pitstop[data]) "
            "with pitstop.WorkerRNG(dataset), given in state= instead",
            ResumeWarning,
            stacklevel=2,
        )

    def __repr__(self) -> str:
        return f"PlainLoader({self.name!r}, {self.loader!r})"
