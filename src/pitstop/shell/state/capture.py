# Capturing a run's whole state as the tree and meta of one checkpoint.
#
# Rules: the tree follows pitstop.core.schema (weights.raw, weights.ema, ema.n_averaged,
# state.<name>, rng.<rank>); it references the live tensors (no copies): a synchronous save
# writes straight from them, a background one copies them into staging first. Components the
# resumed checkpoint holds that nobody has registered yet are carried forward as they were,
# with their parameter-group names, so a later register() still finds them. In overlap mode
# the storages that only optimizer.step() changes may be copied later (deferrable): the
# model's parameters and the optimizers' state, never a buffer or the EMA (an EMA update may
# run when a GradScaler skips the step, and with it the pre-hook that waits for the copy).
# A component whose state_dict() raises fails the save with a SaveError naming the component,
# chained to what it raised.
# How: state_dict() of each object, plus the manifest meta the restore checks read.

"""Capture: the live state as a checkpoint tree and its manifest meta."""

from __future__ import annotations

import platform
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from pitstop.core.schema import (
    EMA,
    EMA_COUNT,
    RANKED,
    RAW,
    RNG,
    STATE,
    WEIGHTS,
    WeightsMeta,
    encode_weights_meta,
)
from pitstop.errors import CheckpointCorrupt, SaveError
from pitstop.shell.data.loaders import is_stateful_loader
from pitstop.shell.sampler import ResumableSampler
from pitstop.shell.state.live import capture_rng, optimizer_groups
from pitstop.shell.state.staging import storage_keys
from pitstop.shell.state.unwrap import unwrap_model

__all__ = [
    "LiveState",
    "capture",
    "component_state",
    "deferrable",
    "rank_state",
    "ranked_state",
    "sharded_components",
    "stepped_tensors",
    "stored_groups",
    "stored_world_size",
    "with_parts",
    "world",
]


def world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without torch.distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@attrs.define(kw_only=True)
class LiveState:
    """The live objects a Checkpointer saves and restores."""

    model: nn.Module
    ema: nn.Module | None
    components: dict[str, Any]
    config: dict[str, Any] | None
    pending: dict[str, Any] = attrs.Factory(dict)
    """Stored component states not registered yet (deferred)."""
    pending_groups: dict[str, Any] = attrs.Factory(dict)
    """Their optimizers' parameter groups, by name."""
    per_rank: set[str] = attrs.Factory(set)
    """Components whose state differs per rank (besides every ResumableSampler and
    StatefulDataLoader)."""
    pending_per_rank: set[str] = attrs.Factory(set)
    """Which of the pending states are per-rank."""

    def per_rank_names(self) -> set[str]:
        """The registered components whose state is per-rank."""
        return {
            name
            for name, obj in self.components.items()
            if name in self.per_rank or isinstance(obj, ResumableSampler) or is_stateful_loader(obj)
        }

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The components that are torch optimizers."""
        return [o for o in self.components.values() if isinstance(o, torch.optim.Optimizer)]


def component_state(name: str, obj: Any) -> Any:
    """``obj.state_dict()``; a :class:`~pitstop.errors.SaveError` naming component ``name``
    (chained to the error) if it raises."""
    try:
        return obj.state_dict()
    except Exception as exc:
        raise SaveError(f"component {name!r}: state_dict failed: {exc}") from exc


def rank_state(live: LiveState) -> dict[str, Any]:
    """This rank's own part of a checkpoint: its RNG streams and per-rank components."""
    per_rank = live.per_rank_names()
    components = {n: s for n, s in live.pending.items() if n in live.pending_per_rank}
    components.update({n: component_state(n, live.components[n]) for n in sorted(per_rank)})
    return {RNG: capture_rng(), RANKED: components}


def sharded_components(live: LiveState) -> dict[str, torch.optim.Optimizer]:
    """The components a sharded checkpoint saves through DCP with the model: its optimizers
    (not marked per-rank), by name."""
    per_rank = live.per_rank_names()
    return {
        name: obj
        for name, obj in live.components.items()
        if isinstance(obj, torch.optim.Optimizer) and name not in per_rank
    }


def capture(
    live: LiveState, parts: list[dict[str, Any]] | None = None, *, sharded: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint tree (referencing live tensors) and manifest meta of ``live``.

    ``parts``: every rank's :func:`rank_state`, in rank order (default: this rank's alone).
    ``sharded``: the model, the EMA and the :func:`sharded_components` are saved through DCP,
    so the tree (the replicated state a sharded checkpoint's manifest holds) leaves them out.
    """
    parts = parts if parts is not None else [rank_state(live)]
    per_rank = live.per_rank_names()
    through_dcp = set(sharded_components(live)) if sharded else set()
    weights: dict[str, Any] = {RAW: {} if sharded else live.model.state_dict()}
    tree: dict[str, Any] = {
        WEIGHTS: weights,
        STATE: {
            **{n: s for n, s in live.pending.items() if n not in live.pending_per_rank},
            **{
                n: component_state(n, o)
                for n, o in live.components.items()
                if n not in per_rank and n not in through_dcp
            },
        },
    }
    ema_buffers = "own"
    if live.ema is not None:
        if not sharded:  # else saved through DCP with the model (pitstop.shell.sharded.dcpstate)
            weights[EMA] = unwrap_model(live.ema).state_dict()
        if isinstance(live.ema, AveragedModel):
            if not sharded:
                tree[EMA_COUNT] = {"n_averaged": live.ema.n_averaged}
            ema_buffers = "own" if live.ema.use_buffers else "raw"
    described = WeightsMeta(
        ema=live.ema is not None,
        ema_buffers=ema_buffers,  # type: ignore[arg-type]  # "own" or "raw", set just above
        buffers=tuple(name for name, _ in live.model.named_buffers()),
    )
    meta = {
        "pitstop": _version(),
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        "config": live.config,
        "components": sorted({*live.components, *live.pending}),
        "per_rank": sorted(per_rank | live.pending_per_rank),
        "optimizers": {
            **{n: g for n, g in live.pending_groups.items() if n in live.pending},
            **{
                name: optimizer_groups(obj, live.model)
                for name, obj in live.components.items()
                if isinstance(obj, torch.optim.Optimizer)
            },
        },
        WEIGHTS: encode_weights_meta(described),
    }
    if sharded:
        meta["sharded_components"] = sorted(through_dcp)
    return with_parts(tree, meta, parts)


def with_parts(
    tree: Mapping[str, Any], meta: Mapping[str, Any], parts: Sequence[Mapping[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``tree`` and ``meta`` (from :func:`capture`) holding every rank's ``parts`` (each a
    :func:`rank_state`, in rank order) instead of the ones they held."""
    out: dict[str, Any] = {}
    for key, value in tree.items():  # in capture's order: the parts come after STATE
        if key in (RNG, RANKED):
            continue
        out[key] = value
        if key == STATE:
            out[RNG] = {rank: part[RNG] for rank, part in enumerate(parts)}
            if any(part[RANKED] for part in parts):
                out[RANKED] = {rank: part[RANKED] for rank, part in enumerate(parts)}
    return out, {**meta, "world_size": len(parts)}


def stepped_tensors(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], ema: nn.Module | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors ``optimizer.step()`` changes (the model's parameters, the optimizers'
    state), and those that change otherwise too (the model's buffers, the EMA's tensors): a
    storage of the first that is not one of the second changes only in a step."""
    state = [
        value
        for obj in optimizers
        for per_param in obj.state.values()
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    ]
    kept: list[torch.Tensor] = [*model.buffers()]
    if ema is not None:
        kept += [*ema.parameters(), *ema.buffers()]
    return [*model.parameters(), *state], kept


def deferrable(live: LiveState) -> frozenset[tuple[str, int | None, int]]:
    """Storages that only ``optimizer.step()`` changes: the model's parameters, optimizer state."""
    stepped, kept = stepped_tensors(live.model, live.optimizers(), live.ema)
    return storage_keys(stepped) - storage_keys(kept)


def _version() -> str:
    from pitstop import __version__

    return __version__


def ranked_state(tree: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s per-rank components in a stored tree (empty when there are none)."""
    ranked = tree.get(RANKED, {})
    own = ranked.get(rank, {}) if isinstance(ranked, Mapping) else {}
    return dict(own) if isinstance(own, Mapping) else {}


def stored_world_size(meta: Mapping[str, Any]) -> int:
    """The world size that wrote a checkpoint (1 when not recorded)."""
    value = meta.get("world_size", 1)
    if type(value) is not int or value < 1:
        raise CheckpointCorrupt(f"manifest key 'world_size' must be an int >= 1, got {value!r}")
    return value


def stored_groups(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizers' parameter groups recorded in ``meta`` (empty when absent)."""
    groups = meta.get("optimizers")
    return dict(groups) if isinstance(groups, Mapping) else {}
