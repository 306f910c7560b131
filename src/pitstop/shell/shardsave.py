# What a Checkpointer does differently when its state is sharded (FSDP2, DTensor).
#
# Rules: a run's state is sharded when the model or an optimizer holds DTensors — decided once,
# when the Checkpointer is built; then every save is a checkpoint directory written through
# torch.distributed.checkpoint. DCP is imported only where a DTensor can exist (its import costs
# seconds). Not yet supported with sharded state, and refused when the Checkpointer is built:
# async_save (DCP's own async path is not wired in) and an EMA. A sharded save is a collective:
# rank 0 plans it and names the temp directory, every rank writes its shards there, and only
# then does rank 0 capture the replicated state, write the manifest last and publish; a failure
# while writing shards is raised on every rank and leaves no temp directory.
# How: functions over the live state, the Saver and the ranks; the Checkpointer calls them.

"""The sharded (FSDP2, DTensor) variant of a Checkpointer's construction and saves."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Any

from torch import nn

from pitstop.errors import ConfigError
from pitstop.shell.capture import LiveState, sharded_components
from pitstop.shell.distributed import Ranks
from pitstop.shell.saving import Saver

__all__ = ["holds_sharded", "save_sharded"]


def holds_sharded(live: LiveState, *, async_save: object, ema: nn.Module | None) -> bool:
    """Whether the model or an optimizer holds sharded state (FSDP2, DTensor): then every
    save is a checkpoint directory written through DCP. Raises ConfigError for what sharded
    state does not support yet (``async_save``, an ``ema``)."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor exists, nor FSDP2 module
        return False
    from pitstop.shell.sharded import is_sharded  # imports DCP: only where it can be needed

    if not is_sharded(live.model, live.components):
        return False
    if async_save:
        raise ConfigError(
            f"Checkpointer async_save={async_save!r}: a sharded model (FSDP2, DTensor) saves "
            "synchronously for now; pass async_save=False"
        )
    if ema is not None:
        raise ConfigError("Checkpointer ema: not supported with a sharded model (FSDP2, DTensor)")
    return True


def save_sharded(
    directory: Path,
    temp: str,
    live: LiveState,
    saver: Saver,
    ranks: Ranks,
    parts: list[dict[str, Any]] | None,
) -> int:
    """Every rank writes its shards into ``directory / temp``; then rank 0 publishes the
    directory (the save's session ticket is returned)."""
    from pitstop.shell.sharded import write_sharded

    try:
        layout = write_sharded(directory / temp, live.model, sharded_components(live), ranks=ranks)
    except BaseException:  # raised on every rank: the temp directory is gone
        if ranks.leader:
            saver.abort_sharded()
        raise
    ticket: int = ranks.lead(partial(saver.publish_sharded, layout, parts))
    return ticket
