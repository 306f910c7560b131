# Restoring a checkpoint into the live run: check everything, then touch, and undo on failure.
#
# Rules: every difference between the checkpoint and the run is found before anything is
# touched (the rules — hard or soft, parameter groups by name, EMA on one side only — are
# pitstop.core.compat's). Then the restore is all-or-nothing: when anything raises while
# loading — a component's load_state_dict, a module's set_extra_state or load hook, the RNG —
# the model, the EMA, every component and every RNG stream are put back exactly as they were.
# Order: components first (a torch optimizer's load replaces its state and groups, so keeping
# references to the old ones is its whole snapshot; any other component's state_dict() is
# deep-copied), then modules whose loading runs code of their own (extra state, load hooks, a
# load override — their tensors are cloned first), then the RNG, and last the modules whose
# loading is only torch's checked copy into tensors of the same names, shapes and dtypes, which
# cannot fail once the checks passed — so no second copy of the weights is ever made for them;
# that copy runs on the calling thread alone (torch's intra-op threads wait for each other on a
# busy machine; a copy is bound by memory anyway).
# A component's own code that raises — state_dict() while it is compared or snapshotted,
# load_state_dict(), a state_differences() judge — is an IncompatibleCheckpoint naming the
# component and the call, chained to what it raised. A StatefulDataLoader over a WorkerRNG of a
# stream without state is a soft difference (shell.data's stateless_stream names what to add).
# How: a list of undo actions, run in reverse on failure.

"""Restore: compatibility checks, then an all-or-nothing load into the live objects."""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from pitstop.core.compat import (
    Difference,
    Kind,
    compare_config,
    diff_components,
    diff_ema,
    diff_hyperparameters,
    diff_param_groups,
    diff_tensors,
    diff_world_size,
    layout_differences,
)
from pitstop.core.schema import EMA, EMA_COUNT, RAW, RNG, STATE, WEIGHTS
from pitstop.errors import IncompatibleCheckpoint
from pitstop.shell.data.loaders import is_stateful_loader
from pitstop.shell.data.workerrng import stateless_stream
from pitstop.shell.state.capture import LiveState, ranked_state, stored_world_size, world
from pitstop.shell.state.live import (
    capture_rng,
    describe,
    entry_specs,
    optimizer_groups,
    restore_rng,
)
from pitstop.shell.state.unwrap import unwrap_model

__all__ = [
    "Restore",
    "apply",
    "component_differences",
    "component_undo",
    "differences",
    "load_component",
    "undo_all",
]

log = logging.getLogger("pitstop")


def differences(
    live: LiveState,
    tree: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    rank: int = 0,
    world_size: int = 1,
    may_change: Iterable[str] = (),
    where: str = "checkpoint",
) -> tuple[list[Difference], frozenset[str]]:
    """Every difference between the stored ``tree`` and rank ``rank``'s run, and the deferred.

    Config changes under a ``may_change`` pattern are no differences: rank 0 logs them, in one
    info line naming ``where``.

    Per-rank state is compared only when the world size is the one that wrote the checkpoint;
    otherwise the world-size difference says what cannot continue.
    """
    weights = tree.get(WEIGHTS, {})
    out = diff_tensors(
        "model", entry_specs(weights.get(RAW, {})), entry_specs(live.model.state_dict())
    )
    out += diff_ema(stored=EMA in weights, live=live.ema is not None)
    if live.ema is not None and EMA in weights:
        out += diff_tensors(
            "ema", entry_specs(weights[EMA]), entry_specs(unwrap_model(live.ema).state_dict())
        )
    stored_world = stored_world_size(meta)
    same_world = stored_world == world_size
    stored_state = dict(tree.get(STATE, {}))
    per_rank = live.per_rank_names()
    if same_world:
        stored_state.update(ranked_state(tree, rank))
    comparable = {n: o for n, o in live.components.items() if same_world or n not in per_rank}
    missing, deferred = diff_components(stored_state, comparable)
    out += missing
    stored_groups = meta.get("optimizers", {})
    for name, obj in comparable.items():
        if name in stored_state:
            try:
                out += component_differences(live, name, obj, stored_state[name], stored_groups)
            except IncompatibleCheckpoint as exc:  # its own code raised: say where it was
                raised = IncompatibleCheckpoint(f"{where}: {d}" for d in exc.differences)
                raise raised from exc.__cause__
    if live.config is not None or meta.get("config") is not None:
        compared = compare_config(meta.get("config"), live.config, may_change=may_change)
        out += compared.differences
        if compared.noted and rank == 0:
            log.info(
                "resume from %s: config changes allowed by config_may_change: %s",
                where,
                "; ".join(compared.noted),
            )
    stored_per_rank = meta.get("per_rank", [])
    names = {*per_rank, *(n for n in stored_per_rank if isinstance(n, str))}
    out += diff_world_size(stored_world, world_size, sorted(names))
    return out, deferred - (per_rank if not same_world else set())


def component_differences(
    live: LiveState, name: str, obj: Any, stored: Any, stored_groups: Mapping[str, Any]
) -> list[Difference]:
    """Every difference between component ``name``'s stored state and ``obj``."""
    if isinstance(obj, torch.optim.Optimizer):
        groups = stored.get("param_groups", []) if isinstance(stored, Mapping) else []
        return [
            *diff_param_groups(
                f"optimizer {name!r}",
                stored_groups.get(name, []),
                optimizer_groups(obj, live.model),
            ),
            *diff_hyperparameters(f"optimizer {name!r}", groups, obj.param_groups),
        ]
    out = layout_differences(
        diff_tensors(
            f"component {name!r}",
            describe(stored),
            describe(_own(name, "state_dict", obj.state_dict)),
        )
    )
    stream = stateless_stream(getattr(obj, "dataset", None)) if is_stateful_loader(obj) else None
    if stream is not None:  # soft: strict refuses it, strict=False warns and resumes
        out.append(
            Difference(
                kind=Kind.COMPONENT,
                message=f"component {name!r}: {stream}",
                soft=True,
                allowed=f"component {name!r} resumes inexactly: {stream}",
            )
        )
    judge = getattr(obj, "state_differences", None)  # a component may judge for itself
    if callable(judge):
        out += [
            Difference(kind=Kind.COMPONENT, message=f"component {name!r}: {m}")
            for m in _own(name, "state_differences", judge, stored)
        ]
    return out


def _own(name: str, call: str, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)``: component ``name``'s own ``call``; an IncompatibleCheckpoint naming
    both, chained to the error, if it raises."""
    try:
        return function(*args)
    except Exception as exc:
        raise IncompatibleCheckpoint([f"component {name!r}: {call} failed: {exc}"]) from exc


def load_component(name: str, obj: Any, stored: Any) -> Callable[[], None]:
    """``obj.load_state_dict(stored)``, undone if it raises; IncompatibleCheckpoint then.

    Returns how to put ``obj`` back as it was before (when another rank failed).
    """
    undo: Callable[[], None] = _own(name, "state_dict", component_undo, obj)
    try:
        obj.load_state_dict(stored)
    except Exception as exc:
        undo_all([undo], f"component {name!r}")
        raise IncompatibleCheckpoint(
            [f"component {name!r}: load_state_dict failed: {exc}"]
        ) from exc
    return undo


class Restore:
    """One all-or-nothing restore of ``tree`` into ``live``, in two phases.

    :meth:`prepare` loads everything whose loading can fail (and undoes it all if anything
    does); :meth:`commit` then loads the plain modules, which cannot fail once checked. Between
    the two, :meth:`undo` puts back what prepare loaded — how many ranks agree before any of
    them commits. ``rank``: whose per-rank state to restore; ``per_rank=False`` leaves the
    per-rank state (RNG streams, per-rank components) as it is (another world size).
    """

    def __init__(
        self,
        live: LiveState,
        tree: Mapping[str, Any],
        path: Path,
        *,
        rank: int = 0,
        per_rank: bool = True,
    ) -> None:
        self._live, self._tree, self._path = live, tree, path
        self._rank, self._per_rank = rank, per_rank
        self._undo: list[Callable[[], object]] = []
        self._rng_before: dict[str, Any] | None = None
        weights = tree[WEIGHTS]
        modules = [(live.model, weights[RAW], "the model")]
        if live.ema is not None:
            modules.insert(0, (unwrap_model(live.ema), weights[EMA], "the EMA"))
        self._own_code = [m for m in modules if not _plain(m[0])]
        self._plain = [m for m in modules if _plain(m[0])]

    def _stored_components(self) -> dict[str, Any]:
        stored = dict(self._tree.get(STATE, {}))
        if self._per_rank:
            stored.update(ranked_state(self._tree, self._rank))
        return {
            name: state
            for name, state in stored.items()
            if name in self._live.components
            and (self._per_rank or name not in self._live.per_rank_names())
        }

    def prepare(self) -> None:
        """Load what can fail; on failure undo it all and raise IncompatibleCheckpoint."""
        live, tree = self._live, self._tree
        undo = self._undo
        rngs = tree.get(RNG) if self._per_rank else None
        mine = rngs.get(self._rank) if isinstance(rngs, Mapping) else None
        self._rng_before = capture_rng(cuda=isinstance(mine, Mapping) and "cuda" in mine)
        what, call = "the model", "load_state_dict"
        try:
            for name, stored in self._stored_components().items():
                obj = live.components[name]
                what, call = f"component {name!r}", "state_dict"  # the snapshot to undo with
                undo.append(component_undo(obj))
                call = "load_state_dict"
                obj.load_state_dict(stored)
            with torch.no_grad():
                for module, stored, label in self._own_code:
                    what, call = label, "state_dict"
                    undo.append(_module_undo(module))
                    call = "load_state_dict"
                    module.load_state_dict(stored)
                if isinstance(live.ema, AveragedModel) and EMA_COUNT in tree:
                    what = "the EMA's n_averaged"
                    before = live.ema.n_averaged.clone()
                    undo.append(partial(live.ema.n_averaged.copy_, before))
                    live.ema.n_averaged.copy_(tree[EMA_COUNT]["n_averaged"])
                what = "the random number generators"
                rng = tree.get(RNG, {}).get(self._rank) if self._per_rank else None
                if rng is not None:
                    restore_rng(rng)
        except Exception as exc:
            self.undo()
            message = f"{self._path.name}: {what}: {call} failed: {exc}"
            raise IncompatibleCheckpoint([message]) from exc

    def undo(self) -> None:
        """Put back everything :meth:`prepare` loaded."""
        undo_all(self._undo, "the run")
        self._undo.clear()
        if self._rng_before is not None:
            restore_rng(self._rng_before)

    def commit(self) -> None:
        """Load the plain modules: torch's checked copy into tensors of the same layout, made
        by this thread alone (:func:`one_thread`)."""
        with torch.no_grad(), one_thread():
            for module, stored, _ in self._plain:
                module.load_state_dict(stored)
        self._undo.clear()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch's CPU work in the block on the calling thread only (its intra-op threads set back
    after). A copy is bound by memory, not by cores: torch's threads gain little on it, and wait
    for each other when a core is busy — the 64 MiB copy of an s3:// resume took 0.21 s with 2
    threads and 0.016 s with one on the shared 2-core VM (benchmarks/object_store.py)."""
    threads = torch.get_num_threads()
    if threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if threads > 1:
            torch.set_num_threads(threads)


def apply(live: LiveState, tree: Mapping[str, Any], path: Path) -> None:
    """Restore ``tree`` (already checked) into ``live``; on any failure put everything back."""
    restore = Restore(live, tree, path, rank=world()[0])
    restore.prepare()
    restore.commit()


def undo_all(undo: list[Callable[[], object]], what: str) -> None:
    """Run the ``undo`` actions, last first; one that raises is logged (naming ``what``) and
    the others still run, so the error being handled is the one raised."""
    for action in reversed(undo):
        try:
            with torch.no_grad():
                action()
        except Exception as again:  # the object that failed may refuse its own state
            log.error("could not put %s back after a failed restore: %s", what, again)


def component_undo(obj: Any) -> Callable[[], None]:
    """How to put ``obj`` back as it is now."""
    if (
        isinstance(obj, torch.optim.Optimizer)
        and type(obj).load_state_dict is torch.optim.Optimizer.load_state_dict
    ):
        # torch's load builds a new state and new groups; the old ones stay untouched.
        state, groups = obj.state, obj.param_groups

        def put_back() -> None:
            obj.__setstate__({"state": state, "param_groups": groups})

        return put_back
    before = copy.deepcopy(obj.state_dict())
    return lambda: obj.load_state_dict(before)


def _module_undo(module: nn.Module) -> Callable[[], None]:
    """How to put ``module``'s tensors and extra state back, bypassing its own load code."""
    live = module.state_dict(keep_vars=True)
    saved = {
        key: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
        for key, value in live.items()
    }
    extra = {
        name: copy.deepcopy(m.get_extra_state())
        for name, m in module.named_modules()
        if type(m).get_extra_state is not nn.Module.get_extra_state
    }

    def put_back() -> None:
        for key, value in saved.items():
            target = live[key]
            if isinstance(target, torch.Tensor):
                target.detach().copy_(value)
        modules = dict(module.named_modules())
        for name, state in extra.items():
            modules[name].set_extra_state(state)

    return put_back


def _plain(module: nn.Module) -> bool:
    """Whether loading ``module`` is only torch's checked copy into its tensors."""
    if type(module).load_state_dict is not nn.Module.load_state_dict:
        return False
    for m in module.modules():
        cls = type(m)
        if cls.get_extra_state is not nn.Module.get_extra_state:
            return False
        if cls.set_extra_state is not nn.Module.set_extra_state:
            return False
        own_load = cls._load_from_state_dict is not nn.Module._load_from_state_dict
        if own_load and not cls.__module__.startswith("torch."):
            return False
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return False
    return True
