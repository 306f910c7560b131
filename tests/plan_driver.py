"""A tiny in-memory stand-in for the shell: asks the core, applies its plans, records writes.

Used by the core's tests to drive whole runs without any I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from pitstop.core.records import NO_CHECKPOINT, Catalog, Pointers, Policy, Progress
from pitstop.core.saving.plan import SavePlan, plan_save
from pitstop.core.saving.schedule import Call, SaveDecision, ScheduleState, decide_save


@attrs.define
class Driver:
    """One run's view of a checkpoint directory, with every write recorded."""

    policy: Policy
    catalog: Catalog = attrs.field(factory=Catalog)
    pointers: Pointers = attrs.field(factory=Pointers)
    state: ScheduleState = attrs.field(factory=lambda: ScheduleState(timer_start=0.0))
    written: list[int] = attrs.field(factory=list)  # steps written, in order
    plans: list[SavePlan] = attrs.field(factory=list)

    def call(
        self,
        call: Call,
        progress: Progress,
        *,
        now: float = 0.0,
        metrics: Mapping[str, float] | None = None,
        stop: bool = False,
    ) -> SaveDecision:
        """Ask the schedule, then carry out the plan as the shell would."""
        decision = decide_save(
            self.policy,
            self.state,
            self.pointers,
            call=call,
            progress=progress,
            now=now,
            metrics=metrics,
            stop=stop,
        )
        if decision.acts:
            plan = plan_save(
                self.catalog,
                self.pointers,
                decision,
                progress=progress,
                policy=self.policy,
                metrics=metrics,
            )
            if plan.entry is not NO_CHECKPOINT:
                self.written.append(plan.entry.step)
            self.catalog, self.pointers = plan.catalog_after, plan.pointers
            self.plans.append(plan)
        self.state = decision.state
        return decision

    def run(
        self,
        final_step: int,
        *,
        metrics_at: Mapping[int, Mapping[str, float]] | None = None,
        stop_at: int | None = None,
        start: Progress | None = None,
    ) -> Progress:
        """Train to ``final_step`` (or stop at ``stop_at``), then finish, like a training loop."""
        progress = start or Progress()
        while progress.step < final_step:
            progress = progress.advance()
            stop = stop_at is not None and progress.step >= stop_at
            self.call(
                Call.MAYBE,
                progress,
                now=float(progress.step),
                metrics=(metrics_at or {}).get(progress.step),
                stop=stop,
            )
            if stop:
                break
        self.call(Call.FINISH, progress, now=float(progress.step), stop=stop_at is not None)
        return progress

    def latest_saved_step(self) -> int | None:
        """The step of the checkpoint ``last`` points to."""
        entry = self.catalog.get(self.pointers.last)
        return None if entry is NO_CHECKPOINT else entry.step
