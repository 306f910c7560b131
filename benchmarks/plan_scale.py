"""How the planning core scales with the number of checkpoints in a directory.

For each catalog size n this builds n published ``CheckpointEntry`` records (mixed save reasons,
a ``val_loss`` metric on some of them) and times the plans the shell asks for on every save and
every resume:

* ``plan_retention`` — the keep/delete plan;
* ``resume_order`` — for each of ``last``, ``best`` and ``final``;
* ``reconcile_pointers`` — with a stale ``last`` symlink and a dangling ``best`` in latest.json;
* ``plan_save`` — one interval save into the catalog (which re-sorts it and plans retention).

It prints the median seconds per plan and ``t(n) / (n * log2(n))`` normalised to the smallest n:
a ratio that stays near (or below) 1 as n grows means growth is no worse than n log n.

Usage::

    .venv/bin/python benchmarks/plan_scale.py [--sizes 1000,10000,100000] [--repeats 5]
                                              [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from pitstop.core import (
    Best,
    Call,
    Catalog,
    CheckpointEntry,
    PointerName,
    Pointers,
    Policy,
    Progress,
    SaveReason,
    ScheduleState,
    decide_save,
    plan_retention,
    plan_save,
    reconcile_pointers,
    resume_order,
)
from pitstop.core.saving.pointers import recompute_best, recompute_final

STEP_GAP = 10  # steps between consecutive checkpoints in the synthetic catalog
POLICY = Policy(every_steps=STEP_GAP, keep_last=5, keep_every=1000, best=Best("val_loss"))
REASONS = (
    SaveReason.INTERVAL,
    SaveReason.INTERVAL,
    SaveReason.INTERVAL,
    SaveReason.TIME,
    SaveReason.BEST,
    SaveReason.MANUAL,
    SaveReason.STOP,
    SaveReason.FINAL,
)
# Aim for at least this many entries processed per timing sample, so small n is not all noise.
MIN_WORK = 20_000


def build_catalog(n: int, seed: int = 0) -> Catalog:
    """Return a catalog of ``n`` checkpoints at steps 10, 20, ..., mixed reasons and metrics."""
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        reason = REASONS[i % len(REASONS)]
        metrics = {"val_loss": rng.random()} if i % 3 == 0 or reason is SaveReason.BEST else {}
        entries.append(
            CheckpointEntry(
                progress=Progress(step=(i + 1) * STEP_GAP, epoch=i // 100),
                seq=i + 1,
                reason=reason,
                metrics=metrics,
            )
        )
    rng.shuffle(entries)  # the shell's directory scan comes back in no particular order
    return Catalog(entries=tuple(entries))


def true_pointers(catalog: Catalog) -> Pointers:
    """Return the pointers a healthy directory holding ``catalog`` would have."""
    newest = catalog.entries[-1]
    best, best_value = recompute_best(catalog, POLICY.best)
    return Pointers(
        last=newest.name, best=best, final=recompute_final(catalog), best_value=best_value
    )


def cases(catalog: Catalog) -> dict[str, Callable[[], object]]:
    """Return the plans to time over ``catalog``, by name."""
    pointers = true_pointers(catalog)
    # What the shell might find on disk after a crash: the last symlink one save behind, and a
    # latest.json whose best names a file that was removed by hand.
    links = Pointers(last=catalog.entries[-2].name if len(catalog) > 1 else pointers.last)
    manifest = Pointers(last=pointers.last, best="step_999999999999.pitstop", best_value=0.0)
    newest = catalog.entries[-1]
    progress = Progress(step=newest.step + STEP_GAP)
    metrics = {"val_loss": 0.5}
    decision = decide_save(
        POLICY,
        ScheduleState(timer_start=0.0, last_saved_step=newest.step),
        pointers,
        call=Call.MAYBE,
        progress=progress,
        now=1.0,
        metrics=metrics,
    )
    assert decision.write, "the benchmark's save must write a new checkpoint"
    return {
        "plan_retention": lambda: plan_retention(catalog, pointers, POLICY),
        "resume_order(last)": lambda: resume_order(catalog, pointers, PointerName.LAST),
        "resume_order(best)": lambda: resume_order(
            catalog, pointers, PointerName.BEST, POLICY.best
        ),
        "resume_order(final)": lambda: resume_order(catalog, pointers, PointerName.FINAL),
        "reconcile_pointers": lambda: reconcile_pointers(
            catalog, links=links, manifest=manifest, best=POLICY.best
        ),
        "plan_save": lambda: plan_save(
            catalog, pointers, decision, progress=progress, policy=POLICY, metrics=metrics
        ),
    }


def median_seconds(func: Callable[[], object], *, n: int, repeats: int) -> float:
    """Return the median seconds one call of ``func`` takes, over ``repeats`` samples."""
    number = max(1, MIN_WORK // n)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            func()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def run(sizes: list[int], repeats: int) -> list[dict[str, object]]:
    """Time every plan at every size; return one result row per (plan, n)."""
    timings: dict[str, dict[int, float]] = {}
    for n in sizes:
        for name, func in cases(build_catalog(n)).items():
            timings.setdefault(name, {})[n] = median_seconds(func, n=n, repeats=repeats)
    smallest = min(sizes)
    rows: list[dict[str, object]] = []
    for name, by_size in timings.items():
        base = by_size[smallest] / (smallest * math.log2(smallest))
        for n in sizes:
            per_nlogn = by_size[n] / (n * math.log2(n))
            rows.append(
                {
                    "plan": name,
                    "n": n,
                    "median_s": by_size[n],
                    "per_entry_us": by_size[n] / n * 1e6,
                    "ratio_nlogn": per_nlogn / base,
                }
            )
    return rows


def format_table(rows: list[dict[str, object]]) -> str:
    """Return ``rows`` as a Markdown table."""
    header = "| plan | n | median ms | µs per entry | t/(n·log2 n), normalised |"
    lines = [header, "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['plan']} | {row['n']} | {row['median_s'] * 1e3:.4g} | "
            f"{row['per_entry_us']:.3g} | {row['ratio_nlogn']:.2f} |"
        )
    return "\n".join(lines)


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes must be integers, got {text!r}") from None
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError(f"--sizes must be integers >= 2, got {text!r}")
    return sorted(set(sizes))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--repeats must be >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print the table (and write JSON with ``--json``). Returns 0."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", type=_sizes, default=[1000, 10000, 100000])
    parser.add_argument("--repeats", type=_positive, default=5)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)

    rows = run(args.sizes, args.repeats)
    print(
        f"pitstop planning core, catalog sizes {args.sizes}, median of {args.repeats} "
        f"repeats; policy keep_last=5, keep_every=1000, best=val_loss (min)\n"
    )
    print(format_table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
