"""Suite — readers racing a live run that publishes and prunes.

A real writer process saves every step with ``keep_last=1`` (each save publishes a checkpoint,
moves the pointers, deletes the one before), while this process reads the directory in a loop
through every public reader: ``load(dir)``, ``load(dir/last)``, ``verify(dir/last)``,
``info(dir)``, ``pitstop ls``, ``ls --json``, ``ls --check`` and ``pitstop verify dir/last``
(the CLI's main function). Readers take no lock: a checkpoint deleted between looking and
reading is gone (the reader looks again), never corrupt, never a traceback. Zero failures.

The duration is bounded by counts: the writer makes a fixed number of saves and the readers
loop until it has exited. Files: 300 saves. Sharded (a 2-rank FSDP2 writer on gloo): 30 saves,
300 under ``-m slow``.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

import pitstop
from multirank import Job
from pitstop.cli import main

WRITER = Path(__file__).with_name("pruning_writer.py")
SHARDED_WRITER = Path(__file__).parents[1] / "e2e" / "sharded_train.py"


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(list(argv))
    return code, out.getvalue()


def _ls_json(directory: Path) -> None:
    code, out = _cli("ls", str(directory), "--json")
    rows = json.loads(out)
    assert code == 0, out
    assert rows, out
    assert all("unreadable" not in row for row in rows), out


def _exits_0(*argv: str) -> Callable[[Path], None]:
    def run(directory: Path) -> None:
        code, out = _cli(*[a.replace("DIR", str(directory)) for a in argv])
        assert code == 0, out

    return run


READERS: dict[str, Callable[[Path], object]] = {
    "load(dir)": pitstop.load,
    "load(dir/last)": lambda d: pitstop.load(d / "last"),
    "verify(dir/last)": lambda d: pitstop.verify(d / "last"),
    "info(dir)": pitstop.info,
    "info(dir/last)": lambda d: pitstop.info(d / "last"),
    "pitstop ls": _exits_0("ls", "DIR"),
    "pitstop ls --json": _ls_json,
    "pitstop ls --check": _exits_0("ls", "DIR", "--check"),
    "pitstop verify dir/last": _exits_0("verify", "DIR/last"),
}


def _read_while_running(job: Job, directory: Path) -> tuple[int, list[str]]:
    """Every reader, round after round, until the writer has exited; the failures."""
    failures: list[str] = []
    rounds = 0
    while job.running() or rounds == 0:
        rounds += 1
        for name, read in READERS.items():
            try:
                read(directory)
            except Exception as exc:  # every failure is one to report, whatever its type
                failures.append(f"round {rounds}, {name}: {type(exc).__name__}: {exc}")
    return rounds, failures


def test_readers_racing_a_pruning_run_of_files(tmp_path: Path) -> None:
    directory = tmp_path / "run"
    with Job(WRITER, directory, "300", ranks=1) as job:
        job.wait_for(0, "saved 1")
        rounds, failures = _read_while_running(job, directory)
        job.wait().check()
    assert failures == [], f"{len(failures)} failures in {rounds} rounds:\n" + "\n".join(failures)
    assert pitstop.info(directory).step == 300


@pytest.mark.parametrize(
    "saves", [pytest.param(30, id="30"), pytest.param(300, id="300", marks=pytest.mark.slow)]
)
def test_readers_racing_a_pruning_sharded_run(tmp_path: Path, saves: int) -> None:
    pytest.importorskip("torch.distributed.fsdp")
    directory = tmp_path / "run"
    args = ("--dir", directory, "--out", tmp_path / "out", "--target", str(saves))
    with Job(SHARDED_WRITER, *args, "--every", "1", "--keep-last", "1", "--no-ema") as job:
        job.wait_for(0, re.compile(r"^saved 1 "))
        rounds, failures = _read_while_running(job, directory)
        job.wait().check()
    assert failures == [], f"{len(failures)} failures in {rounds} rounds:\n" + "\n".join(failures)
