"""A stateful test of the whole planning core against a plain model of what must be true.

The machine drives one checkpoint directory through training, stops, normal ends, manual
saves, crashes (with pointers left stale), corrupted newest files, and resumes from older
checkpoints (abandoned timelines), asking the core for every decision and carrying out every
plan as the shell would. The model is deliberately plain: the name of the most recent write,
the highest sequence number handed out, and the steps written in the current timeline.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pitstop.core.naming import checkpoint_name
from pitstop.core.records import (
    NO_CHECKPOINT,
    CheckpointEntry,
    PointerName,
    Pointers,
    Policy,
    Progress,
)
from pitstop.core.saving.pointers import reconcile_pointers, resume_order
from pitstop.core.saving.schedule import Call, resumed_state
from plan_driver import Driver
from strategies import METRIC, policies

losses = st.none() | st.floats(0.0, 10.0) | st.just(math.nan)


class DirectoryMachine(RuleBasedStateMachine):
    """One checkpoint directory, many runs."""

    @initialize(policy=policies)
    def start(self, policy: Policy) -> None:
        self.policy = policy
        self.driver = Driver(policy)
        self.progress = Progress()
        self.now = 0.0
        self.corrupt: set[str] = set()
        self.pointers_before_last_plan = Pointers()
        # The plain model.
        self.last_written: str | None = None
        self.highest_seq = 0
        self.timeline: list[int] = []  # steps written by policy calls in this timeline

    # --- carrying out calls -------------------------------------------------------------

    def _call(
        self, call: Call, *, metrics: dict[str, float] | None = None, stop: bool = False
    ) -> None:
        before = len(self.driver.plans)
        pointers_before = self.driver.pointers
        decision = self.driver.call(call, self.progress, now=self.now, metrics=metrics, stop=stop)
        if len(self.driver.plans) == before:
            return
        self.pointers_before_last_plan = pointers_before
        plan = self.driver.plans[-1]
        if plan.entry is not NO_CHECKPOINT:
            assert plan.entry.seq > self.highest_seq, "sequence numbers strictly increase"
            self.highest_seq = plan.entry.seq
            self.last_written = plan.entry.name
            self.corrupt.discard(plan.entry.name)  # a rewrite replaces the corrupt file
            if call is not Call.MANUAL:
                assert plan.entry.step not in self.timeline, "a step saved twice in a timeline"
                self.timeline.append(plan.entry.step)
        assert decision.write <= (plan.entry is not NO_CHECKPOINT)

    def _resume_at(self, entry: CheckpointEntry | None) -> None:
        self.progress = Progress() if entry is None else entry.progress
        resumed = NO_CHECKPOINT if entry is None else entry
        self.driver.state = resumed_state(self.driver.catalog, resumed, now=self.now)
        saved = self.driver.state.last_saved_step
        self.timeline = [] if saved is NO_CHECKPOINT else [saved]

    # --- rules --------------------------------------------------------------------------

    @rule(steps=st.integers(1, 12), loss=losses, seconds=st.floats(0.0, 400.0))
    def train(self, steps: int, loss: float | None, seconds: float) -> None:
        for i in range(steps):
            self.progress = self.progress.advance(samples=8)
            self.now += seconds / steps
            metrics = {METRIC: loss} if loss is not None and i == steps - 1 else None
            self._call(Call.MAYBE, metrics=metrics)

    @rule(loss=losses)
    def save_manually(self, loss: float | None) -> None:
        self._call(Call.MANUAL, metrics=None if loss is None else {METRIC: loss})

    @rule(stop=st.booleans())
    def finish(self, stop: bool) -> None:
        self._call(Call.FINISH, stop=stop)
        if stop or self.policy.save_final:
            assert self.driver.pointers.last == checkpoint_name(self.progress.step)
        if not stop and self.policy.save_final:
            assert self.driver.pointers.final == checkpoint_name(self.progress.step)

    @precondition(lambda self: len(self.driver.catalog) > 0)
    @rule()
    def corrupt_newest(self) -> None:
        newest = self.driver.catalog.newest()
        assert newest is not NO_CHECKPOINT
        self.corrupt.add(newest.name)

    @rule(stale_pointers=st.booleans())
    def crash_and_resume_last(self, stale_pointers: bool) -> None:
        """The process dies; a new one reconciles the directory and resumes from `last`."""
        found = self.pointers_before_last_plan if stale_pointers else self.driver.pointers
        catalog = self.driver.catalog
        pointers, _ = reconcile_pointers(
            catalog, links=found, manifest=found, best=self.policy.best
        )
        self.driver.pointers = pointers
        order = resume_order(catalog, pointers, PointerName.LAST)
        valid = [n for n in order if n not in self.corrupt]
        newest_valid = max(
            (e for e in catalog if e.name not in self.corrupt), key=lambda e: e.seq, default=None
        )
        assert (valid[0] if valid else None) == (newest_valid and newest_valid.name)
        chosen = catalog.get(valid[0]) if valid else None
        self._resume_at(chosen if isinstance(chosen, CheckpointEntry) else None)

    @precondition(lambda self: len(self.driver.catalog) > 0)
    @rule(data=st.data())
    def resume_from_an_older_checkpoint(self, data: st.DataObject) -> None:
        """The user resumes from an explicit file; later saves start a new timeline."""
        entry = data.draw(st.sampled_from(self.driver.catalog.entries))
        self._resume_at(entry)

    # --- invariants ---------------------------------------------------------------------

    @invariant()
    def pointer_targets_are_retained(self) -> None:
        for _, target in self.driver.pointers.items():
            assert target in self.driver.catalog

    @invariant()
    def the_newest_write_is_retained_and_resume_starts_there(self) -> None:
        if self.last_written is None:
            return
        assert self.last_written in self.driver.catalog
        assert self.driver.pointers.last == self.last_written
        order = resume_order(self.driver.catalog, Pointers(), PointerName.LAST)
        assert order[0] == self.last_written

    @invariant()
    def nothing_recorded_beats_the_best_pointer(self) -> None:
        best = self.policy.best
        if best is None:
            return
        for entry in self.driver.catalog:  # a step-0 checkpoint holds no training: no candidate
            if METRIC in entry.metrics and entry.step > 0:
                assert not best.improves(entry.metrics[METRIC], self.driver.pointers.best_value)

    @invariant()
    def retention_bounds_the_directory(self) -> None:
        if self.policy.keep_last is None:
            return
        keep_every = self.policy.keep_every
        forever = sum(1 for e in self.driver.catalog if keep_every and e.step % keep_every == 0)
        assert len(self.driver.catalog) <= self.policy.keep_last + 3 + forever


TestDirectoryMachine = DirectoryMachine.TestCase
