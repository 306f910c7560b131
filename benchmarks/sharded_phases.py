"""Where a sharded save's or resume's time goes: a clock around each phase of ``sharded_save.py``.

Runs ``benchmarks/sharded_save.py`` (the same FSDP2 state, ranks and rounds) with only the
``--candidates`` given, and in every rank wraps the functions a save passes through — the
Checkpointer's call and ``wait()`` (by mode: ``Checkpointer.save[sync]``), pitstop's rounds
(``Ranks``), the engine's write, DCP's ``save`` and its steps (the plan's ``reduce_scatter``,
the write's ``all_reduce``, its gathers), pitstop's writer, the manifest and the publish — in
a clock. Each call's time is kept under the outermost wrapped call it ran in (a Checkpointer
call, DCP's ``save``; a call on another thread under that thread's name), so what a phase
costs is read against the call it is part of. Times include what a phase waits for (a round
waits for the slowest rank). Medians in ms per rank, after the benchmark's own table::

    .venv/bin/python benchmarks/sharded_phases.py --mib 64 --repeats 15 \\
        --candidates "dcp save,dcp async_save,Checkpointer.save sync"

With ``--resume``, the benchmark's resumes instead (``--candidates`` from its resume
candidates, ``dcp load`` needed): the Checkpointer's open, ``resume()`` and ``close()``, the
engine's ``read_sharded``, and DCP's ``load``, ``get_*_state_dict`` / ``set_*_state_dict`` as
the benchmark calls them (each a call of its own), every phase of pitstop's resume inside them —
the open's gloo group, directory probe and lock, the scan, the plan, the checks, the agreement,
DCP's read, the apply, the replicated restore::

    .venv/bin/python benchmarks/sharded_phases.py --mib 42 --repeats 5 --resume \
        --candidates "dcp load,Checkpointer.resume"

A clock costs about a microsecond a call: the calls wrapped here happen a few dozen times a
save. Not a benchmark of its own: the durations it prints are the benchmark's, with the clocks.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sharded_save as bench  # the benchmark next to this file

OUT = "PITSTOP_PHASES_OUT"  # where each rank writes its clocks (set for the workers)
CHOSEN = "PITSTOP_PHASES_CANDIDATES"  # the candidates the workers run
TOPS = (  # the calls a phase is counted under: (module, owner or None, name)
    ("pitstop.shell.manager", "Checkpointer", "save"),
    ("pitstop.shell.manager", "Checkpointer", "wait"),
    ("pitstop.shell.sharded.shardwrite", None, "write_sharded"),
    ("torch.distributed.checkpoint.state_dict_saver", None, "save"),
    ("torch.distributed.checkpoint.state_dict_saver", None, "async_save"),
)
RESUME_TOPS = (  # a resume's calls, and torch's as raw DCP's candidate makes them
    ("pitstop.shell.manager", "Checkpointer", "__init__"),
    ("pitstop.shell.manager", "Checkpointer", "resume"),
    ("pitstop.shell.manager", "Checkpointer", "close"),
    ("pitstop.shell.sharded.engine", None, "read_sharded"),
    ("torch.distributed.checkpoint.state_dict_loader", None, "load"),
    ("torch.distributed.checkpoint.state_dict", None, "get_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", None, "get_optimizer_state_dict"),
    ("torch.distributed.checkpoint.state_dict", None, "set_model_state_dict"),
    ("torch.distributed.checkpoint.state_dict", None, "set_optimizer_state_dict"),
)
RESUME_PHASES = (  # each wrapped where its caller finds it
    ("pitstop.shell.manager", None, ("scan",)),
    ("pitstop.shell.ranks.distributed", "Ranks", ("current",)),
    ("pitstop.shell.nodes", None, ("probe_groups", "_open")),
    ("pitstop.shell.resuming", None, ("resume_from", "_load", "differences")),
    ("pitstop.shell.sharded.choice", None, ("_candidates",)),
    ("pitstop.shell.sharded.candidate", None, ("guess", "plan_of", "shares", "started")),
    ("pitstop.shell.sharded.choice", None, ("choose_sharded", "_problem", "verify_sharded")),
    ("pitstop.shell.sharded.choice", None, ("prefetch",)),
    ("pitstop.shell.sharded.candidate", None, ("planned",)),
    ("pitstop.shell.resumeread", "ResumeRead", ("verify", "load")),
    ("pitstop.shell.state.restore", "Restore", ("prepare", "commit")),
    ("pitstop.shell.sharded.engine", None, ("plan_read", "read_layout", "_planned_files")),
    ("pitstop.shell.sharded.engine", None, ("verify_sharded", "load_checked", "apply_state")),
    ("pitstop.shell.sharded.engine", None, ("_apply_checked",)),
    ("pitstop.shell.sharded.engine", "_Kept", ("__init__", "put_back")),
    ("pitstop.shell.sharded.choice", None, ("_check_agreed",)),
    ("pitstop.shell.sharded.rawread", None, ("check_read",)),
    ("pitstop.shell.sharded.filecheck", None, ("checked_file", "_check")),
    ("pitstop.shell.sharded.filecheck", "Started", ("__init__", "verified")),
    ("pitstop.shell.sharded.rawread", "Checked", ("copy",)),
    ("pitstop.shell.ranks.distributed", "Ranks", ("_wait",)),
    ("pitstop.shell.sharded.dcpio", None, ("load",)),
    ("pitstop.shell.sharded.dcpstate", None, ("get_model_state_dict", "get_optimizer_state_dict")),
    ("pitstop.shell.sharded.dcpstate", None, ("set_model_state_dict", "set_optimizer_state_dict")),
    (
        "pitstop.shell.ranks.distributed",
        "Ranks",
        ("all_gather_each", "gather_then_lead", "lead", "all_gather", "each", "broadcast"),
    ),
    ("torch.distributed.checkpoint.utils", "_DistWrapper", ("reduce_scatter", "all_reduce")),
    ("torch.distributed.checkpoint.utils", "_DistWrapper", ("all_gather", "broadcast_object")),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader", ("read_data",)),
    ("torch.distributed.checkpoint.default_planner", "DefaultLoadPlanner", ("set_up_planner",)),
)
PHASES = (
    (
        "pitstop.shell.ranks.distributed",
        "Ranks",
        ("all_gather_each", "gather_then_lead", "lead", "all_gather", "gather"),
    ),
    ("pitstop.shell.shardsave", "ShardedSaves", ("begin", "save", "_write", "_start", "_part")),
    ("pitstop.shell.shardsave", None, ("rank_state", "pack_state", "unpack_state")),
    ("pitstop.shell.saving", "Saver", ("decide", "plan", "begin_sharded", "publish_sharded")),
    ("pitstop.shell.saving", "Saver", ("capture_sharded", "publish_handed")),
    ("pitstop.shell.saving", None, ("capture",)),
    ("pitstop.shell.sharded.shardwrite", None, ("write_shards", "dcp_state", "save", "async_save")),
    ("pitstop.shell.sharded.shardwrite", None, ("start_once_agreed",)),
    ("pitstop.shell.sharded.shardwrite", "PendingShardedWrite", ("written",)),
    ("pitstop.shell.sharded.shardwrite", "WrittenShards", ("layout",)),
    ("pitstop.shell.sharded.shardstage", None, ("stage_sharded",)),
    ("pitstop.shell.sharded.dcpio", "Writer", ("write_data", "finish")),
    ("pitstop.shell.sharded.dcpio", None, ("file_table",)),
    ("pitstop.shell.sharded.dcpwrite", None, ("_crc_while_syncing",)),
    ("pitstop.shell.store.directory", "CheckpointDirectory", ("publish_sharded", "_publish")),
    ("pitstop.shell.store.sharddir", None, ("write_manifest", "publish_sharded")),
    ("pitstop.shell.store.publish", None, ("publish_pointers", "publish_file")),
    ("torch.distributed.checkpoint.utils", "_DistWrapper", ("reduce_scatter", "all_reduce")),
    ("torch.distributed.checkpoint.utils", "_DistWrapper", ("gather_object", "broadcast_object")),
    ("torch.distributed.checkpoint.filesystem", "_FileSystemWriter", ("write_data",)),
    ("torch.distributed.checkpoint.filesystem", "FileSystemWriter", ("finish",)),
)

_times: dict[str, list[float]] = {}
_local = threading.local()


def _clocked(label: str, fn: Callable[..., Any], *, top: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def clocked(*args: Any, **kwargs: Any) -> Any:
        stack: list[str] = _local.__dict__.setdefault("stack", [])
        if stack:  # inside a top call (or a thread's first clocked call)
            prefix = stack[-1]
            key = f"{prefix} / {label}"
        elif top:
            prefix = key = label + _mode(args)
        elif threading.current_thread() is threading.main_thread():
            return fn(*args, **kwargs)  # outside every top call: the benchmark's own
        else:
            prefix = f"thread {threading.current_thread().name}"
            key = f"{prefix} / {label}"
        stack.append(prefix)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _times.setdefault(key, []).append(time.perf_counter() - start)
            stack.pop()

    return clocked


def _mode(args: tuple[Any, ...]) -> str:
    """A Checkpointer's calls by its mode: ``Checkpointer.save[async]``."""
    mode = getattr(args[0], "async_save", None) if args else None
    return "" if mode is None else f"[{ {False: 'sync', True: 'async'}.get(mode, mode) }]"


def _wrap(module: str, owner: str | None, name: str, *, top: bool = False) -> None:
    where: Any = importlib.import_module(module)
    if owner is not None:
        where = getattr(where, owner)
    fn = getattr(where, name, None)
    if fn is None and module.startswith("torch"):  # another torch names its steps otherwise
        return
    if fn is None:
        raise SystemExit(f"{module}.{owner or ''}{'.' if owner else ''}{name} is gone: update")
    label = f"{owner}.{name}" if owner else f"{module.rsplit('.', 1)[1]}.{name}"
    setattr(where, name, _clocked(label, fn, top=top))


def install(*, resume: bool = False) -> None:
    """Wrap every phase in a clock (a worker, before the benchmark imports what it calls):
    a save's, or with ``resume`` a resume's."""
    for module, owner, names in RESUME_PHASES if resume else PHASES:
        for name in names:
            _wrap(module, owner, name)
    for module, owner, name in RESUME_TOPS if resume else TOPS:
        _wrap(module, owner, name, top=True)


def _dump() -> None:
    path = Path(os.environ[OUT]) / f"rank{os.environ['RANK']}.json"
    path.write_text(json.dumps(_times))


def _report(out: Path) -> None:
    for path in sorted(out.glob("rank*.json")):
        times: dict[str, list[float]] = json.loads(path.read_text())
        print(f"\n{path.stem}: median ms (calls), ms a top call in all")
        for key in sorted(times, key=lambda k: (k.split(" / ")[0], -statistics.median(times[k]))):
            runs, top = times[key], times.get(key.split(" / ")[0], [])
            each = f"{sum(runs) / len(top) * 1e3:9.2f}" if top else " " * 9
            print(f"  {statistics.median(runs) * 1e3:9.2f} ({len(runs):3d}) {each}  {key}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    resume = "--resume" in argv
    if "--worker" in argv:  # a rank, as the benchmark's launcher runs this script
        if resume:
            bench.RESUME_CANDIDATES = tuple(os.environ[CHOSEN].split(","))
        else:
            bench.CANDIDATES = tuple(os.environ[CHOSEN].split(","))
        install(resume=resume)
        atexit.register(_dump)
        return bench.main(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    parser.add_argument("--candidates", default=None)
    ours, rest = parser.parse_known_args(argv)
    known, needed = (
        (bench.RESUME_CANDIDATES, ("dcp load",))
        if resume
        else (bench.CANDIDATES, ("dcp save", "dcp async_save"))
    )
    default = ",".join(known if resume else (*needed, "Checkpointer.save sync"))
    chosen = [c.strip() for c in (ours.candidates or default).split(",")]
    unknown = sorted(set(chosen) - set(known))
    if unknown or not set(needed) <= set(chosen):
        raise SystemExit(
            f"--candidates: unknown {unknown}; {' and '.join(map(repr, needed))} needed "
            f"(the ratios); the others: {', '.join(c for c in known if c not in needed)}"
        )
    bench.__file__ = os.path.abspath(__file__)  # the launcher runs this script as each rank
    with tempfile.TemporaryDirectory(prefix="sharded-phases-") as out:
        os.environ[OUT], os.environ[CHOSEN] = out, ",".join(chosen)
        code = bench.main(rest)
        _report(Path(out))
    return code


if __name__ == "__main__":
    sys.exit(main())
