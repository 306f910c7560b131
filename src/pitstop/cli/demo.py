"""``pitstop demo``: pitstop at work on the CPU."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from pitstop.core.naming import NOT_A_CHECKPOINT, checkpoint_name, parse_name
from pitstop.core.plan import plan_save
from pitstop.core.records import (
    NO_CHECKPOINT,
    Best,
    Catalog,
    NoCheckpoint,
    PointerName,
    Pointers,
    Policy,
    Progress,
)
from pitstop.core.schedule import Call, ScheduleState, decide_save

__all__ = ["run_demo"]


def _step_of(name: str | NoCheckpoint) -> str:
    step = NOT_A_CHECKPOINT if name is NO_CHECKPOINT else parse_name(name)
    return "-" if step is NOT_A_CHECKPOINT else str(step)


def run_demo(console: Console) -> int:
    """Show what the planning core decides over a simulated run.

    The full demo (train on the CPU, stop with a real SIGTERM, resume, compare bitwise) needs
    the Checkpointer, which is not built yet; this says so rather than pretending.
    """
    console.print(
        "[bold]pitstop demo[/bold]: the train / SIGTERM / resume demo needs the Checkpointer, "
        "which is not built yet.\nMeanwhile, this is what pitstop's planning core decides for "
        "a simulated 12-step run\n(every_steps=4, keep_last=2, best=val_loss min, evaluated "
        "every 3 steps, save_final=True):\n"
    )
    policy = Policy(every_steps=4, keep_last=2, best=Best("val_loss"), save_final=True)
    catalog, pointers = Catalog(), Pointers()
    state = ScheduleState(timer_start=0.0)
    losses = {3: 0.9, 6: 0.5, 9: 0.7, 12: 0.6}
    table = Table("step", "call", "action", "reason", "last", "best", "final", "deleted")
    progress = Progress()
    for step in range(1, 13):
        progress = progress.advance(samples=32)
        metrics = {"val_loss": losses[step]} if step in losses else None
        for call in (Call.MAYBE, Call.FINISH) if step == 12 else (Call.MAYBE,):
            decision = decide_save(
                policy,
                state,
                pointers,
                call=call,
                progress=progress,
                now=float(step),
                metrics=metrics,
            )
            if not decision.acts:
                continue
            plan = plan_save(
                catalog, pointers, decision, progress=progress, policy=policy, metrics=metrics
            )
            catalog, pointers, state = plan.catalog_after, plan.pointers, decision.state
            table.add_row(
                str(step),
                call.value,
                "write" if decision.write else "repoint",
                decision.reason.value,
                *(_step_of(pointers.target(p)) for p in PointerName),
                ", ".join(_step_of(n) for n in plan.retention.delete) or "-",
            )
    console.print(table)
    kept = ", ".join(checkpoint_name(e.step) for e in catalog)
    console.print(f"\nwhat a real run would keep on disk: {kept}")
    return 0
