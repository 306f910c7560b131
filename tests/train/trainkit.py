"""Helpers for the trainer tests: `pitstop` as a real process, configs, checkpoints read back."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

import zygote
from pitstop.core.records import CheckpointEntry
from pitstop.shell.format import fileformat
from pitstop.shell.store.directory import scan
from pitstop.shell.store.resolve import resolve_checkpoint
from pitstop.shell.store.storage import LocalStorage

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "configs" / "smoke.yaml"
PAUSING = Path(__file__).with_name("pausing_pitstop.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMEOUT = 600  # a hung child fails the test instead of hanging the suite; never a time check


def pitstop_argv(*args: str | os.PathLike[str]) -> list[str]:
    return [sys.executable, "-m", "pitstop", *map(str, args)]


def cli(*args: str | os.PathLike[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``pitstop ARGS`` to completion in a new process (forked from the tests' zygote)."""
    return zygote.run(pitstop_argv(*args), env=ENV, cwd=cwd, timeout=TIMEOUT)


def train(config: Path, output_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pitstop train --config CONFIG --output-dir DIR ARGS``; it must succeed."""
    done = cli("train", "--config", config, "--output-dir", output_dir, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def merge(base: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def smoke_config(path: Path, **sections: Mapping[str, Any]) -> Path:
    """Write configs/smoke.yaml with ``sections`` merged into it to ``path``; return ``path``."""
    data = yaml.safe_load(SMOKE.read_text())
    path.write_text(yaml.safe_dump(merge(data, sections)))
    return path


def last(checkpoint_dir: Path) -> CheckpointEntry:
    """The catalog entry ``last`` points to."""
    found = scan(LocalStorage(checkpoint_dir))
    entry = found.catalog.get(found.pointers.last)
    assert isinstance(entry, CheckpointEntry), f"{checkpoint_dir} has no last"
    return entry


def steps_on_disk(checkpoint_dir: Path) -> list[int]:
    return sorted(e.step for e in scan(LocalStorage(checkpoint_dir)).catalog)


def tree(checkpoint: Path) -> Any:
    """The whole stored tree of a checkpoint (file, pointer or directory)."""
    return fileformat.load(resolve_checkpoint(checkpoint))


@contextlib.contextmanager
def child(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A child process with pipes for stdin, stdout and stderr; ended when the block ends."""
    process = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=TIMEOUT)


def read_until(process: subprocess.Popen[str], wanted: str) -> list[str]:
    """Read the child's stdout line by line up to a line starting with ``wanted``."""
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith(wanted):
            return lines
    raise AssertionError(f"the child ended before printing {wanted!r}: {''.join(lines)[-3000:]}")


def signal_while_paused(process: subprocess.Popen[str], sig: signal.Signals) -> None:
    """Send ``sig`` to a paused pausing_pitstop child; return once its handler has run."""
    assert process.stdin is not None
    assert process.stdout is not None
    process.send_signal(sig)
    for _ in range(1000):  # each round trip lets the child run its pending handler
        process.stdin.write("check\n")
        process.stdin.flush()
        answer = process.stdout.readline()
        if answer.strip() == "stop requested: True":
            return
        assert answer.strip() == "stop requested: False", answer
    raise AssertionError(f"{sig.name} never reached the child's handler")


# The seed's "Two-step resume demonstration", with `pitstop` for `speedtronic`.
DEMO_COMMANDS = (
    """pitstop train \\
  --config configs/smoke.yaml \\
  --device cpu \\
  --output-dir runs/resume-demo \\
  --max-steps 2""",
    """pitstop train \\
  --config configs/smoke.yaml \\
  --device cpu \\
  --output-dir runs/resume-demo \\
  --max-steps 4 \\
  --resume""",
)


def run_verbatim(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a shell-style ``pitstop ...`` command line as it is written.

    ``pitstop`` is the console script installed beside this Python when there is one, else
    ``python -m pitstop``.
    """
    argv = shlex.split(command.replace("\\\n", " "))  # a shell's line continuation
    assert argv[0] == "pitstop"
    script = Path(sys.executable).with_name("pitstop")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pitstop"]
    return subprocess.run(
        [*head, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
        env=ENV,
        cwd=cwd,
    )
