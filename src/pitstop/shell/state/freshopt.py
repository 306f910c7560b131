# Optimizers that have no state yet, kept so through DCP.
#
# Rules: DCP's get_optimizer_state_dict gives an optimizer that has no state zeroed state, by
# one step at learning rate 0, so that it has tensors to save or to read into; left there,
# AdamW's first real step would be its step 2, and a run that saved or resumed would part from
# one that did not. A sharded save takes that state away again once its shards are written or
# staged (the manifest names those optimizers); a resume takes it away when it restores
# nothing, or fails; a resume from a checkpoint that names them leaves them without state
# (pitstop.shell.sharded.engine). Imports no DCP: a resume of a plain run passes through here.
# How: a context manager over the optimizers, taken before DCP sees them.

"""Keeping an optimizer without state so when DCP saves or reads it."""

from __future__ import annotations

from collections.abc import Mapping
from types import TracebackType

import torch

__all__ = ["FreshOptimizers"]


class FreshOptimizers:
    """The optimizers of ``optimizers`` that have no state yet; on leaving the ``with`` block,
    the state they were given since is taken away again — unless :meth:`keep` was called (a
    restore that gave them their checkpoint's state)."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self._fresh = {n: o for n, o in optimizers.items() if not o.state}
        self._kept = False
        self.names = tuple(sorted(self._fresh))
        """Their names, sorted."""

    def keep(self) -> None:
        """Leave them the state they have now when the block ends without an error."""
        self._kept = True

    def __enter__(self) -> FreshOptimizers:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._kept and kind is None:
            return
        for optimizer in self._fresh.values():
            optimizer.state.clear()
