# Staging a rank's sharded state for DCP's background write: the copy to host buffers that
# DCP's async_save then writes from, taken at the call — or, in overlap mode, partly later.
#
# Rules: one DCP stager per Checkpointer, kept (it caches its host buffers; where torch's
# stager closes itself after a stage, torch 2.11, a new one is made for the next), and closed
# with the Checkpointer. The state dict is pitstop.shell.sharded.dcpstate's; each of its tensors
# is a view of a live tensor (a DTensor's local shard). A rank stages alone (no collective), so a
# rank that cannot stage leaves nothing for the others to wait on; the Checkpointer agrees on
# the outcome before any rank's DCP write starts.
# With CUDA the call first waits for the work already queued on the state's devices: DCP's
# stager copies on a stream of its own, which does not wait for the loop's stream.
# Overlap mode: the tensors whose storages only optimizer.step() changes — the model's
# parameters and the optimizers' state, never a buffer or the EMA (an EMA update may run when a
# GradScaler skips the step, and with it the pre-hook) — are copied later, by whichever thread
# needs them first: pitstop's thread that starts DCP's write, or the loop's next
# optimizer.step() (a pre-hook), so that the loop never waits for a thread not yet scheduled.
# The rest is copied at the call. Both copies go through the same stager, one at a time.
# How: the state dict split into two trees of the same nesting, staged one after the other and
# merged; DeferredCopy runs the second once, on the first thread that asks.

"""Staging sharded state for DCP's async_save: at the call, or deferred (overlap mode)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions

from pitstop.shell.sharded.dcpstate import Optimizers, dcp_state, local_shard
from pitstop.shell.state.capture import stepped_tensors
from pitstop.shell.state.staging import storage_keys

__all__ = [
    "DeferredCopy",
    "KeptStager",
    "StagedShards",
    "make_stager",
    "stage_sharded",
    "stager_spent",
]


class KeptStager(AsyncStager):
    """A DCP stager kept across saves (it caches its host buffers), made by ``make`` — and
    made again once a stage has spent it: torch 2.11's ``DefaultStager`` closes its own copier
    at the end of every stage, and the next stage then fails with ``KeyError: <class
    'type'>`` (pytorch/pytorch#183413; fixed after 2.11). Stages run one at a time. Also an
    ``AsyncStager`` for ``dcp.async_save`` itself (its stage returns once the copy is done)."""

    _synchronize_after_execute = False  # each stage returns with its copy done

    def __init__(self, make: Callable[[], DefaultStager]) -> None:
        self._make = make
        self._stager: DefaultStager | None = make()

    def stage(self, state_dict: dict[str, Any], timeout: float | None = None) -> Any:
        """``state_dict`` copied to host buffers, the copy done (with CUDA it runs on the
        stager's stream; ``timeout`` s at most)."""
        if self._stager is None:
            self._stager = self._make()
        staged = self._stager.stage(state_dict)
        done = staged.result(timeout) if isinstance(staged, Future) else staged
        if stager_spent(self._stager):
            spent, self._stager = self._stager, None
            spent.close()
        return done

    def synchronize_staging(self) -> None:
        """Nothing to wait for: each stage returns with its copy done."""
        return

    def close(self) -> None:
        """Release the stager's host buffers and its staging thread (a later stage makes a
        new stager)."""
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()


def stager_spent(stager: DefaultStager) -> bool:
    """Whether ``stager`` closed its own copier in its last stage (torch 2.11): its copy
    table is empty. A stager without those attributes (another torch) is taken as kept."""
    copier = getattr(stager, "_state_dict_stager", None)
    table = getattr(copier, "_deepcopy_dispatch", None)
    return isinstance(table, dict) and not table


def make_stager(model: nn.Module) -> KeptStager:
    """A stager for a background sharded write of ``model``'s state, to keep and reuse (it
    caches its host buffers): pinned memory and a background copy with CUDA — its stream on
    the device the model's shards are on, whatever device is current — a blocking copy on the
    CPU (DCP's own FileSystemWriter stager, ``cache_staged_state_dict=True``, cannot pin
    memory there)."""
    cuda = torch.cuda.is_available()
    options = StagingOptions(
        use_pinned_memory=cuda,
        use_shared_memory=False,
        use_async_staging=cuda,
        use_non_blocking_copy=cuda,
    )
    device = next(
        (d for p in model.parameters() if (d := local_shard(p).device).type == "cuda"), None
    )

    def make() -> DefaultStager:
        if device is None:
            return DefaultStager(options)
        with torch.cuda.device(device):  # the stager makes its stream on the current device
            return DefaultStager(options)

    return KeptStager(make)


class DeferredCopy:
    """A copy that runs once, on the first thread that asks for it (:meth:`run`); any other
    thread asking meanwhile waits for it to end. Its outcome is kept for :meth:`result`."""

    def __init__(self, copy: Callable[[], Any]) -> None:
        self._copy: Callable[[], Any] | None = copy
        self._cond = threading.Condition()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether the copy has ended (copied, or failed)."""
        with self._cond:
            return self._done

    def run(self) -> None:
        """Make the copy on this thread unless another has begun it (then wait for it to end).
        Its error is kept for :meth:`result` and not raised here — except a KeyboardInterrupt
        (any BaseException that is not an Exception), kept and raised here too."""
        with self._cond:
            copy, self._copy = self._copy, None
            if copy is None:
                self._cond.wait_for(lambda: self._done)
                return
        value: Any = None
        error: BaseException | None = None
        try:
            value = copy()
        except Exception as exc:
            error = exc
        except BaseException as exc:  # a Ctrl-C: the save failed, and the loop hears it
            error = exc
            raise
        finally:
            with self._cond:
                self._value, self._error, self._done = value, error, True
                self._cond.notify_all()

    def result(self) -> Any:
        """The copy (made here if no thread has begun it); raises what the copy raised."""
        self.run()
        if self._error is not None:
            raise self._error
        return self._value


@attrs.frozen
class StagedShards:
    """This rank's sharded state, copied to host buffers by :func:`stage_sharded` and not yet
    handed to DCP: no collective has run for it, so a rank that failed to stage leaves
    nothing for the others to wait on. ``later``: the part copied later (overlap mode)."""

    state: dict[str, Any]
    later: DeferredCopy | None = None

    def whole(self) -> dict[str, Any]:
        """The whole staged state: the part copied later merged in (copied here if no thread
        has begun it). Raises what that copy raised."""
        if self.later is None:
            return self.state
        return _merged(self.state, self.later.result())


class Handed(AsyncStager):
    """A stager that stages nothing: it hands DCP the state :func:`stage_sharded` staged."""

    _synchronize_after_execute = False  # staged already: nothing to wait for

    def __init__(self, staged: dict[str, Any]) -> None:
        self._staged = staged

    def stage(self, state_dict: Any) -> Any:
        """What was staged already (``state_dict`` is DCP's view of an empty one)."""
        return self._staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: staged already."""
        return

    def close(self) -> None:
        """Nothing to release: the stager that staged keeps its buffers."""
        return


def stage_sharded(
    model: nn.Module,
    optimizers: Optimizers,
    stager: KeptStager,
    timeout: float | None = None,
    *,
    ema: nn.Module | None = None,
    defer: bool = False,
) -> StagedShards:
    """This rank alone: copy the model's, the ``ema``'s and ``optimizers``' local shards into
    ``stager``'s host buffers, and return once the copy is done, so the live tensors may
    change (``timeout`` s at most for a CUDA copy). ``defer`` (overlap mode): the model's
    parameters and the optimizers' state are left for :attr:`StagedShards.later`, to be
    copied before the next ``optimizer.step()`` changes them. Raises what the copy at the
    call raises, before any collective: agree on the outcome, then start DCP's write on every
    rank or on none."""
    tree = dcp_state(model, optimizers, ema)
    _after_queued_work(model, ema)
    if not defer:
        return StagedShards(stager.stage(tree, timeout))
    keys = _only_stepped(model, optimizers, ema)
    now, later = _split(tree, lambda t: not storage_keys([local_shard(t)]).isdisjoint(keys))
    staged = stager.stage(now, timeout)
    return StagedShards(staged, DeferredCopy(lambda: stager.stage(later, timeout)))


def _after_queued_work(model: nn.Module, ema: nn.Module | None) -> None:
    """Return once the work already queued on the current stream of each CUDA device the
    state is on is done (the optimizer.step() just before the call): DCP's stager copies on a
    stream of its own, which does not wait for that stream."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return  # nothing was ever queued on a GPU
    modules = [model] if ema is None else [model, ema]
    devices = {
        local_shard(t).device
        for module in modules
        for t in itertools.chain(module.parameters(), module.buffers())
    }
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _only_stepped(
    model: nn.Module, optimizers: Optimizers, ema: nn.Module | None
) -> frozenset[Any]:
    """The storages (of the local shards) that only ``optimizer.step()`` changes: the model's
    parameters and the optimizers' state, less any a buffer or the EMA shares."""
    stepped, kept = stepped_tensors(model, optimizers.values(), ema)
    return storage_keys(map(local_shard, stepped)) - storage_keys(map(local_shard, kept))


def _split(
    tree: Mapping[str, Any], later: Callable[[torch.Tensor], bool]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``tree``'s nested dicts split in two of the same nesting: the tensors ``later`` picks,
    and everything else (a list goes whole with the rest)."""
    now: dict[str, Any] = {}
    deferred: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            inner_now, inner_later = _split(value, later)
            if inner_now or not inner_later:
                now[name] = inner_now
            if inner_later:
                deferred[name] = inner_later
        elif isinstance(value, torch.Tensor) and later(value):
            deferred[name] = value
        else:
            now[name] = value
    return now, deferred


def _merged(now: Mapping[str, Any], later: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_split`: ``later``'s entries put back into ``now``'s dicts."""
    out = dict(now)
    for name, value in later.items():
        if name in out and isinstance(value, Mapping):
            out[name] = _merged(out[name], value)
        else:
            out[name] = value
    return out
