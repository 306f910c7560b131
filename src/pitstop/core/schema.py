# The content schema of a training checkpoint: where each part of the state lives.
#
# Rules: the stored tree is
#   weights.raw          the model's state dict (unwrapped: no "module." / "_orig_mod.")
#   weights.ema          the EMA module's own state dict (when the run has an EMA)
#   ema.n_averaged       an AveragedModel's update count
#   state.<name>         each component's state_dict() (optimizer, scheduler, sampler, ...)
#   rng.<rank>           every random number generator of each rank
#   ranked.<rank>.<name> each per-rank component's state (a ResumableSampler's slice, ...)
# and the manifest's meta holds, beside the catalog entry: versions, world_size, config, the
# component names (and which are per-rank), each optimizer's parameter groups by parameter
# name, and `weights`: whether there is an EMA, whose buffers it uses ("own", or "raw": the
# model's at save time) and the model's buffer names. The Checkpointer, pitstop.load and the
# weights functions all address the tree through these names; `weights_meta` checks the one
# part of meta they interpret.
# How: constants, key-path helpers, and one validating reader; no I/O.

"""Where a checkpoint keeps the model, the EMA, each component and each rank's RNG."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal

import attrs

from pitstop.errors import CheckpointCorrupt

__all__ = [
    "EMA",
    "EMA_COUNT",
    "RANKED",
    "RAW",
    "RNG",
    "STATE",
    "WEIGHTS",
    "WeightsMeta",
    "component_path",
    "rng_path",
    "weights_meta",
    "weights_path",
]

WEIGHTS: Final = "weights"
RAW: Final = "raw"
EMA: Final = "ema"
EMA_COUNT: Final = "ema"  # top-level: {"n_averaged": tensor}
STATE: Final = "state"
RNG: Final = "rng"
RANKED: Final = "ranked"

WeightKind = Literal["raw", "ema"]
EmaBuffers = Literal["own", "raw"]


def weights_path(kind: WeightKind) -> tuple[str, str]:
    """The key path of the ``kind`` weights: ``("weights", "raw")``."""
    return (WEIGHTS, kind)


def component_path(name: str) -> tuple[str, str]:
    """The key path of component ``name``'s state."""
    return (STATE, name)


def rng_path(rank: int) -> tuple[str, int]:
    """The key path of rank ``rank``'s random number generators."""
    return (RNG, rank)


@attrs.frozen(kw_only=True)
class WeightsMeta:
    """What the manifest says about the stored weights."""

    ema: bool = False
    ema_buffers: EmaBuffers = "own"
    buffers: tuple[str, ...] = ()


def weights_meta(meta: Mapping[str, object], where: str) -> WeightsMeta:
    """Read and check ``meta["weights"]``; a file not written by a Checkpointer has none.

    Raises :class:`~pitstop.errors.CheckpointCorrupt` naming ``where`` and the key.
    """
    node = meta.get(WEIGHTS)
    if node is None:  # the EMA's own state dict is the EMA
        return WeightsMeta()
    if not isinstance(node, Mapping):
        raise CheckpointCorrupt(f"{where}: manifest key 'weights' must be a mapping")
    ema = node.get("ema", False)
    if not isinstance(ema, bool):
        raise CheckpointCorrupt(f"{where}: manifest key 'weights.ema' must be a bool, got {ema!r}")
    ema_buffers = node.get("ema_buffers", "own")
    if ema_buffers not in ("own", "raw"):
        raise CheckpointCorrupt(
            f"{where}: manifest key 'weights.ema_buffers' must be 'own' or 'raw', "
            f"got {ema_buffers!r}"
        )
    buffers = node.get("buffers", [])
    if not isinstance(buffers, (list, tuple)) or not all(isinstance(b, str) for b in buffers):
        raise CheckpointCorrupt(f"{where}: manifest key 'weights.buffers' must be a list of names")
    return WeightsMeta(ema=ema, ema_buffers=ema_buffers, buffers=tuple(buffers))


def encode_weights_meta(weights: WeightsMeta) -> dict[str, object]:
    """``weights`` as stored in the manifest's meta."""
    return {
        "ema": weights.ema,
        "ema_buffers": weights.ema_buffers,
        "buffers": list(weights.buffers),
    }
