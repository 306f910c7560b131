# The Checkpointer: what a training loop calls.
#
# Rules: every decision is the core's — when to save (decide_save), what a save does to the
# directory (plan_save), which checkpoint a resume uses (resume_order), whether a checkpoint
# fits the run (compat). This class captures and restores state, and carries plans out through
# a locked CheckpointDirectory. Restore is all-or-nothing: every difference is collected before
# anything is touched; components restored through load_state_dict() are snapshotted first and
# put back if one fails. A component the checkpoint holds but the run has not registered yet is
# kept and applied when register() names it (deferred components).
# How: a synchronous save captures references to the live tensors (no copy) and writes them
# straight into the file; the directory lock is held from construction to close().

"""The Checkpointer: save and restore a whole training state from a custom loop."""

from __future__ import annotations

import copy
import logging
import os
import platform
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from pitstop.core.compat import (
    Difference,
    Kind,
    diff_components,
    diff_config,
    diff_param_groups,
    diff_tensors,
    diff_world_size,
)
from pitstop.core.metadata import entry_from_meta, entry_meta
from pitstop.core.naming import NOT_A_CHECKPOINT, parse_name
from pitstop.core.plan import SavePlan, plan_save
from pitstop.core.records import (
    NO_CHECKPOINT,
    CheckpointEntry,
    Metrics,
    NoCheckpoint,
    PointerName,
    Policy,
    Progress,
    SaveReason,
)
from pitstop.core.schedule import Call, ScheduleState, decide_save, resumed_state
from pitstop.errors import CheckpointNotFound, ConfigError, IncompatibleCheckpoint, PitstopError
from pitstop.shell import fileformat
from pitstop.shell.directory import CheckpointDirectory, choose_resume, scan
from pitstop.shell.resolve import resolve_checkpoint
from pitstop.shell.staging import StagingPool, storage_keys
from pitstop.shell.state import (
    capture_rng,
    describe,
    entry_specs,
    optimizer_groups,
    restore_rng,
    snapshot,
)
from pitstop.shell.weights import unwrap_model
from pitstop.shell.writer import BackgroundWriter

__all__ = ["Checkpoint", "Checkpointer", "Stateful"]

log = logging.getLogger("pitstop")


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: optimizers, schedulers, ..."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any, /) -> Any: ...


@attrs.frozen(kw_only=True)
class Checkpoint:
    """One published checkpoint."""

    path: Path
    progress: Progress
    reason: SaveReason
    seq: int
    metrics: Metrics = attrs.field(hash=False)
    detail: str = ""

    @property
    def step(self) -> int:
        """The optimizer step the checkpoint holds."""
        return self.progress.step

    @classmethod
    def of(cls, directory: Path, entry: CheckpointEntry) -> Checkpoint:
        """The public record of the catalog ``entry`` in ``directory``."""
        return cls(
            path=directory / entry.name,
            progress=entry.progress,
            reason=entry.reason,
            seq=entry.seq,
            metrics=entry.metrics,
            detail=entry.detail,
        )


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _metrics(metrics: Mapping[str, object] | None) -> dict[str, float] | None:
    """Metrics as floats: numbers, 0-d tensors and NumPy scalars; never str or bool."""
    if metrics is None:
        return None
    out = {}
    for key, value in metrics.items():
        if isinstance(value, (str, bytes, bool)):
            raise ConfigError(f"metrics[{key!r}] must be a number, got {value!r}")
        try:
            out[str(key)] = float(value)  # type: ignore[arg-type]  # tensors, numpy scalars
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(f"metrics[{key!r}] must be a number, got {value!r}") from None
    return out


def _stop_detail(stop: object) -> tuple[bool, str]:
    if stop is None or not stop:
        return False, ""
    reason = getattr(stop, "reason", None)
    return True, str(reason) if reason else "requested"


class Checkpointer:
    """Saves and restores a run's whole state into one checkpoint directory.

    ``model``: the raw ``nn.Module`` (DDP and ``torch.compile`` wrappers are unwrapped).
    ``ema``: a module of averaged weights (e.g. ``AveragedModel``). ``state``: other components
    by name (optimizer, scheduler, GradScaler, sampler, ...). ``config``: the run's
    configuration, stored and compared on resume. The directory is locked until :meth:`close`.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        ema: nn.Module | None = None,
        state: Mapping[str, Stateful] | None = None,
        policy: Policy | None = None,
        config: Mapping[str, Any] | None = None,
        async_save: bool | Literal["overlap"] = False,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(
                f"Checkpointer model must be an nn.Module, got {type(model).__name__}"
            )
        if ema is not None and not isinstance(ema, nn.Module):
            raise ConfigError(f"Checkpointer ema must be an nn.Module, got {type(ema).__name__}")
        if not (isinstance(async_save, bool) or async_save == "overlap"):
            raise ConfigError(
                f"Checkpointer async_save must be False, True or 'overlap', got {async_save!r}"
            )
        self.async_save = async_save
        self.model = unwrap_model(model)
        self.ema = ema
        self.policy = policy if policy is not None else Policy()
        self.config = copy.deepcopy(dict(config)) if config is not None else None
        self._components: dict[str, Stateful] = {}
        for name, obj in (state or {}).items():
            self._add_component(name, obj)
        self._pending: dict[str, Any] = {}
        self._pending_groups: dict[str, Any] = {}
        self._resumed_from: Path | None = None
        self._directory = CheckpointDirectory(directory, policy=self.policy)
        self._directory.open()
        self._schedule = ScheduleState(timer_start=time.monotonic())
        self._pointers = self._directory.pointers
        self._closed = False
        self.last_blocking_s = 0.0
        """Seconds the last save held the training loop (capture, and the copy when async)."""
        self._writer = BackgroundWriter() if async_save else None
        self._pool = StagingPool() if async_save else None
        self._rollback = (self._schedule, self._pointers)
        self._copied = threading.Event()
        self._copied.set()
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # A Checkpointer dropped or left open at exit still publishes what is in flight.
        self._finalizer = weakref.finalize(self, _shut_down, self._writer, self._directory)
        if async_save == "overlap":
            for obj in self._components.values():
                if isinstance(obj, torch.optim.Optimizer):
                    self._hooks.append(obj.register_step_pre_hook(self._await_copy))

    # --- lifetime -----------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        """The checkpoint directory."""
        return self._directory.path

    def wait(self) -> None:
        """Wait until every save is published; raise the error of one that failed."""
        self._check_open()
        self._settle()

    def _await_copy(self, *_: object) -> None:
        """Optimizer step pre-hook (overlap mode): parameters may change only once copied."""
        self._copied.wait()

    def _check_background(self) -> None:
        """Raise the error of a background save that failed, undoing what it promised."""
        if self._writer is None:
            return
        try:
            self._writer.check()
        except BaseException:
            self._schedule, self._pointers = self._rollback
            raise

    def _settle(self) -> None:
        """Wait for the save in flight; raise its error."""
        if self._writer is None:
            return
        try:
            waited = self._writer.wait()
        except BaseException:
            self._schedule, self._pointers = self._rollback
            raise
        if waited > 0.001:
            log.info("waited %.3fs for the previous save to be published", waited)

    def close(self) -> None:
        """Publish what is in flight, release the directory lock; idempotent.

        Raises the error of a background save that failed, after releasing everything.
        """
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        try:
            if self._writer is not None:
                self._writer.close()
        except BaseException:
            self._schedule, self._pointers = self._rollback
            raise
        finally:
            for hook in self._hooks:
                hook.remove()
            self._directory.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise PitstopError(f"the Checkpointer of {self.directory} is closed")

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint file the last :meth:`resume` restored (``None``: started fresh)."""
        return self._resumed_from

    def checkpoints(self) -> list[Checkpoint]:
        """The published checkpoints, oldest (lowest save sequence number) first."""
        return [Checkpoint.of(self.directory, e) for e in self._directory.catalog]

    # --- components ---------------------------------------------------------------------

    def _add_component(self, name: str, obj: object) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"component names must be non-empty str, got {name!r}")
        if name in self._components:
            raise ConfigError(f"component {name!r} is already registered")
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise ConfigError(
                f"component {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
            )
        self._components[name] = obj

    def register(self, name: str, obj: Stateful) -> None:
        """Add a component; if the resumed checkpoint holds it, restore it now (deferred).

        A deferred component gets the same checks as one passed to the constructor; on a
        mismatch it raises :class:`~pitstop.errors.IncompatibleCheckpoint` and is not added.
        """
        self._check_open()
        self._add_component(name, obj)
        if name in self._pending:
            stored = self._pending[name]
            differences = self._component_checks(name, obj, stored, self._pending_groups)
            try:
                if differences:
                    raise IncompatibleCheckpoint(str(d) for d in differences)
                try:
                    obj.load_state_dict(stored)
                except Exception as exc:
                    raise IncompatibleCheckpoint(
                        [f"component {name!r}: load_state_dict failed: {exc}"]
                    ) from exc
            except IncompatibleCheckpoint:
                del self._components[name]
                raise
            del self._pending[name]
        elif self._resumed_from is not None:
            log.warning("component %r is not in %s; it starts fresh", name, self._resumed_from.name)
        if self.async_save == "overlap" and isinstance(obj, torch.optim.Optimizer):
            self._hooks.append(obj.register_step_pre_hook(self._await_copy))

    # --- saving -------------------------------------------------------------------------

    def maybe_save(
        self,
        progress: Progress,
        *,
        metrics: Mapping[str, object] | None = None,
        stop: object = None,
    ) -> Checkpoint | None:
        """Save if the policy says so at ``progress`` (interval, time, best, stop)."""
        return self._save(Call.MAYBE, progress, metrics=metrics, stop=stop)

    def save(
        self,
        progress: Progress,
        *,
        reason: str = "manual",
        metrics: Mapping[str, object] | None = None,
    ) -> Checkpoint:
        """Save now, whatever the policy says; ``reason`` is recorded with it."""
        saved = self._save(Call.MANUAL, progress, metrics=metrics, detail=reason)
        assert saved is not None  # a manual save always writes
        return saved

    def finish(
        self,
        progress: Progress,
        *,
        stop: object = None,
        metrics: Mapping[str, object] | None = None,
    ) -> Checkpoint | None:
        """End the run: save ``last`` with the stop reason, or ``final`` at a normal end."""
        saved = self._save(Call.FINISH, progress, metrics=metrics, stop=stop)
        self.wait()
        return saved

    def _save(
        self,
        call: Call,
        progress: Progress,
        *,
        metrics: Mapping[str, object] | None,
        stop: object = None,
        detail: str = "",
    ) -> Checkpoint | None:
        self._check_open()
        if not isinstance(progress, Progress):
            raise ConfigError(f"progress must be a pitstop.Progress, got {progress!r}")
        values = _metrics(metrics)
        stopped, stop_detail = _stop_detail(stop)
        directory = self._directory
        self._check_background()
        decision = decide_save(
            self.policy,
            self._schedule,
            self._pointers,
            call=call,
            progress=progress,
            now=time.monotonic(),
            metrics=values,
            stop=stopped,
        )
        if not decision.acts:
            return None
        if detail == SaveReason.MANUAL.value:
            detail = ""
        started = time.perf_counter()  # what the caller waits for, the previous save included
        if self._writer is not None:
            self._settle()  # the directory's state must include the save in flight
        plan = plan_save(
            directory.catalog,
            directory.pointers,
            decision,
            progress=progress,
            policy=self.policy,
            metrics=values,
            detail=detail or stop_detail,
        )
        entry: CheckpointEntry | NoCheckpoint = plan.entry
        if entry is NO_CHECKPOINT:
            entry = directory.catalog.get(plan.pointers.last)
        job = self._job(plan)
        if self._writer is None:
            job()
        else:
            self._rollback = (self._schedule, self._pointers)
            self._writer.submit(job)
        self.last_blocking_s = time.perf_counter() - started
        self._schedule, self._pointers = decision.state, plan.pointers
        return None if entry is NO_CHECKPOINT else Checkpoint.of(self.directory, entry)

    def _job(self, plan: SavePlan) -> Callable[[], None]:
        """What carrying out ``plan`` takes; state is captured now, written when it runs."""
        directory = self._directory
        entry = plan.entry
        if entry is NO_CHECKPOINT:

            def repoint() -> None:
                directory.execute(plan, lambda file, entry, sync: None)

            return repoint
        tree, meta = self._capture()
        pool, copied = self._pool, self._copied
        if pool is None:  # synchronous: write straight from the live tensors
            prepared = fileformat.prepare(tree)

            def write_live() -> None:
                self._publish(plan, entry, lambda: prepared, meta)

            return write_live
        defer = self._deferrable() if self.async_save == "overlap" else frozenset()
        staged_tree, finish_copy = pool.snapshot(tree, defer=defer)
        copied.clear()

        def write_staged() -> None:
            try:
                finish_copy()
                pool.ready()
                copied.set()
                self._publish(plan, entry, lambda: fileformat.prepare(staged_tree), meta)
            finally:
                copied.set()
                pool.release()

        return write_staged

    def _publish(
        self,
        plan: SavePlan,
        entry: CheckpointEntry,
        prepare: Callable[[], fileformat.Prepared],
        meta: Mapping[str, Any],
    ) -> None:
        started = time.perf_counter()
        prepared = prepare()
        self._directory.execute(
            plan,
            lambda file, entry, sync: fileformat.write(
                file, prepared, {**meta, **entry_meta(entry)}, sync=sync
            ),
        )
        log.info(
            "saved %s (%s): %.3fs to durable",
            self._directory.storage.path(entry.name),
            entry.reason.value,
            time.perf_counter() - started,
        )

    def _deferrable(self) -> frozenset[tuple[str, int | None, int]]:
        """Storages that only ``optimizer.step()`` changes: the model's parameters, optimizer state.

        The EMA is not among them: its update may run when a GradScaler skips the step (and
        with it the pre-hook that waits for the copy), so it is copied before save() returns.
        """
        params = list(self.model.parameters())
        state = [
            value
            for obj in self._components.values()
            if isinstance(obj, torch.optim.Optimizer)
            for per_param in obj.state.values()
            for value in per_param.values()
            if isinstance(value, torch.Tensor)
        ]
        kept = [*self.model.buffers()]
        if self.ema is not None:
            kept += [*self.ema.parameters(), *self.ema.buffers()]
        return storage_keys([*params, *state]) - storage_keys(kept)

    def _capture(self) -> tuple[dict[str, Any], dict[str, Any]]:
        rank, world_size = _world()
        weights: dict[str, Any] = {"raw": self.model.state_dict()}
        tree: dict[str, Any] = {
            "weights": weights,
            # A component the resumed checkpoint holds but nobody registered yet is carried
            # forward as it was, so a later register() (or resume) still finds it.
            "state": {
                **self._pending,
                **{name: obj.state_dict() for name, obj in self._components.items()},
            },
            "rng": {rank: capture_rng()},
        }
        ema_buffers = "own"
        if self.ema is not None:
            weights["ema"] = unwrap_model(self.ema).state_dict()
            if isinstance(self.ema, AveragedModel):
                tree["ema"] = {"n_averaged": self.ema.n_averaged}
                ema_buffers = "own" if self.ema.use_buffers else "raw"
        meta = {
            "pitstop": _version(),
            "torch": str(torch.__version__),
            "python": platform.python_version(),
            "world_size": world_size,
            "config": self.config,
            "components": sorted({*self._components, *self._pending}),
            "optimizers": {
                **{n: g for n, g in self._pending_groups.items() if n in self._pending},
                **{
                    name: optimizer_groups(obj, self.model)
                    for name, obj in self._components.items()
                    if isinstance(obj, torch.optim.Optimizer)
                },
            },
            "weights": {
                "ema": self.ema is not None,
                "ema_buffers": ema_buffers,
                "buffers": [name for name, _ in self.model.named_buffers()],
            },
        }
        return tree, meta

    # --- restoring ----------------------------------------------------------------------

    def resume(self, source: str | os.PathLike[str] = "last", *, strict: bool = True) -> Progress:
        """Restore the whole state from ``source`` and return its Progress.

        ``source``: ``"last"`` (the most recently published checkpoint that verifies),
        ``"best"``, ``"final"``, or a path. Nothing to resume from ``"last"`` returns
        ``Progress()`` and leaves everything untouched. Raises
        :class:`~pitstop.errors.IncompatibleCheckpoint` listing every difference, with the run
        exactly as before; ``strict=False`` lets missing components and config differences
        pass with a warning (never shape or dtype differences).
        """
        self._check_open()
        path, entry = self._find(source)
        now = time.monotonic()
        if path is None:
            self._schedule = resumed_state(self._directory.catalog, NO_CHECKPOINT, now=now)
            return Progress()
        manifest = fileformat.read_manifest(path)
        tree: Any = fileformat.load(path, verify=False)  # verified when it was chosen
        differences, deferred = self._differences(tree, manifest.meta)
        hard = [d for d in differences if not d.soft]
        if hard or (strict and differences):
            raise IncompatibleCheckpoint(f"{path.name}: {d}" for d in differences)
        for difference in differences:
            log.warning("resume from %s: %s", path.name, difference)
        self._apply(tree, path)
        self._pending = {name: tree["state"][name] for name in deferred}
        groups = manifest.meta.get("optimizers")
        self._pending_groups = dict(groups) if isinstance(groups, Mapping) else {}
        if deferred:
            log.info(
                "%s holds %s, not registered yet: register() will restore them",
                path.name,
                ", ".join(sorted(deferred)),
            )
        self._resumed_from = path
        in_directory = (
            entry
            if entry is not NO_CHECKPOINT and self._directory.catalog.get(entry.name) == entry
            else NO_CHECKPOINT
        )
        self._schedule = resumed_state(self._directory.catalog, in_directory, now=now)
        return entry.progress if entry is not NO_CHECKPOINT else Progress()

    def _component_checks(
        self, name: str, obj: Stateful, stored: Any, stored_groups: Mapping[str, Any]
    ) -> list[Difference]:
        """Every difference between component ``name``'s stored state and ``obj``."""
        if isinstance(obj, torch.optim.Optimizer):
            return [
                *diff_param_groups(
                    f"optimizer {name!r}",
                    stored_groups.get(name, []),
                    optimizer_groups(obj, self.model),
                ),
                *_diff_hyperparameters(name, stored, obj),
            ]
        return _generic_differences(name, obj, stored)

    def _find(
        self, source: str | os.PathLike[str]
    ) -> tuple[Path | None, CheckpointEntry | NoCheckpoint]:
        names = {p.value for p in PointerName}
        if not (isinstance(source, str) and source in names):
            path = Path(source)
            if path.name in names and path.parent.resolve() == self.directory.resolve():
                source = path.name  # this directory's own pointer: resume from it, fresh if none
        if isinstance(source, str) and source in names:
            storage = self._directory.storage
            found = scan(storage, self.policy.best)
            choice = choose_resume(storage, found, PointerName(source), self.policy.best)
            if choice.path is None and source != PointerName.LAST.value and found.catalog:
                raise CheckpointNotFound(f"{self.directory} has no valid {source} checkpoint")
            return choice.path, choice.entry
        path = resolve_checkpoint(source, fallback=False)
        fileformat.verify(path)
        meta = fileformat.read_manifest(path).meta
        name = path.name if parse_name(path.name) is not NOT_A_CHECKPOINT else None
        if name is None:
            progress = meta.get("progress")
            step = progress.get("step") if isinstance(progress, Mapping) else None
            name = f"step_{step:012d}.pitstop" if isinstance(step, int) else path.name
        return path, entry_from_meta(name, meta)

    def _differences(
        self, tree: Mapping[str, Any], meta: Mapping[str, Any]
    ) -> tuple[list[Difference], frozenset[str]]:
        """Every difference between the stored ``tree`` and the run, and the deferred names."""
        weights = tree.get("weights", {})
        out = diff_tensors(
            "model", entry_specs(weights.get("raw", {})), entry_specs(self.model.state_dict())
        )
        if self.ema is not None:
            if "ema" not in weights:
                out.append(
                    Difference(
                        kind=Kind.MISSING, message="ema: the checkpoint holds no EMA weights"
                    )
                )
            else:
                out += diff_tensors(
                    "ema",
                    entry_specs(weights["ema"]),
                    entry_specs(unwrap_model(self.ema).state_dict()),
                )
        elif "ema" in weights:
            out.append(
                Difference(
                    kind=Kind.UNEXPECTED,
                    message="ema: the checkpoint holds EMA weights, the run has no EMA",
                    soft=True,
                )
            )
        stored_state = tree.get("state", {})
        missing, deferred = diff_components(stored_state, self._components)
        out += missing
        stored_groups = meta.get("optimizers", {})
        for name, obj in self._components.items():
            if name in stored_state:
                out += self._component_checks(name, obj, stored_state[name], stored_groups)
        if self.config is not None or meta.get("config") is not None:
            out += diff_config(meta.get("config"), self.config)
        out += diff_world_size(int(meta.get("world_size", 1)), _world()[1])
        return out, deferred

    def _apply(self, tree: Mapping[str, Any], path: Path) -> None:
        """Restore ``tree`` (already checked); on any failure put everything back and raise.

        Components go through load_state_dict() after a snapshot of each. The model and EMA
        were checked key by key, shape by shape, so loading them fails only in a module's own
        set_extra_state(); modules that have one are snapshotted too.
        """
        stored_state = tree.get("state", {})
        undo: list[tuple[Any, Any]] = []
        rng_before = capture_rng()
        modules = [(self.model, tree["weights"]["raw"])]
        if self.ema is not None:
            modules.append((unwrap_model(self.ema), tree["weights"]["ema"]))
        step = "the model"
        try:
            for name, obj in self._components.items():
                if name in stored_state:
                    step = f"component {name!r}"
                    undo.append((obj, snapshot(obj)))
                    obj.load_state_dict(stored_state[name])
            with torch.no_grad():
                for module, stored in modules:
                    step = "the model" if module is self.model else "the EMA"
                    if _has_extra_state(module):
                        undo.append((module, snapshot(module)))
                    module.load_state_dict(stored)
                if isinstance(self.ema, AveragedModel) and "ema" in tree:
                    self.ema.n_averaged.copy_(tree["ema"]["n_averaged"])
        except Exception as exc:
            for obj, before in reversed(undo):
                try:
                    obj.load_state_dict(before)
                except Exception as again:  # the object that failed may refuse its own state
                    log.error("could not put %s back after a failed restore: %s", step, again)
            restore_rng(rng_before)
            raise IncompatibleCheckpoint(
                [f"{path.name}: {step}: load_state_dict failed: {exc}"]
            ) from exc
        rng = tree.get("rng", {}).get(_world()[0])
        if rng is not None:
            restore_rng(rng)


def _shut_down(writer: BackgroundWriter | None, directory: CheckpointDirectory) -> None:
    """Finish a Checkpointer nobody closed (garbage collection or interpreter exit)."""
    try:
        if writer is not None:
            writer.close()
    except Exception as exc:
        log.error("a background save failed and nobody was left to raise it: %s", exc)
    finally:
        directory.close()


def _has_extra_state(module: nn.Module) -> bool:
    """Whether any submodule keeps non-tensor state (get_extra_state) that loading may reject."""
    return any(type(m).get_extra_state is not nn.Module.get_extra_state for m in module.modules())


def _generic_differences(name: str, obj: Stateful, stored: Any) -> list[Difference]:
    """Differences a generic component can show before its state is loaded.

    Tensors stored under the same key path must keep their shape and dtype (keys that come and
    go are the component's business). A component may also judge for itself through a
    ``state_differences(state) -> list[str]`` method (ResumableSampler has one).
    """
    out = [
        d
        for d in diff_tensors(f"component {name!r}", describe(stored), describe(obj.state_dict()))
        if d.kind in {Kind.SHAPE, Kind.DTYPE}
    ]
    judge = getattr(obj, "state_differences", None)
    if callable(judge):
        out += [
            Difference(kind=Kind.COMPONENT, message=f"component {name!r}: {m}")
            for m in judge(stored)
        ]
    return out


def _diff_hyperparameters(
    name: str, stored: Mapping[str, Any], live: torch.optim.Optimizer
) -> list[Difference]:
    out = []
    for index, (was, now) in enumerate(
        zip(stored.get("param_groups", []), live.param_groups, strict=False)
    ):
        was_keys, now_keys = set(was) - {"params"}, set(now) - {"params"}
        # Settings only on one side are a newer torch's additions; on both sides, another type.
        if was_keys - now_keys and now_keys - was_keys:
            out.append(
                Difference(
                    kind=Kind.GROUPS,
                    message=f"optimizer {name!r}: parameter group {index} has settings "
                    f"{sorted(was_keys - now_keys)} only in the checkpoint and "
                    f"{sorted(now_keys - was_keys)} only in the run (another optimizer type?)",
                )
            )
    return out


def _version() -> str:
    from pitstop import __version__

    return __version__
