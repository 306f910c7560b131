# Components of a run: adding one to a Checkpointer, and registering one later (deferred).
#
# Rules: a component has a non-empty str name, once, and state_dict()/load_state_dict(); anything
# else is a ConfigError naming it, except a plain torch DataLoader, kept as a PlainLoader (no state;
# its resume warns that the data is not exact, unless a ResumableSampler orders it without workers).
# A component registered after a resume whose checkpoint holds it is checked as the constructor's
# are (pitstop.shell.state.restore's component differences) and restored on the spot; one the
# checkpoint does not hold starts fresh, with a warning. With several ranks every rank registers,
# and the outcome is agreed: refused or failed on any rank, the component is neither added nor
# loaded anywhere (a rank that loaded it puts it back). A put-back that fails too is logged, so the
# error raised is the one that named the component.
# How: functions over the live state and the ranks; the Checkpointer calls register_component().

"""Registration: adding a component, and restoring a deferred one when it is registered."""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pitstop.errors import ConfigError, IncompatibleCheckpoint
from pitstop.shell.data.loaders import PlainLoader, is_plain_loader
from pitstop.shell.ranks.distributed import Ranks
from pitstop.shell.sampler import ResumableSampler
from pitstop.shell.state.capture import LiveState
from pitstop.shell.state.restore import component_differences, load_component, undo_all

__all__ = ["add_component", "register_component"]

log = logging.getLogger("pitstop")


def add_component(live: LiveState, name: str, obj: object) -> None:
    """Add component ``obj`` as ``name``; a ConfigError if it cannot be one."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"component names must be non-empty str, got {name!r}")
    if name in live.components:
        raise ConfigError(f"component {name!r} is already registered")
    if is_plain_loader(obj):
        ordered = isinstance(getattr(obj, "batch_sampler", None), ResumableSampler)
        obj = PlainLoader(name, obj, ordered=ordered)  # type: ignore[arg-type]
    elif not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
        raise ConfigError(
            f"component {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
        )
    live.components[name] = obj


def register_component(
    live: LiveState,
    ranks: Ranks,
    name: str,
    obj: object,
    *,
    per_rank: bool,
    resumed_from: Path | None,
    sharded: bool = False,
) -> None:
    """Add ``obj`` on every rank and restore its deferred state, everywhere or nowhere.

    ``sharded``: the model is sharded, so an optimizer is refused (DCP saves it with the model,
    from the Checkpointer's ``state=``).
    """
    if sharded and isinstance(obj, torch.optim.Optimizer):
        raise ConfigError(
            f"register({name!r}): a sharded model's optimizers are passed to the "
            "Checkpointer's state= (they are saved through DCP with the model)"
        )
    try:
        ranks.each(partial(add_component, live, name, obj))
    except BaseException:
        if live.components.get(name) is obj:  # added here, refused on another rank
            del live.components[name]
        raise
    if per_rank:
        live.per_rank.add(name)
    undo: list[Callable[[], object]] = []
    try:
        ranks.each(partial(_restore_deferred, live, resumed_from, name, obj, undo))
    except BaseException:
        undo_all(undo, f"component {name!r}")  # loaded here, failed on another rank
        del live.components[name]
        live.per_rank.discard(name)
        raise
    live.pending.pop(name, None)
    live.pending_per_rank.discard(name)


def _restore_deferred(
    live: LiveState,
    resumed_from: Path | None,
    name: str,
    obj: object,
    undo: list[Callable[[], object]],
) -> None:
    if name in live.pending:
        stored = live.pending[name]
        found = component_differences(live, name, obj, stored, live.pending_groups)
        if found:
            raise IncompatibleCheckpoint(str(d) for d in found)
        undo.append(load_component(name, obj, stored))
    elif resumed_from is not None:
        log.warning("component %r is not in %s; it starts fresh", name, resumed_from.name)
