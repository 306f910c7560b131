# Which components are data loaders whose state is per rank.
#
# Rules: a torchdata StatefulDataLoader's state (its sampler's or stream's position, each
# worker's dataset state) is this rank's own, as every ResumableSampler's is, so it is saved per
# rank. torchdata is an optional extra: nothing here imports it; an object can only be a
# StatefulDataLoader when the user's code has imported torchdata already.
# How: an isinstance check against the class of an already-imported torchdata.

"""Which components are torchdata StatefulDataLoaders (without importing torchdata)."""

from __future__ import annotations

import sys

__all__ = ["is_stateful_loader"]


def is_stateful_loader(obj: object) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader``."""
    module = sys.modules.get("torchdata.stateful_dataloader")
    loader = getattr(module, "StatefulDataLoader", None)
    return isinstance(loader, type) and isinstance(obj, loader)
